//! # aam-models: AAM in Burn
//!
//! The modules of AAM (Attention All Microbes), generic over `B: Backend`, each
//! built from a `Config`, computing what the PyTorch reference computes
//! (`../shared/reference/aam-reference.md` §1; upstream `jbk708/aam`).
//!
//! Job: the model and nothing else. This crate never reads BIOM tables, parses
//! arguments or trains; of the other `aam-*` crates it uses `aam-kernels` (the
//! fused ops) and `aam-data`'s atomic file writer only.
//!
//! The design choice to defend: **parameter paths are the reference's
//! state-dict keys.** Linear weights keep torch's `[out, in]` layout, LayerNorm
//! keeps `weight`/`bias`, attention keeps the packed `in_proj_weight`. A model
//! file written by aam-rs is therefore a torch state dict, and importing a
//! reference checkpoint is a short table of renames (sequential indices, column
//! names; see [`import`]), with no transposes to get wrong.
//!
//! Training mode is Burn's: dropout and nucleotide masking run when the backend
//! records gradients (`B::ad_enabled`), i.e. on an `Autodiff` backend; call
//! `model.valid()` for evaluation.
//!
//! All multi-head attention goes through one op, [`attention::attention`].

pub mod asv_encoder;
pub mod attention;
pub mod categorical;
pub mod embedding;
pub mod error;
pub mod fusion;
pub mod import;
pub mod model;
pub mod nn;
pub mod output;
pub mod pooling;
pub mod precision;
pub mod sample_encoder;
pub mod sequence_encoder;
pub mod sequence_predictor;
pub mod transformer;

#[cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]
pub use aam_kernels::persist_compiled_kernels;
pub use aam_kernels::{AdamItem, AdamOps, AdamStep, AttentionBackend, RuntimeOps};
pub use attention::AttnImplementation;
pub use error::{ImportError, ModelError};
pub use model::{AamModel, ModelConfig};
pub use nn::{set_attention_dropout_seed, Activation};
pub use precision::{autocast, MixedPrecision};
