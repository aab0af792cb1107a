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
    // With parts, head dim 12 is not split (6 dims are not whole quads).
    check_layout_shapes(700);
}

#[test]
fn native_layout_dropout_uses_the_same_mask_forward_and_backward() {
    force_native_layout();
    check_dropout();
}
