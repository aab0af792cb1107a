//! Masked multi-head attention: the public calls ([`fused_attention`],
//! [`fused_packed_attention`], the plain-tensor [`reference_attention`]), and
//! on the CubeCL backends the plan that picks a kernel for each call and the
//! kernels themselves.
//!
//! # Which kernel runs
//!
//! `plan.rs` decides from the device, the call's type and shape, and the
//! caller's [`KernelChoice`] (default: no constraint). At the default
//! model's two levels (head dim 32; the ASV level: 151 tokens, one cube can
//! hold a head's keys; the sample level: 1,024 slots, keys streamed):
//!
//! | runtime (device)              | dtype    | ASV forward | ASV backward | sample forward | sample backward |
//! |-------------------------------|----------|-------------|--------------|----------------|-----------------|
//! | CUDA, sm_80 on (A100, H100)   | f32      | `mma` split TF32 | tiled   | `mma` split TF32 | rows          |
//! | CUDA, sm_80 on                | f16/bf16 | `mma`       | `mma`        | `mma`          | `mma`           |
//! | CUDA before sm_80 (V100, T4)  | f32, bf16| rows        | tiled        | rows           | rows            |
//! | CUDA before sm_80             | f16      | `cmma`      | `cmma`       | `cmma`         | `cmma`          |
//! | HIP (MI300A)                  | f32      | rows        | merged       | rows           | rows            |
//! | HIP                           | f16/bf16 | `cmma`      | `cmma`       | `cmma`         | `cmma`          |
//! | wgpu (Vulkan, Metal; lavapipe)| any      | rows        | rows         | rows           | rows            |
//!
//! `plan::tests::plan_table` asserts this table. The kernels:
//! - rows (`rows.rs`): CUDA cores, any runtime. A unit (or up to 8 adjacent
//!   lanes of a plane, or two units each taking half of the head dims) owns
//!   a query row; tiles of keys in shared memory, online softmax; dQ and
//!   dK/dV as two kernels, or as one (merged) where a cube holds every key
//!   a lane each (HIP at the ASV level; wgpu's 16 KiB cubes are too small).
//! - tiled (`tiled.rs`): the f32 backward on CUDA where a head's keys fit a
//!   cube, as register-tiled products (units own 4 × 4 blocks).
//! - `mma` (`mma.rs`, `mma_backward.rs`, `mma_io.rs`): CUDA's `mma.sync`
//!   with operands and scores in registers; f32 as split TF32 (f32
//!   accuracy), f16/bf16 as they are.
//! - `cmma` (`tensor_core.rs`): CubeCL's portable 16×16×16 tiles, f16/bf16,
//!   where there is no `mma.sync` (HIP, CUDA before Ampere).
//!
//! Every kernel skips key tiles that are all padding, gives a row whose keys
//! are all masked a zero output, and draws attention dropout from the same
//! counter-based hash (`crate::cube`), so any backward follows any forward.
//! `packed.rs` holds the packed self-attention's tensor-op composition (the
//! trait's default, and the `cmma` path's).
//!
//! The fallbacks (rows forward on CUDA, the merged and the separate row
//! backward, lanes, parts) are reached in the parity tests by passing a
//! [`KernelChoice`].

use burn::prelude::*;
use burn::tensor::activation;
use burn::tensor::TensorPrimitive;

use crate::{matmul, AttentionBackend};

#[cfg(feature = "cubecl")]
pub(crate) mod launch;
#[cfg(feature = "cubecl")]
mod mma;
#[cfg(feature = "cubecl")]
mod mma_backward;
#[cfg(feature = "cubecl")]
mod mma_io;
pub(crate) mod packed;
#[cfg(feature = "cubecl")]
pub mod plan;
#[cfg(feature = "cubecl")]
mod rows;
#[cfg(feature = "cubecl")]
mod tensor_core;
#[cfg(feature = "cubecl")]
mod tiled;

/// Dropout settings for one call: of attention probabilities in the
/// attention kernels, of elements in [`crate::dropout`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDropout {
    /// Probability of dropping an element (0 = off).
    pub prob: f64,
    /// Seed of the counter-based mask; the same seed gives the same mask.
    pub seed: u32,
}

impl AttentionDropout {
    /// No dropout.
    pub const NONE: AttentionDropout = AttentionDropout { prob: 0.0, seed: 0 };
}

/// Constraints a caller puts on the plan. The default (`KernelChoice::AUTO`)
/// lets the plan pick; tests and benchmarks set fields to run a fallback
/// where it would not be chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KernelChoice {
    /// Lanes (adjacent units of a plane) per row of the row kernels: 1, 2, 4
    /// or 8 on every runtime (wgpu then needs subgroups that follow the unit
    /// order); `None`: the plan's.
    pub lanes: Option<usize>,
    /// Units that split a row's head dimensions in the row kernels, 1 or 2,
    /// on every runtime; `None`: 2 on CUDA and HIP, 1 elsewhere.
    pub parts: Option<usize>,
    /// CUDA cores only: neither `mma.sync` nor `cmma`.
    pub cuda_cores: bool,
    /// The backward as the dQ and the dK/dV row kernels, never the merged or
    /// the register-tiled one.
    pub separate_backward: bool,
}

impl KernelChoice {
    /// Whatever the plan picks.
    pub const AUTO: KernelChoice = KernelChoice {
        lanes: None,
        parts: None,
        cuda_cores: false,
        separate_backward: false,
    };
}

/// Runs the fused kernel on tensors, with the scale `1/√Dh`; `kernels`
/// constrains the plan (`KernelChoice::AUTO`: none).
///
/// # Shapes
/// as [`AttentionBackend::fused_masked_attention`].
pub fn fused_attention<B: AttentionBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    key_padding_mask: Option<Tensor<B, 2, Bool>>,
    dropout: AttentionDropout,
    kernels: KernelChoice,
) -> Tensor<B, 4> {
    let scale = (q.dims()[3] as f64).sqrt().recip();
    Tensor::from_primitive(TensorPrimitive::Float(B::fused_masked_attention(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        key_padding_mask.map(|m| m.into_primitive()),
        scale,
        dropout,
        kernels,
    )))
}

/// Runs [`AttentionBackend::fused_packed_attention`] on tensors, with the
/// scale `1/√Dh`: attention over `qkv + bias` (the bias added as the
/// kernels load `qkv`).
///
/// # Shapes
/// - qkv: `[N, T, 3D]`, bias: `[3D]`, key_padding_mask: `[N, T]` (true = ignore)
/// - output: `[N, T, D]`
pub fn fused_packed_attention<B: AttentionBackend>(
    qkv: Tensor<B, 3>,
    bias: Option<Tensor<B, 1>>,
    key_padding_mask: Option<Tensor<B, 2, Bool>>,
    heads: usize,
    dropout: AttentionDropout,
    kernels: KernelChoice,
) -> Tensor<B, 3> {
    let d = qkv.dims()[2] / 3;
    assert!(
        qkv.dims()[2] == 3 * d && d % heads == 0,
        "packed attention: width {} is not 3 × a multiple of {heads} heads",
        qkv.dims()[2]
    );
    let scale = ((d / heads) as f64).sqrt().recip();
    if let Some(bias) = &bias {
        assert_eq!(
            bias.dims()[0],
            3 * d,
            "packed attention: bias of {} for width {}",
            bias.dims()[0],
            3 * d
        );
    }
    Tensor::from_primitive(TensorPrimitive::Float(B::fused_packed_attention(
        qkv.into_primitive().tensor(),
        bias.map(|b| b.into_primitive().tensor()),
        key_padding_mask.map(|m| m.into_primitive()),
        heads,
        scale,
        dropout,
        kernels,
    )))
}

/// The plain-tensor reference (no dropout): masked keys get zero weight and an
/// all-masked row gets zero output. The oracle of the parity tests.
pub fn reference_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    key_padding_mask: Option<Tensor<B, 2, Bool>>,
) -> Tensor<B, 4> {
    let [n, _h, _tq, head_dim] = q.dims();
    let tk = k.dims()[2];
    let scores = matmul(q, k.swap_dims(2, 3)) * (head_dim as f64).sqrt().recip();
    let probs = match key_padding_mask {
        Some(mask) => {
            let mask = mask.reshape([n, 1, 1, tk]);
            let shape = scores.dims();
            let scores = scores.mask_fill(mask.clone().expand(shape), -65_504.0);
            // The keep-mask in the scores' float type: `float()` alone gives the
            // default (f32), and an f16/bf16 product with it is garbage on wgpu.
            let keep = mask.bool_not().float().cast(scores.dtype());
            activation::softmax(scores, 3) * keep
        }
        None => activation::softmax(scores, 3),
    };
    matmul(probs, v)
}
