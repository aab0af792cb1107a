//! The attention backward as two kernels (dQ, then dK/dV) at every shape
//! (`AAM_KERNEL_MERGED_BACKWARD=0`, and on CUDA `AAM_KERNEL_TILED=0`),
//! against the CPU reference. By default a head whose keys fit one cube runs
//! the tiled kernel (CUDA) or the merged one (dK, dV and dQ in one), so the
//! short lengths of the other tests never reach the dQ kernel alone; here
//! they do.
//!
//! A test binary of its own: the setting is read once per process.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

mod common;

use common::*;

fn force_separate_backward() {
    std::env::set_var("AAM_KERNEL_MERGED_BACKWARD", "0");
    std::env::set_var("AAM_KERNEL_TILED", "0");
}

#[test]
fn separate_backward_lengths_heads_and_sample_slots() {
    force_separate_backward();
    check_layout_shapes(800);
}

#[test]
fn separate_backward_dropout_uses_the_same_mask_forward_and_backward() {
    force_separate_backward();
    check_dropout();
}
