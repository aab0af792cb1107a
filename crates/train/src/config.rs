//! What a run is asked to do, checked before anything is loaded: the run's
//! hyper-parameters ([`RunConfig`], stored in every checkpoint so that a
//! resumed run continues with the same ones) and the model's architecture
//! from the user's options ([`ModelSpec`] → the reference's
//! `SequenceEncoder` configuration).
//!
//! Validation errors are [`TrainError::InvalidArgument`] naming the option
//! at fault in its command-line spelling without dashes (`batch-size`), so
//! a front end can point at the flag.

use aam_data::AsvSampling;
use aam_models::asv_encoder::{AsvEncoderConfig, MaskStrategy};
use aam_models::sample_encoder::{CountEmbeddingMethod, SampleSequenceEncoderConfig};
use aam_models::sequence_encoder::{EncoderType, SequenceEncoderConfig};
use aam_models::{AttnImplementation, MixedPrecision};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::loss::LossConfig;
use crate::optim::OptimizerConfig;
use crate::parallel::UnifracPairs;
use crate::schedule::SchedulerConfig;

/// Timing of the training step's phases (`--time-phases`): for finding where
/// a step's time goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PhaseTiming {
    /// No timing.
    #[default]
    Off,
    /// The mean time of each phase, the device synchronised after each
    /// (slower).
    Synced,
    /// The time the host spends queueing each phase, unsynchronised: `read`
    /// then holds the wait for the device.
    Host,
}

/// Self-supervised pre-training or supervised training.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    /// `aam-rs pretrain`.
    Pretrain,
    /// `aam-rs train`.
    Train,
}

/// The metric that selects the best epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BestMetric {
    /// Validation total loss (lower is better).
    #[default]
    ValLoss,
    /// R² (higher).
    R2,
    /// MAE (lower).
    Mae,
    /// Accuracy (higher).
    Accuracy,
    /// Weighted F1 (higher).
    F1,
}

impl BestMetric {
    /// The key in the validation results.
    pub fn key(self) -> &'static str {
        match self {
            Self::ValLoss => "total_loss",
            Self::R2 => "r2",
            Self::Mae => "mae",
            Self::Accuracy => "accuracy",
            Self::F1 => "f1",
        }
    }

    pub(crate) fn higher_is_better(self) -> bool {
        matches!(self, Self::R2 | Self::Accuracy | Self::F1)
    }
}

/// The run's hyper-parameters (everything but the model and the data).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// Pretrain or train.
    pub task: Task,
    /// Maximum epochs.
    pub epochs: usize,
    /// Samples per batch (even).
    pub batch_size: usize,
    /// Batches per optimiser step.
    pub gradient_accumulation_steps: usize,
    /// Global gradient-norm clipping threshold.
    pub max_grad_norm: Option<f64>,
    /// Learning rate of the categorical modules (default: the base lr).
    pub categorical_lr: Option<f64>,
    /// Optimiser.
    pub optimizer: OptimizerConfig,
    /// Learning-rate schedule (`total_steps` is filled in by [`fit`](crate::run::fit)).
    pub scheduler: SchedulerConfig,
    /// Loss weights and kinds.
    pub loss: LossConfig,
    /// Early-stopping patience in epochs.
    pub patience: usize,
    /// The metric that selects the best epoch.
    pub best_metric: BestMetric,
    /// Seed of the split, batch order, dropout and masking.
    pub seed: u64,
    /// ASV slots per sample.
    pub token_limit: usize,
    /// Which ASVs fill the slots when a sample has more.
    pub asv_sampling: AsvSampling,
    /// Run every batch on all `token_limit` slots, as the reference
    /// (`--all-slots`), instead of [`Slots::for_model`](crate::run::Slots::for_model)'s choice.
    #[serde(default)]
    pub all_slots: bool,
    /// Batch-building threads.
    pub workers: usize,
    /// Record device memory per phase of the training step (`--memory-profile`);
    /// synchronises the device after each phase, so the run is slower.
    #[serde(default)]
    pub memory_profile: bool,
    /// Log the time of each phase of the training step (`--time-phases`).
    #[serde(default)]
    pub time_phases: PhaseTiming,
    /// Mixed precision of the transformer stacks (`--mixed-precision`); fp16
    /// adds dynamic loss scaling.
    #[serde(default)]
    pub mixed_precision: MixedPrecision,
    /// Which sample pairs the UniFrac loss of a data-parallel step compares
    /// (`--unifrac-pairs`; one device always has the whole batch).
    #[serde(default)]
    pub unifrac_pairs: UnifracPairs,
    /// Also write `checkpoints/last.safetensors` after every this many
    /// optimiser steps, inside epochs (`--checkpoint-every-steps`): bounds
    /// the work a killed run loses. None: at the end of each epoch only.
    #[serde(default)]
    pub checkpoint_every_steps: Option<u64>,
    /// Skip a batch whose losses or gradient norm are not finite (with the
    /// gradients accumulated since the last step), counted as
    /// `skipped_batches`, instead of stopping the run
    /// (`--skip-nonfinite-batches`; one more device read per batch).
    #[serde(default)]
    pub skip_nonfinite_batches: bool,
    /// Validation predictions (and their metrics) averaged over this many
    /// passes, each with its own random ASV draw; with `asv_sampling`
    /// `random` only (the passes of another rule agree). Losses are the
    /// first pass's. `--val-prediction-passes`; default 1.
    #[serde(default = "one")]
    pub val_prediction_passes: usize,
}

fn one() -> usize {
    1
}

impl RunConfig {
    /// Checks ranges, naming the flag at fault.
    pub fn validate(&self) -> Result<()> {
        let bad = |f: &str, r: String| Err(TrainError::arg(f, r));
        if self.epochs == 0 {
            return bad("epochs", "must be ≥ 1".into());
        }
        if self.batch_size < 2 || self.batch_size % 2 == 1 {
            return bad(
                "batch-size",
                format!(
                    "must be even and ≥ 2 (UniFrac pairs), got {}",
                    self.batch_size
                ),
            );
        }
        if self.gradient_accumulation_steps == 0 {
            return bad("gradient-accumulation-steps", "must be ≥ 1".into());
        }
        if !(self.scheduler.lr > 0.0 && self.scheduler.lr.is_finite()) {
            return bad("lr", format!("must be > 0, got {}", self.scheduler.lr));
        }
        if let Some(n) = self.max_grad_norm {
            if !(n > 0.0) {
                return bad("max-grad-norm", format!("must be > 0, got {n}"));
            }
        }
        if self.token_limit == 0 {
            return bad("token-limit", "must be ≥ 1".into());
        }
        if !(1..=100).contains(&self.val_prediction_passes) {
            return bad(
                "val-prediction-passes",
                format!("must be in 1..=100, got {}", self.val_prediction_passes),
            );
        }
        self.loss.validate()
    }
}

/// The architecture options shared by `pretrain` and `train` (reference §5):
/// one width, head count, depth and dropout for every transformer stack.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// Model width D.
    pub embedding_dim: usize,
    /// Attention heads of every stack.
    pub attention_heads: usize,
    /// Layers of every stack.
    pub attention_layers: usize,
    /// Dropout of every stack.
    pub dropout: f64,
    /// Feed per-ASV read counts into the sample encoder.
    pub count_embedding: bool,
    /// How counts enter.
    pub count_embedding_method: CountEmbeddingMethod,
    /// Fraction of nucleotides masked for the nucleotide loss.
    pub nuc_mask_ratio: f64,
    /// Masking strategy.
    pub nuc_mask_strategy: MaskStrategy,
    /// ASVs per chunk through the ASV encoder at inference (0: all at once).
    pub asv_chunk_size: usize,
    /// Attention implementation.
    pub attn_implementation: AttnImplementation,
    /// Bases kept per ASV.
    pub max_bp: usize,
    /// ASV slots per sample.
    pub token_limit: usize,
}

impl ModelSpec {
    /// The base model (`SequenceEncoder`) these options describe, after
    /// checking their ranges.
    pub fn encoder_config(&self, encoder_type: EncoderType) -> Result<SequenceEncoderConfig> {
        if self.embedding_dim == 0 || self.embedding_dim % self.attention_heads.max(1) != 0 {
            return Err(TrainError::arg(
                "embedding-dim",
                format!(
                    "{} must be a positive multiple of --attention-heads {}",
                    self.embedding_dim, self.attention_heads
                ),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(TrainError::arg(
                "dropout",
                format!("must lie in [0, 1), got {}", self.dropout),
            ));
        }
        if !(0.0..1.0).contains(&self.nuc_mask_ratio) {
            return Err(TrainError::arg(
                "nuc-mask-ratio",
                format!("must lie in [0, 1), got {}", self.nuc_mask_ratio),
            ));
        }
        let asv = AsvEncoderConfig::new()
            .with_embedding_dim(self.embedding_dim)
            .with_max_bp(self.max_bp)
            .with_num_layers(self.attention_layers)
            .with_num_heads(self.attention_heads)
            .with_dropout(self.dropout)
            .with_predict_nucleotides(true)
            .with_asv_chunk_size((self.asv_chunk_size > 0).then_some(self.asv_chunk_size))
            .with_attn_implementation(self.attn_implementation)
            .with_mask_ratio(self.nuc_mask_ratio)
            .with_mask_strategy(self.nuc_mask_strategy);
        let sample = SampleSequenceEncoderConfig::new(asv)
            .with_token_limit(self.token_limit)
            .with_sample_num_layers(self.attention_layers)
            .with_sample_num_heads(self.attention_heads)
            .with_sample_dropout(self.dropout)
            .with_count_embedding(self.count_embedding)
            .with_count_embedding_method(self.count_embedding_method);
        Ok(SequenceEncoderConfig::new(sample)
            .with_encoder_num_layers(self.attention_layers)
            .with_encoder_num_heads(self.attention_heads)
            .with_encoder_dropout(self.dropout)
            .with_encoder_type(encoder_type))
    }
}
