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
//! chosen [`Slots`], [`predict_batch`], the loss, the backward pass, and the
//! gradients collected into a [`GradientBuffer`], whose global norm (what
//! `--max-grad-norm` clips) is computed on the device as in training. Dropout
//! and nucleotide masking draw different random numbers on different
//! backends, so the caller passes a model configuration without them
//! ([`ModelConfig::without_dropout`]).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use aam_data::Batch;
use aam_models::model::{AamModel, ModelConfig, StateTensor};
use aam_models::AttentionBackend;
use burn::backend::Autodiff;
use burn::prelude::*;

use crate::error::Result;
use crate::loss::LossConfig;
use crate::optim::GradientBuffer;
use crate::run::{batch_tensors, predict_batch, Slots};

/// One training step's losses and parameter gradients, on the host.
#[derive(Clone, Debug)]
pub struct StepGradients {
    /// Loss parts by name (`total`, `unifrac`, `nuc`, `count`, `target`),
    /// those the loss configuration computes.
    pub losses: BTreeMap<&'static str, f64>,
    /// Gradient of every parameter that took part, by torch key.
    pub gradients: BTreeMap<String, Vec<f32>>,
    /// The global gradient norm as the training loop computes it, on the
    /// backend ([`GradientBuffer::global_norm`]); [`Self::norm`] is the same
    /// norm summed on the host in f64.
    pub device_norm: f64,
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
    let name = |path: &str| config.torch_key(path);
    let buffer = GradientBuffer::collect_model(&model, &grads, &name, 1.0);
    let device_norm = buffer.global_norm();
    let gradients = buffer.to_host();
    Ok(StepGradients {
        losses,
        gradients,
        device_norm,
    })
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
    /// Global gradient norms (host sums): oracle, checked.
    pub norms: (f64, f64),
    /// The same norms as the training loop computes them on each backend.
    pub device_norms: (f64, f64),
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

    /// How far the checked backend's own norm (the one `--max-grad-norm`
    /// clips by) is from the host's sum of its gradients, relative.
    pub fn device_norm_error(&self) -> f64 {
        rel_or_inf(self.device_norms.1, self.norms.1, self.norms.1.max(1e-12))
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
        device_norms: (want.device_norm, got.device_norm),
        tensors,
    }
}

/// How one parameter's fresh draw on a backend compares with the CPU's
/// draw from the same initialiser (different random numbers, the same
/// distribution).
#[derive(Clone, Debug)]
pub struct DrawDifference {
    /// Torch key.
    pub key: String,
    /// Mean and standard deviation of the oracle's draw.
    pub want: (f64, f64),
    /// Mean and standard deviation of the checked backend's draw.
    pub got: (f64, f64),
    /// Share of the checked draw's values that repeat another value.
    pub repeated: f64,
    /// Why the draw looks wrong, if it does.
    pub problem: Option<String>,
}

/// Mean and (population) standard deviation, in f64.
fn mean_std(values: &[f32]) -> (f64, f64) {
    let n = values.len().max(1) as f64;
    let mean = values.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = values
        .iter()
        .map(|&x| (x as f64 - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean, var.sqrt())
}

/// Compares two fresh initialisations of the same model, parameter by
/// parameter: the checked backend's draw must look like the oracle's.
/// Constant initialisers (ones, zeros, constants) must agree exactly; a
/// random one, on tensors of at least 1,024 values, must have its mean
/// within 6 standard errors, its standard deviation within 15%, and at
/// most 1% repeated values (an f32 uniform draw has 2^24 levels, so the
/// oracle repeats well under that at these sizes; a generator whose
/// threads share a seed repeats whole runs). Non-finite values always
/// fail. Rows are returned worst first (problems, then by spread ratio).
pub fn compare_draws(
    want: &HashMap<String, StateTensor>,
    got: &HashMap<String, StateTensor>,
) -> Vec<DrawDifference> {
    let keys: std::collections::BTreeSet<&String> = want.keys().chain(got.keys()).collect();
    let mut rows: Vec<DrawDifference> = keys
        .into_iter()
        .map(|key| {
            let (w, g) = (want.get(key), got.get(key));
            let empty: &[f32] = &[];
            let w = w.map_or(empty, |t| &t.values);
            let g = g.map_or(empty, |t| &t.values);
            let (wm, ws) = mean_std(w);
            let (gm, gs) = mean_std(g);
            let mut sorted = g.to_vec();
            sorted.sort_by(f32::total_cmp);
            let repeats = sorted.windows(2).filter(|p| p[0] == p[1]).count();
            let repeated = repeats as f64 / g.len().max(1) as f64;
            let wrepeated = {
                let mut s = w.to_vec();
                s.sort_by(f32::total_cmp);
                s.windows(2).filter(|p| p[0] == p[1]).count() as f64 / w.len().max(1) as f64
            };
            let problem = if w.len() != g.len() {
                Some(format!("{} values, the CPU's draw {}", g.len(), w.len()))
            } else if g.iter().any(|x| !x.is_finite()) {
                Some("non-finite values".into())
            } else if ws == 0.0 {
                (w != g).then(|| {
                    format!("a constant initialiser, but values differ from the CPU's {wm}")
                })
            } else if w.len() < 1024 {
                None
            } else if (gm - wm).abs() > 6.0 * ws * (2.0 / w.len() as f64).sqrt() {
                Some(format!("mean {gm:.3e}, the CPU's {wm:.3e} (std {ws:.3e})"))
            } else if !(0.85..=1.0 / 0.85).contains(&(gs / ws)) {
                Some(format!("standard deviation {gs:.3e}, the CPU's {ws:.3e}"))
            } else if repeated > 0.01 && repeated > 2.0 * wrepeated {
                Some(format!(
                    "{:.1}% of its values repeat (the CPU's draw {:.1}%)",
                    100.0 * repeated,
                    100.0 * wrepeated
                ))
            } else {
                None
            };
            DrawDifference {
                key: key.clone(),
                want: (wm, ws),
                got: (gm, gs),
                repeated,
                problem,
            }
        })
        .collect();
    let spread = |r: &DrawDifference| {
        if r.want.1 > 0.0 {
            (r.got.1 / r.want.1).ln().abs()
        } else {
            0.0
        }
    };
    rows.sort_by(|a, b| {
        b.problem
            .is_some()
            .cmp(&a.problem.is_some())
            .then(spread(b).total_cmp(&spread(a)))
    });
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    fn draw(seed: u64) -> HashMap<String, StateTensor> {
        use aam_models::asv_encoder::AsvEncoderConfig;
        use aam_models::sample_encoder::SampleSequenceEncoderConfig;
        use aam_models::sequence_encoder::SequenceEncoderConfig;
        // D = 32: the feed-forward weights have 4,096 values.
        let asv = AsvEncoderConfig::new()
            .with_embedding_dim(32)
            .with_max_bp(40)
            .with_num_layers(1)
            .with_num_heads(2);
        let sample = SampleSequenceEncoderConfig::new(asv).with_token_limit(16);
        let config = ModelConfig::SequenceEncoder(SequenceEncoderConfig::new(sample));
        let device = Default::default();
        <NdArray<f32> as Backend>::seed(&device, seed);
        let model: AamModel<NdArray<f32>> = config.init(&device).expect("model");
        model.state_dict(&config).into_iter().collect()
    }

    #[test]
    fn two_cpu_draws_look_alike_and_broken_ones_do_not() {
        let want = draw(1);
        let got = draw(2);
        let rows = compare_draws(&want, &got);
        assert!(
            rows.iter().all(|r| r.problem.is_none()),
            "{:?}",
            rows.iter().find(|r| r.problem.is_some())
        );
        // The largest random tensor: scaled, shifted, or drawn from a
        // generator whose runs repeat, the check must say so.
        let (key, _) = want
            .iter()
            .filter(|(_, t)| mean_std(&t.values).1 > 0.0)
            .max_by_key(|(_, t)| t.values.len())
            .expect("a random parameter");
        let broken = |f: &dyn Fn(&mut Vec<f32>)| {
            let mut got = got.clone();
            f(&mut got.get_mut(key).expect("key").values);
            let rows = compare_draws(&want, &got);
            assert_eq!(rows[0].key, *key, "{:?}", rows[0]);
            rows[0].problem.clone().expect("a problem")
        };
        assert!(broken(&|v| v.iter_mut().for_each(|x| *x *= 1.3)).contains("standard deviation"));
        let std = mean_std(&got[key].values).1 as f32;
        assert!(broken(&|v| v.iter_mut().for_each(|x| *x += std)).contains("mean"));
        assert!(broken(&|v| {
            let half = v.len() / 2;
            let (a, b) = v.split_at_mut(half);
            b[..half].copy_from_slice(&a[..half]);
        })
        .contains("repeat"));
        assert!(broken(&|v| v[0] = f32::NAN).contains("non-finite"));
        // A constant initialiser (a LayerNorm weight) must match exactly.
        let (ones, _) = want
            .iter()
            .find(|(_, t)| t.values.iter().all(|&x| x == 1.0))
            .expect("a ones-initialised parameter");
        let mut off = got.clone();
        off.get_mut(ones).unwrap().values[0] = 0.5;
        assert!(compare_draws(&want, &off)
            .iter()
            .any(|r| r.key == *ones && r.problem.is_some()));
    }
}
