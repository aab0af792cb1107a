//! [`LayerNormOps`] on the CubeCL backends: a group of lanes per row,
//! forward and backward one kernel each (`kernel.rs`), the backward with γ's
//! and β's gradient sums in the same pass.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::CubeCount;

use super::kernel::{layer_norm_backward_rows, layer_norm_backward_rows_sums, layer_norm_rows};
use crate::dense::cube::{column_sums, sum_partials_launch};
use crate::launch::{empty, row_groups};
use crate::LayerNormOps;

impl<R, F, I, BT> LayerNormOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn layer_norm_with_stats(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let x = into_contiguous(x);
        let gamma = into_contiguous(gamma);
        let beta = beta.map(into_contiguous);
        let dims = x.meta.shape().clone();
        let [rows, width] = [dims[0], dims[1]];
        assert_eq!(
            gamma.meta.shape().num_elements(),
            width,
            "layer norm: γ's width"
        );
        let client = x.client.clone();
        let (y, normalised, r) = (
            empty(&x, dims.clone(), x.dtype),
            empty(&x, dims.clone(), x.dtype),
            empty(&x, Shape::new([rows, 1]), x.dtype),
        );
        let (cubes, cube_dim, lanes) = row_groups(&client, rows);
        let with_beta = beta.is_some();
        layer_norm_rows::launch::<R>(
            &client,
            cubes,
            cube_dim,
            x.clone().into_tensor_arg(),
            gamma.clone().into_tensor_arg(),
            beta.unwrap_or(gamma).into_tensor_arg(),
            y.clone().into_tensor_arg(),
            normalised.clone().into_tensor_arg(),
            r.clone().into_tensor_arg(),
            eps as f32,
            lanes,
            with_beta,
            x.dtype.into(),
        );
        (y, normalised, r)
    }

    fn layer_norm_backward(
        normalised: FloatTensor<Self>,
        r: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        dx_add: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let [normalised, r, gamma, dy] = [normalised, r, gamma, dy].map(into_contiguous);
        // Without a gradient to add, the kernels are compiled without the
        // read (`accumulate`), and `dy` stands in for the unused argument.
        let accumulate = dx_add.is_some();
        let dx_add = dx_add.map(into_contiguous).unwrap_or_else(|| dy.clone());
        let dims = dy.meta.shape().clone();
        let rows = dims[0];
        let client = dy.client.clone();
        let dx = empty(&dy, dims.clone(), dy.dtype);
        let (cubes, cube_dim, lanes) = row_groups(&client, rows);
        let width = dims[1];
        let groups = 256 / lanes;
        // γ's and β's gradients summed in the same pass where the cube's
        // shared sums fit 32 KiB (D ≤ 512 at 32 lanes a row).
        if 2 * groups * width * 4 <= 32 * 1024 && rows > 0 {
            let steps = rows.div_ceil(groups * LAYER_NORM_MAX_PARTS).max(1);
            let parts = rows.div_ceil(groups * steps);
            let partial = empty(&dy, Shape::new([2, parts, width]), DType::F32);
            layer_norm_backward_rows_sums::launch::<R>(
                &client,
                CubeCount::Static(parts as u32, 1, 1),
                cube_dim,
                normalised.into_tensor_arg(),
                r.into_tensor_arg(),
                gamma.into_tensor_arg(),
                dy.clone().into_tensor_arg(),
                dx_add.into_tensor_arg(),
                dx.clone().into_tensor_arg(),
                partial.clone().into_tensor_arg(),
                steps as u32,
                lanes,
                width,
                accumulate,
                dy.dtype.into(),
            );
            let (dbeta, dgamma) = sum_partials_launch(&dy, partial, parts, width, true);
            return (dx, dgamma.expect("Σ dy·x̂ was asked for"), dbeta);
        }
        layer_norm_backward_rows::launch::<R>(
            &client,
            cubes,
            cube_dim,
            normalised.clone().into_tensor_arg(),
            r.into_tensor_arg(),
            gamma.into_tensor_arg(),
            dy.clone().into_tensor_arg(),
            dx_add.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            lanes,
            accumulate,
            dy.dtype.into(),
        );
        let (dbeta, dgamma) = column_sums::<R>(&dy, Some(&normalised));
        (dx, dgamma.expect("Σ dy·x̂ was asked for"), dbeta)
    }
}

/// At most this many parts (cubes) in [`layer_norm_backward_rows_sums`]:
/// each cube then takes a whole number of row groups, `steps` at a time,
/// and the sum over parts stays short (the reference's batch: 302,000 ASV
/// tokens, 8 rows a group, 37 steps, 1,021 parts).
const LAYER_NORM_MAX_PARTS: usize = 1024;
