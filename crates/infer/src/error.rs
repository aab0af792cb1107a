//! The errors of loading a model and of preparing, embedding and predicting
//! samples.

use std::path::PathBuf;

/// What went wrong; every variant names the file, sample or option at fault.
#[derive(Debug, thiserror::Error)]
pub enum InferError {
    /// A checkpoint that cannot be read (truncated, foreign, another version).
    #[error(transparent)]
    Checkpoint(#[from] aam_train::TrainError),
    /// A `convert` model folder or reference `.pt` that cannot be read.
    #[error(transparent)]
    ModelDir(#[from] aam_models::error::ImportError),
    /// Samples or metadata that cannot be prepared (an ID given twice, a
    /// negative count, no reads, ...).
    #[error(transparent)]
    Data(#[from] aam_data::Error),
    /// A character that is not a nucleotide code (IUPAC letters, `-`, `.`).
    #[error("sample {sample:?}: ASV {asv} has {character:?} at position {position}, which is not a nucleotide code")]
    InvalidBase {
        /// The sample.
        sample: String,
        /// The ASV (its first 40 bases).
        asv: String,
        /// The character.
        character: char,
        /// Its 0-based position.
        position: usize,
    },
    /// A sequence longer than [`Options::max_sequence_length`](crate::Options).
    #[error("sample {sample:?}: ASV {asv} is {length} bp long, more than the limit of {limit} bp")]
    SequenceTooLong {
        /// The sample.
        sample: String,
        /// The ASV (its first 40 bases).
        asv: String,
        /// Its length.
        length: usize,
        /// The limit.
        limit: usize,
    },
    /// `predict` on a model without a target head.
    #[error("{}: a `pretrain` model has no prediction head: embed with it, or train one with `aam-rs train --pretrained-encoder`", path.display())]
    NoTargetHead {
        /// The model.
        path: PathBuf,
    },
    /// The model reads categorical metadata columns and none was given.
    #[error(
        "the model uses the categorical metadata columns {columns:?}: give the samples' metadata"
    )]
    MetadataRequired {
        /// The columns.
        columns: Vec<String>,
    },
    /// A sample with fewer reads than the rarefaction depth, where the
    /// caller asked for every sample to be kept ([`ModelInfo::check`](crate::ModelInfo::check)).
    #[error(
        "sample {sample:?} has {reads} reads, fewer than the model's rarefaction depth of {depth}"
    )]
    TooShallow {
        /// The sample.
        sample: String,
        /// Its reads.
        reads: f64,
        /// The depth.
        depth: usize,
    },
    /// Every sample has fewer reads than the model's rarefaction depth.
    #[error("no sample reaches the training rarefaction depth of {depth} reads ({dropped} sample(s) have fewer); turn rarefaction off to use them as they are")]
    AllTooShallow {
        /// The depth.
        depth: usize,
        /// How many samples were given.
        dropped: usize,
    },
    /// An option out of range.
    #[error("invalid option {option}: {reason}")]
    InvalidOption {
        /// The option.
        option: &'static str,
        /// Why.
        reason: String,
    },
}

/// `Result` with [`InferError`].
pub type Result<T, E = InferError> = std::result::Result<T, E>;
