//! The attention boundary (§1.3 step 2, §1.10) and `nn.MultiheadAttention`.
//!
//! Every multi-head attention in AAM, at the nucleotide, ASV-set, count, target
//! and fusion levels, goes through [`attention`]: `(q, k, v, key padding mask) →
//! context`. The "math" implementation lives here; the fused CubeCL kernel
//! (`aam-kernels`) plugs in behind the same function, chosen per run by
//! [`AttnImplementation`] and by whether the backend has it.
//!
//! Masked keys contribute exactly zero, and a query row whose keys are *all*
//! masked gets a zero context (never NaN), whichever implementation runs.
//! DEVIATION(§1.12): torch's math path gives NaN for such rows; the reference
//! only ever zeroes those rows afterwards (§1.6 step 8), so the model output is
//! the same, and a Rust service never sees a NaN.

use burn::module::Param;

use aam_kernels::AttentionBackend;
use aam_kernels::{
    fused_attention, fused_packed_attention, matmul, AttentionDropout, KernelChoice,
};
use burn::nn::{Dropout, DropoutConfig};
use burn::prelude::*;
use burn::tensor::activation;
use serde::{Deserialize, Serialize};

use crate::nn::{linear, xavier_uniform, Linear, LinearConfig};
use crate::precision::cast_to;
use burn::tensor::DType;

/// Which implementation computes masked attention.
///
/// The reference's `attn_implementation` strings (`sdpa`, `flash`,
/// `mem_efficient`, `math`) only toggled PyTorch's SDPA kernels; on import they
/// all map to [`AttnImplementation::Auto`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AttnImplementation {
    /// The fused kernel where the backend has one (CubeCL: wgpu, CUDA, ROCm),
    /// the math path elsewhere.
    #[default]
    Auto,
    /// Plain masked softmax attention from tensor ops; runs on every backend.
    Math,
    /// The fused kernel; a backend without one is an error at the first call.
    Fused,
}

impl AttnImplementation {
    /// Whether backend `B` runs this choice through the fused kernel.
    ///
    /// `Auto` trains with the fused kernel too: its backward agrees with a
    /// float64 oracle on wgpu and CUDA (`aam-rs diagnose attention`), and a
    /// CUDA pretraining run with it follows the math path's loss curve
    /// (`docs/performance.md`).
    pub fn uses_fused<B: AttentionBackend>(self) -> bool {
        match self {
            AttnImplementation::Auto => B::has_fused_attention(),
            AttnImplementation::Math => false,
            AttnImplementation::Fused => {
                assert!(
                    B::has_fused_attention(),
                    "--attn-implementation fused: this backend has no fused attention kernel (use auto or math)"
                );
                true
            }
        }
    }
}

/// Fill value for masked scores before the softmax. Finite so that a fully
/// masked row stays finite in f16/bf16 too; any real score exceeds it by far,
/// so `exp(fill − max)` underflows to exactly 0 for masked keys.
const MASKED_SCORE: f32 = -65_504.0;

/// Masked multi-head attention.
///
/// `key_padding_mask` is `true` where a key must be ignored (torch's
/// convention). Dropout `p` is applied to the attention probabilities while
/// training (autodiff enabled), as torch's MHA does. Returns the context and,
/// when `need_weights`, the per-head probabilities.
///
/// # Shapes
/// - q: `[N, H, Tq, Dh]`, k / v: `[N, H, Tk, Dh]`
/// - key_padding_mask: `[N, Tk]`
/// - context: `[N, H, Tq, Dh]`; weights: `[N, H, Tq, Tk]`
pub fn attention<B: AttentionBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    key_padding_mask: Option<Tensor<B, 2, Bool>>,
    dropout: &Dropout,
    implementation: AttnImplementation,
    need_weights: bool,
) -> (Tensor<B, 4>, Option<Tensor<B, 4>>) {
    // The kernel never materialises the weights; callers that need them
    // (the fusion modules) take the math path.
    if need_weights || !implementation.uses_fused::<B>() {
        return math_attention(q, k, v, key_padding_mask, dropout, need_weights);
    }
    let attn_dropout = fused_dropout::<B>(&q.device(), dropout);
    (
        fused_attention(q, k, v, key_padding_mask, attn_dropout, KernelChoice::AUTO),
        None,
    )
}

/// The fused kernel's dropout: `dropout.prob` with a fresh seed while
/// training (autodiff enabled), none otherwise.
fn fused_dropout<B: Backend>(device: &B::Device, dropout: &Dropout) -> AttentionDropout {
    if B::ad_enabled(device) && dropout.prob > 0.0 {
        AttentionDropout {
            prob: dropout.prob,
            seed: crate::nn::next_dropout_seed(),
        }
    } else {
        AttentionDropout::NONE
    }
}

/// The reference ("math") path: `softmax(q·kᵀ/√Dh + mask)·v`, with the
/// probabilities of masked keys forced to zero.
pub fn math_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    key_padding_mask: Option<Tensor<B, 2, Bool>>,
    dropout: &Dropout,
    need_weights: bool,
) -> (Tensor<B, 4>, Option<Tensor<B, 4>>) {
    let [n, _h, _tq, head_dim] = q.dims();
    let tk = k.dims()[2];
    let scale = (head_dim as f64).sqrt().recip();
    // Scores are taken in the inputs' type; the softmax runs in f32 whatever
    // it is (as under torch.autocast), and the probabilities return to the
    // inputs' type for the product with v.
    let compute_dtype = v.dtype();
    let scores = cast_to(matmul(q * scale, k.swap_dims(2, 3)), DType::F32);
    let probs = match key_padding_mask {
        Some(mask) => {
            let mask = mask.reshape([n, 1, 1, tk]);
            let shape = scores.dims();
            let scores = scores.mask_fill(mask.clone().expand(shape), MASKED_SCORE);
            // Zero the masked keys explicitly: a no-op for rows with a valid key,
            // and it turns the uniform weights of an all-masked row into zeros.
            // The keep-mask in the scores' float type: `float()` alone gives the
            // default (f32), and an f16/bf16 product with it is garbage on wgpu.
            let keep = mask.bool_not().float().cast(scores.dtype());
            activation::softmax(scores, 3) * keep
        }
        None => activation::softmax(scores, 3),
    };
    let probs = dropout.forward(cast_to(probs, compute_dtype));
    let context = matmul(probs.clone(), v);
    (context, need_weights.then_some(probs))
}

/// Configuration of [`MultiheadAttention`].
#[derive(Config, Debug)]
pub struct MultiheadAttentionConfig {
    /// Model width D (`embed_dim`).
    pub embed_dim: usize,
    /// Heads H; D must be divisible by H.
    pub num_heads: usize,
    /// Dropout on attention probabilities. Default: 0.1.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Attention implementation. Default: auto.
    #[config(default = "AttnImplementation::Auto")]
    pub attn_implementation: AttnImplementation,
}

/// `torch.nn.MultiheadAttention(batch_first=True)` with its packed input
/// projection (`in_proj_weight` rows: query 0..D, key D..2D, value 2D..3D).
#[derive(Module, Debug)]
pub struct MultiheadAttention<B: Backend> {
    /// `in_proj_weight [3D, D]`.
    pub in_proj_weight: Param<Tensor<B, 2>>,
    /// `in_proj_bias [3D]`.
    pub in_proj_bias: Param<Tensor<B, 1>>,
    /// `out_proj` Linear(D→D).
    pub out_proj: Linear<B>,
    dropout: Dropout,
    num_heads: usize,
    #[module(skip)]
    attn_implementation: AttnImplementation,
}

impl MultiheadAttentionConfig {
    /// Builds the module with torch's initialisation (Xavier-uniform packed
    /// projection, zero biases).
    pub fn init<B: Backend>(&self, device: &B::Device) -> MultiheadAttention<B> {
        let d = self.embed_dim;
        assert!(
            d % self.num_heads == 0,
            "embed_dim {d} must be divisible by num_heads {}",
            self.num_heads
        );
        let mut out_proj = LinearConfig::new(d, d).init(device);
        out_proj.bias = Some(burn::module::Initializer::Zeros.init([d], device));
        MultiheadAttention {
            in_proj_weight: xavier_uniform(d, 3 * d).init([3 * d, d], device),
            in_proj_bias: burn::module::Initializer::Zeros.init([3 * d], device),
            out_proj,
            dropout: DropoutConfig::new(self.dropout).init(),
            num_heads: self.num_heads,
            attn_implementation: self.attn_implementation,
        }
    }
}

impl<B: AttentionBackend> MultiheadAttention<B> {
    /// Self-attention: one packed projection for q, k and v.
    ///
    /// # Shapes
    /// - x: `[N, T, D]`, key_padding_mask: `[N, T]` (true = ignore)
    /// - output: `[N, T, D]`
    pub fn self_attention(
        &self,
        x: Tensor<B, 3>,
        key_padding_mask: Option<Tensor<B, 2, Bool>>,
    ) -> Tensor<B, 3> {
        self.self_attention_with(x, key_padding_mask, true)
    }

    /// [`MultiheadAttention::self_attention`], with the output projection's
    /// bias left out where `out_bias` is false (for a caller that adds it in
    /// its next element-wise pass, see [`crate::nn::Linear::forward_without_bias`]).
    ///
    /// # Shapes
    /// - x: `[N, T, D]`, key_padding_mask: `[N, T]` (true = ignore)
    /// - output: `[N, T, D]`
    pub fn self_attention_with(
        &self,
        x: Tensor<B, 3>,
        key_padding_mask: Option<Tensor<B, 2, Bool>>,
        out_bias: bool,
    ) -> Tensor<B, 3> {
        let project_out = |context: Tensor<B, 3>| {
            if out_bias {
                self.out_proj.forward(context)
            } else {
                self.out_proj.forward_without_bias(context)
            }
        };
        let [n, t, d] = x.dims();
        // In the input's float type (mixed precision, see `precision.rs`).
        let dtype = x.dtype();
        let weight = cast_to(self.in_proj_weight.val(), dtype);
        let bias = cast_to(self.in_proj_bias.val(), dtype);
        if self.attn_implementation.uses_fused::<B>() {
            // One op from the packed projection to the merged heads (and
            // one back): the split and merge as tensor ops cost a GPU step
            // ~26 host ops a layer (`aam_kernels::fused_packed_attention`).
            // The projection's bias is added as the kernels read `qkv`,
            // not by a pass of its own.
            let qkv = linear(x, weight, None);
            let dropout = fused_dropout::<B>(&qkv.device(), &self.dropout);
            let context = fused_packed_attention(
                qkv,
                Some(bias),
                key_padding_mask,
                self.num_heads,
                dropout,
                KernelChoice::AUTO,
            );
            return project_out(context);
        }
        let qkv = linear(x, weight, Some(bias));
        let q = self.split_heads(qkv.clone().narrow(2, 0, d));
        let k = self.split_heads(qkv.clone().narrow(2, d, d));
        let v = self.split_heads(qkv.narrow(2, 2 * d, d));
        let (context, _) = attention(
            q,
            k,
            v,
            key_padding_mask,
            &self.dropout,
            self.attn_implementation,
            false,
        );
        project_out(self.merge_heads(context, n, t, d))
    }

    /// Attention of `query` over `key`/`value` (separate projections), with the
    /// per-head weights, as `MHA(..., need_weights=True, average_attn_weights=False)`.
    ///
    /// # Shapes
    /// - query: `[N, Tq, D]`, key / value: `[N, Tk, D]`
    /// - output: `[N, Tq, D]`; weights: `[N, H, Tq, Tk]`
    pub fn cross_attention(
        &self,
        query: Tensor<B, 3>,
        key: Tensor<B, 3>,
        value: Tensor<B, 3>,
    ) -> (Tensor<B, 3>, Tensor<B, 4>) {
        let [n, tq, d] = query.dims();
        let dtype = query.dtype();
        let w = cast_to(self.in_proj_weight.val(), dtype);
        let b = cast_to(self.in_proj_bias.val(), dtype);
        let project = |x: Tensor<B, 3>, i: usize| {
            linear(
                x,
                w.clone().narrow(0, i * d, d),
                Some(b.clone().narrow(0, i * d, d)),
            )
        };
        let q = self.split_heads(project(query, 0));
        let k = self.split_heads(project(key, 1));
        let v = self.split_heads(project(value, 2));
        let (context, weights) =
            attention(q, k, v, None, &self.dropout, self.attn_implementation, true);
        let out = self.out_proj.forward(self.merge_heads(context, n, tq, d));
        (out, weights.expect("weights were requested"))
    }

    /// `[N, T, D] → [N, H, T, D/H]`
    fn split_heads(&self, x: Tensor<B, 3>) -> Tensor<B, 4> {
        let [n, t, d] = x.dims();
        x.reshape([n, t, self.num_heads, d / self.num_heads])
            .swap_dims(1, 2)
    }

    /// `[N, H, T, D/H] → [N, T, D]`
    fn merge_heads(&self, x: Tensor<B, 4>, n: usize, t: usize, d: usize) -> Tensor<B, 3> {
        x.swap_dims(1, 2).reshape([n, t, d])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::{Distribution, Tolerance};

    type TB = NdArray<f32>;

    fn qkv(n: usize, t: usize) -> [Tensor<TB, 4>; 3] {
        let device = Default::default();
        core::array::from_fn(|_| {
            Tensor::random([n, 2, t, 4], Distribution::Normal(0.0, 1.0), &device)
        })
    }

    #[test]
    fn masked_keys_do_not_change_the_output() {
        let device = Default::default();
        let [q, k, v] = qkv(1, 5);
        let dropout = DropoutConfig::new(0.0).init();
        let mask = Tensor::<TB, 2, Bool>::from_data([[false, false, true, false, true]], &device);
        let (full, _) =
            math_attention(q.clone(), k.clone(), v.clone(), Some(mask), &dropout, false);
        // Same attention over only the three valid keys.
        let idx = Tensor::<TB, 1, Int>::from_ints([0, 1, 3], &device);
        let (kept, _) = math_attention(
            q,
            k.select(2, idx.clone()),
            v.select(2, idx),
            None,
            &dropout,
            false,
        );
        full.into_data()
            .assert_approx_eq::<f32>(&kept.into_data(), Tolerance::default());
    }

    #[test]
    fn all_masked_row_gives_zero_context_not_nan() {
        let device = Default::default();
        let [q, k, v] = qkv(2, 3);
        let dropout = DropoutConfig::new(0.0).init();
        let mask =
            Tensor::<TB, 2, Bool>::from_data([[true, true, true], [false, true, true]], &device);
        let (out, _) = math_attention(q, k, v, Some(mask), &dropout, false);
        let first = out.clone().narrow(0, 0, 1);
        assert_eq!(first.abs().sum().into_scalar(), 0.0);
        assert!(!out.is_nan().any().into_scalar());
    }
}
