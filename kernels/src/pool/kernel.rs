//! The `#[cube]` kernels of attention pooling.

use cubecl::prelude::*;

use crate::cube::sum_over_lanes;

/// Attention pooling of rows (`pool/mod.rs`): per row, the scores `x_t·q·scale`
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

/// The gradients of [`attention_pool_rows`] (`pool/mod.rs`): `dx` and each
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
