//! The model's fast paths against plain ones, on wgpu (lavapipe in CI), as
//! one test binary (each test binary links the backends again):
//! - `folded_biases`: a transformer layer that adds its biases in the
//!   element-wise passes after the products equals the layer with each bias
//!   in its dense layer;
//! - `fused_vs_math`: a whole SequenceEncoder with the fused attention kernel
//!   equals it with the math path.
#![cfg(feature = "wgpu")]

#[path = "folded_biases.rs"]
mod folded_biases;
#[path = "fused_vs_math.rs"]
mod fused_vs_math;
