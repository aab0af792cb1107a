//! The `#[cube]` kernels of the element-wise and row ops: seeded dropout,
//! the Adam steps, LayerNorm, column sums, GELU and attention pooling.

use cubecl::prelude::*;

use crate::cube::{element_keep, sum_over_lanes};

/// Dropout of a contiguous tensor, or the gradient of one (the same mask):
/// `output[i] = input[i]·scale` where element `i` is kept, else 0; with
/// `with_bias`, `input[i]` plus its column's `bias` first (a dense layer's
/// bias added here instead of in a pass of its own); with `with_residual`,
/// plus `residual[i]` (a residual branch in one pass). An operand left out
/// is any tensor, unread.
///
/// Launch: one unit per vector of `N` elements (4 where the element count
/// allows: one 16-byte load per tensor and unit, where one float a unit
/// leaves these passes at about half of the H100's memory bandwidth), cubes from
/// `calculate_cube_count_elemwise`. Element `i·N + c`'s mask is the same
/// whatever `N`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn dropout_elements<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    residual: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    output: &mut Tensor<Vector<F, N>>,
    threshold: u32,
    scale: f32,
    seed: u32,
    #[comptime] with_residual: bool,
    #[comptime] with_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < output.len() {
        let width = input.vector_size();
        let mut xs = input[i];
        if with_bias {
            // A row is a whole number of vectors (the launch's choice of N).
            xs += bias[i % bias.len()];
        }
        let mut y = xs;
        #[unroll]
        for c in 0..width {
            let keep = element_keep(seed, (i * width + c) as u32, threshold);
            y[c] = select(keep, xs[c] * F::cast_from(scale), F::new(0.0));
        }
        if with_residual {
            y += residual[i];
        }
        output[i] = y;
    }
}

/// The Adam/AdamW steps of one or several parameters in one launch, op for
/// op as [`crate::adam_step_ops`] computes them ([`crate::AdamStep`]), each
/// parameter with its own coefficients (row `k` of `coefficients`: decay,
/// l2, β₁, 1 − β₁, β₂, 1 − β₂, √(1 − β₂ᵗ), ε, step size, each rounded to
/// `F`), its moments updated in place.
///
/// Why: one launch per parameter (~170 a step), each with three new buffers,
/// cost CubeCL's server thread a launch and three allocations each, and the
/// training step waits on that thread.
///
/// Launch: cube row `y = k` for parameter `k` (a sequence is indexed at
/// compile time: each cube takes the one branch of its row, uniformly), one
/// unit per element along x; every tensor contiguous, the moments and
/// outputs as long as their parameter.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn adam_steps_elements<F: Float>(
    params: &Sequence<Tensor<F>>,
    grads: &Sequence<Tensor<F>>,
    firsts: &mut Sequence<Tensor<F>>,
    seconds: &mut Sequence<Tensor<F>>,
    params_out: &mut Sequence<Tensor<F>>,
    coefficients: &Tensor<f32>,
    #[define(F)] _dtype: StorageType,
) {
    let item = CUBE_POS_Y as usize;
    let i = ABSOLUTE_POS_X as usize;
    let count = params.len().comptime();
    #[unroll]
    for k in 0..count {
        if item == k && i < params.index(k).len() {
            let mut p = params.index(k)[i];
            let mut g = grads.index(k)[i];
            let c = k * 9;
            let l2 = coefficients[c + 1];
            if l2 != 0.0 {
                g += p * F::cast_from(l2);
            }
            let decay = coefficients[c];
            if decay != 1.0 {
                p *= F::cast_from(decay);
            }
            let m = firsts.index(k)[i] * F::cast_from(coefficients[c + 2])
                + g * F::cast_from(coefficients[c + 3]);
            let v = seconds.index(k)[i] * F::cast_from(coefficients[c + 4])
                + g * g * F::cast_from(coefficients[c + 5]);
            let denom =
                F::sqrt(v) / F::cast_from(coefficients[c + 6]) + F::cast_from(coefficients[c + 7]);
            params_out.index_mut(k)[i] = p - m / denom * F::cast_from(coefficients[c + 8]);
            firsts.index_mut(k)[i] = m;
            seconds.index_mut(k)[i] = v;
        }
    }
}

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
/// with `g = dy·γ` (`norm.rs`), in f32, plus `dx_add` where `accumulate`
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

/// Column sums of `[M, N]` rows in parts: `partial[0, p, c] = Σ a[m, c]`
/// and, with `b`, `partial[1, p, c] = Σ a[m, c]·b[m, c]`, over rows `m` of
/// part `p` (`rows_per_part` rows each, the last part may be short), in f32.
/// Many parts keep the GPU busy where one sum per column would give each
/// column to one unit (`dense.rs`).
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

/// Exact GELU per element, `y = x·Φ(x)`, `Φ(x) = ½·(1 + erf(x/√2))`, in f32;
/// with `use_dropout`, then the seeded dropout of `y` ([`dropout_elements`]'
/// mask for the same seed): the feed-forward's activation and its dropout
/// in one pass over the layer's widest activation instead of two. With
/// `with_bias`, `x` is first shifted by its column's `bias` (in f32): the
/// preceding dense layer's bias, which then needs no pass of its own
/// (otherwise `bias` is any tensor, unread).
///
/// Launch: one unit per vector of `N` elements (see [`dropout_elements`]).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn gelu_elements<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    y: &mut Tensor<Vector<F, N>>,
    threshold: u32,
    scale: f32,
    seed: u32,
    #[comptime] use_dropout: bool,
    #[comptime] with_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < y.len() {
        let width = x.vector_size();
        let xs = x[i];
        let bs = if with_bias { bias[i % bias.len()] } else { xs };
        let mut out = xs;
        #[unroll]
        for c in 0..width {
            let mut v = f32::cast_from(xs[c]);
            if with_bias {
                v += f32::cast_from(bs[c]);
            }
            let cdf = 0.5f32 * (1.0f32 + Erf::erf(v * 0.707_106_77f32));
            let mut value = v * cdf;
            if use_dropout {
                let at = (i * width + c) as u32;
                value = select(element_keep(seed, at, threshold), value * scale, 0.0f32);
            }
            out[c] = F::cast_from(value);
        }
        y[i] = out;
    }
}

/// Exact GELU's input gradient per element, `dx = dy·(Φ(x) + x·φ(x))`,
/// `φ(x) = exp(−x²/2)/√(2π)`, in f32; with `use_dropout`, `dy` first goes
/// through the forward's dropout mask (drawn again from `seed`); with
/// `with_bias`, at `x` shifted by its column's `bias`, as
/// [`gelu_elements`].
///
/// Launch: one unit per vector of `N` elements.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn gelu_backward_elements<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    dx: &mut Tensor<Vector<F, N>>,
    threshold: u32,
    scale: f32,
    seed: u32,
    #[comptime] use_dropout: bool,
    #[comptime] with_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < dx.len() {
        let width = x.vector_size();
        let xs = x[i];
        let bs = if with_bias { bias[i % bias.len()] } else { xs };
        let dys = dy[i];
        let mut out = xs;
        #[unroll]
        for c in 0..width {
            let mut v = f32::cast_from(xs[c]);
            if with_bias {
                v += f32::cast_from(bs[c]);
            }
            let cdf = 0.5f32 * (1.0f32 + Erf::erf(v * 0.707_106_77f32));
            let pdf = f32::exp(-0.5f32 * v * v) * 0.398_942_3f32;
            let mut g = f32::cast_from(dys[c]);
            if use_dropout {
                let at = (i * width + c) as u32;
                g = select(element_keep(seed, at, threshold), g * scale, 0.0f32);
            }
            out[c] = F::cast_from(g * (cdf + v * pdf));
        }
        dx[i] = out;
    }
}

/// Attention pooling of rows (`pool.rs`): per row, the scores `x_t·q·scale`
/// of its `tokens` token states, a softmax over those `valid` marks (every
/// token at score 0 where a row has none), the weighted sum and the row's
/// log-sum-exp, in f32.
///
/// Launch: one cube per row (any grid; [`CUBE_POS`] is linear), cube dim
/// (`lanes`, `planes`). Plane `p` takes tokens `p, p + planes, …` with an
/// online softmax (running max and sum), lane `l` columns `l, l + lanes, …`
/// (`cols` of them at most); plane 0 then merges the planes' partial sums
/// through shared memory. A row's tokens are too few for one plane to keep
/// its loads in flight (151 at the ASV level), so they are spread over the
/// cube. `x` `[N, T, D]` contiguous, `query` `[D]`, `valid` `[N, T]` (1 or
/// 0), `pooled` `[N, D]`, `lse` `[N]` f32.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_pool_rows<F: Float>(
    x: &Tensor<F>,
    query: &Tensor<F>,
    valid: &Tensor<F>,
    pooled: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    tokens: u32,
    scale: f32,
    #[comptime] lanes: usize,
    #[comptime] planes: usize,
    #[comptime] cols: usize,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    // Uniform over the cube.
    if row >= lse.len() {
        terminate!();
    }
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let d = query.len();
    let t_len = tokens as usize;
    let all_padding = pool_row_is_padding::<F>(valid, row, t_len, lanes);
    let mut q = Array::<f32>::new(cols);
    let mut acc = Array::<f32>::new(cols);
    let mut xs = Array::<f32>::new(cols);
    load_columns::<F>(query, &mut q, 0, d, lanes, cols);
    #[unroll]
    for c in 0..cols {
        acc[c] = 0.0f32;
    }
    // See `attention_forward` for why the start is written 0 − 1e30.
    let mut m = 0.0f32;
    m -= 1.0e30;
    let mut l = 0.0f32;
    let mut t = plane;
    while t < t_len {
        load_columns::<F>(x, &mut xs, (row * t_len + t) * d, d, lanes, cols);
        let score = select(all_padding, 0.0f32, row_dot(&xs, &q, lanes, cols) * scale);
        let weighted = all_padding || f32::cast_from(valid[row * t_len + t]) > 0.5f32;
        if weighted {
            let m_new = f32::max(m, score);
            let correction = f32::exp(m - m_new);
            let p = f32::exp(score - m_new);
            l = l * correction + p;
            #[unroll]
            for c in 0..cols {
                acc[c] = acc[c] * correction + p * xs[c];
            }
            m = m_new;
        }
        t += planes;
    }
    // Merge the planes: rescale each plane's sums to the row's max.
    let width = comptime!(cols * lanes);
    let mut maxes = SharedMemory::<f32>::new(planes);
    let mut sums = SharedMemory::<f32>::new(planes);
    let mut parts = SharedMemory::<f32>::new(comptime!(planes * cols * lanes));
    if lane == 0 {
        maxes[plane] = m;
        sums[plane] = l;
    }
    #[unroll]
    for c in 0..cols {
        parts[plane * width + c * lanes + lane] = acc[c];
    }
    sync_cube();
    if plane == 0 {
        let mut row_max = maxes[0];
        #[unroll]
        for p in 1..planes {
            row_max = f32::max(row_max, maxes[p]);
        }
        let mut total = 0.0f32;
        #[unroll]
        for p in 0..planes {
            total += sums[p] * f32::exp(maxes[p] - row_max);
        }
        #[unroll]
        for c in 0..cols {
            let i = lane + c * lanes;
            if i < d {
                let mut sum = 0.0f32;
                #[unroll]
                for p in 0..planes {
                    sum += parts[p * width + c * lanes + lane] * f32::exp(maxes[p] - row_max);
                }
                pooled[row * d + i] = F::cast_from(sum / total);
            }
        }
        if lane == 0 {
            lse[row] = row_max + f32::ln(total);
        }
    }
}

/// The gradients of [`attention_pool_rows`] (`pool.rs`): `dx` and each
/// row's part of the query's gradient, `scale·Σ_t ds_t·x_t`, in f32. Two
/// reads of the row's states: the first sums `Σ_t w_t·g_t` (and the query
/// gradient's parts), merged over the planes through shared memory, the
/// second writes `dx`.
///
/// Launch: as [`attention_pool_rows`]; `lse` `[N]` f32 from it, `dy` `[N,
/// D]`, `dx` `[N, T, D]`, `dquery_rows` `[N, D]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_pool_backward_rows<F: Float>(
    x: &Tensor<F>,
    query: &Tensor<F>,
    valid: &Tensor<F>,
    lse: &Tensor<f32>,
    dy: &Tensor<F>,
    dx: &mut Tensor<F>,
    dquery_rows: &mut Tensor<F>,
    tokens: u32,
    scale: f32,
    #[comptime] lanes: usize,
    #[comptime] planes: usize,
    #[comptime] cols: usize,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    if row >= lse.len() {
        terminate!();
    }
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let d = query.len();
    let t_len = tokens as usize;
    let all_padding = pool_row_is_padding::<F>(valid, row, t_len, lanes);
    let row_lse = lse[row];
    let mut q = Array::<f32>::new(cols);
    let mut dys = Array::<f32>::new(cols);
    let mut xs = Array::<f32>::new(cols);
    // Σ_t w_t·g_t·x_t and Σ_t w_t·x_t over this plane's tokens, this
    // lane's columns.
    let mut wgx = Array::<f32>::new(cols);
    let mut wx = Array::<f32>::new(cols);
    load_columns::<F>(query, &mut q, 0, d, lanes, cols);
    load_columns::<F>(dy, &mut dys, row * d, d, lanes, cols);
    #[unroll]
    for c in 0..cols {
        wgx[c] = 0.0f32;
        wx[c] = 0.0f32;
    }
    let mut wg = 0.0f32;
    let mut t = plane;
    while t < t_len {
        let token = pool_token_weight::<F>(
            x,
            valid,
            &q,
            &dys,
            &mut xs,
            row,
            t,
            t_len,
            d,
            all_padding,
            row_lse,
            scale,
            lanes,
            cols,
        );
        wg += token.w * token.g;
        #[unroll]
        for c in 0..cols {
            wgx[c] += token.w * token.g * xs[c];
            wx[c] += token.w * xs[c];
        }
        t += planes;
    }
    let width = comptime!(cols * lanes);
    let mut wg_parts = SharedMemory::<f32>::new(planes);
    let mut wgx_parts = SharedMemory::<f32>::new(comptime!(planes * cols * lanes));
    let mut wx_parts = SharedMemory::<f32>::new(comptime!(planes * cols * lanes));
    if lane == 0 {
        wg_parts[plane] = wg;
    }
    #[unroll]
    for c in 0..cols {
        wgx_parts[plane * width + c * lanes + lane] = wgx[c];
        wx_parts[plane * width + c * lanes + lane] = wx[c];
    }
    sync_cube();
    let mut row_wg = 0.0f32;
    #[unroll]
    for p in 0..planes {
        row_wg += wg_parts[p];
    }
    let mut t = plane;
    while t < t_len {
        let token = pool_token_weight::<F>(
            x,
            valid,
            &q,
            &dys,
            &mut xs,
            row,
            t,
            t_len,
            d,
            all_padding,
            row_lse,
            scale,
            lanes,
            cols,
        );
        let ds = select(all_padding, 0.0f32, token.w * (token.g - row_wg)) * scale;
        let base = (row * t_len + t) * d;
        #[unroll]
        for c in 0..cols {
            let i = lane + c * lanes;
            if i < d {
                dx[base + i] = F::cast_from(token.w * dys[c] + ds * q[c]);
            }
        }
        t += planes;
    }
    if plane == 0 {
        #[unroll]
        for c in 0..cols {
            let i = lane + c * lanes;
            if i < d {
                let mut part = 0.0f32;
                #[unroll]
                for p in 0..planes {
                    let at = p * width + c * lanes + lane;
                    part += wgx_parts[at] - row_wg * wx_parts[at];
                }
                dquery_rows[row * d + i] = F::cast_from(select(all_padding, 0.0f32, part * scale));
            }
        }
    }
}

/// Whether row `row` of `valid` (`[N, T]`) has no valid token, summed over
/// the plane's `lanes` units (every unit of the plane must call it).
#[cube]
fn pool_row_is_padding<F: Float>(
    valid: &Tensor<F>,
    row: usize,
    t_len: usize,
    #[comptime] lanes: usize,
) -> bool {
    let mut count = 0.0f32;
    let mut t = UNIT_POS_X as usize;
    while t < t_len {
        count += f32::cast_from(valid[row * t_len + t]);
        t += lanes;
    }
    sum_over_lanes(count, lanes) < 0.5f32
}

/// Token `t`'s pooling weight `w_t = exp(s_t − lse)` (0 where it is not
/// weighted) and `g_t = dy·x_t`, loading its states into `xs` (every unit
/// of the plane must call it).
#[cube]
#[allow(clippy::too_many_arguments)]
fn pool_token_weight<F: Float>(
    x: &Tensor<F>,
    valid: &Tensor<F>,
    q: &Array<f32>,
    dys: &Array<f32>,
    xs: &mut Array<f32>,
    row: usize,
    t: usize,
    t_len: usize,
    d: usize,
    all_padding: bool,
    row_lse: f32,
    scale: f32,
    #[comptime] lanes: usize,
    #[comptime] cols: usize,
) -> PoolToken {
    load_columns::<F>(x, xs, (row * t_len + t) * d, d, lanes, cols);
    let score = select(all_padding, 0.0f32, row_dot(xs, q, lanes, cols) * scale);
    let g = row_dot(xs, dys, lanes, cols);
    let weighted = all_padding || f32::cast_from(valid[row * t_len + t]) > 0.5f32;
    let w = select(weighted, f32::exp(score - row_lse), 0.0f32);
    PoolToken { w, g }
}

/// This lane's columns `l, l + lanes, …` of the `d` values at `base` of
/// `t`, as f32 (zeros past `d`).
#[cube]
fn load_columns<F: Float>(
    t: &Tensor<F>,
    out: &mut Array<f32>,
    base: usize,
    d: usize,
    #[comptime] lanes: usize,
    #[comptime] cols: usize,
) {
    let lane = UNIT_POS_X as usize;
    #[unroll]
    for c in 0..cols {
        let i = lane + c * lanes;
        out[c] = 0.0f32;
        if i < d {
            out[c] = f32::cast_from(t[base + i]);
        }
    }
}

/// `a·b` over a row held in [`load_columns`]' layout: this lane's part,
/// summed over the plane's `lanes` (every unit of the plane must call it).
#[cube]
fn row_dot(
    a: &Array<f32>,
    b: &Array<f32>,
    #[comptime] lanes: usize,
    #[comptime] cols: usize,
) -> f32 {
    let mut dot = 0.0f32;
    #[unroll]
    for c in 0..cols {
        dot += a[c] * b[c];
    }
    sum_over_lanes(dot, lanes)
}

/// A token's pooling weight and `dy·x_t` ([`pool_token_weight`]).
#[derive(CubeType)]
struct PoolToken {
    w: f32,
    g: f32,
}
