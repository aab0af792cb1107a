//! Reference §3: the multi-task loss.
//!
//! `total = target_penalty·L_target + count_penalty·L_count + penalty·L_base
//! + nuc_penalty·L_nuc`, where a component whose inputs are absent is 0.
//! Every function here is a plain tensor expression, so the gradients come
//! from autodiff and match the reference's to float rounding (the loss parity
//! test in `tests/` checks values and parameter gradients).
//!
//! Averages over data-dependent position sets divide by `max(n, 1)` computed
//! on the device, so no loss forces a host round trip.

use aam_models::asv_encoder::Nucleotides;
use aam_models::output::AsvTokens;
use aam_models::sequence_encoder::SequenceEncoderOutput;
use aam_models::sequence_predictor::{PredictorOutput, TargetPrediction};
use burn::prelude::*;
use burn::tensor::activation;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// How the target head's regression error is turned into a loss (§3.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TargetLossKind {
    /// Mean squared error.
    Mse,
    /// Mean absolute error.
    Mae,
    /// Smooth L1 with β = 1: `0.5e²` if `|e| < 1`, else `|e| − 0.5`.
    #[default]
    Huber,
    /// Pinball loss over the configured quantiles (prediction `[B, out, Q]`).
    Quantile,
    /// `over·max(p−y, 0) + under·max(y−p, 0)`.
    Asymmetric,
}

impl TargetLossKind {
    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Mse => "mse",
            Self::Mae => "mae",
            Self::Huber => "huber",
            Self::Quantile => "quantile",
            Self::Asymmetric => "asymmetric",
        }
    }
}

/// What the base (self-supervised) loss compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BaseLoss {
    /// UniFrac: `tanh(‖eᵢ − eⱼ‖/10)` against the batch's distance block, over
    /// the strict upper triangle (§3.2).
    #[default]
    Unifrac,
    /// Plain MSE of `base_prediction` against the base target (faith_pd,
    /// taxonomy).
    Mse,
}

/// The weights and kinds of the multi-task loss (reference `MultiTaskLoss`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossConfig {
    /// Weight of the base (UniFrac) loss. Default 1.
    pub penalty: f64,
    /// Weight of the nucleotide loss. Default 1.
    pub nuc_penalty: f64,
    /// Weight of the target loss. Default 1.
    pub target_penalty: f64,
    /// Weight of the count loss. Default 1.
    pub count_penalty: f64,
    /// Base loss.
    pub base: BaseLoss,
    /// Regression target loss. Default huber.
    pub target_loss: TargetLossKind,
    /// Per output column loss kinds (mse/mae/huber), overriding `target_loss`.
    pub column_losses: Option<Vec<TargetLossKind>>,
    /// Quantile levels in (0, 1), for [`TargetLossKind::Quantile`].
    pub quantiles: Option<Vec<f64>>,
    /// Asymmetric loss weight of over-prediction. Default 1.
    pub over_penalty: f64,
    /// Asymmetric loss weight of under-prediction. Default 1.
    pub under_penalty: f64,
    /// NLL class weights (classification).
    pub class_weights: Option<Vec<f64>>,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            penalty: 1.0,
            nuc_penalty: 1.0,
            target_penalty: 1.0,
            count_penalty: 1.0,
            base: BaseLoss::Unifrac,
            target_loss: TargetLossKind::Huber,
            column_losses: None,
            quantiles: None,
            over_penalty: 1.0,
            under_penalty: 1.0,
            class_weights: None,
        }
    }
}

impl LossConfig {
    /// Checks the combinations the reference rejects (with clearer messages).
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, reason: String| {
            Err(TrainError::InvalidArgument {
                field: field.into(),
                reason,
            })
        };
        for (name, v) in [
            ("penalty", self.penalty),
            ("nuc_penalty", self.nuc_penalty),
            ("target_penalty", self.target_penalty),
            ("count_penalty", self.count_penalty),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(name, format!("must be a finite number ≥ 0, got {v}"));
            }
        }
        if self.target_loss == TargetLossKind::Quantile {
            let Some(q) = &self.quantiles else {
                return bad(
                    "quantiles",
                    "the quantile loss needs quantile levels".into(),
                );
            };
            if q.is_empty() || q.iter().any(|&t| !(t > 0.0 && t < 1.0)) {
                return bad(
                    "quantiles",
                    format!("each level must lie in (0, 1), got {q:?}"),
                );
            }
            if q.windows(2).any(|w| w[0] >= w[1]) {
                return bad(
                    "quantiles",
                    format!("levels must be sorted and distinct, got {q:?}"),
                );
            }
        } else if self.quantiles.is_some() {
            return bad(
                "quantiles",
                format!(
                    "only used with the quantile loss, not {}",
                    self.target_loss.name()
                ),
            );
        }
        if self.target_loss == TargetLossKind::Asymmetric
            && !(self.over_penalty > 0.0 && self.under_penalty > 0.0)
        {
            return bad(
                "over_penalty/under_penalty",
                "both must be > 0 for the asymmetric loss".into(),
            );
        }
        if let Some(columns) = &self.column_losses {
            if matches!(
                self.target_loss,
                TargetLossKind::Quantile | TargetLossKind::Asymmetric
            ) {
                return bad(
                    "loss_config",
                    "per-column losses cannot be combined with quantile or asymmetric".into(),
                );
            }
            if let Some(k) = columns
                .iter()
                .find(|k| matches!(k, TargetLossKind::Quantile | TargetLossKind::Asymmetric))
            {
                return bad(
                    "loss_config",
                    format!("a column loss must be mse, mae or huber, not {}", k.name()),
                );
            }
        }
        if let Some(w) = &self.class_weights {
            if w.iter().any(|&x| !(x.is_finite() && x >= 0.0)) || w.iter().all(|&x| x == 0.0) {
                return bad(
                    "class_weights",
                    format!("weights must be finite, ≥ 0 and not all 0, got {w:?}"),
                );
            }
        }
        Ok(())
    }
}

/// The supervised target of a batch.
#[derive(Clone, Debug)]
pub enum Target<B: Backend> {
    /// Normalised regression targets `[B, out]`.
    Regression(Tensor<B, 2>),
    /// Class indices `[B]`.
    Classes(Tensor<B, 1, Int>),
}

/// What the losses compare the predictions with.
#[derive(Clone, Debug)]
pub struct LossTargets<B: Backend> {
    /// The batch's uncorrupted tokens: the count loss's slot mask, and the
    /// nucleotide targets where the predictions carry none of their own.
    pub tokens: AsvTokens<B>,
    /// The batch's UniFrac block `[B, B]` (or a base target for [`BaseLoss::Mse`]).
    pub base: Option<Tensor<B, 2>>,
    /// Count targets `[B, S, 1]` (already normalised as the model sees them).
    pub counts: Option<Tensor<B, 3>>,
    /// Target values.
    pub target: Option<Target<B>>,
    /// Per-sample loss weights `[B]`.
    pub sample_weights: Option<Tensor<B, 1>>,
}

/// The model outputs the losses read, from either model class.
#[derive(Clone, Debug)]
pub struct Predictions<B: Backend> {
    /// Pooled embeddings `[B, D]` (unifrac base).
    pub embeddings: Option<Tensor<B, 2>>,
    /// Base head output (non-unifrac base).
    pub base_prediction: Option<Tensor<B, 2>>,
    /// Nucleotide logits `[B, S, L, V]`, or the model's packed `[1, M, L, V]`
    /// (the filled slots as one sample: the loss, a mean over the scored
    /// positions, is the same).
    pub nuc_logits: Option<Tensor<B, 4>>,
    /// Corrupted positions, shaped as `nuc_logits` without `V` (training
    /// with masking only).
    pub mask_indices: Option<Tensor<B, 3, Bool>>,
    /// The targets of `nuc_logits`, shaped as `mask_indices`; `None`: the
    /// dense ids of [`LossTargets::tokens`].
    pub nuc_tokens: Option<Tensor<B, 3, Int>>,
    /// Count head `[B, S, 1]`.
    pub count_prediction: Option<Tensor<B, 3>>,
    /// Target head.
    pub target: Option<TargetPrediction<B>>,
}

impl<B: Backend> Predictions<B> {
    /// The uncorrupted ids `nuc_logits` are scored against: the model's own
    /// (packed) where it gave them, else the targets' dense ids.
    pub fn nuc_targets(&self, targets: &LossTargets<B>) -> Result<Tensor<B, 3, Int>> {
        match (&self.nuc_tokens, targets.tokens.ids()) {
            (Some(t), _) => Ok(t.clone()),
            (None, Some(ids)) => Ok(ids.clone()),
            (None, None) => Err(TrainError::InvalidArgument {
                field: "tokens".into(),
                reason: "nucleotide logits without their targets: the predictions carry no \
                         `nuc_tokens` and the loss targets hold only the filled slots"
                    .into(),
            }),
        }
    }
}

/// The model's packed nucleotide outputs as one sample of `M` slots:
/// `([1, M, L, V], [1, M, L], [1, M, L])`.
#[allow(clippy::type_complexity)]
fn packed_nucleotides<B: Backend>(
    nucleotides: Option<Nucleotides<B>>,
) -> (
    Option<Tensor<B, 4>>,
    Option<Tensor<B, 3, Bool>>,
    Option<Tensor<B, 3, Int>>,
) {
    match nucleotides {
        Some(n) => (
            Some(n.logits.unsqueeze_dim(0)),
            n.mask_indices.map(|m| m.unsqueeze_dim(0)),
            Some(n.tokens.unsqueeze_dim(0)),
        ),
        None => (None, None, None),
    }
}

impl<B: Backend> From<SequenceEncoderOutput<B>> for Predictions<B> {
    fn from(o: SequenceEncoderOutput<B>) -> Self {
        let (nuc_logits, mask_indices, nuc_tokens) = packed_nucleotides(o.nucleotides);
        Self {
            embeddings: o.embeddings,
            base_prediction: o.base_prediction,
            nuc_logits,
            mask_indices,
            nuc_tokens,
            count_prediction: None,
            target: None,
        }
    }
}

impl<B: Backend> From<PredictorOutput<B>> for Predictions<B> {
    fn from(o: PredictorOutput<B>) -> Self {
        let (nuc_logits, mask_indices, nuc_tokens) = packed_nucleotides(o.nucleotides);
        Self {
            embeddings: o.embeddings,
            base_prediction: o.base_prediction,
            nuc_logits,
            mask_indices,
            nuc_tokens,
            count_prediction: o.count_prediction,
            target: Some(o.target_prediction),
        }
    }
}

/// The loss components of one batch; each a scalar `[1]`, `None` where its
/// inputs were absent (the reference's zero).
#[derive(Clone, Debug)]
pub struct LossParts<B: Backend> {
    /// The weighted sum.
    pub total: Tensor<B, 1>,
    /// Base (UniFrac) loss.
    pub unifrac: Option<Tensor<B, 1>>,
    /// Nucleotide cross-entropy.
    pub nuc: Option<Tensor<B, 1>>,
    /// Count MSE.
    pub count: Option<Tensor<B, 1>>,
    /// Target loss.
    pub target: Option<Tensor<B, 1>>,
}

impl LossConfig {
    /// Every component and their weighted sum.
    pub fn forward<B: Backend>(
        &self,
        pred: &Predictions<B>,
        targets: &LossTargets<B>,
    ) -> Result<LossParts<B>> {
        let device = targets.tokens.device();
        let unifrac = match (self.base, &targets.base) {
            (BaseLoss::Unifrac, Some(t)) => pred
                .embeddings
                .as_ref()
                .map(|e| unifrac_loss(e.clone(), t.clone())),
            (BaseLoss::Mse, Some(t)) => pred
                .base_prediction
                .as_ref()
                .map(|p| mse_checked(p.clone(), t.clone(), "base_prediction"))
                .transpose()?,
            (_, None) => None,
        };
        let nuc = pred
            .nuc_logits
            .as_ref()
            .map(|logits| {
                Ok::<_, TrainError>(nucleotide_loss(
                    logits.clone(),
                    pred.nuc_targets(targets)?,
                    pred.mask_indices.clone(),
                ))
            })
            .transpose()?;
        let count = match (&pred.count_prediction, &targets.counts) {
            (Some(p), Some(c)) => {
                Some(count_loss(p.clone(), c.clone(), targets.tokens.slot_mask()))
            }
            _ => None,
        };
        let target = match (&pred.target, &targets.target) {
            (Some(p), Some(t)) => Some(self.target_loss(p, t, targets.sample_weights.clone())?),
            _ => None,
        };
        let total = self.total(
            unifrac.as_ref(),
            nuc.as_ref(),
            count.as_ref(),
            target.as_ref(),
            &device,
        );
        Ok(LossParts {
            total,
            unifrac,
            nuc,
            count,
            target,
        })
    }

    /// The weighted sum of the components present (`[1]`, 0 without any).
    pub fn total<B: Backend>(
        &self,
        unifrac: Option<&Tensor<B, 1>>,
        nuc: Option<&Tensor<B, 1>>,
        count: Option<&Tensor<B, 1>>,
        target: Option<&Tensor<B, 1>>,
        device: &B::Device,
    ) -> Tensor<B, 1> {
        let mut total = Tensor::<B, 1>::zeros([1], device);
        for (weight, part) in [
            (self.target_penalty, target),
            (self.count_penalty, count),
            (self.penalty, unifrac),
            (self.nuc_penalty, nuc),
        ] {
            if let Some(p) = part {
                if weight != 0.0 {
                    total = total + p.clone() * weight;
                }
            }
        }
        total
    }

    /// §3.5: the target loss for a point, quantile or class prediction.
    pub fn target_loss<B: Backend>(
        &self,
        pred: &TargetPrediction<B>,
        target: &Target<B>,
        sample_weights: Option<Tensor<B, 1>>,
    ) -> Result<Tensor<B, 1>> {
        match (pred, target) {
            (TargetPrediction::Point(log_probs), Target::Classes(classes)) => Ok(nll_loss(
                log_probs.clone(),
                classes.clone(),
                self.class_weights.as_deref(),
                sample_weights,
            )),
            (TargetPrediction::Point(p), Target::Regression(y)) => {
                check_same(&p.dims(), &y.dims(), "target_prediction vs target")?;
                let per_column = |e: Tensor<B, 2>, kind: TargetLossKind| self.elementwise(e, kind);
                let e = p.clone() - y.clone();
                let elementwise = match &self.column_losses {
                    // Sample weights take precedence over per-column kinds (as the reference).
                    Some(kinds) if sample_weights.is_none() => {
                        let out = p.dims()[1];
                        if kinds.len() != out {
                            return Err(TrainError::InvalidArgument {
                                field: "loss_config".into(),
                                reason: format!(
                                    "{} column losses for {out} output columns",
                                    kinds.len()
                                ),
                            });
                        }
                        // Mean of per-column means = overall mean (equal column sizes).
                        let cols: Vec<Tensor<B, 2>> = kinds
                            .iter()
                            .enumerate()
                            .map(|(c, &k)| per_column(e.clone().narrow(1, c, 1), k))
                            .collect();
                        Tensor::cat(cols, 1)
                    }
                    _ => per_column(e, self.target_loss),
                };
                Ok(weighted_mean(elementwise, sample_weights))
            }
            (TargetPrediction::Quantiles(p), Target::Regression(y)) => {
                let [b, out, q] = p.dims();
                check_same(&[b, out], &y.dims(), "target_prediction vs target")?;
                let levels =
                    self.quantiles
                        .as_ref()
                        .ok_or_else(|| TrainError::InvalidArgument {
                            field: "quantiles".into(),
                            reason:
                                "the model predicts quantiles but the loss has no quantile levels"
                                    .into(),
                        })?;
                if levels.len() != q {
                    return Err(TrainError::InvalidArgument {
                        field: "quantiles".into(),
                        reason: format!(
                            "{} levels for a model with {q} quantile outputs",
                            levels.len()
                        ),
                    });
                }
                let device = p.device();
                let tau = Tensor::<B, 1>::from_data(
                    TensorData::new(levels.iter().map(|&t| t as f32).collect(), [q]),
                    &device,
                )
                .reshape([1, 1, q]);
                let e = y.clone().reshape([b, out, 1]) - p.clone();
                let pinball = (e.clone() * tau.clone()).max_pair(e * (tau - 1.0));
                Ok(weighted_mean(pinball.reshape([b, out * q]), sample_weights))
            }
            (TargetPrediction::Quantiles(_), Target::Classes(_)) => {
                Err(TrainError::InvalidArgument {
                    field: "classifier".into(),
                    reason: "a quantile model cannot be trained on class labels".into(),
                })
            }
        }
    }

    /// Elementwise loss of errors `e = p − y`.
    fn elementwise<B: Backend>(&self, e: Tensor<B, 2>, kind: TargetLossKind) -> Tensor<B, 2> {
        match kind {
            TargetLossKind::Mse => e.powi_scalar(2),
            TargetLossKind::Mae => e.abs(),
            TargetLossKind::Huber => {
                let a = e.clone().abs();
                let linear = a.clone() - 0.5;
                (e.powi_scalar(2) * 0.5).mask_where(a.greater_equal_elem(1.0), linear)
            }
            TargetLossKind::Asymmetric => {
                activation::relu(e.clone()) * self.over_penalty
                    + activation::relu(e.neg()) * self.under_penalty
            }
            // Quantile predictions have their own branch; a point prediction
            // with a quantile loss is the median's absolute error ×0.5.
            TargetLossKind::Quantile => e.abs() * 0.5,
        }
    }
}

/// Mean of `[B, k]` elementwise losses; with sample weights
/// `mean_i(w_i · mean_k l_ik)` (not divided by Σw, as the reference).
fn weighted_mean<B: Backend>(
    l: Tensor<B, 2>,
    sample_weights: Option<Tensor<B, 1>>,
) -> Tensor<B, 1> {
    match sample_weights {
        None => l.mean(),
        Some(w) => {
            let [b, _] = l.dims();
            (l.mean_dim(1).reshape([b]) * w).mean()
        }
    }
}

fn check_same(a: &[usize], b: &[usize], what: &str) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(TrainError::Shape {
            what: what.into(),
            left: a.to_vec(),
            right: b.to_vec(),
        })
    }
}

fn mse_checked<B: Backend>(p: Tensor<B, 2>, t: Tensor<B, 2>, what: &str) -> Result<Tensor<B, 1>> {
    check_same(&p.dims(), &t.dims(), what)?;
    Ok((p - t).powi_scalar(2).mean())
}

/// Pairwise `tanh(‖eᵢ − eⱼ‖ / 10)` `[B, B]` with a zero diagonal; the squared
/// distance is clamped at 1e-8 before the square root (the reference's guard
/// against an infinite gradient for identical rows).
///
/// # Shapes
/// - embeddings: `[B, D]` → `[B, B]`
pub fn pairwise_tanh_distances<B: Backend>(embeddings: Tensor<B, 2>) -> Tensor<B, 2> {
    let [b, d] = embeddings.dims();
    let device = embeddings.device();
    let diff = embeddings.clone().reshape([b, 1, d]) - embeddings.reshape([1, b, d]);
    let squared = diff.powi_scalar(2).sum_dim(2).reshape([b, b]);
    let distance = squared.clamp_min(1e-8).sqrt();
    let off_diagonal = Tensor::<B, 2>::ones([b, b], &device) - Tensor::<B, 2>::eye(b, &device);
    (distance * off_diagonal.clone() / 10.0).tanh() * off_diagonal
}

/// 1 on the strict upper triangle (`i < j`), 0 elsewhere.
fn strict_upper<B: Backend>(b: usize, device: &B::Device) -> Tensor<B, 2> {
    let values: Vec<f32> = (0..b * b)
        .map(|k| if k / b < k % b { 1.0 } else { 0.0 })
        .collect();
    Tensor::from_data(TensorData::new(values, [b, b]), device)
}

/// §3.2: MSE between [`pairwise_tanh_distances`] and the UniFrac block over
/// the `B(B−1)/2` pairs `i < j`; 0 for a single sample.
///
/// # Shapes
/// - embeddings: `[B, D]`; target: `[B, B]` → `[1]`
pub fn unifrac_loss<B: Backend>(embeddings: Tensor<B, 2>, target: Tensor<B, 2>) -> Tensor<B, 1> {
    let [b, _] = embeddings.dims();
    let device = embeddings.device();
    if b < 2 {
        return (embeddings.sum() * 0.0).reshape([1]);
    }
    let predicted = pairwise_tanh_distances(embeddings);
    let pairs = (b * (b - 1) / 2) as f64;
    ((predicted - target).powi_scalar(2) * strict_upper::<B>(b, &device)).sum() / pairs
}

/// The positions scored by the nucleotide loss: masked ∧ valid when the model
/// corrupted its input, else every valid (non-zero) position, START included.
pub(crate) fn nucleotide_positions<B: Backend>(
    tokens: Tensor<B, 3, Int>,
    mask_indices: Option<Tensor<B, 3, Bool>>,
) -> Tensor<B, 3, Bool> {
    let valid = tokens.greater_elem(0);
    match mask_indices {
        Some(masked) => masked.bool_and(valid),
        None => valid,
    }
}

/// §3.3: mean cross-entropy over all `V` logits at the scored positions
/// (0 when there are none).
///
/// # Shapes
/// - logits: `[B, S, L, V]`; tokens: `[B, S, L]`; mask_indices: `[B, S, L]` → `[1]`
pub fn nucleotide_loss<B: Backend>(
    logits: Tensor<B, 4>,
    tokens: Tensor<B, 3, Int>,
    mask_indices: Option<Tensor<B, 3, Bool>>,
) -> Tensor<B, 1> {
    let [b, s, l, _v] = logits.dims();
    let positions = nucleotide_positions(tokens.clone(), mask_indices).float();
    let log_probs = activation::log_softmax(logits, 3);
    let picked = log_probs
        .gather(3, tokens.reshape([b, s, l, 1]))
        .reshape([b, s, l]);
    let n = positions.clone().sum().clamp_min(1.0);
    (picked.neg() * positions).sum() / n
}

/// Nucleotide accuracy of one batch (§3.6): argmax equals the uncorrupted
/// token, over the masked positions if any, else over positions holding a
/// nucleotide (1..=4). Returns `(correct, scored)` as device scalars.
pub fn nucleotide_accuracy<B: Backend>(
    logits: Tensor<B, 4>,
    tokens: Tensor<B, 3, Int>,
    mask_indices: Option<Tensor<B, 3, Bool>>,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let [b, s, l, _] = logits.dims();
    let nucleotides = tokens
        .clone()
        .greater_elem(0)
        .bool_and(tokens.clone().lower_elem(5));
    let masked = mask_indices.map(|m| m.bool_and(tokens.clone().greater_elem(0)));
    let positions = match masked {
        Some(m) => {
            // Masked positions if any were drawn in this batch, else nucleotides.
            let any = m.clone().any().reshape([1, 1, 1]).expand([b, s, l]);
            m.mask_where(any.bool_not(), nucleotides)
        }
        None => nucleotides,
    };
    let hits = logits
        .argmax(3)
        .reshape([b, s, l])
        .equal(tokens)
        .bool_and(positions.clone());
    (hits.float().sum(), positions.float().sum())
}

/// §3.4: squared error of the count head over the non-empty slots, divided
/// by their number (0 when there are none).
///
/// # Shapes
/// - prediction, counts: `[B, S, 1]`; slot_mask: `[B, S]` → `[1]`
pub fn count_loss<B: Backend>(
    prediction: Tensor<B, 3>,
    counts: Tensor<B, 3>,
    slot_mask: Tensor<B, 2, Bool>,
) -> Tensor<B, 1> {
    let [b, s] = slot_mask.dims();
    let slots = slot_mask.reshape([b, s, 1]).float();
    let n = slots.clone().sum().clamp_min(1.0);
    ((prediction - counts).powi_scalar(2) * slots).sum() / n
}

/// §3.5 classification: NLL of log-probabilities, class-weighted mean
/// `Σ w_{yᵢ}·(−log pᵢ) / Σ w_{yᵢ}`; with sample weights the plain mean of
/// `w_{yᵢ}·(−log pᵢ)·swᵢ`.
///
/// # Shapes
/// - log_probs: `[B, C]`; classes: `[B]`; sample_weights: `[B]` → `[1]`
pub fn nll_loss<B: Backend>(
    log_probs: Tensor<B, 2>,
    classes: Tensor<B, 1, Int>,
    class_weights: Option<&[f64]>,
    sample_weights: Option<Tensor<B, 1>>,
) -> Tensor<B, 1> {
    let [b, c] = log_probs.dims();
    let device = log_probs.device();
    let picked = log_probs
        .gather(1, classes.clone().reshape([b, 1]))
        .reshape([b])
        .neg();
    let weights = class_weights.map(|w| {
        let table = Tensor::<B, 1>::from_data(
            TensorData::new(
                w.iter()
                    .map(|&x| x as f32)
                    .chain(std::iter::repeat(1.0))
                    .take(c)
                    .collect::<Vec<f32>>(),
                [c],
            ),
            &device,
        );
        table.select(0, classes)
    });
    match (weights, sample_weights) {
        (None, None) => picked.mean(),
        (Some(w), None) => (picked * w.clone()).sum() / w.sum(),
        (None, Some(sw)) => (picked * sw).mean(),
        (Some(w), Some(sw)) => (picked * w * sw).mean(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    type TB = NdArray<f32>;

    fn close(a: f32, b: f32) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }

    #[test]
    fn unifrac_loss_uses_the_upper_triangle_only() {
        let device = Default::default();
        let e = Tensor::<TB, 2>::from_floats([[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]], &device);
        // Pairs: (0,1) d=5, (0,2) d=0 → clamp 1e-4, (1,2) d=5.
        let t = Tensor::<TB, 2>::from_floats(
            [[0.0, 0.1, 0.2], [9.0, 0.0, 0.3], [9.0, 9.0, 0.0]],
            &device,
        );
        let p = [(0.5f32).tanh(), (1e-5f32).tanh(), (0.5f32).tanh()];
        let want = ((p[0] - 0.1).powi(2) + (p[1] - 0.2).powi(2) + (p[2] - 0.3).powi(2)) / 3.0;
        close(unifrac_loss(e, t).into_scalar(), want);
    }

    #[test]
    fn unifrac_loss_of_one_sample_is_zero() {
        let device = Default::default();
        let e = Tensor::<TB, 2>::from_floats([[1.0, 2.0]], &device);
        close(
            unifrac_loss(e, Tensor::zeros([1, 1], &device)).into_scalar(),
            0.0,
        );
    }

    #[test]
    fn nucleotide_loss_scores_valid_or_masked_positions() {
        let device = Default::default();
        // One ASV: START, A, pad. Uniform logits → CE = ln 7 at each position.
        let tokens = Tensor::<TB, 3, Int>::from_ints([[[5, 1, 0]]], &device);
        let logits = Tensor::<TB, 4>::zeros([1, 1, 3, 7], &device);
        close(
            nucleotide_loss(logits.clone(), tokens.clone(), None).into_scalar(),
            7f32.ln(),
        );
        let none =
            Tensor::<TB, 3, Bool>::from_bool(TensorData::from([[[false, false, true]]]), &device);
        // The only masked position is padding → no position → 0.
        close(
            nucleotide_loss(logits, tokens, Some(none)).into_scalar(),
            0.0,
        );
    }

    #[test]
    fn huber_switches_at_one() {
        let device = Default::default();
        let cfg = LossConfig::default();
        let p = Tensor::<TB, 2>::from_floats([[0.5], [3.0]], &device);
        let y = Tensor::<TB, 2>::zeros([2, 1], &device);
        let l = cfg
            .target_loss(&TargetPrediction::Point(p), &Target::Regression(y), None)
            .unwrap()
            .into_scalar();
        close(l, (0.125 + 2.5) / 2.0);
    }

    #[test]
    fn class_weighted_nll_is_a_weighted_mean() {
        let device = Default::default();
        let lp = Tensor::<TB, 2>::from_floats([[-1.0, -2.0], [-3.0, -4.0]], &device);
        let y = Tensor::<TB, 1, Int>::from_ints([0, 1], &device);
        let l = nll_loss(lp, y, Some(&[1.0, 3.0]), None).into_scalar();
        close(l, (1.0 + 3.0 * 4.0) / 4.0);
    }

    #[test]
    fn validate_rejects_unsorted_quantiles() {
        let cfg = LossConfig {
            target_loss: TargetLossKind::Quantile,
            quantiles: Some(vec![0.5, 0.1]),
            ..Default::default()
        };
        assert!(cfg.validate().unwrap_err().to_string().contains("sorted"));
    }
}
