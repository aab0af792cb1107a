//! The one-op kernels' tests (Adam, attention pooling, the validated dense
//! products, GELU, LayerNorm, packed self-attention, seeded dropout, slot
//! unpacking) as one test binary: each test binary builds and links the
//! backends again, so eight take CI ~5 minutes more than one (two cores).
//! Run one file's tests with its module name as the filter, e.g.
//! `cargo test -p aam-kernels --features wgpu,ndarray --test ops layer_norm::`.
//!
//! The parity suites that set a kernel layout for the whole process
//! (`fused_lanes`, `fused_native_layout`, `fused_separate_backward`) stay
//! binaries of their own, as do `fused_parity`, `half_precision` and
//! `matmul_kernels`, which the device scripts run by name.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

#[path = "../common/mod.rs"]
mod common;

mod adam_step;
mod attention_pool;
mod dense_validated_matmul;
mod gelu;
mod layer_norm;
mod packed_attention;
mod seeded_dropout;
mod unpack_rows;
