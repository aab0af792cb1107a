//! [`GeluOps`] on the CubeCL backends: one element-wise kernel each way
//! (`kernel.rs`), with the bias, the dropout mask and the bias's gradient
//! sum in the same pass.

use burn::tensor::ops::FloatTensor;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::kernel::{gelu_backward_elements, gelu_elements};
use crate::dense::cube::gradient_column_sums;
use crate::launch::{dropout_args, dropout_elements_count, elementwise_launch, empty, row_bias};
use crate::{AttentionDropout, GeluOps};

impl<R, F, I, BT> GeluOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn gelu_exact(x: FloatTensor<Self>) -> FloatTensor<Self> {
        gelu_launch(x, None, AttentionDropout::NONE)
    }

    fn gelu_exact_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        gelu_backward_launch(x, None, dy, AttentionDropout::NONE)
    }

    fn gelu_exact_dropout(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        gelu_launch(x, bias, dropout)
    }

    fn gelu_exact_dropout_backward(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        gelu_backward_launch(x, bias, dy, dropout)
    }

    fn gelu_exact_dropout_backward_column_sum(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        gradient_column_sums(Some((x, bias)), dy, dropout)
    }
}

/// [`gelu_elements`] on `x` (made contiguous), shifted by a per-column
/// `bias` where given, with the seeded dropout of its output when
/// `dropout.prob > 0`.
fn gelu_launch<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    dropout: AttentionDropout,
) -> CubeTensor<R> {
    let (use_dropout, threshold, scale, seed) = dropout_args(dropout);
    let x = into_contiguous(x);
    let bias = bias.map(|b| row_bias(&x, b, "gelu"));
    let shape = x.meta.shape().clone();
    let elements = dropout_elements_count(&shape);
    let client = x.client.clone();
    let y = empty(&x, shape, x.dtype);
    let (cubes, cube_dim, width) = elementwise_launch(&client, elements, bias.as_ref());
    gelu_elements::launch::<R>(
        &client,
        cubes,
        cube_dim,
        width,
        x.clone().into_tensor_arg(),
        bias.as_ref().unwrap_or(&x).clone().into_tensor_arg(),
        y.clone().into_tensor_arg(),
        threshold,
        scale,
        seed,
        use_dropout,
        bias.is_some(),
        x.dtype.into(),
    );
    y
}

/// [`gelu_backward_elements`]: `x`'s gradient from `dy`, at `x` shifted by
/// `bias` where given, through [`gelu_launch`]'s dropout mask when
/// `dropout.prob > 0`.
fn gelu_backward_launch<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    dy: CubeTensor<R>,
    dropout: AttentionDropout,
) -> CubeTensor<R> {
    let (use_dropout, threshold, scale, seed) = dropout_args(dropout);
    let [x, dy] = [x, dy].map(into_contiguous);
    let bias = bias.map(|b| row_bias(&x, b, "gelu backward"));
    let shape = dy.meta.shape().clone();
    let elements = dropout_elements_count(&shape);
    let client = dy.client.clone();
    let dx = empty(&dy, shape, dy.dtype);
    let (cubes, cube_dim, width) = elementwise_launch(&client, elements, bias.as_ref());
    gelu_backward_elements::launch::<R>(
        &client,
        cubes,
        cube_dim,
        width,
        x.clone().into_tensor_arg(),
        bias.as_ref().unwrap_or(&x).clone().into_tensor_arg(),
        dy.clone().into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        threshold,
        scale,
        seed,
        use_dropout,
        bias.is_some(),
        dy.dtype.into(),
    );
    dx
}
