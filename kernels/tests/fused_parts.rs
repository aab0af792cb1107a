//! The backward kernels with each row's head dimensions split over two
//! units (`AAM_KERNEL_PARTS=2`, one lane per row), against the CPU
//! reference: partners add their partial dot products with plane shuffles,
//! and a masked key's partner runs the loop only for those shuffles. The
//! default layout does this on CUDA and HIP; forcing it here runs it in CI on
//! wgpu through lavapipe, where it is otherwise never taken.
//!
//! A test binary of its own: the settings are read once per process.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

mod common;

use common::*;

fn force_parts() {
    std::env::set_var("AAM_KERNEL_LANES", "1");
    std::env::set_var("AAM_KERNEL_PARTS", "2");
}

#[test]
fn parts_lengths_heads_and_sample_slots() {
    force_parts();
    for (i, &t) in [1usize, 7, 151, 33].iter().enumerate() {
        check(&Case::new(700 + i as u64, 3, 2, t, t, 32));
    }
    // 16, 64 and 128 split in two; 12 does not (6 dims are not whole quads)
    // and runs with whole rows.
    for (i, &dh) in [16usize, 64, 128, 12].iter().enumerate() {
        check(&Case::new(710 + i as u64, 3, 2, 40, 40, dh));
    }
    check(&Case::new(720, 4, 3, 9, 70, 32));
    check(&Case::new(721, 2, 2, 1024, 1024, 32));
}

#[test]
fn parts_dropout_uses_the_same_mask_forward_and_backward() {
    force_parts();
    check_dropout();
}
