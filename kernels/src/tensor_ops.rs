//! Tensor-op helpers the ops' defaults share.

use burn::prelude::*;
use burn::tensor::ops::FloatTensor;

use crate::DenseOps;

/// `x + bias` with `bias [W]` broadcast over the rows of `x [..., W]`; `x`
/// itself where there is no bias.
pub fn with_row_bias<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    match bias {
        Some(bias) => x + bias.unsqueeze(),
        None => x,
    }
}

/// `t [..., W]` summed over everything but its last axis, `[W]`: a
/// per-column bias's gradient ([`DenseOps::column_sum`]).
pub(crate) fn column_sum_last<B: DenseOps>(t: FloatTensor<B>) -> FloatTensor<B> {
    B::column_sum(as_rows::<B>(t))
}

/// `t [..., W]` as rows of its last axis, `[M, W]` (a reshape of the
/// tensor itself: under autodiff, of the inner tensor, recorded by no node).
pub(crate) fn as_rows<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    let shape = t.shape();
    let width = shape[shape.num_dims() - 1];
    let rows = shape.num_elements() / width.max(1);
    B::float_reshape(t, Shape::new([rows, width]))
}

/// `x + bias` with `bias [W]` broadcast over `x`'s rows (`x [..., W]`); `x`
/// itself where there is no bias.
pub(crate) fn add_row_bias<B: Backend>(
    x: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    let Some(bias) = bias else {
        return x;
    };
    let rank = x.shape().num_dims();
    let mut dims = vec![1; rank];
    dims[rank - 1] = bias.shape()[0];
    B::float_add(x, B::float_reshape(bias, Shape::from(dims)))
}
