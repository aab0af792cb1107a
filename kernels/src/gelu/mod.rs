//! Exact (erf) GELU with a lean backward ([`GeluOps`]): autodiff keeps only
//! the input; with a bias before it and the seeded dropout after it as one
//! op ([`gelu_dropout`]); and a feed-forward layer's second half,
//! `dense(gelu_dropout(h))`, as one node that keeps `h`
//! ([`gelu_dropout_dense`]).

use burn::prelude::*;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorPrimitive;

use crate::{
    add_row_bias, column_sum_last, dense, seeded_dropout_runs, with_row_bias, AttentionDropout,
    DropoutOps,
};

mod autodiff;
#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "fusion")]
mod fusion;
#[cfg(feature = "cubecl")]
mod kernel;

/// Exact (erf) GELU with a lean backward, alone, after a bias, before seeded
/// dropout, and before a dense layer (a feed-forward layer's second half).
pub trait GeluOps: DropoutOps {
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

    /// The input gradient of [`GeluOps::gelu_exact`] at `x`:
    /// `dy·(Φ(x) + x·φ(x))`. Tensor ops by default; one kernel on the CubeCL
    /// backends and one custom op under fusion (a dozen fewer host ops per
    /// feed-forward layer).
    fn gelu_exact_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        // φ(x) = exp(−x²/2)/√(2π)
        let pdf = Self::float_mul_scalar(
            Self::float_exp(Self::float_mul_scalar(
                Self::float_powi_scalar(x.clone(), 2.into()),
                (-0.5).into(),
            )),
            (1.0 / (2.0 * std::f64::consts::PI).sqrt()).into(),
        );
        let derivative = Self::float_add(normal_cdf::<Self>(x.clone()), Self::float_mul(x, pdf));
        Self::float_mul(dy, derivative)
    }

    /// `seeded_dropout(gelu_exact(x + bias))`, the feed-forward's activation
    /// and its dropout (and the bias of the dense layer before it, one value
    /// per column of `x`'s last axis): one kernel and one pass on the CubeCL
    /// backends, where the ops write and read the layer's widest activation
    /// once more each (~0.55 ms per ASV-level layer forward and backward on
    /// an H100 at the reference's batch, and the bias's own pass ~0.45 ms).
    /// Under autodiff the node keeps only `x` (and the bias); its backward is
    /// [`GeluOps::gelu_exact_dropout_backward`]. The default is the
    /// ops.
    ///
    /// # Panics
    /// When [`DropoutOps::has_seeded_dropout`] is false.
    ///
    /// # Shapes
    /// - x: `[..., F]`, bias: `[F]` → output: x's shape
    fn gelu_exact_dropout(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        Self::seeded_dropout(Self::gelu_exact(add_row_bias::<Self>(x, bias)), dropout)
    }

    /// The input gradient of [`GeluOps::gelu_exact_dropout`] at
    /// `x + bias`: `gelu_exact_backward(x + bias, seeded_dropout(dy))`, the
    /// mask drawn again. (The bias's gradient is this summed over the rows.)
    fn gelu_exact_dropout_backward(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        Self::gelu_exact_backward(
            add_row_bias::<Self>(x, bias),
            Self::seeded_dropout(dy, dropout),
        )
    }

    /// `(gelu_exact_dropout_backward(x, bias, dy), its sum over the rows)`:
    /// the input gradient and the bias's (`dy` and `x` `[..., F]`, the sum
    /// `[F]`). One pass on the CubeCL backends, where the sum read the
    /// gradient back in a pass of its own; the default is the two ops.
    fn gelu_exact_dropout_backward_column_sum(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let dx = Self::gelu_exact_dropout_backward(x, bias, dy, dropout);
        let sum = column_sum_last::<Self>(dx.clone());
        (dx, sum)
    }

    /// `dense(gelu_exact_dropout(h, h_bias, dropout), weight, bias)`: a
    /// feed-forward layer's second half, and with `h_bias` the first
    /// layer's bias (so that `h` is the first layer's product without it,
    /// and no pass adds it). Under autodiff one node that keeps `h` and not
    /// the activation: its backward recomputes `gelu_exact_dropout(h)` (one
    /// element-wise pass) for the weight gradient. So a layer keeps one
    /// `[M, F]` activation where it kept two (`F = 4·D`: on the reference's
    /// batch 619 MB per ASV-level layer, a quarter of what a layer keeps for
    /// its backward). The default is the ops.
    ///
    /// # Panics
    /// When [`DropoutOps::has_seeded_dropout`] is false.
    ///
    /// # Shapes
    /// - h: `[M, F]`, h_bias: `[F]`, weight: `[N, F]`, bias: `[N]`
    /// - output: `[M, N]`
    fn gelu_dropout_dense(
        h: FloatTensor<Self>,
        h_bias: Option<FloatTensor<Self>>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        Self::dense(Self::gelu_exact_dropout(h, h_bias, dropout), weight, bias)
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

/// `dropout(gelu(x + bias))` with the exact (erf) GELU (`bias` per column
/// of the last axis, where given): one op where the backend has the seeded
/// dropout kernel ([`GeluOps::gelu_exact_dropout`]; the same mask
/// as [`dropout`](crate::dropout()) with the same seed), else the ops.
pub fn gelu_dropout<B: GeluOps, const D: usize>(
    x: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
    dropout: AttentionDropout,
) -> Tensor<B, D> {
    if seeded_dropout_runs::<B>() {
        return Tensor::from_primitive(TensorPrimitive::Float(B::gelu_exact_dropout(
            x.into_primitive().tensor(),
            bias.map(|b| b.into_primitive().tensor()),
            dropout,
        )));
    }
    let x = with_row_bias(x, bias).into_primitive().tensor();
    crate::dropout(
        Tensor::from_primitive(TensorPrimitive::Float(B::gelu_exact(x))),
        dropout,
    )
}

/// `dense(gelu_dropout(h, h_bias), weight, bias)` ([`dense`],
/// [`gelu_dropout`]): where the backend has the seeded dropout kernel one
/// op whose autodiff node keeps `h` instead of the activation
/// ([`GeluOps::gelu_dropout_dense`]), else the ops.
///
/// # Shapes
/// - h: `[M, F]`, h_bias: `[F]`, weight: `[N, F]`, bias: `[N]`
/// - output: `[M, N]`
pub fn gelu_dropout_dense<B: GeluOps>(
    h: Tensor<B, 2>,
    h_bias: Option<Tensor<B, 1>>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    dropout: AttentionDropout,
) -> Tensor<B, 2> {
    if seeded_dropout_runs::<B>() {
        return Tensor::from_primitive(TensorPrimitive::Float(B::gelu_dropout_dense(
            h.into_primitive().tensor(),
            h_bias.map(|b| b.into_primitive().tensor()),
            weight.into_primitive().tensor(),
            bias.map(|b| b.into_primitive().tensor()),
            dropout,
        )));
    }
    dense(gelu_dropout(h, h_bias, dropout), weight, bias)
}
