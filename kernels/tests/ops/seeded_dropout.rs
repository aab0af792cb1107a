//! Seeded dropout (`aam_kernels::dropout` on a CubeCL backend): each element
//! is either dropped or scaled by exactly `1/(1−p)`, about `p` of them are
//! dropped, the same seed draws the same mask and another seed another, and
//! the backward pass (which keeps no mask) drops the gradient with the
//! forward's mask. `dropout_add` (a residual branch as one op) equals the
//! residual plus `dropout` with the same seed, and its backward gives the
//! residual the output gradient and the input the dropped one; with a bias
//! it equals the ops on `x + bias`, gradients included.
//!
//! Runs on CUDA when built with `--features cuda` (the device machine), else on
//! wgpu: in CI through Mesa's lavapipe (a CPU Vulkan driver).
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use crate::common::*;
use aam_kernels::{dropout, dropout_add, AttentionDropout, DropoutOps};
use burn::prelude::*;
use burn::tensor::Distribution;

/// `(x, dropout(x))` on the host for a fresh normal `x`.
fn run(shape: [usize; 2], drop: AttentionDropout, data_seed: u64) -> (Vec<f32>, Vec<f32>) {
    let device = Default::default();
    <Gpu as Backend>::seed(&device, data_seed);
    let x = Tensor::<Gpu, 2>::random(shape, Distribution::Normal(0.0, 1.0), &device);
    let y = dropout(x.clone(), drop);
    (values(x), values(y))
}

/// The kept positions of `y = dropout(x)`, checking that every element is
/// 0 or `x·scale` (as the kernel computes it, in f32).
fn kept(x: &[f32], y: &[f32], prob: f64) -> Vec<bool> {
    let scale = (1.0 / (1.0 - prob)) as f32;
    x.iter()
        .zip(y)
        .enumerate()
        .map(|(i, (&x, &y))| {
            assert!(
                y == 0.0 || y == x * scale,
                "element {i}: {y} is neither 0 nor {x}·{scale}"
            );
            y != 0.0
        })
        .collect()
}

fn kept_fraction(mask: &[bool]) -> f64 {
    mask.iter().filter(|&&k| k).count() as f64 / mask.len() as f64
}

#[test]
fn drops_about_p_and_scales_the_rest() {
    assert!(
        Gpu::has_seeded_dropout(),
        "the CubeCL backends have the kernel"
    );
    for (shape, prob) in [([1, 1], 0.5), ([37, 131], 0.1), ([1000, 129], 0.3)] {
        let drop = AttentionDropout { prob, seed: 77 };
        let (x, y) = run(shape, drop, 1);
        let mask = kept(&x, &y, prob);
        let n = mask.len() as f64;
        if n >= 1000.0 {
            // Binomial: 5 standard deviations.
            let tolerance = 5.0 * (prob * (1.0 - prob) / n).sqrt();
            let fraction = kept_fraction(&mask);
            assert!(
                (fraction - (1.0 - prob)).abs() < tolerance,
                "{shape:?}, p = {prob}: kept {fraction}"
            );
        }
    }
}

#[test]
fn the_seed_alone_draws_the_mask() {
    let drop = AttentionDropout {
        prob: 0.25,
        seed: 0x5eed,
    };
    let shape = [513, 67];
    // Different data, same seed: the same positions are dropped.
    let (x1, y1) = run(shape, drop, 2);
    let (x2, y2) = run(shape, drop, 3);
    let (m1, m2) = (kept(&x1, &y1, drop.prob), kept(&x2, &y2, drop.prob));
    assert_eq!(m1, m2, "same seed, same mask");
    // Another seed: about a fraction 2p(1−p) of the positions differ.
    let (x3, y3) = run(
        shape,
        AttentionDropout {
            seed: 0x5eee,
            ..drop
        },
        2,
    );
    let m3 = kept(&x3, &y3, drop.prob);
    let differ = m1.iter().zip(&m3).filter(|(a, b)| a != b).count() as f64 / m1.len() as f64;
    let expected = 2.0 * drop.prob * (1.0 - drop.prob);
    assert!(
        (differ - expected).abs() < 0.05,
        "another seed changed {differ} of the mask, expected ~{expected}"
    );
    // Neighbouring elements are independent: the mask of the odd elements
    // agrees with that of the even ones about as often as chance says.
    let pairs = m1.chunks_exact(2).filter(|p| p[0] == p[1]).count() as f64;
    let agree = pairs / (m1.len() / 2) as f64;
    let chance = drop.prob.powi(2) + (1.0 - drop.prob).powi(2);
    assert!(
        (agree - chance).abs() < 0.05,
        "neighbours agree {agree}, chance {chance}"
    );
}

#[test]
fn the_mask_is_the_same_whether_units_take_one_element_or_four() {
    // 399 elements run one a unit, 400 four a unit: element i's mask is the
    // hash of (seed, i) either way.
    let drop = AttentionDropout {
        prob: 0.3,
        seed: 4242,
    };
    let (x1, y1) = run([3, 133], drop, 6);
    let (x4, y4) = run([4, 100], drop, 7);
    let (m1, m4) = (kept(&x1, &y1, drop.prob), kept(&x4, &y4, drop.prob));
    assert_eq!(m1[..], m4[..399], "element masks differ between widths");
}

#[test]
fn large_tensors_use_every_element_index() {
    // More elements than one grid dimension of 256-unit cubes holds
    // (65,535 · 256), as the feed-forward activation of a real batch.
    let drop = AttentionDropout { prob: 0.1, seed: 9 };
    let (x, y) = run([65_600, 257], drop, 4);
    let mask = kept(&x, &y, drop.prob);
    // The last rows are dropped at the same rate as the first.
    let tail = &mask[mask.len() - 257 * 1000..];
    for part in [&mask[..257 * 1000], tail] {
        let fraction = kept_fraction(part);
        assert!((fraction - 0.9).abs() < 0.01, "kept {fraction}");
    }
}

#[test]
fn the_backward_pass_drops_the_gradient_with_the_forwards_mask() {
    let device = Default::default();
    <Gpu as Backend>::seed(&device, 5);
    let drop = AttentionDropout {
        prob: 0.4,
        seed: 31,
    };
    let shape = [301, 45];
    let x =
        Tensor::<GpuAd, 2>::random(shape, Distribution::Normal(0.0, 1.0), &device).require_grad();
    let w = Tensor::<GpuAd, 2>::random(shape, Distribution::Normal(0.0, 1.0), &device);
    let y = dropout(x.clone(), drop);
    let grads = (y.clone() * w.clone()).sum().backward();
    let dx = values(x.grad(&grads).expect("x has a gradient"));
    let mask = kept(&values(x.inner()), &values(y.inner()), drop.prob);
    let scale = (1.0 / (1.0 - drop.prob)) as f32;
    for (i, ((&dx, &w), &keep)) in dx.iter().zip(&values(w.inner())).zip(&mask).enumerate() {
        let want = if keep { w * scale } else { 0.0 };
        assert_eq!(dx, want, "element {i}");
    }
}

#[test]
fn dropout_add_is_the_residual_plus_dropout_both_ways() {
    let device = Default::default();
    <Gpu as Backend>::seed(&device, 6);
    let drop = AttentionDropout {
        prob: 0.3,
        seed: 1234,
    };
    // An odd size: the last cube is partly empty.
    let shape = [257, 33];
    let normal = || Tensor::<GpuAd, 2>::random(shape, Distribution::Normal(0.0, 1.0), &device);
    let (residual, x, w) = (normal().require_grad(), normal().require_grad(), normal());
    let y = dropout_add(residual.clone(), x.clone(), None, drop);
    let grads = (y.clone() * w.clone()).sum().backward();
    let dropped = values(dropout(x.clone().inner(), drop));
    let mask = kept(&values(x.clone().inner()), &dropped, drop.prob);
    assert!(mask.contains(&false) && mask.contains(&true));
    for (i, ((&y, &r), &d)) in values(y.inner())
        .iter()
        .zip(&values(residual.clone().inner()))
        .zip(&dropped)
        .enumerate()
    {
        assert_eq!(y, r + d, "element {i}: residual + dropout");
    }
    let w = values(w.inner());
    assert_eq!(
        values(residual.grad(&grads).expect("the residual has a gradient")),
        w,
        "the residual's gradient is the output's"
    );
    let dx = values(x.grad(&grads).expect("x has a gradient"));
    let scale = (1.0 / (1.0 - drop.prob)) as f32;
    for (i, ((&dx, &w), &keep)) in dx.iter().zip(&w).zip(&mask).enumerate() {
        let want = if keep { w * scale } else { 0.0 };
        assert_eq!(dx, want, "element {i}: x's gradient");
    }
}

/// `dropout_add(residual, x, bias)` (the bias added in the kernel) against
/// `residual + dropout(x + bias)` with one seed: values and the gradients of
/// all three (the bias's summed with `x`'s in one kernel, in parts of 256
/// rows: 530 rows make three), on rows the forward kernel takes four
/// elements at a time (128 wide) and one at a time (33), and at p = 0 (the
/// kernel still runs, adding the bias and the residual).
#[test]
fn dropout_add_with_a_bias_is_the_ops_on_the_sum() {
    let device = Default::default();
    <Gpu as Backend>::seed(&device, 8);
    for (rows, width, prob) in [(530, 128, 0.3), (57, 33, 0.3), (20, 128, 0.0)] {
        let drop = AttentionDropout { prob, seed: 4321 };
        let normal = |shape: [usize; 2]| {
            Tensor::<GpuAd, 2>::random(shape, Distribution::Normal(0.0, 1.0), &device)
        };
        let (residual, x, w) = (
            normal([rows, width]),
            normal([rows, width]),
            normal([rows, width]),
        );
        let bias = normal([1, width]).reshape([width]);
        let run = |fused: bool| -> [Vec<f32>; 4] {
            let (residual, x, bias) = (
                residual.clone().require_grad(),
                x.clone().require_grad(),
                bias.clone().require_grad(),
            );
            let y = if fused {
                dropout_add(residual.clone(), x.clone(), Some(bias.clone()), drop)
            } else {
                residual.clone() + dropout(x.clone() + bias.clone().unsqueeze(), drop)
            };
            let grads = (y.clone() * w.clone()).sum().backward();
            [
                values(y.inner()),
                values(residual.grad(&grads).expect("d residual")),
                values(x.grad(&grads).expect("dx")),
                values(bias.grad(&grads).expect("d bias")),
            ]
        };
        let (fused, ops) = (run(true), run(false));
        for (i, name) in ["y", "d residual", "dx", "d bias"].iter().enumerate() {
            // The bias's gradient: the same sums over the rows in another order.
            let tol = if i == 3 { 1e-5 } else { 1e-6 };
            let err = rel(&fused[i], &ops[i]);
            assert!(
                err <= tol,
                "{rows}x{width}, p {prob}: {name}: the fused op off the ops by {err:e}"
            );
        }
    }
}
