//! `aam-infer`: trained aam-rs models inside Rust programs.
//!
//! **Job.** Load a model that `aam-rs pretrain` or `train` wrote (a
//! checkpoint file), that `aam-rs convert` made from a reference PyTorch
//! checkpoint (a folder), or a reference checkpoint itself (`.pt`, converted
//! on load), on any Burn backend and device; give it samples
//! as `(ID, [(ASV sequence, reads)])` or read from a BIOM table; get back
//! sample embeddings `[n, D]` (and, on request, each sample's ASV
//! embeddings) or predictions in the target's original units (a class
//! label with every class's probability, or every quantile of a quantile
//! model). `aam-rs predict`, `aam-rs embed` and `aam-rs serve` are thin
//! front ends over this crate, so the three give the same numbers for the
//! same sample.
//!
//! ```no_run
//! use aam_infer::{Model, Options, SampleReads};
//! use burn::backend::NdArray;
//!
//! # fn main() -> Result<(), aam_infer::InferError> {
//! let model = Model::<NdArray>::load("runs/demo/checkpoints/best.safetensors", &Default::default())?;
//! let sample = SampleReads {
//!     id: "S1".into(),
//!     reads: vec![("TACGGAGGGTGCAAGCGTTAATCGG".into(), 600.0), ("TACGTAGGGGGCAAGCGTTATCCGG".into(), 400.0)],
//! };
//! let embeddings = model.embed(&[sample], &Options::default())?;
//! println!("{} → {:?}", embeddings.ids[0], embeddings.row(0));
//! # Ok(())
//! # }
//! ```
//!
//! **Preparation, the same as training's.** Each sample is rarefied to the
//! training depth (the checkpoint records it; [`Options::rarefy`] turns it
//! off) with a draw that depends only on the sample's reads, ID and seed,
//! so a sample gets the same embedding alone, in a request of many, or in
//! a table. Its ASVs keep the order given (a table's row order), which the
//! model sees through its slot position embedding; a sample with more ASVs
//! than the model's `token_limit` keeps the training rule's choice
//! (`first` or `abundance`; `random`, an augmentation, becomes `abundance`
//! at inference). Sequences are cut to the model's `max_bp` as in training.
//!
//! **Errors, not panics.** Every failure is an [`InferError`] naming the
//! file, sample or option: an unreadable checkpoint, a character that is
//! not a nucleotide code, a sequence over [`Options::max_sequence_length`],
//! a sample without reads, an ID given twice, a `pretrain` model asked to
//! predict, predictions that read metadata columns (categorical inputs,
//! per-category normalisation) without the samples' metadata.
//!
//! **Threads.** A [`Model`] is used from one thread at a time (Burn's
//! GPU backends tie a device to the thread that drives it); a service puts
//! it behind one worker that owns it, as `aam-rs serve` does.

#![deny(missing_docs)]

mod error;
mod model;

pub use aam_data::{BiomTable, Metadata, SampleReads};
pub use aam_models::import::ImportHints;
pub use error::{InferError, Result};
pub use model::{
    AsvEmbedding, Embeddings, Model, ModelInfo, ModelKind, Options, Prediction, Predictions,
    Prepared,
};

/// Every sample of a BIOM table (BIOM 2.x HDF5 or 1.0 JSON), each with its
/// ASVs in the table's row order.
pub fn read_table(path: impl AsRef<std::path::Path>) -> Result<Vec<SampleReads>> {
    Ok(SampleReads::from_table(&BiomTable::read(path)?))
}
