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
    for (i, &t) in [1usize, 7, 151, 33].iter().enumerate() {
        check(&Case::new(600 + i as u64, 3, 2, t, t, 32));
    }
    for (i, &dh) in [16usize, 64, 128].iter().enumerate() {
        check(&Case::new(610 + i as u64, 3, 2, 40, 40, dh));
    }
    check(&Case::new(620, 4, 3, 9, 70, 32));
    check(&Case::new(621, 2, 2, 1024, 1024, 32));
}

#[test]
fn lanes_dropout_uses_the_same_mask_forward_and_backward() {
    force_lanes();
    check_dropout();
}
