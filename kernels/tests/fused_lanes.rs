//! The kernels with every row split over 4 lanes (`AAM_KERNEL_LANES=4`),
//! against the CPU reference: the partial softmax states and gradient sums
//! of a row's lanes are merged with plane shuffles, which the default
//! layout uses on CUDA and HIP only for calls with few rows (the sample
//! level). Forcing it here runs that merge at every shape, and in CI on
//! wgpu through lavapipe, where it is otherwise never taken.
//!
//! A test binary of its own: the setting is read once per process.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

mod common;

use common::*;

fn force_lanes() {
    std::env::set_var("AAM_KERNEL_LANES", "4");
}

#[test]
fn lanes_lengths_heads_and_sample_slots() {
    force_lanes();
    check_layout_shapes(600);
}

#[test]
fn lanes_dropout_uses_the_same_mask_forward_and_backward() {
    force_lanes();
    check_dropout();
}
