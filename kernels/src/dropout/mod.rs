//! Dropout whose mask is a hash of `(seed, element index)` ([`DropoutOps`]):
//! the backward draws the same mask again, so autodiff keeps none; alone, or
//! with a bias and a residual added in the same pass ([`dropout_add`]).
//! Backends without the kernel run Burn's Bernoulli dropout ([`dropout`]).

use burn::prelude::*;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorPrimitive;

use crate::{add_row_bias, column_sum_last, with_row_bias, AttentionDropout, DenseOps};

mod autodiff;
#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "fusion")]
mod fusion;
#[cfg(feature = "cubecl")]
mod kernel;

/// Dropout whose mask is a hash of a seed and the element index.
pub trait DropoutOps: DenseOps {
    /// Whether [`DropoutOps::seeded_dropout`] runs a kernel here.
    fn has_seeded_dropout() -> bool {
        false
    }

    /// Dropout whose mask is a hash of `(seed, element index)`: element `i`
    /// of the contiguous tensor is kept, scaled by `1/(1−p)`, where the hash
    /// is at least `p·2³²`. The same seed gives the same mask, so the backward
    /// pass is this op again on the output gradient, and `Autodiff<B>` keeps
    /// no mask (Burn's `Dropout` keeps its f32 mask for the backward pass: on
    /// a real-sized batch ~190 MiB per ASV-level layer).
    ///
    /// # Panics
    /// When [`DropoutOps::has_seeded_dropout`] is false.
    fn seeded_dropout(x: FloatTensor<Self>, dropout: AttentionDropout) -> FloatTensor<Self> {
        let _ = (x, dropout);
        panic!("this backend has no seeded dropout kernel; use aam_kernels::dropout")
    }

    /// `(seeded_dropout(dy), its sum over the rows)` (`dy [..., N]`, the sum
    /// `[N]`): the gradients of `x` and of the bias of
    /// [`DropoutOps::seeded_dropout_add`]. One pass on the CubeCL
    /// backends; the default is the two ops.
    ///
    /// # Panics
    /// When [`DropoutOps::has_seeded_dropout`] is false.
    fn seeded_dropout_column_sum(
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let dx = Self::seeded_dropout(dy, dropout);
        let sum = column_sum_last::<Self>(dx.clone());
        (dx, sum)
    }

    /// `residual + seeded_dropout(x + bias)` (residual and x of the same
    /// shape and type, bias one value per column of their last axis): a
    /// transformer layer's residual branch, with the bias of the dense layer
    /// that made `x`, as one op and one pass (CubeCL backends), where the
    /// bias, the dropout and the add are a pass each. Under autodiff the
    /// residual's gradient is the output's, `x`'s the seeded dropout of it,
    /// and the bias's that summed over the rows. The default is the ops.
    ///
    /// # Panics
    /// When [`DropoutOps::has_seeded_dropout`] is false.
    fn seeded_dropout_add(
        residual: FloatTensor<Self>,
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        Self::float_add(
            residual,
            Self::seeded_dropout(add_row_bias::<Self>(x, bias), dropout),
        )
    }
}

/// Dropout with probability `dropout.prob` (the caller decides whether it
/// is training). Where the backend has the kernel
/// ([`DropoutOps::has_seeded_dropout`]: the CubeCL backends) the mask
/// is a hash of `(dropout.seed, element index)` and autodiff keeps none;
/// elsewhere it is Burn's `Dropout` (a Bernoulli mask from the backend's
/// RNG, `seed` unused).
pub fn dropout<B: DropoutOps, const D: usize>(
    x: Tensor<B, D>,
    dropout: AttentionDropout,
) -> Tensor<B, D> {
    if dropout.prob <= 0.0 {
        return x;
    }
    if B::has_seeded_dropout() {
        return Tensor::from_primitive(TensorPrimitive::Float(B::seeded_dropout(
            x.into_primitive().tensor(),
            dropout,
        )));
    }
    let keep = 1.0 - dropout.prob;
    let mask = x.random_like(burn::tensor::Distribution::Bernoulli(keep));
    x * mask * (1.0 / keep)
}

/// `residual + dropout(x + bias)` ([`dropout`]; `bias` per column of the
/// last axis, where given), one op where the backend has the seeded kernel
/// ([`DropoutOps::seeded_dropout_add`]), else the ops.
///
/// # Shapes
/// - residual, x: the same shape, bias: `[x's last axis]` → output: x's shape
pub fn dropout_add<B: DropoutOps, const D: usize>(
    residual: Tensor<B, D>,
    x: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
    dropout: AttentionDropout,
) -> Tensor<B, D> {
    assert_eq!(residual.dims(), x.dims(), "dropout_add: shapes differ");
    if seeded_dropout_runs::<B>() {
        return Tensor::from_primitive(TensorPrimitive::Float(B::seeded_dropout_add(
            residual.into_primitive().tensor(),
            x.into_primitive().tensor(),
            bias.map(|b| b.into_primitive().tensor()),
            dropout,
        )));
    }
    residual + crate::dropout(with_row_bias(x, bias), dropout)
}

/// Whether [`dropout_add`] and [`gelu_dropout`](crate::gelu_dropout) run as one op, the seeded
/// kernel's: where the backend has it,
/// and for `dropout_add` also at p = 0, where it still adds the bias and
/// the residual in one pass.
///
/// A caller that moves a dense layer's bias into them (as the transformer
/// layer does) saves that bias's own pass exactly where this holds.
pub fn seeded_dropout_runs<B: DropoutOps>() -> bool {
    B::has_seeded_dropout()
}
