//! LayerNorm's forward and backward kernels and the column-sum kernel (the
//! CubeCL side of `LayerNormOps::{layer_norm_with_stats,
//! layer_norm_backward}` and `DenseOps::column_sum`) against the tensor-op versions on
//! ndarray, through autodiff as the model uses them: `aam_kernels::layer_norm`
//! (value and the gradients of x, γ, β) and `aam_kernels::dense` (whose bias
//! gradient is the column sum), at row counts below, at and past the parts
//! of the sums, widths 2-600 (both LayerNorm backward paths), with and
//! without a shift. (Not width 1: there `x̂ = 0` and `dx = 0` exactly, and
//! rounding noise comes out multiplied by `1/√ε`, as it does in every
//! implementation.)
//!
//! Runs on CUDA when built with `--features cuda` (the device machine), else on
//! wgpu: in CI through Mesa's lavapipe (a CPU Vulkan driver). With `fusion`
//! the kernels run as custom ops of Burn's fusion stream.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use crate::common::*;
use aam_kernels::{dense, layer_norm, AttentionBackend};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

/// f32 sums over up to a few thousand rows, in another order than ndarray's.
const RTOL: f32 = 1e-5;

fn tensor<B: Backend, const D: usize>(values: &[f32], shape: [usize; D]) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(values.to_vec(), shape), &Default::default())
}

fn random(rng: &mut Rng, n: usize, offset: f32, spread: f32) -> Vec<f32> {
    (0..n).map(|_| offset + spread * rng.normal()).collect()
}

/// LayerNorm's output and gradients of `Σ y ⊙ dy` on backend `Ad`, or with
/// `residual` of `Σ (x + y) ⊙ dy`, as in AAM's pre-norm blocks (the kernel
/// adds the residual's gradient for x to its own).
fn run_layer_norm<Ad: AutodiffBackend + AttentionBackend>(
    inputs: &[Vec<f32>; 4],
    rows: usize,
    width: usize,
    with_beta: bool,
    residual: bool,
) -> Vec<Vec<f32>> {
    let x = tensor::<Ad, 2>(&inputs[0], [rows, width]).require_grad();
    let gamma = tensor::<Ad, 1>(&inputs[1], [width]).require_grad();
    let beta = tensor::<Ad, 1>(&inputs[2], [width]).require_grad();
    let dy = tensor::<Ad, 2>(&inputs[3], [rows, width]);
    let y = layer_norm(
        x.clone(),
        gamma.clone(),
        with_beta.then(|| beta.clone()),
        1e-5,
    );
    let out = if residual {
        x.clone() + y.clone()
    } else {
        y.clone()
    };
    let grads = (out * dy).sum().backward();
    let mut out = vec![
        values(y),
        values(x.grad(&grads).expect("dx")),
        values(gamma.grad(&grads).expect("dγ")),
    ];
    if with_beta {
        out.push(values(beta.grad(&grads).expect("dβ")));
    }
    out
}

#[test]
fn layer_norm_kernels_match_the_ops() {
    let mut rng = Rng::new(11);
    for (rows, width, with_beta) in [
        (1, 12, true),
        (7, 128, true),
        (300, 33, false),
        (2_049, 128, true),
        (600, 2, true),
        // γ's and β's gradients summed with dx in one kernel: a cube takes
        // several row groups in turn where the rows exceed ~1,024 groups.
        (40_001, 128, true),
        // Widths whose shared sums don't fit a cube (past 128 at lavapipe's
        // 8 lanes a row, past 512 at CUDA's 32): dx, then a column-sum pass.
        (64, 200, true),
        (40, 600, false),
    ] {
        // Rows with an offset and a spread, as activations have.
        let inputs = [
            random(&mut rng, rows * width, 0.5, 2.0),
            random(&mut rng, width, 1.0, 0.5),
            random(&mut rng, width, 0.0, 0.5),
            random(&mut rng, rows * width, 0.0, 1.0),
        ];
        for residual in [false, true] {
            let got = run_layer_norm::<GpuAd>(&inputs, rows, width, with_beta, residual);
            let want = run_layer_norm::<CpuAd>(&inputs, rows, width, with_beta, residual);
            for (i, name) in ["y", "dx", "dγ", "dβ"].iter().enumerate().take(got.len()) {
                let err = rel(&got[i], &want[i]);
                assert!(
                    err <= RTOL,
                    "rows {rows}, width {width}, beta {with_beta}, residual {residual}: \
                     {name} off by {err:e}"
                );
            }
        }
    }
}

/// The backward op itself with a gradient to add (`dx_add`), on both kernel
/// paths (γ's and β's sums in the same pass at width 128, a separate pass at
/// 600), against the ops: the autodiff test above reaches it only where
/// Burn's traversal runs the residual's backward first.
#[test]
fn layer_norm_backward_adds_the_other_gradient() {
    let mut rng = Rng::new(13);
    for (rows, width) in [(5, 128), (3_001, 128), (40, 600)] {
        let inputs: Vec<Vec<f32>> = [(0.5, 2.0), (1.0, 0.5), (0.0, 1.0), (0.0, 1.0)]
            .iter()
            .zip([rows * width, width, rows * width, rows * width])
            .map(|(&(offset, spread), n)| random(&mut rng, n, offset, spread))
            .collect();
        fn run<B: AttentionBackend>(inputs: &[Vec<f32>], rows: usize, width: usize) -> Vec<f32> {
            let x = tensor::<B, 2>(&inputs[0], [rows, width])
                .into_primitive()
                .tensor();
            let gamma = tensor::<B, 1>(&inputs[1], [width])
                .into_primitive()
                .tensor();
            let dy = tensor::<B, 2>(&inputs[2], [rows, width])
                .into_primitive()
                .tensor();
            let add = tensor::<B, 2>(&inputs[3], [rows, width])
                .into_primitive()
                .tensor();
            let (_, normalised, r) = B::layer_norm_with_stats(x, gamma.clone(), None, 1e-5);
            let (dx, _, _) = B::layer_norm_backward(normalised, r, gamma, dy, Some(add));
            values(Tensor::<B, 2>::from_primitive(
                burn::tensor::TensorPrimitive::Float(dx),
            ))
        }
        let got = run::<Gpu>(&inputs, rows, width);
        let want = run::<Cpu>(&inputs, rows, width);
        let err = rel(&got, &want);
        assert!(err <= RTOL, "rows {rows}, width {width}: dx off by {err:e}");
    }
}

#[test]
fn dense_bias_gradient_is_the_column_sum() {
    let mut rng = Rng::new(12);
    // 20,001 rows: 79 parts of 256 rows, more than a column's 32 lanes.
    for (rows, k, n) in [(5, 8, 3), (257, 16, 130), (3_001, 12, 9), (20_001, 4, 13)] {
        let x = random(&mut rng, rows * k, 0.0, 1.0);
        let w = random(&mut rng, n * k, 0.0, 1.0);
        let b = random(&mut rng, n, 0.0, 1.0);
        let dy = random(&mut rng, rows * n, 0.0, 1.0);
        fn run<Ad: AutodiffBackend + AttentionBackend>(
            [x, w, b, dy]: [&[f32]; 4],
            [rows, k, n]: [usize; 3],
        ) -> Vec<f32> {
            let bias = tensor::<Ad, 1>(b, [n]).require_grad();
            let y = dense(
                tensor::<Ad, 2>(x, [rows, k]),
                tensor(w, [n, k]),
                Some(bias.clone()),
            );
            let grads = (y * tensor::<Ad, 2>(dy, [rows, n])).sum().backward();
            values(bias.grad(&grads).expect("db"))
        }
        let inputs = [&x[..], &w, &b, &dy];
        let got = run::<GpuAd>(inputs, [rows, k, n]);
        let want = run::<CpuAd>(inputs, [rows, k, n]);
        let err = rel(&got, &want);
        assert!(err <= RTOL, "rows {rows}, {k} → {n}: db off by {err:e}");
    }
}
