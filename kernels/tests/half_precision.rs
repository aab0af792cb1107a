//! The f16/bf16 paths against the f32 kernel on the same (rounded) inputs:
//! the forward with dropout (the same seed must draw the same mask in both),
//! and the gradients of a half-precision forward and backward (with
//! dropout: against the math path given the half forward's output).
//!
//! On CUDA the half kernels run on tensor cores (`mma.sync`: `mma.rs`,
//! `mma_backward.rs`; on HIP `cmma`, `tensor_core.rs`) and the f32 ones as
//! split TF32 or on CUDA cores, so these tests hold them to the same
//! semantics: masks, all-padding rows, dropout hash, and the log-sum-exp
//! the backward recomputes the probabilities from. On wgpu (lavapipe in
//! CI) both run the CUDA-core kernel.
//!
//! Runs on CUDA when built with `--features cuda` (the device machine), else
//! on wgpu.

use crate::common::*;
use aam_kernels::{fused_attention, AttentionDropout, KernelChoice};
use burn::prelude::*;
use burn::tensor::{bf16, f16, DType, TensorData};

/// Half against f32 on the same rounded inputs: the half side rounds its
/// probabilities (tensor cores) and its output to the half type.
const RTOL_HALF: f32 = 1e-2;
/// Gradients, per type: the half backward also rounds `dS` and reads the
/// rounded output (`Δ = rowsum(dO ⊙ O)`), and `dS = P ⊙ (dP − Δ)` cancels,
/// more with dropout's scaled `dP` (about 8× the error without, in either
/// type). bf16 keeps 3 fewer mantissa bits than f16: 8× the tolerance.
fn grad_rtol(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => 1e-2,
        _ => 8e-2,
    }
}

/// `(tq, tk, dh, n)`: the ASV level (151 tokens, 10 blocks of 16 rows), the
/// sample level's 1024 slots, cross lengths streamed through shared memory
/// on CUDA (700 keys at head dim 64), one token, and the head dims.
const SHAPES: [(usize, usize, usize, usize); 7] = [
    (151, 151, 32, 3),
    (1024, 1024, 32, 2),
    (300, 700, 64, 3),
    (1, 1, 16, 3),
    (9, 70, 16, 3),
    (40, 40, 64, 3),
    (20, 20, 128, 3),
];

fn half_types(device: &burn::tensor::Device<Gpu>) -> Vec<DType> {
    let types: Vec<DType> = [DType::F16, DType::BF16]
        .into_iter()
        .filter(|&t| Gpu::supports_dtype(device, t))
        .collect();
    // Every device aam-rs runs the kernel on has at least f16 (lavapipe, CUDA).
    assert!(!types.is_empty(), "no half type on this device");
    types
}

fn round(dtype: DType, x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| match dtype {
            DType::F16 => f16::from_f32(v).to_f32(),
            _ => bf16::from_f32(v).to_f32(),
        })
        .collect()
}

fn rounded_case(seed: u64, dtype: DType, (tq, tk, dh, n): (usize, usize, usize, usize)) -> Case {
    let mut case = Case::new(seed, n, 2, tq, tk, dh);
    // `w` too: it is the output gradient dO, which the half backward
    // receives in the half type. Unrounded, dO's own rounding (2⁻¹¹ in f16)
    // would be amplified by `dS = P ⊙ (dP − Δ)`'s cancellation into the
    // errors measured here, whichever kernel ran.
    (case.q, case.k, case.v, case.w) = (
        round(dtype, &case.q),
        round(dtype, &case.k),
        round(dtype, &case.v),
        round(dtype, &case.w),
    );
    case
}

#[test]
fn half_forward_draws_the_f32_dropout_mask() {
    let gpu = Default::default();
    for dtype in half_types(&gpu) {
        for (i, &shape) in SHAPES.iter().enumerate() {
            let case = rounded_case(700 + i as u64, dtype, shape);
            for prob in [0.0, 0.2] {
                let drop = AttentionDropout {
                    prob,
                    seed: 77 + i as u32,
                };
                let [q, k, v, _] = case.tensors::<Gpu>(&gpu);
                let mask = case.mask::<Gpu>(&gpu);
                let full = values(fused_attention(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    Some(mask.clone()),
                    drop,
                    KernelChoice::AUTO,
                ));
                let half = fused_attention(
                    q.cast(dtype),
                    k.cast(dtype),
                    v.cast(dtype),
                    Some(mask),
                    drop,
                    KernelChoice::AUTO,
                );
                assert_eq!(half.dtype(), dtype, "the kernel keeps the input type");
                let half = values(half.cast(DType::F32));
                let e = rel(&half, &full);
                eprintln!("{dtype:?} {shape:?} p={prob}: rel err {e:e} against f32");
                assert!(
                    e <= RTOL_HALF,
                    "{dtype:?} {shape:?} p={prob}: rel err {e:e}"
                );
                if case.n > 2 {
                    let first = case.h * case.tq * case.dh;
                    assert!(
                        half[..first].iter().all(|x| *x == 0.0),
                        "{dtype:?} {shape:?}: an all-padding sample must give zeros"
                    );
                }
                assert!(half.iter().all(|x| x.is_finite()), "non-finite output");
            }
        }
    }
}

/// The output and `(dq, dk, dv)` of `Σ w ⊙ attention(q, k, v)` with the
/// inputs cast to `dtype` (all back in f32).
fn gradients(case: &Case, dtype: DType, drop: AttentionDropout) -> (Vec<f32>, [Vec<f32>; 3]) {
    let gpu = Default::default();
    let [q, k, v, w] = case.tensors::<GpuAd>(&gpu);
    let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
    let out = fused_attention(
        q.clone().cast(dtype),
        k.clone().cast(dtype),
        v.clone().cast(dtype),
        Some(case.mask::<GpuAd>(&gpu)),
        drop,
        KernelChoice::AUTO,
    )
    .cast(DType::F32);
    let g = (out.clone() * w).sum().backward();
    let grads = [q, k, v].map(|t| values(t.grad(&g).expect("a gradient")));
    (values(out), grads)
}

/// The gradients of attention given the forward's output `out` (f32 on
/// the CPU, the math path with the kernels' dropout mask): `dV = P̃ᵀ·dO`,
/// `dS = P ⊙ (Z ⊙ dO·Vᵀ − Δ)` with `Δ = rowsum(dO ⊙ out)`, `dQ = s·dS·K`,
/// `dK = s·dSᵀ·Q`. Given a half forward's rounded `out`, this is what a
/// half backward computes up to its own rounding.
fn gradients_given_output(case: &Case, drop: AttentionDropout, out: &[f32]) -> [Vec<f32>; 3] {
    let cpu = Default::default();
    let [q, k, v, w] = case.tensors::<Cpu>(&cpu);
    let scale = (case.dh as f64).sqrt().recip();
    let shape = [case.n, case.h, case.tq, case.dh];
    let out = Tensor::<Cpu, 4>::from_data(TensorData::new(out.to_vec(), shape), &cpu);
    let (probs, factors) = probs_and_dropout(case, q.clone(), k.clone(), drop, &cpu);
    let dp = w.clone().matmul(v.swap_dims(2, 3)) * factors.clone();
    let delta = (w.clone() * out).sum_dim(3);
    let ds = probs.clone() * (dp - delta);
    let dq = ds.clone().matmul(k) * scale;
    let dk = ds.swap_dims(2, 3).matmul(q) * scale;
    let dv = (probs * factors).swap_dims(2, 3).matmul(w);
    [dq, dk, dv].map(values)
}

/// With dropout, the half backward against [`gradients_given_output`] of
/// the half forward's own output. Why not against the f32 kernel: a
/// half forward stores `out` rounded, and `Δ = rowsum(dO ⊙ out)` inherits
/// its rounding. Where a row's true `dS` is 0 (one valid key: the
/// softmax is constant) its `out = V/(1 − p)` is not representable once
/// dropout scales it, and the rounding's residual in `Δ` becomes all of
/// that row's `dS`, summed over a sample's queries into its key's dK:
/// 0.24 of the largest dK at the sample level in bf16, the same in every
/// half path (`mma.sync`, `cmma`, CUDA cores; H100, 2026-11-27), as in
/// any attention that keeps its output in half precision.
#[test]
fn half_gradients_with_dropout_match_the_math_path_given_the_output() {
    check_gradients(900, "p=0.2, math path given out", |case, dtype, i| {
        let drop = AttentionDropout {
            prob: 0.2,
            seed: 15 + i as u32,
        };
        let (out, half) = gradients(case, dtype, drop);
        [half, gradients_given_output(case, drop, &out)]
    });
}

/// Without dropout, the half gradients against the f32 kernel's on the
/// same rounded inputs.
#[test]
fn half_gradients_match_f32() {
    check_gradients(800, "against f32", |case, dtype, _| {
        let drop = AttentionDropout::NONE;
        [
            gradients(case, dtype, drop).1,
            gradients(case, DType::F32, drop).1,
        ]
    });
}

/// For each half type and shape, `grads(case, dtype, shape index)` gives
/// the half gradients and the ones they must match (each within
/// [`grad_rtol`]); every error is printed before the test fails.
fn check_gradients(
    seed: u64,
    what: &str,
    grads: impl Fn(&Case, DType, usize) -> [[Vec<f32>; 3]; 2],
) {
    let gpu = Default::default();
    let mut failures = Vec::new();
    for dtype in half_types(&gpu) {
        for (i, &shape) in SHAPES.iter().enumerate() {
            // Over 512 rows on wgpu: the forward test covers them (the f32
            // backward is slow on lavapipe); on CUDA they are the streamed
            // paths of the `mma.sync` backward. One key: the softmax of one
            // score is constant, so dq and dk are zero and any relative
            // error is noise.
            if (cfg!(not(feature = "cuda")) && shape.0.max(shape.1) > 512) || shape.1 == 1 {
                continue;
            }
            let case = rounded_case(seed + i as u64, dtype, shape);
            let [half, want] = grads(&case, dtype, i);
            for (name, (h, f)) in ["dq", "dk", "dv"].iter().zip(half.iter().zip(&want)) {
                let e = rel(h, f);
                let line = format!("{dtype:?} {shape:?} {what}: {name} rel err {e:e}");
                eprintln!("{line}");
                if e > grad_rtol(dtype) {
                    failures.push(line);
                }
            }
        }
    }
    assert!(failures.is_empty(), "over tolerance: {failures:#?}");
}
