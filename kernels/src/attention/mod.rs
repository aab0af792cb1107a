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
//!   accuracy), f16/bf16 as they are: one forward kernel generic over a
//!   `#[cube]` trait of what the two differ in (`MmaOperands`).
//! - `cmma` (`tensor_core.rs`): CubeCL's portable 16×16×16 tiles, f16/bf16,
//!   where there is no `mma.sync` (HIP, CUDA before Ampere).
//!
//! Every kernel takes the call's runtime scalars (score scale, heads,
//! operand offsets, dropout) as one launch struct, `args::Scalars`, and its
//! shared inputs (Q, K, V, bias, the keys' validity) as another,
//! `args::Operands`, which `launch.rs` builds for each launch.
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
use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::TensorPrimitive;

use crate::matmul;

mod autodiff;
#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "fusion")]
mod fusion;

/// Fused masked attention, on split heads or on the packed projection.
pub trait AttentionOps: Backend {
    /// Whether [`AttentionOps::fused_masked_attention`] runs a kernel here.
    fn has_fused_attention() -> bool {
        false
    }

    /// Fused masked self-attention on the packed projection `qkv` (torch's
    /// `in_proj` output: per row the query, key and value, `D = H·Dh` wide
    /// each, head `h` at columns `h·Dh..(h+1)·Dh` of each), to the
    /// merged-heads context: one op instead of the split into heads, the
    /// attention and the merge (`packed.rs` says what that saves a step).
    ///
    /// The output of [`AttentionOps::packed_attention_forward`];
    /// `Autodiff` overrides it with one node whose backward is
    /// [`AttentionOps::packed_attention_backward`].
    ///
    /// `bias`, where given, is the input projection's bias, added to `qkv`
    /// as the kernels load it (`crate::cube`, `bias_at`, says why); the
    /// `Autodiff` node's gradient for it is the column sum of `dqkv`.
    ///
    /// # Shapes
    /// - qkv: `[N, T, 3D]`, D divisible by `heads`, Dh ≤ 128; bias: `[3D]`
    /// - key_padding_mask: `[N, T]`, `true` = ignore this key
    /// - output: `[N, T, D]`; rows whose keys are all masked are 0
    ///
    /// # Panics
    /// When [`AttentionOps::has_fused_attention`] is false.
    fn fused_packed_attention(
        qkv: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        key_padding_mask: Option<BoolTensor<Self>>,
        heads: usize,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> FloatTensor<Self> {
        Self::packed_attention_forward(qkv, bias, key_padding_mask, heads, scale, dropout, kernels)
            .0
    }

    /// The packed forward with its saved statistics: `(out [N, T, D], lse
    /// [N, H, T])`. The default splits the heads and runs
    /// [`AttentionOps::fused_attention_forward`]; Burn's fusion backend
    /// makes that one custom op. On the CubeCL backends the row and `mma`
    /// kernels read the heads of `qkv` in place and write `out` merged
    /// (strided views and element offsets: no split or merge copies); the
    /// `cmma` kernels (f16/bf16 where there is no `mma.sync`) take the
    /// default. `kernels` constrains the plan.
    fn packed_attention_forward(
        qkv: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        key_padding_mask: Option<BoolTensor<Self>>,
        heads: usize,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        packed::packed_forward_ops::<Self>(
            qkv,
            bias,
            key_padding_mask,
            heads,
            scale,
            dropout,
            kernels,
        )
    }

    /// The packed backward: `dqkv [N, T, 3D]` from the forward's input,
    /// output (`[N, T, D]`) and `lse`, and the output gradient `dout
    /// [N, T, D]`. The default runs
    /// [`AttentionOps::fused_attention_backward`] on the split heads and
    /// writes the three gradients into `dqkv` in one concatenation; Burn's
    /// fusion backend makes that one custom op. On the CubeCL backends the
    /// row, tiled and `mma` kernels read `qkv`, `out` and `dout` in place and
    /// write dQ, dK and dV straight into their thirds of `dqkv`. `bias` as in the forward (the
    /// gradient of `qkv + bias` is the same `dqkv`).
    #[allow(clippy::too_many_arguments)]
    fn packed_attention_backward(
        qkv: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        key_padding_mask: Option<BoolTensor<Self>>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> FloatTensor<Self> {
        packed::packed_backward_ops::<Self>(
            qkv,
            bias,
            key_padding_mask,
            out,
            lse,
            dout,
            heads,
            scale,
            dropout,
            kernels,
        )
    }

    /// Fused masked attention.
    ///
    /// # Shapes
    /// - q: `[N, H, Tq, Dh]`, k / v: `[N, H, Tk, Dh]`, Dh ≤ 128
    /// - key_padding_mask: `[N, Tk]`, `true` = ignore this key
    /// - output: `[N, H, Tq, Dh]`; rows whose keys are all masked are 0
    ///
    /// The output of [`AttentionOps::fused_attention_forward`]; `Autodiff`
    /// overrides it to record the backward pass.
    ///
    /// # Panics
    /// When [`AttentionOps::has_fused_attention`] is false.
    fn fused_masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> FloatTensor<Self> {
        Self::fused_attention_forward(q, k, v, key_padding_mask, scale, dropout, kernels).0
    }

    /// The forward kernel with its saved statistics: `(output, lse)`, where
    /// `lse [N, H, Tq]` (f32) is each row's log-sum-exp of scaled scores.
    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let _ = (q, k, v, key_padding_mask, scale, dropout, kernels);
        panic!("this backend has no fused attention kernel; use the math path")
    }

    /// The backward kernels: `(dq, dk, dv)` from the forward's inputs, output
    /// and `lse`, and the output gradient `dout`.
    #[allow(clippy::too_many_arguments)]
    fn fused_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let _ = (
            q,
            k,
            v,
            key_padding_mask,
            out,
            lse,
            dout,
            scale,
            dropout,
            kernels,
        );
        panic!("this backend has no fused attention kernel; use the math path")
    }
}

#[cfg(feature = "cubecl")]
mod args;
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
/// as [`AttentionOps::fused_masked_attention`].
pub fn fused_attention<B: AttentionOps>(
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

/// Runs [`AttentionOps::fused_packed_attention`] on tensors, with the
/// scale `1/√Dh`: attention over `qkv + bias` (the bias added as the
/// kernels load `qkv`).
///
/// # Shapes
/// - qkv: `[N, T, 3D]`, bias: `[3D]`, key_padding_mask: `[N, T]` (true = ignore)
/// - output: `[N, T, D]`
pub fn fused_packed_attention<B: AttentionOps>(
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
