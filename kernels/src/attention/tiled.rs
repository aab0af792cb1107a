//! The attention backward as register-tiled products, for heads whose keys
//! fit one cube (the ASV level's 151): dQ, dK and dV of one (n, h) in one
//! cube ([`attention_backward_tiled`]); on CUDA cores, f32 arithmetic. The
//! f32 backward on CUDA wherever it fits (`plan.rs`). No Burn imports here.
//!
//! Why a third backward: [`attention_backward_merged`](super::rows) gives
//! each unit half of a key and walks the queries one at a time. Every
//! (query, key) pair then costs its unit two dot products finished by plane
//! shuffles, an exponential and a dropout hash per half, and four quad
//! loads for 32 multiply-adds; Nsight Compute counted ~276 instructions a
//! pair, 168 registers a unit and one cube an SM (H100, 2026-11-27).
//! Here the work of a query tile is three small matrix products, and each
//! unit owns a 4 × 4 block of one of them, as a matmul's units do:
//!
//! 1. `S = Q·Kᵀ` and `dP = dO·Vᵀ` (queries × keys): per head dimension, a
//!    unit's block of four queries and four keys loads one quad of `Qᵀ` and
//!    one of `Kᵀ` (both stored dimension-major) for 16 multiply-adds; then
//!    `P = exp(S − lse)`, parked in shared memory while the same registers
//!    sum `dP` (so 16 sums are live, not 32), the dropout mask and
//!    `dS = P·(dP − Δ)` once per pair, into shared memory.
//! 2. `dV += P̃ᵀ·dO` and `dK += dSᵀ·Q` (keys × head dims, summed over all
//!    query tiles in registers): a unit owns four keys × four dims of each.
//! 3. `dQ = scale · dS·K` (the tile's queries × head dims): a unit owns
//!    four queries × four dims over a quarter of the keys; the four quarters
//!    are four adjacent units, added by plane shuffles.
//!
//! Each product reads two quads per 16 multiply-adds, and a pair's
//! exponential and hash are computed once. A plane's units are laid out so
//! that a load touches few distinct quads (eight key quads × four query or
//! dim quads; a plane over 32 key quads of one query quad needed 135
//! registers and was slower than the merged kernel). The next tile is
//! staged after a tile's steps 2-3 (two copies of the row-major q and dO
//! tiles), which leaves two cube syncs a tile. Holding it in registers
//! across those steps instead took the kernel past 96 registers, to one cube
//! an SM, and was slower (`docs/performance.md`, 2026-11-27).
//!
//! Shared memory: `Kᵀ`, `Vᵀ` of the whole head, `Qᵀ` and `dOᵀ` of a tile,
//! two copies of the tile's q and dO by row, `P̃` and `dS` of a tile
//! (112,512 bytes at 151 keys, head dim 32, 32 queries a tile): with 96
//! registers a unit, two cubes an H100 SM. Rows are an odd number of quads
//! apart, so that units reading rows four apart fall in different banks.
//! CUDA only: wgpu gives a cube 16 KiB by default, and HIP's 64 KiB would
//! need smaller tiles, which are untested; elsewhere the merged kernel runs.
//!
//! Semantics are the merged kernel's: q is scaled (and biased) as loaded,
//! a masked key's `P` is zero whatever its score, rows past the end have
//! `lse = +1e30` (so `P = 0`) and zero q and dO, the dropout hash is that of
//! `(seed, bh, query, key)`, and a masked key's dK and dV are written as 0.

use cubecl::prelude::*;

use super::args::{Operands, Scalars};
use super::mma_io::{head_rows, read_quad, HeadRows};
use crate::cube::{bias_at, cube_head, dropout_keep, row_start, CubeHead, Quad, FAST_EXP};

/// Quads between two rows of a shared-memory matrix `quads` quads wide:
/// the next odd number (see the module doc).
pub const fn odd_stride(quads: usize) -> usize {
    quads | 1
}

/// Quads of keys the kernel works on: `keys` in quads, rounded up to a
/// multiple of 8 (a plane's eight columns of key quads; the quads past the
/// keys are padding, masked).
pub const fn padded_key_quads(keys: usize) -> usize {
    keys.div_ceil(4).next_multiple_of(8)
}

/// Shared memory (bytes) of [`attention_backward_tiled`] for `keys` keys,
/// head dim `head_dim` and `tile` queries a tile.
pub fn tiled_shared_bytes(keys: usize, head_dim: usize, tile: usize) -> usize {
    let key_stride = odd_stride(padded_key_quads(keys));
    let row_stride = odd_stride(head_dim / 4);
    let quads = 2 * head_dim * key_stride // Kᵀ, Vᵀ
        + 2 * 2 * tile * row_stride // q, dO by row, two copies
        + 2 * head_dim * odd_stride(tile / 4) // Qᵀ, dOᵀ
        + 2 * tile * key_stride // P̃, dS
        + padded_key_quads(keys); // key validity
    quads * 16 + 2 * tile * 4
}

/// Backward of one (n, h) a cube: `dQ`, `dK`, `dV` (see the module doc).
/// `keys` is the key count (`k.shape(2)`), `tile` the queries a tile (a
/// multiple of 16), `head_dim` 16, 32 or 64, `units` the cube's units:
/// [`padded_key_quads`]`(keys) · head_dim/4` (one (key quad, dim quad)
/// block of dK and dV each, a multiple of 32), at least `tile`.
///
/// Launch: cube x: n·H + h − bh_offset; `units` units.
#[cube(launch, fast_math = FAST_EXP)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_tiled<F: Float, N: Size>(
    ops: &Operands<Vector<F, N>, Vector<F, N>, F>,
    dout: &Tensor<Vector<F, N>>,
    out: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    dkv: &mut Tensor<F>,
    dq: &mut Tensor<F>,
    call: &Scalars,
    #[comptime] head_dim: usize,
    #[comptime] keys: usize,
    #[comptime] tile: usize,
    #[comptime] units: usize,
    #[comptime] use_dropout: bool,
    #[comptime] with_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, bias, key_valid) = (&ops.q, &ops.k, &ops.v, &ops.bias, &ops.key_valid);
    let tq = q.shape(2);
    let head = cube_head(call.heads, call.bh_offset, call.seed);
    let unit = UNIT_POS_X as usize;
    let key_quads = comptime!(padded_key_quads(keys));
    let key_stride = comptime!(odd_stride(padded_key_quads(keys)));
    let row_stride = comptime!(odd_stride(head_dim / 4));
    let row_tile = comptime!(tile * odd_stride(head_dim / 4));

    let mut shared = TiledShared {
        qt: SharedMemory::<Quad>::new(comptime!(head_dim * odd_stride(tile / 4))),
        dot: SharedMemory::<Quad>::new(comptime!(head_dim * odd_stride(tile / 4))),
        kt: SharedMemory::<Quad>::new(comptime!(head_dim * odd_stride(padded_key_quads(keys)))),
        vt: SharedMemory::<Quad>::new(comptime!(head_dim * odd_stride(padded_key_quads(keys)))),
        q_rows: SharedMemory::<Quad>::new(comptime!(2 * tile * odd_stride(head_dim / 4))),
        do_rows: SharedMemory::<Quad>::new(comptime!(2 * tile * odd_stride(head_dim / 4))),
        p: SharedMemory::<Quad>::new(comptime!(tile * odd_stride(padded_key_quads(keys)))),
        ds: SharedMemory::<Quad>::new(comptime!(tile * odd_stride(padded_key_quads(keys)))),
        valid: SharedMemory::<Quad>::new(key_quads),
        lse: SharedMemory::<f32>::new(tile),
        delta: SharedMemory::<f32>::new(tile),
    };

    let views = QueryTileRows {
        q: head_rows(q, 0u32, &head),
        dout: head_rows(dout, 0u32, &head),
        out: head_rows(out, 0u32, &head),
    };
    load_key_rows::<F, N>(
        k,
        v,
        &head_rows(k, call.k_offset, &head),
        &head_rows(v, call.v_offset, &head),
        bias,
        key_valid,
        &head,
        &mut shared.kt,
        &mut shared.vt,
        &mut shared.valid,
        call.k_offset,
        call.v_offset,
        head_dim,
        keys,
        units,
        with_bias,
    );

    // The unit's block of dK and dV: keys 4·kb.., dims 4·db.. (`dk[j]`: key
    // 4·kb + j). A plane takes eight key quads × four dim quads, so that
    // each of its loads reads at most eight distinct quads.
    let lane = unit % 32;
    let plane = unit / 32;
    let dim_groups = comptime!(head_dim / 16);
    let own_db = (plane % dim_groups) * 4 + lane / 8;
    let own_kb = (plane / dim_groups) * 8 + lane % 8;
    let mut dk = Array::<Quad>::new(4usize);
    let mut dv = Array::<Quad>::new(4usize);
    #[unroll]
    for j in 0..4usize {
        dk[j] = Quad::new(0.0f32);
        dv[j] = Quad::new(0.0f32);
    }

    let n_tiles = tq.div_ceil(tile);
    stage_query_tile::<F, N>(
        q,
        dout,
        out,
        &views,
        lse,
        bias,
        &head,
        &mut shared,
        0,
        0,
        tq,
        call.scale,
        head_dim,
        tile,
        units,
        with_bias,
    );
    sync_cube();
    scores_and_gradients(
        &mut shared,
        &head,
        0,
        call.dropout_threshold,
        call.dropout_scale,
        keys,
        tile,
        head_dim,
        units,
        use_dropout,
    );
    sync_cube();

    for t in 0..n_tiles {
        let start = t * tile;
        let buffer = (t % 2) * row_tile;
        let next_buffer = ((t + 1) % 2) * row_tile;
        // Step 3: dQ = scale · dS·K.
        weights_times_keys::<F>(
            &shared.ds,
            &shared.kt,
            &shared.valid,
            dq,
            &head,
            start,
            tq,
            call.scale,
            keys,
            tile,
            head_dim,
            units,
        );
        let valid = shared.valid[own_kb];
        if valid[0] + valid[1] + valid[2] + valid[3] > 0.0 {
            for i4 in 0..comptime!(tile / 4) {
                #[unroll]
                for r in 0..4usize {
                    let i = i4 * 4 + r;
                    let p = shared.p[i * key_stride + own_kb];
                    let ds = shared.ds[i * key_stride + own_kb];
                    let o = shared.do_rows[buffer + i * row_stride + own_db];
                    let x = shared.q_rows[buffer + i * row_stride + own_db];
                    #[unroll]
                    for j in 0..4usize {
                        dv[j] = dv[j] + Quad::new(p[j]) * o;
                        dk[j] = dk[j] + Quad::new(ds[j]) * x;
                    }
                }
            }
        }
        // This tile's q and dO (read above) are done with: the next tile's
        // take the other copy, `Qᵀ` and `dOᵀ` (read only by step 1).
        if t + 1 < n_tiles {
            stage_query_tile::<F, N>(
                q,
                dout,
                out,
                &views,
                lse,
                bias,
                &head,
                &mut shared,
                start + tile,
                next_buffer,
                tq,
                call.scale,
                head_dim,
                tile,
                units,
                with_bias,
            );
        }
        sync_cube();
        if t + 1 < n_tiles {
            scores_and_gradients(
                &mut shared,
                &head,
                start + tile,
                call.dropout_threshold,
                call.dropout_scale,
                keys,
                tile,
                head_dim,
                units,
                use_dropout,
            );
        }
        sync_cube();
    }

    let valid = shared.valid[own_kb];
    #[unroll]
    for j in 0..4usize {
        let key = own_kb * 4 + j;
        if key < keys {
            let active = valid[j] > 0.0;
            let dk_at = row_start(dkv, call.dk_offset, head.n, head.h, key) + own_db * 4;
            let dv_at = row_start(dkv, call.dv_offset, head.n, head.h, key) + own_db * 4;
            let dk_j = dk[j];
            let dv_j = dv[j];
            #[unroll]
            for c in 0..4usize {
                dkv[dk_at + c] = F::cast_from(select(active, dk_j[c], 0.0f32));
                dkv[dv_at + c] = F::cast_from(select(active, dv_j[c], 0.0f32));
            }
        }
    }
}

/// The shared memory of [`attention_backward_tiled`]: dimension-major `Kᵀ`,
/// `Vᵀ` (quad `d·key_stride + kb` holds keys `4·kb..` of dimension `d`) and
/// the tile's `Qᵀ`, `dOᵀ` (likewise by query); the tile's q and dO by row
/// (rows `odd_stride(head_dim/4)` quads apart, two copies); `P̃` and `dS` by query
/// (quad `i·key_stride + kb`); key validity by quad; the tile's
/// log-sum-exp and Δ.
#[derive(CubeType)]
struct TiledShared {
    qt: SharedMemory<Quad>,
    dot: SharedMemory<Quad>,
    kt: SharedMemory<Quad>,
    vt: SharedMemory<Quad>,
    q_rows: SharedMemory<Quad>,
    do_rows: SharedMemory<Quad>,
    p: SharedMemory<Quad>,
    ds: SharedMemory<Quad>,
    valid: SharedMemory<Quad>,
    lse: SharedMemory<f32>,
    delta: SharedMemory<f32>,
}

/// Stages the query tile at row `start`: q (scaled, with its bias) and dO
/// by row at quad `buffer` (rows `odd_stride(head_dim/4)` quads apart) and
/// by dimension (`Qᵀ`, `dOᵀ`: one copy, read only by step 1; a unit reads
/// four rows × one quad of dims and writes both), zeros past `tq`; the
/// log-sum-exp (`+1e30` past `tq`, so that its probabilities are 0) and
/// `Δ = rowsum(dO ⊙ O)`,
/// whose quads' shares (adjacent units) meet by plane shuffles. Every unit
/// must call it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_query_tile<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    dout: &Tensor<Vector<F, N>>,
    out: &Tensor<Vector<F, N>>,
    views: &QueryTileRows,
    lse: &Tensor<f32>,
    bias: &Tensor<F>,
    head: &CubeHead,
    shared: &mut TiledShared,
    start: usize,
    buffer: usize,
    tq: usize,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] units: usize,
    #[comptime] with_bias: bool,
) {
    let unit = UNIT_POS_X as usize;
    let dim_quads = comptime!(head_dim / 4);
    let row_stride = comptime!(odd_stride(head_dim / 4));
    let query_stride = comptime!(odd_stride(tile / 4));
    let q_bias = head.h * head_dim;
    let items = comptime!(tile / 4 * (head_dim / 4));
    // A unit takes four rows × one quad of dims: q and dO by row (one
    // vector load a row, where `N` is 4) and, transposed in registers, by
    // dimension (`Qᵀ`, `dOᵀ`), so each is read once. Consecutive units take
    // consecutive quads of the same rows, so that a row's `Δ` meets by
    // shuffles within a plane (`dim_quads` divides 32).
    #[unroll]
    for round in 0..comptime!(items.div_ceil(units)) {
        let item = unit + round * units;
        let qb = item / dim_quads;
        let d4 = item % dim_quads;
        let mut xq = Sequence::<Quad>::new();
        let mut xdo = Sequence::<Quad>::new();
        let mut shares = Array::<f32>::new(4usize);
        #[unroll]
        for i in 0..4usize {
            let row = start + qb * 4 + i;
            let mut x = Quad::new(0.0f32);
            let mut g = Quad::new(0.0f32);
            let mut share = 0.0f32;
            if item < items && row < tq {
                let d = d4 * 4;
                let raw = read_quad::<F, N>(q, views.q.base + row * views.q.stride + d);
                g = read_quad::<F, N>(dout, views.dout.base + row * views.dout.stride + d);
                let o = read_quad::<F, N>(out, views.out.base + row * views.out.stride + d);
                #[unroll]
                for c in 0..4usize {
                    x[c] = (raw[c] + bias_at(bias, q_bias + d + c, with_bias)) * scale;
                    share += g[c] * o[c];
                }
            }
            xq.push(x);
            xdo.push(g);
            shares[i] = share;
        }
        #[unroll]
        for i in 0..4usize {
            let mut share = shares[i];
            let mut offset = 1u32;
            #[unroll]
            for _ in 0..comptime!((head_dim / 4).ilog2() as usize) {
                share += plane_shuffle_xor(share, offset);
                offset *= 2;
            }
            shares[i] = share;
        }
        if item < items {
            #[unroll]
            for i in 0..4usize {
                let r = qb * 4 + i;
                shared.q_rows[buffer + r * row_stride + d4] = *xq.index(i);
                shared.do_rows[buffer + r * row_stride + d4] = *xdo.index(i);
                if d4 == 0 {
                    shared.delta[r] = shares[i];
                }
            }
            #[unroll]
            for c in 0..4usize {
                let mut tq4 = Quad::new(0.0f32);
                let mut tdo4 = Quad::new(0.0f32);
                #[unroll]
                for i in 0..4usize {
                    tq4[i] = xq.index(i)[c];
                    tdo4[i] = xdo.index(i)[c];
                }
                shared.qt[(d4 * 4 + c) * query_stride + qb] = tq4;
                shared.dot[(d4 * 4 + c) * query_stride + qb] = tdo4;
            }
        }
    }
    if unit < tile {
        let mut lse_row = 1.0e30f32;
        if start + unit < tq {
            lse_row = lse[head.bh * tq + start + unit];
        }
        shared.lse[unit] = lse_row;
    }
}

/// The tiled backward's query-side rows: q, dO and the output.
#[derive(CubeType)]
struct QueryTileRows {
    q: HeadRows,
    dout: HeadRows,
    out: HeadRows,
}

/// Loads a head's key validity by quad, then `Kᵀ` and `Vᵀ` with a unit
/// reading four keys × one quad of dims of each (one
/// vector load a key, where `N` is 4) and writing them transposed.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_key_rows<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    k_rows: &HeadRows,
    v_rows: &HeadRows,
    bias: &Tensor<F>,
    key_valid: &Tensor<f32>,
    head: &CubeHead,
    kt: &mut SharedMemory<Quad>,
    vt: &mut SharedMemory<Quad>,
    valid: &mut SharedMemory<Quad>,
    k_offset: u32,
    v_offset: u32,
    #[comptime] head_dim: usize,
    #[comptime] keys: usize,
    #[comptime] units: usize,
    #[comptime] with_bias: bool,
) {
    let key_quads = comptime!(padded_key_quads(keys));
    let key_stride = comptime!(odd_stride(padded_key_quads(keys)));
    let dim_quads = comptime!(head_dim / 4);
    let unit = UNIT_POS_X as usize;
    load_key_validity(key_valid, head, valid, keys, units);
    let k_bias = k_offset as usize + head.h * head_dim;
    let v_bias = v_offset as usize + head.h * head_dim;
    let mut item = unit;
    while item < key_quads * dim_quads {
        let kb = item / dim_quads;
        let d = (item % dim_quads) * 4;
        let mut xk = Sequence::<Quad>::new();
        let mut xv = Sequence::<Quad>::new();
        #[unroll]
        for j in 0..4usize {
            let key = kb * 4 + j;
            let mut a = Quad::new(0.0f32);
            let mut b = Quad::new(0.0f32);
            if key < keys {
                if key_valid[head.n * keys + key] > 0.0 {
                    a = read_quad::<F, N>(k, k_rows.base + key * k_rows.stride + d);
                    b = read_quad::<F, N>(v, v_rows.base + key * v_rows.stride + d);
                    #[unroll]
                    for c in 0..4usize {
                        a[c] += bias_at(bias, k_bias + d + c, with_bias);
                        b[c] += bias_at(bias, v_bias + d + c, with_bias);
                    }
                }
            }
            xk.push(a);
            xv.push(b);
        }
        #[unroll]
        for c in 0..4usize {
            let mut tk4 = Quad::new(0.0f32);
            let mut tv4 = Quad::new(0.0f32);
            #[unroll]
            for j in 0..4usize {
                tk4[j] = xk.index(j)[c];
                tv4[j] = xv.index(j)[c];
            }
            kt[(d + c) * key_stride + kb] = tk4;
            vt[(d + c) * key_stride + kb] = tv4;
        }
        item += units;
    }
}

/// Step 1 for the staged tile at row `start`: each unit's blocks of four
/// queries × four keys get `P̃` (after dropout) and `dS = P·(dP − Δ)` into
/// shared memory. A block of four masked keys is zero without products.
#[cube]
#[allow(clippy::too_many_arguments)]
fn scores_and_gradients(
    shared: &mut TiledShared,
    head: &CubeHead,
    start: usize,
    dropout_threshold: u32,
    dropout_scale: f32,
    #[comptime] keys: usize,
    #[comptime] tile: usize,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
    #[comptime] use_dropout: bool,
) {
    let key_stride = comptime!(odd_stride(padded_key_quads(keys)));
    // A plane takes four query quads × eight key quads (see `own_kb`).
    let query_groups = comptime!(tile / 16);
    let lane = UNIT_POS_X as usize % 32;
    let mut plane = UNIT_POS_X as usize / 32;
    while plane < comptime!(tile / 16 * (padded_key_quads(keys) / 8)) {
        let qb = (plane % query_groups) * 4 + lane / 8;
        let kb = (plane / query_groups) * 8 + lane % 8;
        let valid = shared.valid[kb];
        let any = valid[0] + valid[1] + valid[2] + valid[3] > 0.0;
        // `acc[i]`: query 4·qb + i against the four keys: the scores, whose
        // probabilities wait in `shared.p` (this unit's own quads) while the
        // same registers sum dP, so that only 16 sums are live at a time.
        let mut acc = Array::<Quad>::new(4usize);
        #[unroll]
        for i in 0..4usize {
            acc[i] = Quad::new(0.0f32);
        }
        if any {
            add_block_product(
                &mut acc, &shared.qt, &shared.kt, qb, kb, head_dim, tile, keys,
            );
        }
        #[unroll]
        for i in 0..4usize {
            let lse_i = shared.lse[qb * 4 + i];
            let s = acc[i];
            let mut e = Quad::new(0.0f32);
            #[unroll]
            for j in 0..4usize {
                // 0 for a masked key: its exp(0 − lse) could overflow.
                e[j] = select(valid[j] > 0.0, (s[j] - lse_i).exp(), 0.0f32);
            }
            shared.p[(qb * 4 + i) * key_stride + kb] = e;
            acc[i] = Quad::new(0.0f32);
        }
        if any {
            add_block_product(
                &mut acc,
                &shared.dot,
                &shared.vt,
                qb,
                kb,
                head_dim,
                tile,
                keys,
            );
        }
        #[unroll]
        for i in 0..4usize {
            let row = qb * 4 + i;
            let delta_i = shared.delta[row];
            let p_i = shared.p[row * key_stride + kb];
            let dp_i = acc[i];
            let mut kept = p_i;
            let mut ds = Quad::new(0.0f32);
            #[unroll]
            for j in 0..4usize {
                let mut dp_ij = dp_i[j];
                if use_dropout {
                    let keep = dropout_keep(
                        head.head_key,
                        (start + row) as u32,
                        (kb * 4 + j) as u32,
                        dropout_threshold,
                    );
                    kept[j] = select(keep, p_i[j] * dropout_scale, 0.0f32);
                    dp_ij = select(keep, dp_ij * dropout_scale, 0.0f32);
                }
                ds[j] = p_i[j] * (dp_ij - delta_i);
            }
            shared.p[row * key_stride + kb] = kept;
            shared.ds[row * key_stride + kb] = ds;
        }
        plane += comptime!(units / 32);
    }
}

/// `acc[i] += Σ_d xt[d][4·qb + i] · yt[d][4·kb..]`: a block of four rows
/// (queries) × four keys of `X·Yᵀ` from dimension-major `Xᵀ` (`tile` rows,
/// `Qᵀ` or `dOᵀ`) and `Yᵀ` (the keys, `Kᵀ` or `Vᵀ`): one quad of each per
/// dimension for 16 multiply-adds.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_block_product(
    acc: &mut Array<Quad>,
    xt: &SharedMemory<Quad>,
    yt: &SharedMemory<Quad>,
    qb: usize,
    kb: usize,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] keys: usize,
) {
    let query_stride = comptime!(odd_stride(tile / 4));
    let key_stride = comptime!(odd_stride(padded_key_quads(keys)));
    for d4 in 0..comptime!(head_dim / 4) {
        #[unroll]
        for c in 0..4usize {
            let d = d4 * 4 + c;
            let x = xt[d * query_stride + qb];
            let y = yt[d * key_stride + kb];
            #[unroll]
            for i in 0..4usize {
                acc[i] = acc[i] + Quad::new(x[i]) * y;
            }
        }
    }
}

/// `factor · W·K` for a tile's rows into `dst` (rows `start..` of head
/// (n, h), up to `tq`), where `W` (`weights`, by row, quads of four keys)
/// is the tile's `dS` or `P̃` and `K` the keys' `Kᵀ` or `Vᵀ` (by
/// dimension): the backward's `dQ = scale · dS·K`. Four adjacent units share a block of four rows × four dims,
/// each taking every fourth quad of keys, and add their sums by shuffles;
/// unit `s` of the four writes the block's row `s`. A plane takes four row
/// quads × two dim quads (at most eight distinct quads a load of `K`,
/// sixteen of `W`). Every unit must call it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn weights_times_keys<F: Float>(
    weights: &SharedMemory<Quad>,
    keys_t: &SharedMemory<Quad>,
    valid: &SharedMemory<Quad>,
    dst: &mut Tensor<F>,
    head: &CubeHead,
    start: usize,
    tq: usize,
    factor: f32,
    #[comptime] keys: usize,
    #[comptime] tile: usize,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
) {
    let key_quads = comptime!(padded_key_quads(keys));
    let key_stride = comptime!(odd_stride(padded_key_quads(keys)));
    let dim_pairs = comptime!(head_dim / 8);
    let planes = comptime!(tile / 16 * (head_dim / 8));
    let lane = UNIT_POS_X as usize % 32;
    let share = lane % 4;
    #[unroll]
    for round in 0..comptime!((tile / 16 * (head_dim / 8)).div_ceil(units / 32)) {
        // Uniform over a plane, whose units all shuffle.
        let plane = UNIT_POS_X as usize / 32 + round * comptime!(units / 32);
        let qb = (plane / dim_pairs) * 4 + lane / 8;
        let db = (plane % dim_pairs) * 2 + (lane / 4) % 2;
        // `acc[i]`: row 4·qb + i, dims 4·db..
        let mut acc = Array::<Quad>::new(4usize);
        #[unroll]
        for i in 0..4usize {
            acc[i] = Quad::new(0.0f32);
        }
        if plane < planes {
            let mut kb = share;
            while kb < key_quads {
                let valid_kb = valid[kb];
                if valid_kb[0] + valid_kb[1] + valid_kb[2] + valid_kb[3] > 0.0 {
                    // `kk[c]`: dimension 4·db + c of the four keys.
                    let mut kk = Array::<Quad>::new(4usize);
                    #[unroll]
                    for c in 0..4usize {
                        kk[c] = keys_t[(db * 4 + c) * key_stride + kb];
                    }
                    #[unroll]
                    for i in 0..4usize {
                        let w = weights[(qb * 4 + i) * key_stride + kb];
                        let mut sum = acc[i];
                        #[unroll]
                        for c in 0..4usize {
                            let y = kk[c];
                            #[unroll]
                            for j in 0..4usize {
                                sum[c] += w[j] * y[j];
                            }
                        }
                        acc[i] = sum;
                    }
                }
                kb += 4;
            }
        }
        #[unroll]
        for i in 0..4usize {
            let mut sum = acc[i];
            #[unroll]
            for c in 0..4usize {
                sum[c] += plane_shuffle_xor(sum[c], 1u32);
                sum[c] += plane_shuffle_xor(sum[c], 2u32);
            }
            acc[i] = sum;
        }
        let row = start + qb * 4 + share;
        if plane < planes && row < tq {
            let at = row_start(dst, 0u32, head.n, head.h, row) + db * 4;
            #[unroll]
            for i in 0..4usize {
                if i == share {
                    let x = acc[i];
                    #[unroll]
                    for c in 0..4usize {
                        dst[at + c] = F::cast_from(x[c] * factor);
                    }
                }
            }
        }
    }
}

/// Loads a head's key validity by quad of keys (0 past `keys`), for both
/// key loaders.
#[cube]
fn load_key_validity(
    key_valid: &Tensor<f32>,
    head: &CubeHead,
    valid: &mut SharedMemory<Quad>,
    #[comptime] keys: usize,
    #[comptime] units: usize,
) {
    let mut kb = UNIT_POS_X as usize;
    while kb < comptime!(padded_key_quads(keys)) {
        let mut x = Quad::new(0.0f32);
        #[unroll]
        for j in 0..4usize {
            let key = kb * 4 + j;
            if key < keys {
                x[j] = key_valid[head.n * keys + key];
            }
        }
        valid[kb] = x;
        kb += units;
    }
}
