//! Self-attention on the packed projection (`fused_packed_attention`: one op
//! from `qkv [N, T, 3D]` to the merged heads, one autodiff node, one fusion
//! custom op each way) against the CPU reference on the heads split by tensor
//! ops: output, `dqkv` and the gradient of the input projection's bias,
//! which the packed op adds to `qkv` as its kernels load it. With dropout it
//! must draw the same masks as the split-heads kernel call, forward and
//! backward.
//!
//! Runs on CUDA when built with `--features cuda` (the device machine), else on
//! wgpu: in CI through Mesa's lavapipe. With `fusion` the ops run as custom
//! ops of Burn's fusion stream.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use crate::common::*;
use aam_kernels::{
    fused_attention, fused_packed_attention, reference_attention, AttentionDropout, KernelChoice,
};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

/// A packed case: `qkv [n, t, 3·h·dh]`, its bias `[3·h·dh]`, output weights
/// `w [n, t, h·dh]`, and the mask of [`Case`] (an all-padding sample, a
/// one-key sample, random lengths with holes).
struct Packed {
    n: usize,
    t: usize,
    h: usize,
    dh: usize,
    qkv: Vec<f32>,
    bias: Vec<f32>,
    w: Vec<f32>,
    case: Case,
}

impl Packed {
    fn new(seed: u64, n: usize, h: usize, t: usize, dh: usize) -> Packed {
        let mut rng = Rng::new(seed);
        let d = h * dh;
        let qkv = (0..n * t * 3 * d).map(|_| rng.normal()).collect();
        let bias = (0..3 * d).map(|_| rng.normal()).collect();
        let w = (0..n * t * d).map(|_| rng.normal()).collect();
        Packed {
            n,
            t,
            h,
            dh,
            qkv,
            bias,
            w,
            case: Case::new(seed, n, h, t, t, dh),
        }
    }

    /// `qkv` and the bias (both requiring gradients), and `w`.
    fn tensors<B: AutodiffBackend>(
        &self,
        device: &B::Device,
    ) -> (Tensor<B, 3>, Tensor<B, 1>, Tensor<B, 3>) {
        let d = self.h * self.dh;
        let qkv = TensorData::new(self.qkv.clone(), [self.n, self.t, 3 * d]);
        let bias = TensorData::new(self.bias.clone(), [3 * d]);
        let w = TensorData::new(self.w.clone(), [self.n, self.t, d]);
        (
            Tensor::from_data(qkv, device).require_grad(),
            Tensor::from_data(bias, device).require_grad(),
            Tensor::from_data(w, device),
        )
    }

    fn label(&self) -> String {
        format!("n={} t={} h={} dh={}", self.n, self.t, self.h, self.dh)
    }
}

/// `[N, T, 3D]` → q, k, v `[N, H, T, Dh]` by tensor ops; and back.
fn split<B: Backend>(qkv: Tensor<B, 3>, h: usize) -> [Tensor<B, 4>; 3] {
    let [n, t, d3] = qkv.dims();
    let d = d3 / 3;
    core::array::from_fn(|i| {
        qkv.clone()
            .narrow(2, i * d, d)
            .reshape([n, t, h, d / h])
            .swap_dims(1, 2)
    })
}

fn merge<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 3> {
    let [n, h, t, dh] = x.dims();
    x.swap_dims(1, 2).reshape([n, t, h * dh])
}

/// `(out, dqkv, dbias)` of `f = Σ attention(qkv + bias) ⊙ w`, on the GPU,
/// packed (the bias added by the kernels) or by the split-heads kernel call
/// on `qkv + bias` made by a tensor op.
fn gpu_run(p: &Packed, packed: bool, dropout: AttentionDropout) -> [Vec<f32>; 3] {
    let device = Default::default();
    let (qkv, bias, w) = p.tensors::<GpuAd>(&device);
    let mask = Some(p.case.mask::<GpuAd>(&device));
    let out = if packed {
        fused_packed_attention(
            qkv.clone(),
            Some(bias.clone()),
            mask,
            p.h,
            dropout,
            KernelChoice::AUTO,
        )
    } else {
        let [q, k, v] = split(qkv.clone() + bias.clone().unsqueeze(), p.h);
        merge(fused_attention(q, k, v, mask, dropout, KernelChoice::AUTO))
    };
    grads_of(out, w, qkv, bias)
}

fn grads_of<B: AutodiffBackend>(
    out: Tensor<B, 3>,
    w: Tensor<B, 3>,
    qkv: Tensor<B, 3>,
    bias: Tensor<B, 1>,
) -> [Vec<f32>; 3] {
    let grads = (out.clone() * w).sum().backward();
    [
        values(out),
        values(qkv.grad(&grads).expect("dqkv")),
        values(bias.grad(&grads).expect("dbias")),
    ]
}

/// The CPU reference on the split heads of `qkv + bias`.
fn cpu_run(p: &Packed) -> [Vec<f32>; 3] {
    let device = Default::default();
    let (qkv, bias, w) = p.tensors::<CpuAd>(&device);
    let [q, k, v] = split(qkv.clone() + bias.clone().unsqueeze(), p.h);
    let out = merge(reference_attention(q, k, v, Some(p.case.mask(&device))));
    grads_of(out, w, qkv, bias)
}

#[test]
fn packed_attention_matches_the_reference() {
    let cases = [
        Packed::new(1, 3, 4, 151, 32), // the ASV level: 151 tokens
        Packed::new(2, 4, 2, 7, 16),
        Packed::new(3, 3, 2, 1, 32), // one token: all-padding and one-key rows
        Packed::new(4, 2, 4, 1024, 16), // the sample level's slots
        Packed::new(5, 3, 1, 33, 64),
    ];
    for p in &cases {
        let [out, dqkv, dbias] = gpu_run(p, true, AttentionDropout::NONE);
        let [want_out, want_dqkv, want_dbias] = cpu_run(p);
        let label = p.label();
        let e = rel(&out, &want_out);
        assert!(e <= FORWARD_RTOL_F32, "{label}: output off by {e:e}");
        let e = rel(&dqkv, &want_dqkv);
        assert!(e <= GRAD_RTOL_F32, "{label}: dqkv off by {e:e}");
        let e = rel(&dbias, &want_dbias);
        assert!(e <= GRAD_RTOL_F32, "{label}: dbias off by {e:e}");
        // With n > 2, sample 0 is all padding: a zero context.
        let row = p.t * p.h * p.dh;
        let zeros = out[..row].iter().all(|x| *x == 0.0);
        assert!(p.n <= 2 || zeros, "{label}: all-padding sample not zero");
    }
}

#[test]
fn packed_dropout_draws_the_split_heads_masks() {
    let p = Packed::new(6, 3, 2, 64, 32);
    let dropout = AttentionDropout {
        prob: 0.3,
        seed: 77,
    };
    let packed = gpu_run(&p, true, dropout);
    let split = gpu_run(&p, false, dropout);
    let none = gpu_run(&p, true, AttentionDropout::NONE);
    assert!(rel(&packed[0], &none[0]) > 1e-2, "dropout changed nothing");
    for (i, name) in ["output", "dqkv", "dbias"].iter().enumerate() {
        let e = rel(&packed[i], &split[i]);
        assert!(e <= 1e-6, "{name}: packed and split heads differ by {e:e}");
    }
}

/// The packed op in f16/bf16 (the model's mixed-precision path, the bias
/// added by the kernels) against the f32 op on the same rounded `qkv` and
/// bias: output, `dqkv` and `dbias`, without and with dropout (the same
/// seed draws the same mask in every type). On CUDA the half forward and
/// backward run on `mma.sync` (`mma.rs`, `mma_backward.rs`), which read q,
/// k and v at offsets of the packed rows and add the bias as they load.
#[test]
fn packed_half_matches_f32() {
    use burn::tensor::{bf16, f16, DType};
    let device: burn::tensor::Device<Gpu> = Default::default();
    // (seed, n, h, t, dh)
    let shapes = [
        (11, 3, 4, 151, 32), // the ASV level
        (12, 3, 2, 40, 64),
        #[cfg(feature = "cuda")]
        (13, 3, 4, 1024, 32), // the sample level (slow on lavapipe)
    ];
    for dtype in [DType::F16, DType::BF16] {
        if !Gpu::supports_dtype(&device, dtype) {
            continue;
        }
        // bf16 keeps 3 fewer mantissa bits than f16 (as `half_precision`).
        let (out_rtol, grad_rtol) = match dtype {
            DType::F16 => (1e-2, 1e-2),
            _ => (1e-2, 8e-2),
        };
        let round = |x: &mut Vec<f32>| {
            for v in x.iter_mut() {
                *v = match dtype {
                    DType::F16 => f16::from_f32(*v).to_f32(),
                    _ => bf16::from_f32(*v).to_f32(),
                };
            }
        };
        for &(seed, n, h, t, dh) in &shapes {
            let mut p = Packed::new(seed, n, h, t, dh);
            round(&mut p.qkv);
            round(&mut p.bias);
            for prob in [0.0, 0.2] {
                let dropout = AttentionDropout { prob, seed: 31 };
                let full = gpu_run_typed(&p, dropout, DType::F32);
                let half = gpu_run_typed(&p, dropout, dtype);
                let label = format!("{dtype:?} {} p={prob}", p.label());
                for (i, name) in ["output", "dqkv", "dbias"].iter().enumerate() {
                    let e = rel(&half[i], &full[i]);
                    eprintln!("{label}: {name} rel err {e:e}");
                    let rtol = if i == 0 { out_rtol } else { grad_rtol };
                    assert!(e <= rtol, "{label}: {name} off by {e:e}");
                }
            }
        }
    }
}

/// [`gpu_run`] of the packed op with `qkv` and the bias cast to `dtype`
/// (the gradients back in f32).
fn gpu_run_typed(
    p: &Packed,
    dropout: AttentionDropout,
    dtype: burn::tensor::DType,
) -> [Vec<f32>; 3] {
    let device = Default::default();
    let (qkv, bias, w) = p.tensors::<GpuAd>(&device);
    let mask = Some(p.case.mask::<GpuAd>(&device));
    let out = fused_packed_attention(
        qkv.clone().cast(dtype),
        Some(bias.clone().cast(dtype)),
        mask,
        p.h,
        dropout,
        KernelChoice::AUTO,
    )
    .cast(burn::tensor::DType::F32);
    grads_of(out, w, qkv, bias)
}
