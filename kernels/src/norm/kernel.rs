//! The `#[cube]` kernels of LayerNorm: rows with their statistics, and the
//! backward (with the column sums of γ's and β's gradients).

use cubecl::prelude::*;

use crate::cube::sum_over_lanes;

/// LayerNorm of rows with its statistics: `y = x̂·γ (+ β)`, the normalised
/// rows `x̂ = (x − mean)·r` and `r = 1/√(var + ε)` (biased variance), in f32.
///
/// Launch: `lanes` adjacent units per row (a power of two no larger than
/// the plane, so that a row's group sits in one plane), a 1-D cube of
/// whole groups, cubes in any grid ([`CUBE_POS`] is linear). Lane `l` reads
/// elements `l, l + lanes, …` of its row, so a group's loads are adjacent
/// in memory. `x`, `y`, `normalised` `[M, D]` contiguous, `r` `[M, 1]`.
/// Without a shift `beta` is any tensor (unread).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_rows<F: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    y: &mut Tensor<F>,
    normalised: &mut Tensor<F>,
    r: &mut Tensor<F>,
    eps: f32,
    #[comptime] lanes: usize,
    #[comptime] with_beta: bool,
    #[define(F)] _dtype: StorageType,
) {
    let lane = UNIT_POS_X as usize % lanes;
    let row = CUBE_POS as usize * (CUBE_DIM_X as usize / lanes) + UNIT_POS_X as usize / lanes;
    // Rows past the end still take part in the shuffles, with nothing read.
    let in_range = row < r.len();
    let d = gamma.len();
    let base = row * d;
    let width = f32::cast_from(d);
    let mut sum = 0.0f32;
    if in_range {
        let mut i = lane;
        while i < d {
            sum += f32::cast_from(x[base + i]);
            i += lanes;
        }
    }
    let mean = sum_over_lanes(sum, lanes) / width;
    let mut squares = 0.0f32;
    if in_range {
        let mut i = lane;
        while i < d {
            let centred = f32::cast_from(x[base + i]) - mean;
            squares += centred * centred;
            i += lanes;
        }
    }
    let rs = 1.0f32 / f32::sqrt(sum_over_lanes(squares, lanes) / width + eps);
    if in_range {
        if lane == 0 {
            r[row] = F::cast_from(rs);
        }
        let mut i = lane;
        while i < d {
            let n = (f32::cast_from(x[base + i]) - mean) * rs;
            normalised[base + i] = F::cast_from(n);
            let mut out = n * f32::cast_from(gamma[i]);
            if with_beta {
                out += f32::cast_from(beta[i]);
            }
            y[base + i] = F::cast_from(out);
            i += lanes;
        }
    }
}

/// LayerNorm's input gradient per row, `dx = r·(g − mean(g) − x̂·mean(g·x̂))`
/// with `g = dy·γ` (`norm/mod.rs`), in f32, plus `dx_add` where `accumulate`
/// (the input's gradient along its other paths, which a separate pass would
/// read with `dx` and write once more).
///
/// Launch: as [`layer_norm_rows`], `lanes` units per row; `normalised`,
/// `dy`, `dx_add`, `dx` `[M, D]` contiguous, `r` `[M, 1]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_rows<F: Float>(
    normalised: &Tensor<F>,
    r: &Tensor<F>,
    gamma: &Tensor<F>,
    dy: &Tensor<F>,
    dx_add: &Tensor<F>,
    dx: &mut Tensor<F>,
    #[comptime] lanes: usize,
    #[comptime] accumulate: bool,
    #[define(F)] _dtype: StorageType,
) {
    let lane = UNIT_POS_X as usize % lanes;
    let row = CUBE_POS as usize * (CUBE_DIM_X as usize / lanes) + UNIT_POS_X as usize / lanes;
    let in_range = row < r.len();
    let d = gamma.len();
    let base = row * d;
    let width = f32::cast_from(d);
    let mut sum_g = 0.0f32;
    let mut sum_gx = 0.0f32;
    if in_range {
        let mut i = lane;
        while i < d {
            let g = f32::cast_from(dy[base + i]) * f32::cast_from(gamma[i]);
            sum_g += g;
            sum_gx += g * f32::cast_from(normalised[base + i]);
            i += lanes;
        }
    }
    let mean_g = sum_over_lanes(sum_g, lanes) / width;
    let mean_gx = sum_over_lanes(sum_gx, lanes) / width;
    if in_range {
        let rs = f32::cast_from(r[row]);
        let mut i = lane;
        while i < d {
            let g = f32::cast_from(dy[base + i]) * f32::cast_from(gamma[i]);
            let n = f32::cast_from(normalised[base + i]);
            let mut value = (g - mean_g - n * mean_gx) * rs;
            if accumulate {
                value += f32::cast_from(dx_add[base + i]);
            }
            dx[base + i] = F::cast_from(value);
            i += lanes;
        }
    }
}

/// [`layer_norm_backward_rows`] with the column sums of γ's and β's
/// gradients in the same pass: `partial[0, p, c] = Σ dy[m, c]` and
/// `partial[1, p, c] = Σ dy[m, c]·x̂[m, c]` over the rows `m` of cube `p`
/// (then [`sum_partials`]), where a separate pass ([`column_partial_sums`])
/// read `dy` and `x̂` back from memory.
///
/// Launch: cube dim 256, `lanes` units per row, so `256 / lanes` rows at a
/// time, `steps` times: cube `p` takes rows `[p·steps·g, (p+1)·steps·g)`
/// (`g = 256 / lanes`), one cube per part; `width` is D (the shared sums
/// are `2·g·D` floats). `normalised`, `dy`, `dx_add`, `dx` `[M, D]`
/// contiguous, `r` `[M, 1]`, `partial` `[2, P, D]` f32; `dx_add` is added
/// to `dx` where `accumulate`, as in [`layer_norm_backward_rows`].
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_rows_sums<F: Float>(
    normalised: &Tensor<F>,
    r: &Tensor<F>,
    gamma: &Tensor<F>,
    dy: &Tensor<F>,
    dx_add: &Tensor<F>,
    dx: &mut Tensor<F>,
    partial: &mut Tensor<f32>,
    steps: u32,
    #[comptime] lanes: usize,
    #[comptime] width: usize,
    #[comptime] accumulate: bool,
    #[define(F)] _dtype: StorageType,
) {
    let groups = comptime!(256 / lanes);
    let per_lane = comptime!(width.div_ceil(lanes));
    let lane = UNIT_POS_X as usize % lanes;
    let slot = UNIT_POS_X as usize / lanes;
    let rows = r.len();
    let parts = CUBE_COUNT as usize;
    let d = comptime!(width);
    let widthf = f32::cast_from(d);
    let mut sum_dy = Array::<f32>::new(per_lane);
    let mut sum_dyx = Array::<f32>::new(per_lane);
    #[unroll]
    for k in 0..per_lane {
        sum_dy[k] = 0.0;
        sum_dyx[k] = 0.0;
    }
    for step in 0..steps as usize {
        let row = (CUBE_POS as usize * steps as usize + step) * groups + slot;
        let in_range = row < rows;
        let base = row * d;
        let mut sum_g = 0.0f32;
        let mut sum_gx = 0.0f32;
        if in_range {
            #[unroll]
            for k in 0..per_lane {
                let i = lane + k * lanes;
                if i < d {
                    let g = f32::cast_from(dy[base + i]) * f32::cast_from(gamma[i]);
                    sum_g += g;
                    sum_gx += g * f32::cast_from(normalised[base + i]);
                }
            }
        }
        let mean_g = sum_over_lanes(sum_g, lanes) / widthf;
        let mean_gx = sum_over_lanes(sum_gx, lanes) / widthf;
        if in_range {
            let rs = f32::cast_from(r[row]);
            #[unroll]
            for k in 0..per_lane {
                let i = lane + k * lanes;
                if i < d {
                    let dyv = f32::cast_from(dy[base + i]);
                    let n = f32::cast_from(normalised[base + i]);
                    let g = dyv * f32::cast_from(gamma[i]);
                    let mut value = (g - mean_g - n * mean_gx) * rs;
                    if accumulate {
                        value += f32::cast_from(dx_add[base + i]);
                    }
                    dx[base + i] = F::cast_from(value);
                    sum_dy[k] += dyv;
                    sum_dyx[k] += dyv * n;
                }
            }
        }
    }
    let mut shared = SharedMemory::<f32>::new(comptime!(2 * groups * width));
    #[unroll]
    for k in 0..per_lane {
        let i = lane + k * lanes;
        if i < d {
            shared[slot * d + i] = sum_dy[k];
            shared[(groups + slot) * d + i] = sum_dyx[k];
        }
    }
    sync_cube();
    let mut c = UNIT_POS_X as usize;
    while c < d {
        let mut total = 0.0f32;
        let mut total_x = 0.0f32;
        for g in 0..groups {
            total += shared[g * d + c];
            total_x += shared[(groups + g) * d + c];
        }
        partial[CUBE_POS as usize * d + c] = total;
        partial[(parts + CUBE_POS as usize) * d + c] = total_x;
        c += CUBE_DIM_X as usize;
    }
}
