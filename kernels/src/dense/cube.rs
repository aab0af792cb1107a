//! [`DenseOps`] on the CubeCL backends: the dense layers' products on the
//! validated matmul kernels (`crate::matmul`), and the sums over rows in
//! parts as kernels (`kernel.rs`), which the other ops' bias gradients use
//! too ([`column_sums`], [`gradient_column_sums`]).

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{CubeCount, CubeDim};

use super::kernel::{
    column_partial_sums, gradient_column_partials, sum_partials, SUM_PARTIALS_COLUMNS,
};
use crate::launch::{dropout_args, dropout_elements_count, empty, one_unit_each, row_bias};
use crate::{AttentionDropout, DenseOps};

impl<R, F, I, BT> DenseOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn dense_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::matmul::dense_matmul(a, b)
    }

    fn column_sum(t: FloatTensor<Self>) -> FloatTensor<Self> {
        column_sums::<R>(&into_contiguous(t), None).0
    }
}

/// Rows per part of [`column_sums`]: short parts make many units (a real-sized
/// batch's 62,967 ASV-level rows × 128 columns give ~31,000), and
/// [`sum_partials`] splits each column's parts (~250 there, ~1,200 at the
/// reference's 302,000 rows) over lanes.
const COLUMN_ROWS_PER_PART: usize = 256;

/// Units that share a column's parts in [`sum_partials`] (256 a cube, the
/// most every runtime allows).
const SUM_PARTIAL_LANES: usize = 32;

/// `(Σ_m a[m, c], Σ_m a[m, c]·b[m, c])` (the second only with `b`) over the
/// rows of contiguous `[M, N]` tensors: partial sums over parts of rows,
/// then their sums, in f32 (two launches for both, one op for the host).
pub(crate) fn column_sums<R: CubeRuntime>(
    a: &CubeTensor<R>,
    b: Option<&CubeTensor<R>>,
) -> (CubeTensor<R>, Option<CubeTensor<R>>) {
    let dims = a.meta.shape();
    let [rows, columns] = [dims[0], dims[1]];
    let parts = rows.div_ceil(COLUMN_ROWS_PER_PART);
    let client = a.client.clone();
    let sums = if b.is_some() { 2 } else { 1 };
    let partial = empty(a, Shape::new([sums, parts.max(1), columns]), DType::F32);
    let (cubes, cube_dim) = one_unit_each(&client, (parts * columns).max(1), 256);
    column_partial_sums::launch::<R>(
        &client,
        cubes,
        cube_dim,
        a.clone().into_tensor_arg(),
        b.unwrap_or(a).clone().into_tensor_arg(),
        partial.clone().into_tensor_arg(),
        columns as u32,
        COLUMN_ROWS_PER_PART as u32,
        b.is_some(),
        a.dtype.into(),
    );
    sum_partials_launch(a, partial, parts, columns, b.is_some())
}

/// [`sum_partials`] over `partial` `[1 or 2, parts, columns]` f32: the
/// column sums (of `like`'s type), and the second ones with `with_b`.
pub(crate) fn sum_partials_launch<R: CubeRuntime>(
    like: &CubeTensor<R>,
    partial: CubeTensor<R>,
    parts: usize,
    columns: usize,
    with_b: bool,
) -> (CubeTensor<R>, Option<CubeTensor<R>>) {
    let column = || empty(like, Shape::new([columns]), like.dtype);
    let sum = column();
    let sum_ab = with_b.then(column);
    sum_partials::launch::<R>(
        &like.client,
        CubeCount::Static(columns.div_ceil(SUM_PARTIALS_COLUMNS) as u32, 1, 1),
        CubeDim::new_2d(SUM_PARTIALS_COLUMNS as u32, SUM_PARTIAL_LANES as u32),
        partial.into_tensor_arg(),
        sum.clone().into_tensor_arg(),
        sum_ab.as_ref().unwrap_or(&sum).clone().into_tensor_arg(),
        parts as u32,
        SUM_PARTIAL_LANES,
        with_b,
        like.dtype.into(),
    );
    (sum, sum_ab)
}

/// [`gradient_column_partials`] and [`sum_partials`]: `(dx, Σ_rows dx)`
/// for `dx = dy` through `dropout`'s mask and, with `gelu = Some((x,
/// bias))`, exact GELU's derivative at `x + bias`. `dy` (and `x`) `[..., N]`,
/// viewed as rows of `N`.
pub(crate) fn gradient_column_sums<R: CubeRuntime>(
    gelu: Option<(CubeTensor<R>, Option<CubeTensor<R>>)>,
    dy: CubeTensor<R>,
    dropout: AttentionDropout,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (use_dropout, threshold, scale, seed) = dropout_args(dropout);
    let dy = into_contiguous(dy);
    let shape = dy.meta.shape().clone();
    let columns = shape[shape.num_dims() - 1];
    let rows = dropout_elements_count(&shape) / columns.max(1);
    let (x, bias) = match gelu {
        Some((x, bias)) => {
            let x = into_contiguous(x);
            assert_eq!(
                x.meta.shape(),
                &shape,
                "GELU gradient: x and dy differ in shape"
            );
            let bias = bias.map(|b| row_bias(&x, b, "GELU gradient"));
            (Some(x), bias)
        }
        None => (None, None),
    };
    let client = dy.client.clone();
    let dx = empty(&dy, shape, dy.dtype);
    // Four columns a unit where they divide a row, in parts a quarter as
    // long: as many units as one column a unit over parts of
    // `COLUMN_ROWS_PER_PART` rows, each load 16 bytes.
    let width = if columns.is_multiple_of(4) { 4 } else { 1 };
    let rows_per_part = COLUMN_ROWS_PER_PART / width;
    let parts = rows.div_ceil(rows_per_part).max(1);
    let partial = empty(&dy, Shape::new([1, parts, columns]), DType::F32);
    let vectors = columns / width;
    let (cubes, cube_dim) = one_unit_each(&client, (parts * vectors).max(1), 256);
    let x_arg = x.as_ref().unwrap_or(&dy);
    gradient_column_partials::launch::<R>(
        &client,
        cubes,
        cube_dim,
        width,
        x_arg.clone().into_tensor_arg(),
        bias.as_ref().unwrap_or(x_arg).clone().into_tensor_arg(),
        dy.clone().into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        partial.clone().into_tensor_arg(),
        vectors as u32,
        rows_per_part as u32,
        threshold,
        scale,
        seed,
        x.is_some(),
        use_dropout,
        bias.is_some(),
        dy.dtype.into(),
    );
    (
        dx,
        sum_partials_launch(&dy, partial, parts, columns, false).0,
    )
}
