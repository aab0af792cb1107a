//! The dense layer end to end under autodiff: its backward products on the
//! validated CubeCL kernels (`DenseOps::dense_matmul`, not Burn's
//! autotune) give the CPU's gradients, through the split weight gradient with
//! its batched parts and leftover rows; and the forward gives the CPU's
//! output at a shape where CubeCL's autotuned matmul with the transposed
//! weight as a view is wrong (`dense_forward` copies it).
//! Runs on CUDA when built with `--features cuda` (the device machine), else on
//! wgpu: in CI through Mesa's lavapipe (a CPU Vulkan driver).
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use crate::common::*;
use aam_kernels::{dense, ROWS_PER_PART};
use burn::prelude::*;

/// `(y, dx, dw, db)` of `dense` on backend `B` for the given inputs, with
/// a non-uniform output gradient `g` (the loss is `Σ y·g`).
fn run<B: burn::tensor::backend::AutodiffBackend + aam_kernels::AttentionBackend>(
    inputs: [(&[f32], [usize; 2]); 3],
    bias: &[f32],
) -> [Vec<f32>; 4] {
    let device = Default::default();
    let t = |(v, shape): (&[f32], [usize; 2])| {
        Tensor::<B, 2>::from_data(TensorData::new(v.to_vec(), shape), &device)
    };
    let [x, w, g] = inputs.map(t);
    let (x, w) = (x.require_grad(), w.require_grad());
    let b = Tensor::<B, 1>::from_data(TensorData::new(bias.to_vec(), [bias.len()]), &device)
        .require_grad();
    let y = dense(x.clone(), w.clone(), Some(b.clone()));
    let grads = (y.clone() * g).sum().backward();
    [
        values(y),
        values(x.grad(&grads).unwrap()),
        values(w.grad(&grads).unwrap()),
        values(b.grad(&grads).unwrap()),
    ]
}

/// CUDA's f32 matmuls run on TF32 tensor cores (~1e-3); lavapipe in f32.
#[cfg(feature = "cuda")]
const RTOL: f32 = 1e-2;
#[cfg(not(feature = "cuda"))]
const RTOL: f32 = GRAD_RTOL_F32;

#[test]
fn dense_gradients_on_the_validated_kernels_equal_the_cpus() {
    let mut rng = Rng::new(20);
    // Two whole parts and a leftover of 17 rows; widths unlike each other.
    let (rows, k, n) = (2 * ROWS_PER_PART + 17, 24, 16);
    let mut draw = |len: usize| (0..len).map(|_| rng.normal()).collect::<Vec<f32>>();
    let (x, w, g, b) = (draw(rows * k), draw(n * k), draw(rows * n), draw(n));
    let inputs = [(&x[..], [rows, k]), (&w[..], [n, k]), (&g[..], [rows, n])];
    let want = run::<CpuAd>(inputs, &b);
    let got = run::<GpuAd>(inputs, &b);
    for (what, (got, want)) in ["y", "dx", "dw", "db"].iter().zip(got.iter().zip(&want)) {
        let err = rel(got, want);
        assert!(err <= RTOL, "{what}: rel err {err:e}");
    }
}
