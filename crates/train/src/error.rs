//! The training crate's error type: every variant names the file, field or
//! value at fault.

use std::path::PathBuf;

/// Errors of `aam-train`.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A configuration value is out of range or inconsistent.
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// The option at fault (CLI flag spelling without dashes).
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// Two tensors that must agree in shape do not.
    #[error("shape mismatch in {what}: {left:?} vs {right:?}")]
    Shape {
        /// Which comparison.
        what: String,
        /// First shape.
        left: Vec<usize>,
        /// Second shape.
        right: Vec<usize>,
    },
    /// A loss or the gradient norm became NaN or infinite; the run stops
    /// before any checkpoint holds the weights of that step.
    #[error("not finite at epoch {} batch {} (optimiser step {step}): {terms}; batch samples: {samples}. Nothing of this step was saved; the last good checkpoint is {checkpoint}. Lower --lr, set --max-grad-norm, or check these samples", .epoch + 1, .batch + 1)]
    NonFinite {
        /// The quantities and their values (`nuc_loss NaN, total_loss NaN`).
        terms: String,
        /// Epoch (0-based).
        epoch: usize,
        /// Batch within the epoch (0-based).
        batch: usize,
        /// Optimiser steps taken before it.
        step: u64,
        /// The batch's sample IDs.
        samples: String,
        /// `checkpoints/last.safetensors` of the run.
        checkpoint: PathBuf,
    },
    /// A checkpoint cannot be read or does not fit.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The UniFrac distances could not be computed from `--tree`.
    #[error("--tree: {0}")]
    Unifrac(#[from] aam_unifrac::Error),
    /// An input file given by an option could not be used (`option` is the
    /// option's command-line spelling without dashes; the source names the file).
    #[error("--{option}: {source}")]
    Input {
        /// The option that named the input.
        option: &'static str,
        /// The cause.
        #[source]
        source: aam_data::Error,
    },
    /// A data-parallel replica's weights left the others' (a bug: they take
    /// the same steps).
    #[error("replica {rank}: {reason}")]
    Replica {
        /// The replica's rank (its place in `--devices`).
        rank: usize,
        /// What failed.
        reason: String,
    },
    /// The data pipeline failed.
    #[error(transparent)]
    Data(#[from] aam_data::Error),
    /// Building or loading the model failed.
    #[error(transparent)]
    Model(#[from] aam_models::ModelError),
    /// Importing or saving weights failed.
    #[error(transparent)]
    Import(#[from] aam_models::import::ImportError),
}

/// `Result` with [`TrainError`].
pub type Result<T, E = TrainError> = std::result::Result<T, E>;

impl TrainError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// An invalid-argument error.
    pub fn arg(field: &str, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field: field.into(),
            reason: reason.into(),
        }
    }
}
