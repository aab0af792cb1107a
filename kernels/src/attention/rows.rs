//! The CubeCL kernels: forward, dQ, dK/dV, and both backward sides in one
//! ([`attention_backward_merged`]) where a cube holds a head's keys. No Burn
//! imports here.
//!
//! Tensors are contiguous `[N, H, T, Dh]` (index `((n·H + h)·T + t)·Dh + d`).
//! A row (a query row in forward and dQ, a key row in dK/dV) belongs to a
//! group of `lanes` adjacent units of one plane, which keep the row and their
//! own accumulator in registers; the cube loads tiles of the other side into
//! shared memory and each lane of a group walks its share of every tile (the
//! keys, or queries, `lane`, `lane + lanes`, ...) with an online softmax.
//! At the end the lanes of a group merge their partial results with plane
//! shuffles. `lanes > 1` gives a call with few rows (at most 2^15, say a
//! sample level of batch 8 or less) enough units to fill a GPU; `lanes = 1`
//! (the ASV level, and every wgpu launch) needs no plane operations for
//! them.
//!
//! With one lane, CUDA and HIP split each row's head dimensions over
//! `parts = 2` adjacent units instead: each keeps half of the row and of its
//! sums, and partners add their halves of every dot product with one plane
//! shuffle. Whole rows cost the backward kernels 180-240 registers a unit
//! (one cube an H100 SM); halves, 105-128.
//!
//! The loops over a lane's keys are unrolled when `unroll` is set, so the
//! scores stay in registers and the dot products of different keys overlap
//! (a dot product alone is a chain of `Dh` dependent FMAs).
//!
//! Shared-memory tiles hold [`Quad`]s, four floats read with one 16-byte
//! load. With one float per load the kernels would be bound by shared-memory
//! instructions (one load per FMA, where an SM issues four FMA instructions
//! for each shared load); a quad feeds four FMAs. A row of a tile is
//! `ceil(Dh/4)` quads, zero-padded past `Dh` (the register rows are padded
//! the same way), and rows are `stride` quads apart: with several lanes
//! reading different rows, one extra quad puts them in different banks.
//!
//! Arithmetic is f32 whatever the storage type. Key tiles whose keys are all
//! padding are skipped as a whole (the per-tile valid counts are computed
//! before launch), which is what makes a 200-of-1024 sample cost ~200 keys.
//! Masked scores are `-1e30` (below any real score, and finite so that the
//! difference of two masked maxima is 0, not `inf − inf` = NaN), and their
//! probabilities are set to zero explicitly.

use cubecl::prelude::*;

use super::args::{Operands, Scalars};
use crate::cube::{bias_at, dropout_head_key, dropout_keep, head_start, row_start, Quad, FAST_EXP};

/// Merges the online-softmax states `(m, l, acc)` of the lanes of a group
/// (`stats = [m, l]`; butterfly over `lanes`, a power of two ≤ 8). Every
/// unit of the plane must call it.
#[cube]
fn merge_softmax_lanes(
    stats: &mut Array<f32>,
    acc: &mut Array<f32>,
    #[comptime] lanes: usize,
    #[comptime] head_dim: usize,
    #[comptime] unroll: bool,
) {
    if comptime!(lanes >= 8) {
        merge_softmax_at(stats, acc, 4u32, head_dim, unroll);
    }
    if comptime!(lanes >= 4) {
        merge_softmax_at(stats, acc, 2u32, head_dim, unroll);
    }
    if comptime!(lanes >= 2) {
        merge_softmax_at(stats, acc, 1u32, head_dim, unroll);
    }
}

/// Merges the states of the lanes `offset` apart: both rescaled to the
/// larger maximum and added.
#[cube]
fn merge_softmax_at(
    stats: &mut Array<f32>,
    acc: &mut Array<f32>,
    offset: u32,
    #[comptime] head_dim: usize,
    #[comptime] unroll: bool,
) {
    let m = stats[0];
    let m_other = plane_shuffle_xor(m, offset);
    let l_other = plane_shuffle_xor(stats[1], offset);
    let m_new = f32::max(m, m_other);
    let c = (m - m_new).exp();
    let c_other = (m_other - m_new).exp();
    stats[0] = m_new;
    stats[1] = stats[1] * c + l_other * c_other;
    #[unroll(unroll)]
    for d in 0..head_dim {
        let other = plane_shuffle_xor(acc[d], offset);
        acc[d] = acc[d] * c + other * c_other;
    }
}

/// Adds the accumulators of the lanes of a group (butterfly over `lanes`,
/// a power of two ≤ 8). Every unit of the plane must call it.
#[cube]
fn sum_lanes(
    acc: &mut Array<f32>,
    #[comptime] lanes: usize,
    #[comptime] head_dim: usize,
    #[comptime] unroll: bool,
) {
    if comptime!(lanes >= 8) {
        sum_lanes_at(acc, 4u32, head_dim, unroll);
    }
    if comptime!(lanes >= 4) {
        sum_lanes_at(acc, 2u32, head_dim, unroll);
    }
    if comptime!(lanes >= 2) {
        sum_lanes_at(acc, 1u32, head_dim, unroll);
    }
}

#[cube]
fn sum_lanes_at(
    acc: &mut Array<f32>,
    offset: u32,
    #[comptime] head_dim: usize,
    #[comptime] unroll: bool,
) {
    #[unroll(unroll)]
    for d in 0..head_dim {
        acc[d] += plane_shuffle_xor(acc[d], offset);
    }
}

/// Where a unit of a query-row kernel ([`attention_forward`],
/// [`attention_backward_dq`]) stands: its sample `n` and head `h`, its query
/// `row` (`active` when the row exists; `compute` when the unit runs the key
/// loop: every unit with `parts > 1`, whose partners shuffle in it), its
/// `lane` and head-dimension `part`, where the head's keys and values start,
/// the key tiles, and the dropout key of its head.
#[derive(CubeType)]
struct QueryUnit {
    bh: usize,
    tq: usize,
    tk: usize,
    head_key: u32,
    n: usize,
    h: usize,
    part: usize,
    lane: usize,
    row: usize,
    active: bool,
    compute: bool,
    k_base: usize,
    v_base: usize,
    n_tiles: usize,
    first_quad: usize,
}

/// The [`QueryUnit`] of this unit (launch: cube x: n·H + h − bh_offset,
/// y: query block; units = query rows × `lanes` × `parts`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn query_unit<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    call: &Scalars,
    #[comptime] head_dim: usize,
    #[comptime] tile_keys: usize,
    #[comptime] lanes: usize,
    #[comptime] parts: usize,
) -> QueryUnit {
    let tq = q.shape(2);
    let tk = k.shape(2);
    let bh = (CUBE_POS_X + call.bh_offset) as usize;
    let n = bh / call.heads as usize;
    let h = bh % call.heads as usize;
    let part = UNIT_POS_X as usize % parts;
    let rows_per_cube = CUBE_DIM_X as usize / (lanes * parts);
    let row = CUBE_POS_Y as usize * rows_per_cube + UNIT_POS_X as usize / (lanes * parts);
    let active = row < tq;
    let mut compute = active;
    if comptime!(parts > 1) {
        compute = true;
    }
    QueryUnit {
        bh,
        tq,
        tk,
        head_key: dropout_head_key(call.seed, bh as u32),
        n,
        h,
        part,
        lane: (UNIT_POS_X as usize / parts) % lanes,
        row,
        active,
        compute,
        k_base: head_start(k, call.k_offset, n, h),
        v_base: head_start(v, call.v_offset, n, h),
        n_tiles: tk.div_ceil(tile_keys),
        first_quad: part * comptime!(head_dim.div_ceil(4) / parts),
    }
}

/// Forward: `out = softmax(q·kᵀ·scale, masked)·v` and the row log-sum-exp.
///
/// A row's head dimensions may be split over `parts` adjacent units, as in
/// the backward kernels (see [`attention_backward_dq`]): each keeps half of
/// q and of the accumulator, and partners add their halves of each score
/// with a plane shuffle, so both see the same scores and softmax state
/// (registers on the H100: 116 with whole rows, 86 split; ASV forward 1.66
/// → 1.48 ms). `parts > 1` needs `lanes = 1`.
///
/// Launch: cube (x: n·H + h − bh_offset, y: query block), units = query
/// rows × `lanes` × `parts`.
#[cube(launch, fast_math = FAST_EXP)]
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<F: Float>(
    ops: &Operands<F, F, F>,
    tile_valid: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    call: &Scalars,
    #[comptime] head_dim: usize,
    #[comptime] tile_keys: usize,
    #[comptime] lanes: usize,
    #[comptime] parts: usize,
    #[comptime] stride: usize,
    #[comptime] use_dropout: bool,
    #[comptime] with_bias: bool,
    #[comptime] unroll: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, bias, key_valid) = (&ops.q, &ops.k, &ops.v, &ops.bias, &ops.key_valid);
    let u = query_unit::<F>(q, k, v, call, head_dim, tile_keys, lanes, parts);
    let keys_per_lane = comptime!(tile_keys / lanes);
    let quads = comptime!(head_dim.div_ceil(4) / parts);
    let dims = comptime!(head_dim / parts);
    let q_base = row_start(q, 0u32, u.n, u.h, u.row) + u.part * dims;
    let out_base = row_start(out, 0u32, u.n, u.h, u.row) + u.part * dims;

    let mut q_row = Array::<f32>::new(comptime!(quads * 4));
    let mut acc = Array::<f32>::new(comptime!(quads * 4));
    #[unroll(unroll)]
    for d in 0..comptime!(quads * 4) {
        q_row[d] = 0.0;
        acc[d] = 0.0;
    }
    if u.active {
        #[unroll(unroll)]
        for d in 0..dims {
            let q_bias = bias_at(bias, u.h * head_dim + u.part * dims + d, with_bias);
            q_row[d] = (f32::cast_from(q[q_base + d]) + q_bias) * call.scale;
        }
    }

    let mut k_tile = SharedMemory::<Quad>::new(comptime!(tile_keys * stride));
    let mut v_tile = SharedMemory::<Quad>::new(comptime!(tile_keys * stride));
    let mut valid_tile = SharedMemory::<f32>::new(tile_keys);
    let mut scores = Array::<f32>::new(keys_per_lane);

    // The running maximum starts at the masked score. Written as 0 − 1e30:
    // CubeCL takes a negative literal for a compile-time constant, and a
    // variable initialised with one cannot be reassigned at run time.
    let mut m = 0.0f32;
    m -= 1.0e30;
    let mut l = 0.0f32;

    for t in 0..u.n_tiles {
        // Uniform over the cube: every unit takes the same branch.
        if tile_valid[u.n * u.n_tiles + t] > 0.0 {
            load_key_tile::<F>(
                k,
                v,
                bias,
                key_valid,
                &mut k_tile,
                &mut v_tile,
                &mut valid_tile,
                u.k_base,
                u.v_base,
                call.k_offset as usize + u.h * head_dim,
                call.v_offset as usize + u.h * head_dim,
                u.n * u.tk,
                t * tile_keys,
                u.tk,
                head_dim,
                tile_keys,
                stride,
                with_bias,
            );
            sync_cube();
            if u.compute {
                let mut tile_max = 0.0f32;
                tile_max -= 1.0e30;
                #[unroll(unroll)]
                for i in 0usize..keys_per_lane {
                    let jj = i * lanes + u.lane;
                    let at = jj * stride + u.first_quad;
                    let s = sum_parts(dot_quads(&q_row, &k_tile, at, quads, unroll), parts);
                    let score = select(valid_tile[jj] > 0.0, s, -1.0e30f32);
                    tile_max = f32::max(tile_max, score);
                    scores[i] = score;
                }
                // A lane whose keys of this tile are all masked keeps its
                // state: m_new = m, correction 1, every p 0.
                let m_new = f32::max(m, tile_max);
                let correction = (m - m_new).exp();
                l *= correction;
                #[unroll(unroll)]
                for d in 0..dims {
                    acc[d] *= correction;
                }
                #[unroll(unroll)]
                for i in 0usize..keys_per_lane {
                    let jj = i * lanes + u.lane;
                    let p = select(valid_tile[jj] > 0.0, (scores[i] - m_new).exp(), 0.0f32);
                    l += p;
                    let mut weight = p;
                    if use_dropout {
                        let col = (t * tile_keys + jj) as u32;
                        let keep =
                            dropout_keep(u.head_key, u.row as u32, col, call.dropout_threshold);
                        weight = select(keep, p * call.dropout_scale, 0.0f32);
                    }
                    let at = jj * stride + u.first_quad;
                    add_scaled_quads(&mut acc, weight, &v_tile, at, quads, unroll);
                }
                m = m_new;
            }
            sync_cube();
        }
    }

    if comptime!(lanes > 1) {
        let mut stats = Array::<f32>::new(2usize);
        stats[0] = m;
        stats[1] = l;
        merge_softmax_lanes(&mut stats, &mut acc, lanes, head_dim, unroll);
        m = stats[0];
        l = stats[1];
    }

    // l ≥ 1 once any key was valid (the maximum contributes exp(0)); a row
    // with no valid key gets zeros.
    let seen = l > 0.0;
    if u.active && u.lane == 0 {
        let inv = select(seen, 1.0f32 / l, 0.0f32);
        #[unroll(unroll)]
        for d in 0..dims {
            out[out_base + d] = F::cast_from(acc[d] * inv);
        }
        if u.part == 0 {
            lse[u.bh * u.tq + u.row] = select(seen, m + l.ln(), 0.0f32);
        }
    }
}

/// Loads keys `[start, start + tile_keys)` of one (n, h) into shared memory
/// (see [`load_rows`]; with their biases from `k_bias` and `v_bias` where
/// `with_bias`) and the validity of each key (0 past the end).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_key_tile<F: Float>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    bias: &Tensor<F>,
    key_valid: &Tensor<f32>,
    k_tile: &mut SharedMemory<Quad>,
    v_tile: &mut SharedMemory<Quad>,
    valid_tile: &mut SharedMemory<f32>,
    k_base: usize,
    v_base: usize,
    k_bias: usize,
    v_bias: usize,
    valid_base: usize,
    start: usize,
    tk: usize,
    #[comptime] head_dim: usize,
    #[comptime] tile_keys: usize,
    #[comptime] stride: usize,
    #[comptime] with_bias: bool,
) {
    load_rows::<F>(
        k,
        k_tile,
        1.0f32,
        k_base,
        k.stride(2),
        start,
        tk,
        bias,
        k_bias,
        head_dim,
        tile_keys,
        stride,
        with_bias,
    );
    load_rows::<F>(
        v,
        v_tile,
        1.0f32,
        v_base,
        v.stride(2),
        start,
        tk,
        bias,
        v_bias,
        head_dim,
        tile_keys,
        stride,
        with_bias,
    );
    let mut jj = UNIT_POS_X as usize;
    while jj < tile_keys {
        let j = start + jj;
        let mut valid = 0.0f32;
        if j < tk {
            valid = key_valid[valid_base + j];
        }
        valid_tile[jj] = valid;
        jj += CUBE_DIM_X as usize;
    }
}

/// Loads rows `[start, start + rows)` of the `[len, head_dim]` matrix at
/// `base` in `src` (row `i` at `base + i·row_stride`), plus the bias
/// `bias[bias_base + d]` where `with_bias`, times `scale`, into `tile` (row
/// `r` at quad `r·stride`), with zeros past `len` and past `head_dim`. All
/// units of the cube share the work, a quad each.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_rows<F: Float>(
    src: &Tensor<F>,
    tile: &mut SharedMemory<Quad>,
    scale: f32,
    base: usize,
    row_stride: usize,
    start: usize,
    len: usize,
    bias: &Tensor<F>,
    bias_base: usize,
    #[comptime] head_dim: usize,
    #[comptime] rows: usize,
    #[comptime] stride: usize,
    #[comptime] with_bias: bool,
) {
    let quads = comptime!(head_dim.div_ceil(4));
    let mut idx = UNIT_POS_X as usize;
    while idx < rows * quads {
        let r = idx / quads;
        let d4 = idx % quads;
        let i = start + r;
        let mut x = Quad::new(0.0f32);
        if i < len {
            let at = base + i * row_stride + d4 * 4;
            // The first branch is decided at compile time: a head dim that
            // is a multiple of four needs no per-element check.
            #[unroll]
            #[allow(clippy::if_same_then_else)]
            for c in 0..4usize {
                if comptime!(head_dim.is_multiple_of(4)) {
                    let b = bias_at(bias, bias_base + d4 * 4 + c, with_bias);
                    x[c] = (f32::cast_from(src[at + c]) + b) * scale;
                } else if d4 * 4 + c < head_dim {
                    let b = bias_at(bias, bias_base + d4 * 4 + c, with_bias);
                    x[c] = (f32::cast_from(src[at + c]) + b) * scale;
                }
            }
        }
        tile[r * stride + d4] = x;
        idx += CUBE_DIM_X as usize;
    }
}

/// `Σ_d row[d] · tile_row[d]` for the tile row starting at quad `at`.
#[cube]
fn dot_quads(
    row: &Array<f32>,
    tile: &SharedMemory<Quad>,
    at: usize,
    #[comptime] quads: usize,
    #[comptime] unroll: bool,
) -> f32 {
    let mut sum = 0.0f32;
    #[unroll(unroll)]
    for d4 in 0..quads {
        let x = tile[at + d4];
        #[unroll]
        for c in 0..4usize {
            sum += row[d4 * 4 + c] * x[c];
        }
    }
    sum
}

/// `acc[d] += weight · tile_row[d]` for the tile row starting at quad `at`.
#[cube]
fn add_scaled_quads(
    acc: &mut Array<f32>,
    weight: f32,
    tile: &SharedMemory<Quad>,
    at: usize,
    #[comptime] quads: usize,
    #[comptime] unroll: bool,
) {
    #[unroll(unroll)]
    for d4 in 0..quads {
        let x = tile[at + d4];
        #[unroll]
        for c in 0..4usize {
            acc[d4 * 4 + c] += weight * x[c];
        }
    }
}

/// Adds the partial sums of the `parts` adjacent units that share a row,
/// each holding `head_dim / parts` of its dimensions (`parts` is 1 or 2;
/// with 1 it returns `x`). Every unit of the plane must call it when
/// `parts = 2`.
#[cube]
fn sum_parts(x: f32, #[comptime] parts: usize) -> f32 {
    let mut sum = x;
    if comptime!(parts == 2) {
        sum += plane_shuffle_xor(sum, 1u32);
    }
    sum
}

/// Backward, query side: `dQ = scale · Σ_j P_ij (dP_ij − Δ_i) k_j`, with
/// `P` recomputed from the saved log-sum-exp and `Δ_i = rowsum(dO_i ⊙ O_i)`
/// computed here in f32 and written to `delta` for [`attention_backward_dkdv`]
/// (launched after this kernel on the same stream).
///
/// A row's head dimensions may be split over `parts` adjacent units (each
/// keeps `head_dim / parts` of q, dO and dQ in registers and adds its partial
/// dot products to its partners' with plane shuffles): with whole rows the
/// backward kernels need 180-240 registers a unit, so an H100 SM holds one
/// cube of 160 units (8% occupancy). `parts > 1` needs `lanes = 1`.
///
/// Launch: as [`attention_forward`], units = query rows × `lanes` × `parts`.
#[cube(launch, fast_math = FAST_EXP)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_dq<F: Float>(
    ops: &Operands<F, F, F>,
    out: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    tile_valid: &Tensor<f32>,
    dq: &mut Tensor<F>,
    delta: &mut Tensor<f32>,
    call: &Scalars,
    #[comptime] head_dim: usize,
    #[comptime] tile_keys: usize,
    #[comptime] lanes: usize,
    #[comptime] parts: usize,
    #[comptime] stride: usize,
    #[comptime] use_dropout: bool,
    #[comptime] with_bias: bool,
    #[comptime] unroll: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, bias, key_valid) = (&ops.q, &ops.k, &ops.v, &ops.bias, &ops.key_valid);
    let u = query_unit::<F>(q, k, v, call, head_dim, tile_keys, lanes, parts);
    let keys_per_lane = comptime!(tile_keys / lanes);
    let quads = comptime!(head_dim.div_ceil(4) / parts);
    let dims = comptime!(head_dim / parts);
    let q_base = row_start(q, 0u32, u.n, u.h, u.row) + u.part * dims;
    let out_base = row_start(out, 0u32, u.n, u.h, u.row) + u.part * dims;
    let do_base = row_start(dout, 0u32, u.n, u.h, u.row) + u.part * dims;
    let dq_base = row_start(dq, 0u32, u.n, u.h, u.row) + u.part * dims;

    let mut q_row = Array::<f32>::new(comptime!(quads * 4));
    let mut do_row = Array::<f32>::new(comptime!(quads * 4));
    let mut acc = Array::<f32>::new(comptime!(quads * 4));
    let mut row_lse = 0.0f32;
    let mut row_delta = 0.0f32;
    #[unroll(unroll)]
    for d in 0..comptime!(quads * 4) {
        q_row[d] = 0.0;
        do_row[d] = 0.0;
        acc[d] = 0.0;
    }
    if u.active {
        #[unroll(unroll)]
        for d in 0..dims {
            let q_bias = bias_at(bias, u.h * head_dim + u.part * dims + d, with_bias);
            q_row[d] = (f32::cast_from(q[q_base + d]) + q_bias) * call.scale;
            do_row[d] = f32::cast_from(dout[do_base + d]);
            row_delta += do_row[d] * f32::cast_from(out[out_base + d]);
        }
        row_lse = lse[u.bh * u.tq + u.row];
    }
    row_delta = sum_parts(row_delta, parts);
    if u.active && u.lane == 0 && u.part == 0 {
        delta[u.bh * u.tq + u.row] = row_delta;
    }

    let mut k_tile = SharedMemory::<Quad>::new(comptime!(tile_keys * stride));
    let mut v_tile = SharedMemory::<Quad>::new(comptime!(tile_keys * stride));
    let mut valid_tile = SharedMemory::<f32>::new(tile_keys);

    for t in 0..u.n_tiles {
        if tile_valid[u.n * u.n_tiles + t] > 0.0 {
            load_key_tile::<F>(
                k,
                v,
                bias,
                key_valid,
                &mut k_tile,
                &mut v_tile,
                &mut valid_tile,
                u.k_base,
                u.v_base,
                call.k_offset as usize + u.h * head_dim,
                call.v_offset as usize + u.h * head_dim,
                u.n * u.tk,
                t * tile_keys,
                u.tk,
                head_dim,
                tile_keys,
                stride,
                with_bias,
            );
            sync_cube();
            if u.compute {
                #[unroll(unroll)]
                for i in 0usize..keys_per_lane {
                    let jj = i * lanes + u.lane;
                    let at = jj * stride + u.first_quad;
                    let s = sum_parts(dot_quads(&q_row, &k_tile, at, quads, unroll), parts);
                    let mut dp = sum_parts(dot_quads(&do_row, &v_tile, at, quads, unroll), parts);
                    let p = select(valid_tile[jj] > 0.0, (s - row_lse).exp(), 0.0f32);
                    if use_dropout {
                        let col = (t * tile_keys + jj) as u32;
                        let keep =
                            dropout_keep(u.head_key, u.row as u32, col, call.dropout_threshold);
                        dp = select(keep, dp * call.dropout_scale, 0.0f32);
                    }
                    let ds = p * (dp - row_delta);
                    add_scaled_quads(&mut acc, ds, &k_tile, at, quads, unroll);
                }
            }
            sync_cube();
        }
    }

    if comptime!(lanes > 1) {
        sum_lanes(&mut acc, lanes, head_dim, unroll);
    }
    if u.active && u.lane == 0 {
        #[unroll(unroll)]
        for d in 0..dims {
            dq[dq_base + d] = F::cast_from(acc[d] * call.scale);
        }
    }
}

/// The merged backward's dQ for one query tile
/// ([`attention_backward_merged`]): `dq[row] = scale · Σ_j dS[row, j] k_j` for the tile's
/// `rows` (≤ `tile`) rows, from `ds_quads` (key `j`'s dS of queries 4q..4q+3
/// at quad `j·tile/4 + q`) and `k_all` (key `j`'s quad `d4` at
/// `j·⌈head_dim/4⌉ + d4`).
///
/// A unit sums four rows × one quad of dimensions over a `1/key_splits`
/// share of the keys: two shared loads feed 16 multiply-adds (one row a
/// unit over all keys does 4 for two loads; on the H100, 2026-11-26, the
/// merged kernel took 18.9 ms a training step, against 19.7 with one row a
/// unit). With `key_splits > 1` the partial sums meet in `ds_quads`, which
/// must hold `key_splits · tile · ⌈head_dim/4⌉` quads, and the cube must
/// have a unit per item (`key_splits · tile/4 · ⌈head_dim/4⌉`). Every unit
/// of the cube must call it (it syncs).
#[cube]
#[allow(clippy::too_many_arguments, clippy::assign_op_pattern)]
fn dq_from_ds_tile<F: Float>(
    ds_quads: &mut SharedMemory<Quad>,
    k_all: &SharedMemory<Quad>,
    dq: &mut Tensor<F>,
    dq_base: usize,
    row_stride: usize,
    rows: usize,
    tk: usize,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] key_splits: usize,
) {
    let all_quads = comptime!(head_dim.div_ceil(4));
    let query_quads = comptime!(tile / 4);
    let items = comptime!(tile / 4 * head_dim.div_ceil(4));
    let chunk = tk.div_ceil(key_splits);
    let mut sums = Array::<Quad>::new(4usize);
    let unit = UNIT_POS_X as usize;
    let mut e = unit;
    // Items (key share, row quad, dimension quad); with splits, at most one
    // a unit (the caller's launch has units for all), whose sums stay.
    while e < items * key_splits {
        let split = e / items;
        let qq = (e % items) / all_quads;
        let d4 = e % all_quads;
        #[unroll]
        for r in 0..4usize {
            sums[r] = Quad::new(0.0f32);
        }
        let first = split * chunk;
        let mut last = first + chunk;
        if last > tk {
            last = tk;
        }
        for j in first..last {
            let ds = ds_quads[j * query_quads + qq];
            let kq = k_all[j * all_quads + d4];
            #[unroll]
            for r in 0..4usize {
                sums[r] = sums[r] + Quad::new(ds[r]) * kq;
            }
        }
        if comptime!(key_splits == 1) {
            write_dq_rows::<F>(
                &sums,
                dq,
                dq_base,
                row_stride,
                rows,
                qq * 4,
                d4,
                scale,
                head_dim,
            );
        }
        e += CUBE_DIM_X as usize;
    }
    if comptime!(key_splits > 1) {
        // Every dS is read: the partial sums replace it, then one unit per
        // (row quad, dimension quad) adds the shares.
        sync_cube();
        if unit < items * key_splits {
            let split = unit / items;
            let qq = (unit % items) / all_quads;
            let d4 = unit % all_quads;
            #[unroll]
            for r in 0..4usize {
                ds_quads[(split * tile + qq * 4 + r) * all_quads + d4] = sums[r];
            }
        }
        sync_cube();
        if unit < items {
            let qq = unit / all_quads;
            let d4 = unit % all_quads;
            #[unroll]
            for r in 0..4usize {
                let mut total = Quad::new(0.0f32);
                for split in 0..key_splits {
                    total = total + ds_quads[(split * tile + qq * 4 + r) * all_quads + d4];
                }
                sums[r] = total;
            }
            write_dq_rows::<F>(
                &sums,
                dq,
                dq_base,
                row_stride,
                rows,
                qq * 4,
                d4,
                scale,
                head_dim,
            );
        }
    }
}

/// Writes `scale · sums[r]` to dimensions `4·d4..` of rows `first + r` of a
/// dQ tile (rows at `dq_base + row·row_stride`), for rows below `rows`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_dq_rows<F: Float>(
    sums: &Array<Quad>,
    dq: &mut Tensor<F>,
    dq_base: usize,
    row_stride: usize,
    rows: usize,
    first: usize,
    d4: usize,
    scale: f32,
    #[comptime] head_dim: usize,
) {
    #[unroll]
    for r in 0..4usize {
        if first + r < rows {
            let at = dq_base + (first + r) * row_stride + d4 * 4;
            let x = sums[r];
            #[unroll]
            for c in 0..4usize {
                if d4 * 4 + c < head_dim {
                    dq[at + c] = F::cast_from(x[c] * scale);
                }
            }
        }
    }
}

/// A key unit's registers in [`attention_backward_dkdv`] and
/// [`attention_backward_merged`]: its share of the key's row (`dims` of k
/// and v, zero past them and for a masked key) and its sums of dK and dV.
#[derive(CubeType)]
struct KeyRow {
    k: Array<f32>,
    v: Array<f32>,
    dk: Array<f32>,
    dv: Array<f32>,
}

/// A [`KeyRow`] with the key's `dims` elements at `k_base` and `v_base`
/// (plus their biases from `k_bias`, `v_bias` where `with_bias`; zeros
/// unless `active`) and zero sums.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_key_row<F: Float>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    k_base: usize,
    v_base: usize,
    bias: &Tensor<F>,
    k_bias: usize,
    v_bias: usize,
    active: bool,
    #[comptime] quads: usize,
    #[comptime] dims: usize,
    #[comptime] with_bias: bool,
    #[comptime] unroll: bool,
) -> KeyRow {
    let mut key = KeyRow {
        k: Array::<f32>::new(comptime!(quads * 4)),
        v: Array::<f32>::new(comptime!(quads * 4)),
        dk: Array::<f32>::new(comptime!(quads * 4)),
        dv: Array::<f32>::new(comptime!(quads * 4)),
    };
    #[unroll(unroll)]
    for d in 0..comptime!(quads * 4) {
        key.k[d] = 0.0;
        key.v[d] = 0.0;
        key.dk[d] = 0.0;
        key.dv[d] = 0.0;
    }
    if active {
        #[unroll(unroll)]
        for d in 0..dims {
            key.k[d] = f32::cast_from(k[k_base + d]) + bias_at(bias, k_bias + d, with_bias);
            key.v[d] = f32::cast_from(v[v_base + d]) + bias_at(bias, v_bias + d, with_bias);
        }
    }
    key
}

/// Adds query row `i` (its scaled q and dO in the tiles at quad `at`, its
/// log-sum-exp and Δ) to the key's sums `dV += P̃·dO` and `dK += dS·q`,
/// and returns `dS = P·(dP − Δ)` (P̃, dP: after dropout). Every unit of
/// the key's `parts` must call it (they shuffle).
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_query_to_key(
    key: &mut KeyRow,
    q_tile: &SharedMemory<Quad>,
    do_tile: &SharedMemory<Quad>,
    at: usize,
    lse_i: f32,
    delta_i: f32,
    active: bool,
    head_key: u32,
    i: u32,
    col: u32,
    dropout_threshold: u32,
    dropout_scale: f32,
    #[comptime] parts: usize,
    #[comptime] quads: usize,
    #[comptime] use_dropout: bool,
    #[comptime] unroll: bool,
) -> f32 {
    let s = sum_parts(dot_quads(&key.k, q_tile, at, quads, unroll), parts);
    let mut dp = sum_parts(dot_quads(&key.v, do_tile, at, quads, unroll), parts);
    // 0 for a masked key: its exp(0 − lse) could overflow.
    let p = select(active, (s - lse_i).exp(), 0.0f32);
    let mut p_kept = p;
    if use_dropout {
        let keep = dropout_keep(head_key, i, col, dropout_threshold);
        p_kept = select(keep, p * dropout_scale, 0.0f32);
        dp = select(keep, dp * dropout_scale, 0.0f32);
    }
    let ds = p * (dp - delta_i);
    add_scaled_quads(&mut key.dv, p_kept, do_tile, at, quads, unroll);
    add_scaled_quads(&mut key.dk, ds, q_tile, at, quads, unroll);
    ds
}

/// Writes the key's dK and dV sums (`dims` elements) at `dk_base` and
/// `dv_base`; a masked key's (run only for its partners' shuffles) as 0.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_key_gradients<F: Float>(
    key: &KeyRow,
    dkv: &mut Tensor<F>,
    dk_base: usize,
    dv_base: usize,
    active: bool,
    #[comptime] dims: usize,
    #[comptime] unroll: bool,
) {
    #[unroll(unroll)]
    for d in 0..dims {
        dkv[dk_base + d] = F::cast_from(select(active, key.dk[d], 0.0f32));
        dkv[dv_base + d] = F::cast_from(select(active, key.dv[d], 0.0f32));
    }
}

/// Backward, key side: `dV_j = Σ_i P̃_ij dO_i` and
/// `dK_j = scale · Σ_i P_ij (dP_ij − Δ_i) q_i` (P̃: after dropout). Masked
/// keys get zero gradients, and a cube whose keys are all masked skips the
/// query loop. `tile` is both the rows of a query tile and the tiling of
/// `tile_valid`. Head dimensions split over `parts` units as in
/// [`attention_backward_dq`]. Where one cube can hold all of a head's keys,
/// [`attention_backward_merged`] does this kernel's work and the dQ
/// kernel's in one.
///
/// Launch: cube (x: n·H + h − bh_offset, y: key block), units = key rows ×
/// `lanes` × `parts`; the lanes of a key split each query tile.
#[cube(launch, fast_math = FAST_EXP)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_dkdv<F: Float>(
    ops: &Operands<F, F, F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    tile_valid: &Tensor<f32>,
    dkv: &mut Tensor<F>,
    call: &Scalars,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] lanes: usize,
    #[comptime] parts: usize,
    #[comptime] stride: usize,
    #[comptime] use_dropout: bool,
    #[comptime] with_bias: bool,
    #[comptime] unroll: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, bias, key_valid) = (&ops.q, &ops.k, &ops.v, &ops.bias, &ops.key_valid);
    let tq = q.shape(2);
    let tk = k.shape(2);
    let bh = (CUBE_POS_X + call.bh_offset) as usize;
    let head_key = dropout_head_key(call.seed, bh as u32);
    let n = bh / call.heads as usize;
    let part = UNIT_POS_X as usize % parts;
    let lane = (UNIT_POS_X as usize / parts) % lanes;
    let key_slot = UNIT_POS_X as usize / (lanes * parts);
    let keys_per_cube = CUBE_DIM_X as usize / (lanes * parts);
    let first_key = CUBE_POS_Y as usize * keys_per_cube;
    let col = first_key + key_slot;
    let in_range = col < tk;
    let mut active = false;
    if in_range {
        active = key_valid[n * tk + col] > 0.0;
    }
    // With parts, partners shuffle inside the query loop: every unit runs
    // it, and a masked key's sums are dropped at the end.
    let mut compute = active;
    if comptime!(parts > 1) {
        compute = true;
    }
    // Uniform over the cube: does any key tile overlapping the cube's keys
    // hold a valid key?
    let n_key_tiles = tk.div_ceil(tile);
    let mut end_key = first_key + keys_per_cube;
    if end_key > tk {
        end_key = tk;
    }
    let mut block_valid = 0.0f32;
    for t in first_key / tile..(end_key - 1) / tile + 1 {
        block_valid += tile_valid[n * n_key_tiles + t];
    }
    let h = bh % call.heads as usize;
    let q_base = head_start(q, 0u32, n, h);
    let do_base = head_start(dout, 0u32, n, h);
    let mut n_tiles = 0usize;
    if block_valid > 0.0 {
        n_tiles = tq.div_ceil(tile);
    }
    let queries_per_lane = comptime!(tile / lanes);
    let quads = comptime!(head_dim.div_ceil(4) / parts);
    let dims = comptime!(head_dim / parts);
    let first_quad = part * quads;
    let k_base = row_start(k, call.k_offset, n, h, col) + part * dims;
    let v_base = row_start(v, call.v_offset, n, h, col) + part * dims;
    let dk_base = row_start(dkv, call.dk_offset, n, h, col) + part * dims;
    let dv_base = row_start(dkv, call.dv_offset, n, h, col) + part * dims;

    let mut key = load_key_row::<F>(
        k,
        v,
        k_base,
        v_base,
        bias,
        call.k_offset as usize + h * head_dim + part * dims,
        call.v_offset as usize + h * head_dim + part * dims,
        active,
        quads,
        dims,
        with_bias,
        unroll,
    );

    let mut q_tile = SharedMemory::<Quad>::new(comptime!(tile * stride));
    let mut do_tile = SharedMemory::<Quad>::new(comptime!(tile * stride));
    let mut lse_tile = SharedMemory::<f32>::new(tile);
    let mut delta_tile = SharedMemory::<f32>::new(tile);
    for t in 0..n_tiles {
        let start = t * tile;
        load_rows::<F>(
            q,
            &mut q_tile,
            call.scale,
            q_base,
            q.stride(2),
            start,
            tq,
            bias,
            h * head_dim,
            head_dim,
            tile,
            stride,
            with_bias,
        );
        load_rows::<F>(
            dout,
            &mut do_tile,
            1.0f32,
            do_base,
            dout.stride(2),
            start,
            tq,
            dout,
            0usize,
            head_dim,
            tile,
            stride,
            false,
        );
        let mut ii = UNIT_POS_X as usize;
        while ii < tile {
            let i = start + ii;
            // Rows past the end: lse = +big makes p = 0, and their q and dO are 0.
            let mut lse_i = 1.0e30f32;
            let mut delta_i = 0.0f32;
            if i < tq {
                lse_i = lse[bh * tq + i];
                delta_i = delta[bh * tq + i];
            }
            lse_tile[ii] = lse_i;
            delta_tile[ii] = delta_i;
            ii += CUBE_DIM_X as usize;
        }
        sync_cube();
        if compute {
            #[unroll(unroll)]
            for r in 0usize..queries_per_lane {
                let ii = r * lanes + lane;
                add_query_to_key(
                    &mut key,
                    &q_tile,
                    &do_tile,
                    ii * stride + first_quad,
                    lse_tile[ii],
                    delta_tile[ii],
                    active,
                    head_key,
                    (start + ii) as u32,
                    col as u32,
                    call.dropout_threshold,
                    call.dropout_scale,
                    parts,
                    quads,
                    use_dropout,
                    unroll,
                );
            }
        }
        sync_cube();
    }

    if comptime!(lanes > 1) {
        sum_lanes(&mut key.dk, lanes, head_dim, unroll);
        sum_lanes(&mut key.dv, lanes, head_dim, unroll);
    }
    if in_range && lane == 0 {
        write_key_gradients::<F>(&key, dkv, dk_base, dv_base, active, dims, unroll);
    }
}

/// The attention backward in one kernel where one cube holds all of an
/// (n, h)'s keys (the ASV level's 151), a key a unit with its head dims
/// split over `parts` units: dK and dV as [`attention_backward_dkdv`], and
/// `dQ_i = scale · Σ_j dS_ij k_j` from each query tile's `dS`, kept in
/// shared memory with the keys (`dq_from_ds_tile`). So `P`, `dP` and the
/// dropout hash are computed once for the three gradients, not once in each
/// of two kernels (at the ASV level a dQ kernel of its own is 40% of the
/// backward).
///
/// The query tiles are pipelined: each unit issues its loads of the next
/// tile's rows (q, dO and O, a quad each, and for the first `tile` units a
/// row's log-sum-exp) before the current tile's products, and stores them
/// to shared memory while the cube sums the current tile's dQ. `Δ_i =
/// rowsum(dO_i ⊙ O_i)` is summed a quad at a time by the units that store
/// them, and over the quads by one unit a row. (With each tile's loads
/// first, behind a barrier, and `Δ` summed by one unit a row over its whole
/// row, Nsight Compute shows the warps waiting at the cube's barriers and
/// on global loads for 43% of their stall cycles.)
///
/// `key_capacity` is the keys' count (the shared memory for the keys and a
/// tile's `dS`), `key_splits` the shares of the keys a tile's dQ sums
/// split into, `loads` the quads of a query tile each unit loads
/// (`⌈tile · ⌈head_dim/4⌉ / units⌉`).
///
/// Launch: cube x: n·H + h − bh_offset; units = `key_capacity · parts`
/// rounded up to whole planes, at least `tile`, and at least
/// `key_splits · tile/4 · ⌈head_dim/4⌉`.
#[cube(launch, fast_math = FAST_EXP)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_merged<F: Float>(
    ops: &Operands<F, F, F>,
    dout: &Tensor<F>,
    out: &Tensor<F>,
    lse: &Tensor<f32>,
    dkv: &mut Tensor<F>,
    dq: &mut Tensor<F>,
    call: &Scalars,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] parts: usize,
    #[comptime] stride: usize,
    #[comptime] use_dropout: bool,
    #[comptime] with_bias: bool,
    #[comptime] key_capacity: usize,
    #[comptime] key_splits: usize,
    #[comptime] loads: usize,
    #[comptime] unroll: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, bias, key_valid) = (&ops.q, &ops.k, &ops.v, &ops.bias, &ops.key_valid);
    let tq = q.shape(2);
    let tk = k.shape(2);
    let bh = (CUBE_POS_X + call.bh_offset) as usize;
    let head_key = dropout_head_key(call.seed, bh as u32);
    let n = bh / call.heads as usize;
    let h = bh % call.heads as usize;
    let unit = UNIT_POS_X as usize;
    let part = unit % parts;
    let col = unit / parts;
    let mut active = false;
    if col < tk {
        active = key_valid[n * tk + col] > 0.0;
    }
    let quads = comptime!(head_dim.div_ceil(4) / parts);
    let dims = comptime!(head_dim / parts);
    let all_quads = comptime!(head_dim.div_ceil(4));
    let query_quads = comptime!(tile / 4);
    let first_quad = part * quads;
    let rows = RowStarts {
        q: head_start(q, 0u32, n, h),
        dout: head_start(dout, 0u32, n, h),
        out: head_start(out, 0u32, n, h),
        lse: bh * tq,
    };
    let k_base = row_start(k, call.k_offset, n, h, col) + part * dims;
    let v_base = row_start(v, call.v_offset, n, h, col) + part * dims;

    let mut key = load_key_row::<F>(
        k,
        v,
        k_base,
        v_base,
        bias,
        call.k_offset as usize + h * head_dim + part * dims,
        call.v_offset as usize + h * head_dim + part * dims,
        active,
        quads,
        dims,
        with_bias,
        unroll,
    );

    let mut q_tile = SharedMemory::<Quad>::new(comptime!(tile * stride));
    let mut do_tile = SharedMemory::<Quad>::new(comptime!(tile * stride));
    let mut lse_tile = SharedMemory::<f32>::new(tile);
    let mut delta_tile = SharedMemory::<f32>::new(tile);
    // Each quad's share of Δ: `dO·O` over its four dimensions.
    let mut delta_quads = SharedMemory::<f32>::new(comptime!(tile * head_dim.div_ceil(4)));
    // Every key (quads, as the query tile: zeros for a masked key, whose dS
    // is zero) and a query tile's dS, stored by key, four queries a quad, so
    // that one load gives the dS of four query rows; after the tile's dQ
    // sums the same memory holds their partial sums.
    let mut k_all = SharedMemory::<Quad>::new(comptime!(key_capacity * head_dim.div_ceil(4)));
    let mut ds_quads = SharedMemory::<Quad>::new(comptime!(key_capacity * (tile / 4)));
    if col < key_capacity {
        #[unroll(unroll)]
        for d4 in 0..quads {
            let mut x = Quad::new(0.0f32);
            #[unroll]
            for c in 0..4usize {
                x[c] = key.k[d4 * 4 + c];
            }
            k_all[col * all_quads + first_quad + d4] = x;
        }
    }

    // The next tile's rows, in flight in registers.
    let mut next = QueryRows {
        q: Array::<Quad>::new(loads),
        dout: Array::<Quad>::new(loads),
        out: Array::<Quad>::new(loads),
        lse: Array::<f32>::new(1usize),
    };
    let n_tiles = tq.div_ceil(tile);
    fetch_query_rows::<F>(
        q,
        dout,
        out,
        lse,
        &rows,
        &mut next,
        0,
        tq,
        call.scale,
        bias,
        h * head_dim,
        head_dim,
        tile,
        loads,
        with_bias,
    );
    stage_query_rows(
        &next,
        &mut q_tile,
        &mut do_tile,
        &mut lse_tile,
        &mut delta_quads,
        head_dim,
        tile,
        stride,
        loads,
    );
    sync_cube();
    sum_delta_quads(&delta_quads, &mut delta_tile, head_dim, tile);
    sync_cube();

    for t in 0..n_tiles {
        let start = t * tile;
        let more = t + 1 < n_tiles;
        if more {
            fetch_query_rows::<F>(
                q,
                dout,
                out,
                lse,
                &rows,
                &mut next,
                start + tile,
                tq,
                call.scale,
                bias,
                h * head_dim,
                head_dim,
                tile,
                loads,
                with_bias,
            );
        }
        // Every unit (a masked key's too: its partners shuffle with it, and
        // its dS, zero, is read) runs the tile. Rows past the end have
        // lse = +big, so p = 0, and their q and dO are 0.
        let mut ds_four = Quad::new(0.0f32);
        #[unroll(unroll)]
        for ii in 0usize..tile {
            let ds = add_query_to_key(
                &mut key,
                &q_tile,
                &do_tile,
                ii * stride + first_quad,
                lse_tile[ii],
                delta_tile[ii],
                active,
                head_key,
                (start + ii) as u32,
                col as u32,
                call.dropout_threshold,
                call.dropout_scale,
                parts,
                quads,
                use_dropout,
                unroll,
            );
            ds_four[ii % 4] = ds;
            if ii % 4 == 3 && part == 0 && col < key_capacity {
                ds_quads[col * query_quads + ii / 4] = ds_four;
            }
        }
        sync_cube();
        // The tile's rows are read: the next tile's replace them while the
        // cube sums this tile's dQ (which reads only `ds_quads` and `k_all`).
        if more {
            stage_query_rows(
                &next,
                &mut q_tile,
                &mut do_tile,
                &mut lse_tile,
                &mut delta_quads,
                head_dim,
                tile,
                stride,
                loads,
            );
        }
        dq_from_ds_tile::<F>(
            &mut ds_quads,
            &k_all,
            dq,
            row_start(dq, 0u32, n, h, start),
            dq.stride(2),
            tq - start,
            tk,
            call.scale,
            head_dim,
            tile,
            key_splits,
        );
        // With key shares, `dq_from_ds_tile` synced after the staging.
        if comptime!(key_splits == 1) {
            sync_cube();
        }
        if more {
            sum_delta_quads(&delta_quads, &mut delta_tile, head_dim, tile);
        }
        // The next tile's dS overwrites `ds_quads`, read until here.
        sync_cube();
    }

    if col < tk {
        let dk_base = row_start(dkv, call.dk_offset, n, h, col) + part * dims;
        let dv_base = row_start(dkv, call.dv_offset, n, h, col) + part * dims;
        write_key_gradients::<F>(&key, dkv, dk_base, dv_base, active, dims, unroll);
    }
}

/// Where rows of one (n, h) start in [`attention_backward_merged`]'s
/// inputs: element (row 0, dimension 0) of q, dO and O, and row 0's
/// log-sum-exp.
#[derive(CubeType)]
struct RowStarts {
    q: usize,
    dout: usize,
    out: usize,
    lse: usize,
}

/// A unit's share of a query tile's rows on their way to shared memory
/// ([`fetch_query_rows`], [`stage_query_rows`]): `loads` quads each of q
/// (scaled), dO and O, and one row's log-sum-exp.
#[derive(CubeType)]
struct QueryRows {
    q: Array<Quad>,
    dout: Array<Quad>,
    out: Array<Quad>,
    lse: Array<f32>,
}

/// Loads this unit's share of the query tile at row `start` into `next`:
/// quad `UNIT_POS_X + l·CUBE_DIM_X` of the tile (row-major, `⌈head_dim/4⌉`
/// quads a row) for `l < loads`, zeros past `tq` and past `head_dim`; and
/// for units below `tile`, that row's log-sum-exp (`+1e30` past `tq`, so that
/// its probabilities are 0). q gets its bias from `q_bias` where `with_bias`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_query_rows<F: Float>(
    q: &Tensor<F>,
    dout: &Tensor<F>,
    out: &Tensor<F>,
    lse: &Tensor<f32>,
    rows: &RowStarts,
    next: &mut QueryRows,
    start: usize,
    tq: usize,
    scale: f32,
    bias: &Tensor<F>,
    q_bias: usize,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] loads: usize,
    #[comptime] with_bias: bool,
) {
    let all_quads = comptime!(head_dim.div_ceil(4));
    #[unroll]
    for l in 0..loads {
        let idx = UNIT_POS_X as usize + l * CUBE_DIM_X as usize;
        let i = start + idx / all_quads;
        let d = (idx % all_quads) * 4;
        let mut xq = Quad::new(0.0f32);
        let mut xdo = Quad::new(0.0f32);
        let mut xo = Quad::new(0.0f32);
        if idx < tile * all_quads && i < tq {
            let q_at = rows.q + i * q.stride(2) + d;
            let do_at = rows.dout + i * dout.stride(2) + d;
            let o_at = rows.out + i * out.stride(2) + d;
            #[unroll]
            #[allow(clippy::if_same_then_else)]
            for c in 0..4usize {
                if comptime!(head_dim.is_multiple_of(4)) || d + c < head_dim {
                    let b = bias_at(bias, q_bias + d + c, with_bias);
                    xq[c] = (f32::cast_from(q[q_at + c]) + b) * scale;
                    xdo[c] = f32::cast_from(dout[do_at + c]);
                    xo[c] = f32::cast_from(out[o_at + c]);
                }
            }
        }
        next.q[l] = xq;
        next.dout[l] = xdo;
        next.out[l] = xo;
    }
    let i = start + UNIT_POS_X as usize;
    let mut lse_i = 1.0e30f32;
    if (UNIT_POS_X as usize) < tile && i < tq {
        lse_i = lse[rows.lse + i];
    }
    next.lse[0] = lse_i;
}

/// Stores the rows [`fetch_query_rows`] loaded: q and dO into their tiles,
/// the log-sum-exp, and each quad's `dO·O` into `delta_quads` (summed over a
/// row by [`sum_delta_quads`] after a sync).
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_query_rows(
    next: &QueryRows,
    q_tile: &mut SharedMemory<Quad>,
    do_tile: &mut SharedMemory<Quad>,
    lse_tile: &mut SharedMemory<f32>,
    delta_quads: &mut SharedMemory<f32>,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] stride: usize,
    #[comptime] loads: usize,
) {
    let all_quads = comptime!(head_dim.div_ceil(4));
    #[unroll]
    for l in 0..loads {
        let idx = UNIT_POS_X as usize + l * CUBE_DIM_X as usize;
        if idx < tile * all_quads {
            let at = (idx / all_quads) * stride + idx % all_quads;
            q_tile[at] = next.q[l];
            do_tile[at] = next.dout[l];
            let products = next.dout[l] * next.out[l];
            delta_quads[idx] = (products[0] + products[1]) + (products[2] + products[3]);
        }
    }
    if (UNIT_POS_X as usize) < tile {
        lse_tile[UNIT_POS_X as usize] = next.lse[0];
    }
}

/// `Δ` of each row of the staged tile, from its quads' shares: by the last
/// `tile` units of the cube (the first ones write dQ in `dq_from_ds_tile`'s
/// last phase).
#[cube]
fn sum_delta_quads(
    delta_quads: &SharedMemory<f32>,
    delta_tile: &mut SharedMemory<f32>,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
) {
    let all_quads = comptime!(head_dim.div_ceil(4));
    let shifted = UNIT_POS_X as usize + tile;
    if shifted >= CUBE_DIM_X as usize {
        let row = shifted - CUBE_DIM_X as usize;
        let mut sum = 0.0f32;
        #[unroll]
        for d4 in 0..all_quads {
            sum += delta_quads[row * all_quads + d4];
        }
        delta_tile[row] = sum;
    }
}

/// The key validity of an attention call from its padding mask (non-zero =
/// ignore the key): `key_valid[n, j]` is 1 for a key to attend to, else 0,
/// and `tile_valid[n, t]` counts the valid keys of tile `t` (0 lets a cube
/// skip the tile). One launch where the same from tensor ops took ~8.
///
/// A unit per key (`tile_keys` adjacent units a tile, so that a cube of
/// `units`, a multiple of `tile_keys`, holds whole tiles), then the first
/// unit of each tile sums its tile's from shared memory. A unit per tile
/// walking its keys took 13.6 µs a launch at the sample level on the H100
/// (Nsight Compute; two launches a training step's attention call), a
/// quarter of the f16/bf16 forward's time there.
///
/// Launch: one unit per (sequence, tile, key of the tile), `units` a cube;
/// `mask` and `key_valid` `[N, Tk]`, `tile_valid` `[N, ⌈Tk / tile_keys⌉]`,
/// contiguous.
#[cube(launch)]
pub fn key_validity<B: Int>(
    mask: &Tensor<B>,
    key_valid: &mut Tensor<f32>,
    tile_valid: &mut Tensor<f32>,
    #[comptime] tile_keys: usize,
    #[comptime] units: usize,
    #[define(B)] _bool: StorageType,
) {
    let mut valid_keys = SharedMemory::<f32>::new(units);
    let tiles = tile_valid.shape(1);
    let tk = key_valid.shape(1);
    let tile = ABSOLUTE_POS / tile_keys;
    let n = tile / tiles;
    let j = (tile % tiles) * tile_keys + ABSOLUTE_POS % tile_keys;
    let mut valid = 0.0f32;
    if tile < tile_valid.len() && j < tk {
        valid = select(mask[n * tk + j] == B::from_int(0), 1.0f32, 0.0f32);
        key_valid[n * tk + j] = valid;
    }
    valid_keys[UNIT_POS as usize] = valid;
    sync_cube();
    if ABSOLUTE_POS % tile_keys == 0 && tile < tile_valid.len() {
        let mut count = 0.0f32;
        #[unroll]
        for k in 0..tile_keys {
            count += valid_keys[UNIT_POS as usize + k];
        }
        tile_valid[tile] = count;
    }
}
