//! Host-side helpers that the CubeCL launches of several ops share.

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::{CubeCount, CubeDim};

use crate::AttentionDropout;

/// Dropout as the kernels take it: `(use, threshold = p·2³², 1/(1−p), seed)`.
pub(crate) fn dropout_args(dropout: AttentionDropout) -> (bool, u32, f32, u32) {
    let p = dropout.prob.clamp(0.0, 1.0);
    if p <= 0.0 {
        return (false, 0, 1.0, 0);
    }
    let threshold = (p * 4_294_967_296.0).min(u32::MAX as f64) as u32;
    let scale = if p < 1.0 {
        (1.0 / (1.0 - p)) as f32
    } else {
        0.0
    };
    (true, threshold, scale, dropout.seed)
}

/// An element offset as the kernels take it.
pub(crate) fn element_offset(offset: usize) -> u32 {
    u32::try_from(offset).expect("fused attention: an operand offset past 2^32 elements")
}

/// Cubes of `cube` units covering `units` units, one unit per element or row
/// (the launch of every element-wise and per-row kernel here).
pub(crate) fn one_unit_each<R: CubeRuntime>(
    client: &cubecl::client::ComputeClient<R>,
    units: usize,
    cube: u32,
) -> (CubeCount, CubeDim) {
    let cube_dim = CubeDim::new_1d(cube);
    (
        cubecl::calculate_cube_count_elemwise(client, units, cube_dim),
        cube_dim,
    )
}

/// A new contiguous tensor on `like`'s device.
pub(crate) fn empty<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: Shape,
    dtype: DType,
) -> CubeTensor<R> {
    empty_device_contiguous_dtype::<R>(like.client.clone(), like.device.clone(), shape, dtype)
}

/// `bias` (made contiguous) checked against `x`: one value per column of
/// `x`'s last axis, of `x`'s type.
pub(crate) fn row_bias<R: CubeRuntime>(
    x: &CubeTensor<R>,
    bias: CubeTensor<R>,
    op: &str,
) -> CubeTensor<R> {
    let columns = x.meta.shape()[x.meta.shape().num_dims() - 1];
    assert_eq!(
        bias.meta.shape().as_slice(),
        &[columns],
        "{op}: the bias must have one value per column ({columns})"
    );
    assert_eq!(
        bias.dtype, x.dtype,
        "{op}: the bias's type differs from x's"
    );
    into_contiguous(bias)
}

/// The launch of an element-wise kernel ([`dropout_elements`],
/// [`gelu_elements`]) over `elements` contiguous ones: `(cubes, cube_dim,
/// width)`, each unit taking `width` elements, 4 where they divide (and,
/// with a per-column `bias`, where they divide a row, so that a unit's
/// elements share a row).
pub(crate) fn elementwise_launch<R: CubeRuntime>(
    client: &cubecl::client::ComputeClient<R>,
    elements: usize,
    bias: Option<&CubeTensor<R>>,
) -> (CubeCount, CubeDim, usize) {
    let divides = |n: usize| n.is_multiple_of(4);
    let width = if divides(elements) && bias.is_none_or(|b| divides(b.meta.shape()[0])) {
        4
    } else {
        1
    };
    let (cubes, cube_dim) = one_unit_each(client, elements / width, 256);
    (cubes, cube_dim, width)
}

/// The launch of a row kernel with a group of adjacent lanes per row
/// ([`layer_norm_rows`]): `(cubes, cube_dim, lanes)`. Lanes are the
/// device's smallest plane, at most 32 (one per row where planes are
/// unknown), so that a row's shuffles stay in one plane and its loads are
/// adjacent; 256 units a cube.
pub(crate) fn row_groups<R: CubeRuntime>(
    client: &cubecl::client::ComputeClient<R>,
    rows: usize,
) -> (CubeCount, CubeDim, usize) {
    let plane = client.properties().hardware.plane_size_min as usize;
    let lanes = if plane.is_power_of_two() {
        plane.min(32)
    } else {
        1
    };
    let cube_dim = CubeDim::new_1d(256);
    let cubes = rows.div_ceil(256 / lanes).max(1);
    (
        cubecl::calculate_cube_count_elemwise(client, cubes, CubeDim::new_1d(1)),
        cube_dim,
        lanes,
    )
}

/// The elements of a tensor whose dropout mask is hashed from the element
/// index (a u32 in the kernels).
pub(crate) fn dropout_elements_count(shape: &Shape) -> usize {
    let elements = shape.num_elements();
    assert!(
        elements <= u32::MAX as usize,
        "dropout: {elements} elements exceed the kernel's u32 index"
    );
    elements
}
