//! # aam-kernels: fused masked attention and lean-backward ops in CubeCL
//!
//! Job: multi-head attention `softmax(q·kᵀ·scale + mask)·v` with a per-sequence
//! key padding mask, forward and backward, as a Burn backend extension. It knows
//! nothing of AAM: it takes `[N, H, T, Dh]` tensors and an `[N, Tk]` mask, and
//! depends on no `aam-*` crate. As extensions of their own it carries the
//! other ops whose Burn autodiff costs a training step dearly: exact GELU, LayerNorm and
//! the dense layer, each one node with a lean backward, and dropout whose
//! mask is a hash of a seed and the element index (redrawn in the backward
//! pass, never stored). On a GPU a training step is bound by the host's work
//! per op, so on the CubeCL backends GELU, LayerNorm's forward and backward,
//! the dense backward, the sum over rows and the Adam steps are one op each
//! too (a kernel, or one custom op of Burn's fusion stream), with the tensor
//! ops as the default everywhere else. A dense layer's bias can be left to
//! the element-wise op after it ([`dropout_add`] and [`gelu_dropout`] take
//! one, and sum its gradient in the same pass as the input's), so that on a
//! GPU no pass over a layer's output exists only to add a bias.
//!
//! Why it exists: AAM attention is almost always masked (ASVs padded to 151
//! tokens, samples padded to 1024 ASV slots), and the PyTorch reference's fast
//! path (`mem_efficient` SDPA) was silently wrong with a padding mask on ROCm.
//! The kernels are flash-style (tiled over keys, online softmax, O(T) memory),
//! **skip key tiles that are entirely padding** (a sample with 200 real ASVs
//! out of 1024 slots costs ~200 keys), give a defined zero output for query
//! rows whose keys are all masked (never NaN), and apply attention dropout
//! from a counter-based hash so the backward pass regenerates the same mask
//! without storing it.
//!
//! Which attention kernel runs is decided per call by a plan (the device's
//! runtime and capabilities, the call's type and shape; `attention/plan.rs`),
//! not by settings: the table of what runs where is in the doc of the
//! `attention` module. Library code reads no environment variable.
//!
//! Layout: a folder per op (after Burn's custom-kernel example and its
//! `kernel/<op>/` tree), each with
//! - `mod.rs`: the op's trait, whose methods' defaults are tensor ops (what
//!   backends without kernels run: ndarray, candle, libtorch), the public
//!   calls on tensors, and the op's tests;
//! - `cube.rs`: the trait on the CubeCL backends (wgpu, CUDA, ROCm): the
//!   launches; `kernel.rs`: their `#[cube]` kernels;
//! - `autodiff.rs`: the trait under `Autodiff<B>`: the op's node and its
//!   backward;
//! - `fusion.rs`: the trait under Burn's fusion backend: the op as a custom
//!   operation of the lazy fusion stream, run on the inner backend.
//!
//! | folder       | trait              | public calls |
//! |--------------|--------------------|--------------|
//! | `attention/` | [`AttentionOps`]   | [`fused_attention`], [`fused_packed_attention`], [`reference_attention`]; the plan and the kernel families |
//! | `dense/`     | [`DenseOps`]       | [`dense`], [`matmul`], [`row_product`], [`sum_rows`]; the column-sum kernels every bias gradient uses; [`set_compile_ahead_hook`] (compiling the dense layers' kernels ahead, elsewhere) |
//! | `dropout/`   | [`DropoutOps`]     | [`dropout`], [`dropout_add`] |
//! | `gelu/`      | [`GeluOps`]        | [`gelu_dropout`], [`gelu_dropout_dense`] |
//! | `norm/`      | [`LayerNormOps`]   | [`layer_norm`] |
//! | `pool/`      | [`PoolOps`]        | [`attention_pool`] |
//! | `slots/`     | [`SlotOps`]        | [`unpack_rows`] |
//! | `adam/`      | [`AdamOps`]        | [`adam_step_ops`] (the optimiser calls the trait) |
//! | `runtime/`   | [`RuntimeOps`]     | the kernel cache; collectives (NCCL on CUDA, in one process and across processes) |
//! | `matmul/`    |                    | the dense layers' matmul kernels and their plan (CubeCL) |
//!
//! Shared by the ops: `cube.rs` (`#[cube]` helpers: the tile element, fast
//! `exp`, the dropout hash, head addressing), `launch.rs` (their host-side
//! counterparts: dropout arguments, allocation, grids, element-wise
//! launches), `fusion.rs` (the custom-op plumbing), `autodiff.rs` (nodes
//! with an optional parent), `tensor_ops.rs` (the defaults' row helpers).
//! [`AttentionBackend`] is every op trait at once, the bound the model
//! takes; [`DefaultOps`] gives a backend without kernels all the defaults.

use burn::prelude::*;

mod adam;
mod attention;
mod autodiff;
#[cfg(feature = "cubecl")]
mod cube;
mod dense;
mod dropout;
#[cfg(feature = "fusion")]
mod fusion;
mod gelu;
#[cfg(feature = "cubecl")]
mod launch;
#[cfg(feature = "cubecl")]
mod matmul;
mod norm;
mod pool;
mod runtime;
mod slots;
mod tensor_ops;

pub use adam::{adam_step_ops, AdamItem, AdamOps, AdamStep};
#[cfg(feature = "cubecl")]
pub use attention::plan::{
    AttentionPlan, AttentionShape, Backward as BackwardKernel, DeviceInfo,
    Forward as ForwardKernel, Runtime, MAX_HEAD_DIM,
};
pub use attention::{
    fused_attention, fused_packed_attention, reference_attention, AttentionDropout, AttentionOps,
    KernelChoice,
};
pub use dense::ahead::{
    announce_rows, covers, dense_layers, dense_problems, run_dense_problem, set_compile_ahead_hook,
    Ahead, AheadHook, DenseLayer, DenseProblem,
};
pub use dense::{dense, matmul, row_product, sum_rows, DenseOps, ROWS_PER_PART};
pub use dropout::{dropout, dropout_add, seeded_dropout_runs, DropoutOps};
pub use gelu::{gelu_dropout, gelu_dropout_dense, GeluOps};
#[cfg(feature = "cubecl")]
pub use matmul::{
    dense_matmul_candidates, dense_matmul_plan, launch_matmul, set_matmul_tuning, DenseKernel,
    MatmulShape, MatmulTuning, TmaTiling,
};
pub use norm::{layer_norm, LayerNormOps};
pub use pool::{attention_pool, PoolOps};
#[cfg(feature = "cubecl")]
pub use runtime::{kernel_cache_root, persist_compiled_kernels};
pub use runtime::{RuntimeOps, KERNELS_BUILD};
pub use slots::{unpack_rows, RowSlots, SlotOps};
pub use tensor_ops::with_row_bias;
pub(crate) use tensor_ops::{add_row_bias, as_rows, column_sum_last};

/// The backend extensions of aam-rs, every op trait at once: the bound the
/// model's modules take. Implemented for every backend that implements
/// each op trait.
pub trait AttentionBackend:
    RuntimeOps
    + AttentionOps
    + DenseOps
    + DropoutOps
    + GeluOps
    + LayerNormOps
    + PoolOps
    + SlotOps
    + AdamOps
{
}

impl<B> AttentionBackend for B where
    B: RuntimeOps
        + AttentionOps
        + DenseOps
        + DropoutOps
        + GeluOps
        + LayerNormOps
        + PoolOps
        + SlotOps
        + AdamOps
{
}

/// A backend without kernels of its own: every op trait with its tensor-op
/// defaults (Burn's ops; attention then takes the model's math path). The
/// CPU backends here; a backend of your own becomes an [`AttentionBackend`]
/// with `impl DefaultOps for MyBackend {}`.
pub trait DefaultOps: Backend {}

impl<B: DefaultOps> RuntimeOps for B {}
impl<B: DefaultOps> AttentionOps for B {}
impl<B: DefaultOps> DenseOps for B {}
impl<B: DefaultOps> DropoutOps for B {}
impl<B: DefaultOps> GeluOps for B {}
impl<B: DefaultOps> LayerNormOps for B {}
impl<B: DefaultOps> PoolOps for B {}
impl<B: DefaultOps> SlotOps for B {}
impl<B: DefaultOps> AdamOps for B {}

#[cfg(feature = "ndarray")]
impl DefaultOps for burn::backend::NdArray<f32> {}
#[cfg(feature = "ndarray")]
impl DefaultOps for burn::backend::NdArray<f64> {}

#[cfg(feature = "candle")]
#[allow(deprecated)] // burn-candle: deprecated upstream after 0.21, kept while it works
impl<F, I> DefaultOps for burn::backend::Candle<F, I>
where
    burn::backend::Candle<F, I>: Backend,
    F: burn::backend::candle::FloatCandleElement,
    I: burn::backend::candle::IntCandleElement,
{
}

#[cfg(feature = "tch")]
impl<E> DefaultOps for burn::backend::LibTorch<E> where burn::backend::LibTorch<E>: Backend {}
