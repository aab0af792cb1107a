//! [`PoolOps`] on the CubeCL backends: one kernel each way, which reads the
//! states once (see `mod.rs`).

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{CubeCount, CubeDim};

use super::kernel::{attention_pool_backward_rows, attention_pool_rows};
use crate::launch::empty;
use crate::{DenseOps, PoolOps};

impl<R, F, I, BT> PoolOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn attention_pool_with_stats(
        x: FloatTensor<Self>,
        query: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [x, query, valid] = [x, query, valid].map(into_contiguous);
        let [n, t, d] = pool_dims(&x, &query, &valid);
        let client = x.client.clone();
        let pooled = empty(&x, Shape::new([n, d]), x.dtype);
        let lse = empty(&x, Shape::new([n]), DType::F32);
        let (cubes, cube_dim, lanes) = pool_cubes(&client, n);
        attention_pool_rows::launch::<R>(
            &client,
            cubes,
            cube_dim,
            x.clone().into_tensor_arg(),
            query.into_tensor_arg(),
            valid.into_tensor_arg(),
            pooled.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            t as u32,
            scale as f32,
            lanes,
            POOL_PLANES,
            d.div_ceil(lanes),
            x.dtype.into(),
        );
        (pooled, lse)
    }

    fn attention_pool_backward(
        x: FloatTensor<Self>,
        query: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [x, query, valid, lse, dy] = [x, query, valid, lse, dy].map(into_contiguous);
        let [n, t, d] = pool_dims(&x, &query, &valid);
        assert_eq!(
            dy.meta.shape().dims::<2>(),
            [n, d],
            "attention pool: dy's shape"
        );
        assert_eq!(
            lse.dtype,
            DType::F32,
            "attention pool: lse must be the forward's (f32)"
        );
        let client = x.client.clone();
        let dx = empty(&x, x.meta.shape().clone(), x.dtype);
        let dquery_rows = empty(&x, Shape::new([n, d]), x.dtype);
        let (cubes, cube_dim, lanes) = pool_cubes(&client, n);
        attention_pool_backward_rows::launch::<R>(
            &client,
            cubes,
            cube_dim,
            x.clone().into_tensor_arg(),
            query.into_tensor_arg(),
            valid.into_tensor_arg(),
            lse.into_tensor_arg(),
            dy.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            dquery_rows.clone().into_tensor_arg(),
            t as u32,
            scale as f32,
            lanes,
            POOL_PLANES,
            d.div_ceil(lanes),
            x.dtype.into(),
        );
        (dx, Self::column_sum(dquery_rows))
    }
}

/// Planes a cube of attention pooling splits a row's tokens over.
const POOL_PLANES: usize = 8;

/// One cube per row for attention pooling: `(cubes, cube dim, lanes)`, the
/// lanes a plane (a power of two up to 32, as [`row_groups`]).
fn pool_cubes<R: CubeRuntime>(
    client: &cubecl::client::ComputeClient<R>,
    rows: usize,
) -> (CubeCount, CubeDim, usize) {
    let plane = client.properties().hardware.plane_size_min as usize;
    let lanes = if plane.is_power_of_two() {
        plane.min(32)
    } else {
        1
    };
    (
        cubecl::calculate_cube_count_elemwise(client, rows.max(1), CubeDim::new_1d(1)),
        CubeDim::new_2d(lanes as u32, POOL_PLANES as u32),
        lanes,
    )
}

/// `[N, T, D]` of attention pooling's operands, checked against each other.
fn pool_dims<R: CubeRuntime>(
    x: &CubeTensor<R>,
    query: &CubeTensor<R>,
    valid: &CubeTensor<R>,
) -> [usize; 3] {
    let [n, t, d] = x.meta.shape().dims::<3>();
    assert_eq!(
        query.meta.shape().num_elements(),
        d,
        "attention pool: query's width"
    );
    assert_eq!(
        valid.meta.shape().dims::<2>(),
        [n, t],
        "attention pool: valid's shape"
    );
    assert_eq!(valid.dtype, x.dtype, "attention pool: valid's type");
    assert!(t > 0, "attention pool: rows without tokens");
    [n, t, d]
}
