//! Attention pooling's kernels (the CubeCL side of
//! `PoolOps::{attention_pool_with_stats, attention_pool_backward}`)
//! against the tensor ops on ndarray, through autodiff as the model uses
//! them (`aam_kernels::attention_pool`): the pooled rows and the gradients of
//! the states and the query, for rows with every token valid, some, one and
//! none (uniform weights), at the ASV level's shape (151 tokens, width 128)
//! and at widths the kernel's lanes do not divide.
//!
//! Runs on CUDA when built with `--features cuda` (the device machine), else on
//! wgpu: in CI through Mesa's lavapipe (a CPU Vulkan driver). With `fusion`
//! the kernels run as custom ops of Burn's fusion stream.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use crate::common::*;
use aam_kernels::{attention_pool, AttentionBackend};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

/// The pooled rows and the gradients of `Σ pooled ⊙ dy` on backend `Ad`.
fn run<Ad: AutodiffBackend + AttentionBackend>(
    [x, q, dy]: &[Vec<f32>; 3],
    lengths: &[usize],
    [n, t, d]: [usize; 3],
    scale: f64,
) -> [Vec<f32>; 3] {
    let device = Default::default();
    let x =
        Tensor::<Ad, 3>::from_data(TensorData::new(x.clone(), [n, t, d]), &device).require_grad();
    let q = Tensor::<Ad, 1>::from_data(TensorData::new(q.clone(), [d]), &device).require_grad();
    let dy = Tensor::<Ad, 2>::from_data(TensorData::new(dy.clone(), [n, d]), &device);
    let valid: Vec<bool> = lengths
        .iter()
        .flat_map(|&l| (0..t).map(move |i| i < l))
        .collect();
    let valid = Tensor::<Ad, 2, Bool>::from_data(TensorData::new(valid, [n, t]), &device);
    let pooled = attention_pool(x.clone(), q.clone(), valid, scale);
    let grads = (pooled.clone() * dy).sum().backward();
    [
        values(pooled),
        values(x.grad(&grads).expect("dx")),
        values(q.grad(&grads).expect("dq")),
    ]
}

#[test]
fn attention_pool_kernels_match_the_ops() {
    let mut rng = Rng::new(31);
    for [n, t, d] in [[37, 151, 128], [5, 7, 20], [300, 3, 8], [2, 1, 130]] {
        // Lengths: all, none, one, and random in between.
        let lengths: Vec<usize> = (0..n)
            .map(|i| match i % 4 {
                0 => t,
                1 => 0,
                2 => 1,
                _ => 1 + (rng.normal().abs() * t as f32) as usize % t,
            })
            .collect();
        let mut draw = |len: usize| (0..len).map(|_| rng.normal()).collect::<Vec<f32>>();
        let inputs = [draw(n * t * d), draw(d), draw(n * d)];
        let scale = 1.0 / (d as f64).sqrt();
        let want = run::<CpuAd>(&inputs, &lengths, [n, t, d], scale);
        let got = run::<GpuAd>(&inputs, &lengths, [n, t, d], scale);
        for (what, (got, want)) in ["pooled", "dx", "dquery"].iter().zip(got.iter().zip(&want)) {
            let err = rel(got, want);
            let tol = if *what == "pooled" {
                FORWARD_RTOL_F32
            } else {
                GRAD_RTOL_F32
            };
            assert!(err <= tol, "[{n}, {t}, {d}] {what}: rel err {err:e}");
        }
    }
}
