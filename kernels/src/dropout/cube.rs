//! [`DropoutOps`] on the CubeCL backends: one element-wise kernel
//! (`kernel.rs`) for the dropout, for its gradient (with a bias's column
//! sums, `crate::dense`), and for a residual branch.

use burn::tensor::ops::FloatTensor;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::kernel::dropout_elements;
use crate::dense::cube::gradient_column_sums;
use crate::launch::{dropout_args, dropout_elements_count, elementwise_launch, empty, row_bias};
use crate::{AttentionDropout, DropoutOps};

impl<R, F, I, BT> DropoutOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn has_seeded_dropout() -> bool {
        true
    }

    fn seeded_dropout(x: FloatTensor<Self>, dropout: AttentionDropout) -> FloatTensor<Self> {
        let (use_dropout, ..) = dropout_args(dropout);
        if !use_dropout {
            return x;
        }
        seeded_dropout_launch(into_contiguous(x), None, None, dropout)
    }

    fn seeded_dropout_add(
        residual: FloatTensor<Self>,
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        let [residual, x] = [residual, x].map(into_contiguous);
        assert_eq!(
            residual.meta.shape(),
            x.meta.shape(),
            "seeded_dropout_add: shapes differ"
        );
        assert_eq!(residual.dtype, x.dtype, "seeded_dropout_add: types differ");
        // p = 0 runs the same kernel: its mask then keeps every element at
        // scale 1 (`dropout_args`), and the bias and residual still join in
        // one pass.
        seeded_dropout_launch(x, Some(residual), bias, dropout)
    }

    fn seeded_dropout_column_sum(
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        gradient_column_sums(None, dy, dropout)
    }
}

/// One launch of [`dropout_elements`]: the seeded dropout of contiguous `x`
/// (shifted by a per-column `bias` where given), plus contiguous `residual`
/// where given.
fn seeded_dropout_launch<R: CubeRuntime>(
    x: CubeTensor<R>,
    residual: Option<CubeTensor<R>>,
    bias: Option<CubeTensor<R>>,
    dropout: AttentionDropout,
) -> CubeTensor<R> {
    let (_, threshold, scale, seed) = dropout_args(dropout);
    let bias = bias.map(|b| row_bias(&x, b, "seeded dropout"));
    let shape = x.meta.shape().clone();
    let elements = dropout_elements_count(&shape);
    let client = x.client.clone();
    let out = empty(&x, shape, x.dtype);
    let (cubes, cube_dim, width) = elementwise_launch(&client, elements, bias.as_ref());
    dropout_elements::launch::<R>(
        &client,
        cubes,
        cube_dim,
        width,
        x.clone().into_tensor_arg(),
        residual.as_ref().unwrap_or(&x).clone().into_tensor_arg(),
        bias.as_ref().unwrap_or(&x).clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        threshold,
        scale,
        seed,
        residual.is_some(),
        bias.is_some(),
        x.dtype.into(),
    );
    out
}
