//! Host-side helpers that the CubeCL launches of several ops share.

use burn::tensor::{DType, Shape};
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
