//! The layout CUDA and HIP use for calls with one lane per row (the ASV and
//! sample levels), against the CPU reference: every kernel splits each row's
//! head dimensions over two units (`AAM_KERNEL_PARTS=2`), whose partial dot
//! products are added with plane shuffles (a masked key's or past-the-end
//! row's partner runs the loop only for those shuffles). Forcing it here runs
//! it in CI on wgpu through lavapipe, where it is otherwise never taken.
//!
//! A test binary of its own: the settings are read once per process.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

mod common;

use common::*;

fn force_native_layout() {
    std::env::set_var("AAM_KERNEL_LANES", "1");
    std::env::set_var("AAM_KERNEL_PARTS", "2");
}

#[test]
fn native_layout_lengths_heads_and_sample_slots() {
    force_native_layout();
    for (i, &t) in [1usize, 7, 151, 33].iter().enumerate() {
        check(&Case::new(700 + i as u64, 3, 2, t, t, 32));
    }
    // Head dims 16, 64 and 128 are split in two, 12 is not (6 dims are not
    // whole quads).
    for (i, &dh) in [16usize, 64, 128, 12].iter().enumerate() {
        check(&Case::new(710 + i as u64, 3, 2, 40, 40, dh));
    }
    check(&Case::new(720, 4, 3, 9, 70, 32));
    check(&Case::new(721, 2, 2, 1024, 1024, 32));
}

#[test]
fn native_layout_dropout_uses_the_same_mask_forward_and_backward() {
    force_native_layout();
    check_dropout();
}
