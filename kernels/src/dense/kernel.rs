//! The `#[cube]` kernels of the sums over rows: column sums in parts, an
//! element-wise gradient with its column sums in one pass, and the sum over
//! the parts.

use cubecl::prelude::*;

use crate::cube::element_keep;

/// Column sums of `[M, N]` rows in parts: `partial[0, p, c] = Σ a[m, c]`
/// and, with `b`, `partial[1, p, c] = Σ a[m, c]·b[m, c]`, over rows `m` of
/// part `p` (`rows_per_part` rows each, the last part may be short), in f32.
/// Many parts keep the GPU busy where one sum per column would give each
/// column to one unit (`dense/mod.rs`).
///
/// Launch: one unit per `(part, column)`, index `p·N + c`; `partial`
/// `[1 or 2, P, N]` f32.
#[cube(launch)]
pub fn column_partial_sums<F: Float>(
    a: &Tensor<F>,
    b: &Tensor<F>,
    partial: &mut Tensor<f32>,
    columns: u32,
    rows_per_part: u32,
    #[comptime] with_b: bool,
    #[define(F)] _dtype: StorageType,
) {
    let unit = ABSOLUTE_POS;
    let n = columns as usize;
    let rows = a.len() / n;
    let parts = rows.div_ceil(rows_per_part as usize);
    if unit < parts * n {
        let part = unit / n;
        let column = unit % n;
        let start = part * (rows_per_part as usize);
        let stop = start + (rows_per_part as usize);
        let end = select(stop < rows, stop, rows);
        let mut sum = 0.0f32;
        let mut sum_ab = 0.0f32;
        for m in start..end {
            let at = m * n + column;
            let x = f32::cast_from(a[at]);
            sum += x;
            if with_b {
                sum_ab += x * f32::cast_from(b[at]);
            }
        }
        partial[unit] = sum;
        if with_b {
            partial[parts * n + unit] = sum_ab;
        }
    }
}

/// An element-wise gradient and its column sums in one pass: `dx = dy`
/// through the seeded dropout mask (`use_dropout`) and, with `gelu`, times
/// exact GELU's derivative at `x` (shifted by its column's `bias` with
/// `with_bias`), written to `dx`, and `partial[p, c] = Σ dx[m, c]` over rows
/// `m` of part `p`, as [`column_partial_sums`] (then [`sum_partials`]).
/// The bias gradient of a dense layer whose bias was added by the
/// element-wise pass after it (dropout plus residual, GELU): the sum needs
/// no pass of its own to read `dx` back.
///
/// Launch: one unit per `(part, vector of N columns)`, index `p·(C/N) + v`
/// for `C` columns (N = 4 where C allows: one 16-byte load per tensor and
/// row); `x`, `dy`, `dx` `[M, C]` contiguous (`x` and `bias` any tensors,
/// unread, where not used), `partial` `[P, C]` f32. Element `m·C + c`'s mask
/// is [`dropout_elements`]' for the same seed.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn gradient_column_partials<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    dx: &mut Tensor<Vector<F, N>>,
    partial: &mut Tensor<Vector<f32, N>>,
    vectors: u32,
    rows_per_part: u32,
    threshold: u32,
    scale: f32,
    seed: u32,
    #[comptime] gelu: bool,
    #[comptime] use_dropout: bool,
    #[comptime] with_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let unit = ABSOLUTE_POS;
    let width = dy.vector_size();
    let n = vectors as usize;
    let rows = dy.len() / n;
    let parts = rows.div_ceil(rows_per_part as usize);
    if unit < parts * n {
        let part = unit / n;
        let column = unit % n;
        let start = part * (rows_per_part as usize);
        let stop = start + (rows_per_part as usize);
        let end = select(stop < rows, stop, rows);
        let mut shift = Vector::<f32, N>::new(0.0f32);
        if with_bias {
            shift = Vector::cast_from(bias[column]);
        }
        let mut sum = Vector::<f32, N>::new(0.0f32);
        for m in start..end {
            let at = m * n + column;
            let dys = dy[at];
            let mut xs = dys;
            if gelu {
                xs = x[at];
            }
            let mut out = dys;
            #[unroll]
            for c in 0..width {
                let mut g = f32::cast_from(dys[c]);
                if use_dropout {
                    let element = (at * width + c) as u32;
                    g = select(element_keep(seed, element, threshold), g * scale, 0.0f32);
                }
                if gelu {
                    let v = f32::cast_from(xs[c]) + shift[c];
                    let cdf = 0.5f32 * (1.0f32 + Erf::erf(v * 0.707_106_77f32));
                    let pdf = f32::exp(-0.5f32 * v * v) * 0.398_942_3f32;
                    g *= cdf + v * pdf;
                }
                out[c] = F::cast_from(g);
                sum[c] += g;
            }
            dx[at] = out;
        }
        partial[unit] = sum;
    }
}

/// Columns per cube of [`sum_partials`]: eight, one 32-byte sector of a
/// part's row, so that a plane reads four parts of them at once.
pub const SUM_PARTIALS_COLUMNS: usize = 8;

/// The sums over parts of [`column_partial_sums`]: `sum[c] = Σ_p
/// partial[0, p, c]` and, with `b`, `sum_ab[c] = Σ_p partial[1, p, c]`.
///
/// The parts of a column are split over `lanes` units, whose sums meet in
/// shared memory: a real batch has ~1,200 parts a column and only 128-512
/// columns, and one unit a column walking all its parts, waiting on each
/// load in turn, took 52 µs a launch on the H100 (4 ms a training step);
/// with 32 lanes, 19-21 µs in CubeCL's profiler, the most of it the
/// profiler's own cost per launch (longer parts with fewer of them gave
/// nothing back: H100, 2026-11-26).
///
/// Launch: cube dim ([`SUM_PARTIALS_COLUMNS`], `lanes`), one cube per
/// [`SUM_PARTIALS_COLUMNS`] columns; unit x is the column, unit y the lane.
#[cube(launch)]
pub fn sum_partials<F: Float>(
    partial: &Tensor<f32>,
    sum: &mut Tensor<F>,
    sum_ab: &mut Tensor<F>,
    parts: u32,
    #[comptime] lanes: usize,
    #[comptime] with_b: bool,
    #[define(F)] _dtype: StorageType,
) {
    let width = comptime!(SUM_PARTIALS_COLUMNS);
    let x = UNIT_POS_X as usize;
    let lane = UNIT_POS_Y as usize;
    let column = CUBE_POS as usize * width + x;
    let n = sum.len();
    let parts = parts as usize;
    let mut total = 0.0f32;
    let mut total_ab = 0.0f32;
    if column < n {
        let mut p = lane;
        while p < parts {
            total += partial[p * n + column];
            if with_b {
                total_ab += partial[(parts + p) * n + column];
            }
            p += lanes;
        }
    }
    let mut lane_sums = SharedMemory::<f32>::new(comptime!(2 * SUM_PARTIALS_COLUMNS * lanes));
    lane_sums[lane * width + x] = total;
    if with_b {
        lane_sums[(lanes + lane) * width + x] = total_ab;
    }
    sync_cube();
    if lane == 0 && column < n {
        let mut total = 0.0f32;
        let mut total_ab = 0.0f32;
        for l in 0..lanes {
            total += lane_sums[l * width + x];
            if with_b {
                total_ab += lane_sums[(lanes + l) * width + x];
            }
        }
        sum[column] = F::cast_from(total);
        if with_b {
            sum_ab[column] = F::cast_from(total_ab);
        }
    }
}
