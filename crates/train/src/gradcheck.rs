//! Is a backend's training step right? One step's losses and every
//! parameter gradient, computed on two backends from the same weights and
//! the same batch, and compared tensor by tensor.
//!
//! This is the check the reference's users never had: its `mem_efficient`
//! attention on ROCm was wrong only with a padding mask, i.e. only on real
//! data, and nothing compared it with a path known to be right. Here the
//! oracle is the CPU (ndarray, f32), and the batch is whatever the caller
//! loads: `aam-rs diagnose gradients` runs it on a user's own table, and
//! `tests/train_gradients.rs` on the demo data.
//!
//! The step is `fit`'s ([`crate::run::fit`]): [`batch_tensors`] on the
//! chosen [`Slots`], [`predict_batch`], the loss, the backward pass. Dropout
//! and nucleotide masking draw different random numbers on different
//! backends, so the caller passes a model configuration without them
//! ([`ModelConfig::without_dropout`]).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use aam_data::Batch;
use aam_models::import::{AamModel, ModelConfig, StateTensor};
use aam_models::AttentionBackend;
use burn::backend::Autodiff;
use burn::prelude::*;

use crate::error::Result;
use crate::loss::LossConfig;
use crate::run::{batch_tensors, predict_batch, Slots};

/// One training step's losses and parameter gradients, on the host.
#[derive(Clone, Debug)]
pub struct StepGradients {
    /// Loss parts by name (`total`, `unifrac`, `nuc`, `count`, `target`),
    /// those the loss configuration computes.
    pub losses: BTreeMap<&'static str, f64>,
    /// Gradient of every parameter that took part, by torch key.
    pub gradients: BTreeMap<String, Vec<f32>>,
}

impl StepGradients {
    /// The global L2 norm of the gradients (what `--max-grad-norm` clips).
    pub fn norm(&self) -> f64 {
        self.gradients
            .values()
            .map(|g| l2(g).powi(2))
            .sum::<f64>()
            .sqrt()
    }
}

/// The L2 norm of `values`, summed in f64.
fn l2(values: &[f32]) -> f64 {
    values
        .iter()
        .map(|&x| (x as f64).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// The losses and gradients of one step of `model` (with weights `state`)
/// on `batch`, on backend `B` (a classifier's targets are class indices).
pub fn step_gradients<B: AttentionBackend>(
    config: &ModelConfig,
    state: &HashMap<String, StateTensor>,
    batch: &Batch,
    loss: &LossConfig,
    slots: Slots,
    device: &B::Device,
) -> Result<StepGradients> {
    let mut model: AamModel<Autodiff<B>> = config.init(device)?;
    model.load_state_dict(config, state.clone(), Path::new("the compared weights"))?;
    let classifier = matches!(config, ModelConfig::SequencePredictor(c) if c.is_classifier);
    let (input, targets) = batch_tensors::<Autodiff<B>>(batch, device, classifier, slots);
    let predictions = predict_batch(&model, input, loss.nuc_penalty > 0.0);
    let parts = loss.forward(&predictions, &targets)?;
    let mut losses = BTreeMap::new();
    for (name, part) in [
        ("unifrac", &parts.unifrac),
        ("nuc", &parts.nuc),
        ("count", &parts.count),
        ("target", &parts.target),
    ] {
        if let Some(p) = part {
            losses.insert(name, p.clone().into_scalar().elem::<f64>());
        }
    }
    losses.insert("total", parts.total.clone().into_scalar().elem::<f64>());
    let grads = parts.total.backward();
    let gradients = model
        .named_gradients(config, &grads)
        .into_iter()
        .filter_map(|(key, g)| {
            g.map(|g| {
                (
                    key,
                    g.convert::<f32>().to_vec::<f32>().expect("f32 gradient"),
                )
            })
        })
        .collect();
    Ok(StepGradients { losses, gradients })
}

/// How far one parameter's gradient is from the oracle's.
#[derive(Clone, Debug)]
pub struct TensorDifference {
    /// Torch key.
    pub key: String,
    /// Largest absolute difference over the largest magnitude of the
    /// oracle's gradient (floored at `1e-3`, so that a near-zero gradient
    /// does not turn rounding into a large relative error).
    pub rel_err: f64,
    /// L2 norm of the oracle's gradient.
    pub norm_want: f64,
    /// L2 norm of the checked backend's gradient.
    pub norm_got: f64,
}

/// A checked step against the oracle's.
#[derive(Clone, Debug)]
pub struct Comparison {
    /// `(name, oracle, checked)` for each loss part.
    pub losses: Vec<(&'static str, f64, f64)>,
    /// Global gradient norms: oracle, checked.
    pub norms: (f64, f64),
    /// Every parameter, worst first. A parameter with a gradient on one
    /// side only, or of another length, has `rel_err` infinite.
    pub tensors: Vec<TensorDifference>,
}

impl Comparison {
    /// `(name, oracle, checked, relative difference)` of each loss part,
    /// the difference relative to the oracle's value floored at 1.
    pub fn loss_errors(&self) -> impl Iterator<Item = (&'static str, f64, f64, f64)> + '_ {
        self.losses
            .iter()
            .map(|&(name, want, got)| (name, want, got, rel_or_inf(want, got, want.abs().max(1.0))))
    }

    /// The largest relative difference of any loss part ([`Self::loss_errors`]).
    pub fn worst_loss(&self) -> f64 {
        self.loss_errors().map(|(.., err)| err).fold(0.0, f64::max)
    }

    /// The worst parameter, if any.
    pub fn worst_tensor(&self) -> Option<&TensorDifference> {
        self.tensors.first()
    }
}

/// `|a - b| / scale`, infinite where either is not finite.
fn rel_or_inf(a: f64, b: f64, scale: f64) -> f64 {
    let d = (a - b).abs() / scale;
    if d.is_finite() {
        d
    } else {
        f64::INFINITY
    }
}

/// Compares `got` (the checked backend) with `want` (the oracle).
pub fn compare(want: &StepGradients, got: &StepGradients) -> Comparison {
    let losses = want
        .losses
        .iter()
        .map(|(name, w)| (*name, *w, got.losses.get(name).copied().unwrap_or(f64::NAN)))
        .collect();
    let keys: std::collections::BTreeSet<&String> =
        want.gradients.keys().chain(got.gradients.keys()).collect();
    let mut tensors: Vec<TensorDifference> = keys
        .into_iter()
        .map(|key| {
            let (w, g) = (want.gradients.get(key), got.gradients.get(key));
            let rel_err = match (w, g) {
                (Some(w), Some(g)) if w.len() == g.len() => {
                    let scale = w
                        .iter()
                        .fold(0f64, |m, &x| m.max((x as f64).abs()))
                        .max(1e-3);
                    w.iter()
                        .zip(g)
                        .map(|(&a, &b)| rel_or_inf(a as f64, b as f64, scale))
                        .fold(0.0, f64::max)
                }
                _ => f64::INFINITY,
            };
            TensorDifference {
                key: key.clone(),
                rel_err,
                norm_want: w.map_or(0.0, |w| l2(w)),
                norm_got: g.map_or(0.0, |g| l2(g)),
            }
        })
        .collect();
    tensors.sort_by(|a, b| b.rel_err.total_cmp(&a.rel_err));
    Comparison {
        losses,
        norms: (want.norm(), got.norm()),
        tensors,
    }
}
