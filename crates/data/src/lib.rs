//! `aam-data`: the AAM data pipeline (reference spec §2) as plain Rust.
//!
//! **Job.** Turn a user's inputs into model batches: a BIOM table whose
//! observation IDs are ASV sequences ([`BiomTable`], BIOM 2.x HDF5 and 1.0
//! JSON), rarefied ([`BiomTable::rarefy`]) and tokenised ([`TokenCache`]); a
//! UniFrac distance matrix ([`DistanceMatrix`]) or per-sample Faith's PD
//! ([`SampleValues`]); a metadata TSV ([`Metadata`])
//! with numeric targets ([`TargetNormalizer`]) and categorical columns
//! ([`CategoricalEncoder`]); a seeded split ([`train_val_split`]); batches
//! `tokens [B,S,L]`, `counts [B,S,1]`, `unifrac [B,B]`, targets and
//! categorical ids ([`BatchLoader`], [`Batch`]) prepared on worker threads.
//! Before a long run, [`summarize`] describes and checks those inputs
//! (`aam-rs inspect`).
//!
//! **Must not depend on** Burn, CubeCL or any other `aam-*` crate: it hands
//! out `Vec`s and shapes, and the training crate makes tensors of them. So it
//! builds and tests in seconds.
//!
//! **The design choice to defend: samples are joined by ID, once, up front.**
//! The reference assumes ID-less matrices are in table order and lets batches
//! shrink when metadata is missing (§2.5, §2.6, §8 item 7). Here
//! [`Dataset::builder`] matches the table, the matrix and the metadata by
//! sample ID before anything else happens; a missing sample is an error that
//! lists it, or, when the caller asks, a logged drop. Matrices always carry
//! IDs (from the file, a sidecar list, or an explicit opt-in to table order).
//! After that, a [`Dataset`] position *is* a sample, and batch code never
//! looks an ID up again.
//!
//! Typical use:
//! ```no_run
//! # fn main() -> aam_data::Result<()> {
//! use std::sync::Arc;
//! use aam_data::*;
//! let table = BiomTable::read("table.biom")?.rarefy(5000, 42)?.table;
//! let matrix = Arc::new(DistanceMatrix::read("unifrac.h5", &MatrixIds::Auto)?);
//! let metadata = Arc::new(Metadata::read("metadata.tsv")?);
//! let dataset = Arc::new(
//!     Dataset::builder(&table)
//!         .max_bp(150)
//!         .unifrac(matrix, MissingPolicy::Error)
//!         .metadata(metadata)
//!         .target("age", MissingPolicy::Error)
//!         .build()?,
//! );
//! let split = dataset.split(0.2, 42)?;
//! let transforms = Arc::new(Transforms {
//!     target: Some(dataset.fit_target_normalizer(TargetTransform::MinMax, &[], &split.train)?),
//!     ..Default::default()
//! });
//! let train = BatchLoader::new(dataset.clone(), split.train, transforms, BatchConfig::train(8, 1024, 42))?;
//! for batch in train.epoch(0) {
//!     let batch = batch?;
//!     let [_b, _s, _l] = batch.tokens_shape();
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Errors are one [`Error`] enum whose variants name the file and the
//! offending sample, observation, line or column. The library never prints;
//! warnings (dropped samples, unseen categories) go through `tracing`.

#![deny(missing_docs)]

mod batch;
mod biom;
mod categorical;
mod dataset;
mod error;
mod hdf5_util;
mod metadata;
mod normalize;
mod rarefy;
mod samples_json;
mod split;
pub mod summary;
pub mod tokenize;
mod unifrac;
mod write;

pub use batch::{slot_asvs, AsvSampling, Batch, BatchConfig, BatchLoader, Prefetch, Transforms};
pub use biom::{BiomTable, SampleCounts};
pub use categorical::{CategoricalEncoder, CategoryWeights, UNKNOWN};
pub use dataset::{Dataset, DatasetBuilder, SampleReads};
pub use error::{Error, IdList, Result, MAX_LISTED};
pub use metadata::{is_missing, Metadata};
pub use normalize::{
    CategoryStats, CountNormalizer, MeanStd, TargetNormalizer, TargetTransform, MAX_EXP_INPUT,
    MIN_STD,
};
pub use rarefy::{rarefy_sample, Rarefied};
pub use samples_json::{parse_samples_json, SamplesDocument, SamplesJsonError};
pub use split::{train_val_split, Split};
pub use summary::{summarize, Summary, SummaryOptions};
pub use tokenize::TokenCache;
pub use unifrac::{
    read_id_file, sidecar_candidates, DistanceMatrix, MatrixIds, MissingPolicy, SampleValues,
    TOLERANCE,
};
pub use write::{write_atomic, write_atomic_with};
