//! # aam-kernels: one fused masked-attention kernel, written once in CubeCL
//!
//! Job: multi-head attention `softmax(q·kᵀ·scale + mask)·v` with a per-sequence
//! key padding mask, forward and backward, as a Burn backend extension. It knows
//! nothing of AAM: it takes `[N, H, T, Dh]` tensors and an `[N, Tk]` mask, and
//! depends on no `aam-*` crate.
//!
//! Why it exists: AAM attention is almost always masked (ASVs padded to 151
//! tokens, samples padded to 1024 ASV slots), and the PyTorch reference's fast
//! path (`mem_efficient` SDPA) was silently wrong with a padding mask on ROCm.
//! This kernel is flash-style (tiled over keys, online softmax, O(T) memory),
//! **skips key tiles that are entirely padding** (a sample with 200 real ASVs
//! out of 1024 slots costs ~200 keys), gives a defined zero output for query
//! rows whose keys are all masked (never NaN), and applies attention dropout
//! from a counter-based hash so the backward pass regenerates the same mask
//! without storing it.
//!
//! Layout (after Burn's custom-kernel example):
//! - `lib.rs`: the [`AttentionBackend`] extension trait and the public
//!   [`fused_attention`] / [`reference_attention`] pair (the plain-tensor
//!   reference is the test oracle).
//! - `kernel.rs`: the `#[cube]` kernels only (forward, dQ, dK/dV).
//! - `forward.rs`: the trait for CubeCL backends: contiguous inputs, launches.
//! - `backward.rs`: the trait for `Autodiff<B>`: saved statistics, gradients.
//! - `fusion.rs`: the trait for Burn's fusion backend `Fusion<B>`: the
//!   kernels as custom operations of the lazy fusion stream.
//!
//! Backends without a kernel (ndarray, candle, libtorch) implement the trait
//! with `has_fused_attention() == false`; callers then run their math path.

use burn::prelude::*;
use burn::tensor::activation;
use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::TensorPrimitive;

mod backward;
#[cfg(feature = "cubecl")]
mod forward;
#[cfg(feature = "fusion")]
mod fusion;
#[cfg(feature = "cubecl")]
mod kernel;

/// Keeps compiled CUDA/HIP kernels on disk between runs.
///
/// CubeCL JIT-compiles every kernel of a training step the first time it
/// runs; on CUDA that took ~6 minutes for the default model's step on an
/// H100, every run. CubeCL can keep the compiled code, but only when its
/// configuration asks for it; this asks, next to CubeCL's autotune results
/// (`target/` of the enclosing Cargo workspace, else the user cache
/// directory's `cubecl/`). A `cubecl.toml` that sets `[compilation] cache`
/// wins. Call it once, before the first device is used; later calls, or
/// calls after CubeCL read its configuration, change nothing.
#[cfg(feature = "cubecl")]
pub fn persist_compiled_kernels() {
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
        if config.compilation.cache.is_none() {
            config.compilation.cache = Some(config.autotune.cache.clone());
        }
        // Once CubeCL has loaded its configuration it cannot change (`set`
        // would panic); the run then goes on without the cache.
        let loaded = CubeClRuntimeConfig::storage().lock().is_some();
        if !loaded {
            CubeClRuntimeConfig::set(config);
        }
    });
}

/// Attention dropout settings for one call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDropout {
    /// Probability of dropping an attention probability (0 = off).
    pub prob: f64,
    /// Seed of the counter-based mask; the same seed gives the same mask.
    pub seed: u32,
}

impl AttentionDropout {
    /// No dropout.
    pub const NONE: AttentionDropout = AttentionDropout { prob: 0.0, seed: 0 };
}

/// The backend extensions of aam-rs: masked attention as one fused kernel
/// (where the backend has it), and exact GELU with a lean backward.
pub trait AttentionBackend: Backend {
    /// Whether [`AttentionBackend::fused_masked_attention`] runs a kernel here.
    fn has_fused_attention() -> bool {
        false
    }

    /// Bytes the backend's memory pool holds on `device`, where it reports
    /// them (the CubeCL backends); `None` elsewhere. Diagnostics read it before
    /// and after an operation to see how much the pool had to grow for it.
    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        let _ = device;
        None
    }

    /// Bytes of live tensors in the memory pool on `device`, where the backend
    /// reports them (the CubeCL backends); `None` elsewhere.
    fn memory_in_use(device: &Self::Device) -> Option<u64> {
        let _ = device;
        None
    }

    /// Exact (erf) GELU, `x·Φ(x) = ½·x·(1 + erf(x/√2))`.
    ///
    /// A backend extension for its gradient, not its value: built from
    /// tensor ops, autodiff would keep `x/√2` and `Φ(x)` besides `x` for the
    /// backward pass, two more copies of the feed-forward activation (the
    /// largest of a step) per layer. `Autodiff<B>` overrides it with one node
    /// that keeps only `x` and computes the exact derivative
    /// `Φ(x) + x·φ(x)` in the backward pass. (Burn's own `gelu` keeps only
    /// `x` too, but differentiates the tanh approximation.)
    fn gelu_exact(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let cdf = normal_cdf::<Self>(x.clone());
        Self::float_mul(x, cdf)
    }

    /// Fused masked attention.
    ///
    /// # Shapes
    /// - q: `[N, H, Tq, Dh]`, k / v: `[N, H, Tk, Dh]`, Dh ≤ 128
    /// - key_padding_mask: `[N, Tk]`, `true` = ignore this key
    /// - output: `[N, H, Tq, Dh]`; rows whose keys are all masked are 0
    ///
    /// The output of [`AttentionBackend::fused_attention_forward`]; `Autodiff`
    /// overrides it to record the backward pass.
    ///
    /// # Panics
    /// When [`AttentionBackend::has_fused_attention`] is false.
    fn fused_masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        scale: f64,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        Self::fused_attention_forward(q, k, v, key_padding_mask, scale, dropout).0
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
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let _ = (q, k, v, key_padding_mask, scale, dropout);
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
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let _ = (q, k, v, key_padding_mask, out, lse, dout, scale, dropout);
        panic!("this backend has no fused attention kernel; use the math path")
    }
}

/// `Φ(x) = ½·(1 + erf(x/√2))`, the standard normal CDF.
pub(crate) fn normal_cdf<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let erf = B::float_erf(B::float_mul_scalar(
        x,
        std::f64::consts::FRAC_1_SQRT_2.into(),
    ));
    B::float_mul_scalar(B::float_add_scalar(erf, 1.0.into()), 0.5.into())
}

/// Runs the fused kernel on tensors.
///
/// # Shapes
/// as [`AttentionBackend::fused_masked_attention`].
pub fn fused_attention<B: AttentionBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    key_padding_mask: Option<Tensor<B, 2, Bool>>,
    dropout: AttentionDropout,
) -> Tensor<B, 4> {
    let scale = (q.dims()[3] as f64).sqrt().recip();
    Tensor::from_primitive(TensorPrimitive::Float(B::fused_masked_attention(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        key_padding_mask.map(|m| m.into_primitive()),
        scale,
        dropout,
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
    let scores = q.matmul(k.swap_dims(2, 3)) * (head_dim as f64).sqrt().recip();
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
    probs.matmul(v)
}

#[cfg(feature = "ndarray")]
impl AttentionBackend for burn::backend::NdArray<f32> {}
#[cfg(feature = "ndarray")]
impl AttentionBackend for burn::backend::NdArray<f64> {}

#[cfg(feature = "candle")]
#[allow(deprecated)] // burn-candle: deprecated upstream after 0.21, kept while it works
impl<F, I> AttentionBackend for burn::backend::Candle<F, I>
where
    burn::backend::Candle<F, I>: Backend,
    F: burn::backend::candle::FloatCandleElement,
    I: burn::backend::candle::IntCandleElement,
{
}

#[cfg(feature = "tch")]
impl<E> AttentionBackend for burn::backend::LibTorch<E> where burn::backend::LibTorch<E>: Backend {}
