//! The exact-GELU kernels (`GeluOps::{gelu_exact,
//! gelu_exact_backward}` on a CubeCL backend) against the tensor-op versions
//! on ndarray, through autodiff as the feed-forward layer uses them: value and
//! input gradient of `gelu_exact` under autodiff, over a range that covers both
//! tails, at sizes around a cube's 256 units.
//!
//! The fused GELU and dropout (`aam_kernels::gelu_dropout`) against the two
//! ops with the same seed, values and input gradient; with a bias added in
//! the kernel against the sum first; and the feed-forward's second half
//! (`gelu_dropout_dense`, with either bias) against its ops.
//!
//! Runs on CUDA when built with `--features cuda` (the device machine), else on
//! wgpu: in CI through Mesa's lavapipe (a CPU Vulkan driver). With `fusion`
//! the kernels run as custom ops of Burn's fusion stream.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use crate::common::*;
use aam_kernels::{AttentionDropout, GeluOps};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::TensorPrimitive;

fn run<Ad: AutodiffBackend + GeluOps>(x: &[f32], dy: &[f32]) -> [Vec<f32>; 2] {
    let device = Default::default();
    let n = x.len();
    let x = Tensor::<Ad, 1>::from_data(TensorData::new(x.to_vec(), [n]), &device).require_grad();
    let dy = Tensor::<Ad, 1>::from_data(TensorData::new(dy.to_vec(), [n]), &device);
    let y: Tensor<Ad, 1> = Tensor::from_primitive(TensorPrimitive::Float(Ad::gelu_exact(
        x.clone().into_primitive().tensor(),
    )));
    let grads = (y.clone() * dy).sum().backward();
    [values(y), values(x.grad(&grads).expect("dx"))]
}

#[test]
fn gelu_kernels_match_the_ops() {
    let mut rng = Rng::new(13);
    for n in [1, 255, 257, 10_000] {
        // Mostly N(0, 2), with both tails (erf saturates) at the ends.
        let mut x: Vec<f32> = (0..n).map(|_| 2.0 * rng.normal()).collect();
        if n > 2 {
            x[0] = -9.0;
            x[n - 1] = 9.0;
        }
        let dy: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
        let got = run::<GpuAd>(&x, &dy);
        let want = run::<CpuAd>(&x, &dy);
        for (i, name) in ["y", "dx"].iter().enumerate() {
            // erf as an f32 polynomial (CubeCL's, 1.5e-7) against libm's.
            let err = rel(&got[i], &want[i]);
            assert!(err <= 2e-6, "n {n}: {name} off by {err:e}");
        }
    }
}

/// `gelu_dropout(x)` and `dropout(gelu(x))` with one seed: the same values
/// (one kernel against two, the same hash of the element index) and the same
/// input gradient (the fused backward draws the mask again), about `p` of
/// the outputs dropped.
#[test]
fn gelu_dropout_is_the_dropout_of_gelu_both_ways() {
    let drop = AttentionDropout {
        prob: 0.25,
        seed: 77,
    };
    let mut rng = Rng::new(14);
    let n = 20_000;
    let x: Vec<f32> = (0..n).map(|_| 2.0 * rng.normal()).collect();
    let dy: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
    let run = |fused: bool| -> [Vec<f32>; 2] {
        let device = Default::default();
        let x = Tensor::<GpuAd, 2>::from_data(TensorData::new(x.clone(), [n / 100, 100]), &device)
            .require_grad();
        let dy =
            Tensor::<GpuAd, 2>::from_data(TensorData::new(dy.clone(), [n / 100, 100]), &device);
        let y = if fused {
            aam_kernels::gelu_dropout(x.clone(), None, drop)
        } else {
            let gelu: Tensor<GpuAd, 2> = Tensor::from_primitive(TensorPrimitive::Float(
                GpuAd::gelu_exact(x.clone().into_primitive().tensor()),
            ));
            aam_kernels::dropout(gelu, drop)
        };
        let grads = (y.clone() * dy).sum().backward();
        [values(y), values(x.grad(&grads).expect("dx"))]
    };
    let (fused, split) = (run(true), run(false));
    let dropped = fused[0].iter().filter(|v| **v == 0.0).count() as f64 / n as f64;
    assert!((dropped - 0.25).abs() < 0.02, "dropped {dropped}");
    for (i, name) in ["y", "dx"].iter().enumerate() {
        let err = rel(&fused[i], &split[i]);
        assert!(err <= 1e-6, "{name}: fused off the two ops by {err:e}");
    }
}

/// `gelu_dropout(x, bias)` (the bias added in the kernel) and
/// `gelu_dropout(x + bias)` with one seed: the same values and gradients of
/// `x` and the bias (summed with the gradient in one kernel, in parts of
/// 256 rows: 530 rows make three), on rows of a width the forward kernel
/// takes four at a time (128) and of one it takes one at a time (33), with
/// and without dropout.
#[test]
fn gelu_dropout_with_a_bias_is_gelu_dropout_of_the_sum() {
    let mut rng = Rng::new(16);
    for (rows, width, prob) in [(530, 128, 0.2), (61, 33, 0.2), (40, 128, 0.0)] {
        let drop = AttentionDropout { prob, seed: 9 };
        let n = rows * width;
        let x: Vec<f32> = (0..n).map(|_| 2.0 * rng.normal()).collect();
        let b: Vec<f32> = (0..width).map(|_| rng.normal()).collect();
        let dy: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
        let run = |fused: bool| -> [Vec<f32>; 3] {
            let device = Default::default();
            let x =
                Tensor::<GpuAd, 2>::from_data(TensorData::new(x.clone(), [rows, width]), &device)
                    .require_grad();
            let b = Tensor::<GpuAd, 1>::from_data(TensorData::new(b.clone(), [width]), &device)
                .require_grad();
            let dy =
                Tensor::<GpuAd, 2>::from_data(TensorData::new(dy.clone(), [rows, width]), &device);
            let y = if fused {
                aam_kernels::gelu_dropout(x.clone(), Some(b.clone()), drop)
            } else {
                aam_kernels::gelu_dropout(x.clone() + b.clone().unsqueeze(), None, drop)
            };
            let grads = (y.clone() * dy).sum().backward();
            [
                values(y),
                values(x.grad(&grads).expect("dx")),
                values(b.grad(&grads).expect("db")),
            ]
        };
        let (fused, split) = (run(true), run(false));
        for (i, name) in ["y", "dx", "db"].iter().enumerate() {
            // db: the same sums over the rows, in another order.
            let tol = if i == 2 { 1e-5 } else { 1e-6 };
            let err = rel(&fused[i], &split[i]);
            assert!(
                err <= tol,
                "{rows}x{width}, p {prob}: {name}: bias in the kernel off the sum by {err:e}"
            );
        }
    }
}

/// `gelu_dropout_dense(h, h_bias, w, b)` (one autodiff node that keeps `h`
/// and recomputes the activation in its backward) and `dense(gelu_dropout(h
/// + h_bias), w, b)` with one seed: the same output and the same gradients
/// of `h`, `w`, `b` and `h_bias`, with and without either bias.
#[test]
fn gelu_dropout_dense_is_the_dense_of_gelu_dropout_both_ways() {
    let drop = AttentionDropout { prob: 0.2, seed: 5 };
    let (m, f, n) = (300, 64, 24);
    let mut rng = Rng::new(15);
    let mut draw = |len: usize| -> Vec<f32> { (0..len).map(|_| rng.normal()).collect() };
    let (h, w, b, hb, dy) = (draw(m * f), draw(n * f), draw(n), draw(f), draw(m * n));
    for (with_bias, with_h_bias) in [(true, false), (false, false), (true, true), (false, true)] {
        let run = |fused: bool| -> Vec<Vec<f32>> {
            let device = Default::default();
            let tensor = |v: &Vec<f32>, shape: [usize; 2]| {
                Tensor::<GpuAd, 2>::from_data(TensorData::new(v.clone(), shape), &device)
            };
            let h = tensor(&h, [m, f]).require_grad();
            let w = tensor(&w, [n, f]).require_grad();
            let b = tensor(&b, [1, n]).reshape([n]).require_grad();
            let hb = tensor(&hb, [1, f]).reshape([f]).require_grad();
            let bias = with_bias.then(|| b.clone());
            let h_bias = with_h_bias.then(|| hb.clone());
            let y = if fused {
                aam_kernels::gelu_dropout_dense(h.clone(), h_bias, w.clone(), bias, drop)
            } else {
                let input = match h_bias {
                    Some(hb) => h.clone() + hb.unsqueeze(),
                    None => h.clone(),
                };
                aam_kernels::dense(
                    aam_kernels::gelu_dropout(input, None, drop),
                    w.clone(),
                    bias,
                )
            };
            let grads = (y.clone() * tensor(&dy, [m, n])).sum().backward();
            let mut out = vec![values(y), values(h.grad(&grads).expect("dh"))];
            out.push(values(w.grad(&grads).expect("dw")));
            if with_bias {
                out.push(values(b.grad(&grads).expect("db")));
            }
            if with_h_bias {
                out.push(values(hb.grad(&grads).expect("dh_bias")));
            }
            out
        };
        let (fused, split) = (run(true), run(false));
        let names = ["y", "dh", "dw"]
            .into_iter()
            .chain(with_bias.then_some("db"))
            .chain(with_h_bias.then_some("dh_bias"));
        for (i, name) in names.enumerate() {
            let tol = if name == "dh_bias" { 1e-5 } else { 1e-6 };
            let err = rel(&fused[i], &split[i]);
            assert!(
                err <= tol,
                "bias {with_bias}, h_bias {with_h_bias}: {name}: fused off the ops by {err:e}"
            );
        }
    }
}
