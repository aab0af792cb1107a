//! The attention backward on tensor cores for f16/bf16, with the products'
//! operands and results in registers (`mma.sync.m16n8k16`, the layouts of
//! `mma.rs`): [`attention_backward_dq_mma_half`] (dQ and `Δ`), then
//! [`attention_backward_dkdv_mma_half`] (dK and dV). CUDA only. No Burn
//! imports here.
//!
//! Why: `tensor_core.rs`'s `cmma` backward sends every score through shared
//! memory, as its forward does (the fragments' layout is opaque); at the ASV
//! shape on the H100 its forward+backward took 1.14x cuDNN's time
//! (2026-11-27). Here each
//! kernel is the forward's shape with more products, FlashAttention-2's
//! split into a query-major and a key-major pass (no atomics, so the result
//! is deterministic):
//!
//! - dQ: a plane owns 16 queries, `Q` and `dO` operands in registers (as the
//!   forward's `Q`), and walks the keys in chunks of 16: `S = Q·Kᵀ`,
//!   `dP = dO·Vᵀ` (K and V by row in shared memory), `P = exp(S − lse)`,
//!   `dS = P ⊙ (dP̃ − Δ)` on the accumulator registers, then `dQ += dS·K`
//!   with `dS` as the `A` operand as it stands (K by dim in shared memory).
//!   It computes `Δ = rowsum(dO ⊙ O)` of its rows first and writes it for
//!   the second kernel.
//! - dK/dV: a plane owns 16 keys, `K` and `V` operands in registers, and
//!   walks the queries in chunks of 16: `Sᵀ = K·Qᵀ`, `dPᵀ = V·dOᵀ` (Q and dO
//!   by row), `Pᵀ = exp(Sᵀ − lse)` with the chunk's `lse` and `Δ` from
//!   shared memory, then `dV += P̃ᵀ·dO` and `dK += dSᵀ·Q` (Q and dO by dim).
//!   A unit's two keys are fixed, so the key mask is two registers.
//!
//! Where a head's rows of the other side fit a cube (the ASV level's 151)
//! they are loaded once; else (the sample level's 1,024) they stream
//! through shared memory a block at a time, and the dQ kernel skips blocks
//! and chunks of keys that are all padding, as the forward does; the dK/dV
//! kernel's planes whose keys are all padding skip the products (a cube of
//! them only writes zeros). Semantics are the other backwards': q scaled
//! (and biased) as loaded, the dropout hash of `(seed, bh, query, key)`,
//! rows past the end with `lse = +1e30` (so `P = 0`) and zero q and dO,
//! zero dK and dV for masked keys; `P̃` and `dS` are rounded to the storage
//! type before their products, as in every tensor-core attention.
//!
//! Global memory goes through `mma_io.rs`: the other side's rows staged by
//! 16-byte vectors, both layouts from one read, a plane's own rows and its
//! results by pair (read one element at a time, global-load waits are most
//! of both kernels' stalls). Both kernels
//! launch unchecked (every global read is behind a row or key guard of its
//! own). Where queries stream the dK/dV kernel runs eight planes a cube
//! (`MmaBackward` in `forward.rs`): more, smaller cubes for the few with
//! valid keys. H100, bf16, forward+backward (2026-11-28): 1.24 ms at the
//! ASV shape against cuDNN's 3.12-3.16 (with the `cmma` backward 3.62,
//! 2026-11-27), 0.127-0.159 at the sample shape against 0.31-0.43
//! (`docs/performance.md`).

use cubecl::prelude::*;

use super::args::{Operands, Scalars};
use super::mma::{add_products_half, block_rows, load_validity, scores_half};
use super::mma_io::{
    half_stride, head_rows, row_operands, stage_rows, store_pair, AccPair, Half4, HeadRows, Pair,
    RowOperands, ValidPair,
};
use crate::cube::{cube_head, dropout_keep, CubeHead, FAST_EXP};

/// Shared memory (bytes) of [`attention_backward_dq_mma_half`] holding
/// `rows` key rows (K and V by row, K by dim), and of
/// [`attention_backward_dkdv_mma_half`] holding `rows` query rows (Q and dO
/// by row and by dim, lse and Δ).
pub fn mma_backward_shared_bytes(rows: usize, head_dim: usize, dkdv: bool) -> usize {
    let by_row = rows * half_stride(head_dim / 4) * 8;
    let by_dim = head_dim * half_stride(rows / 4) * 8;
    if dkdv {
        2 * (by_row + by_dim) + 2 * rows * 4
    } else {
        2 * by_row + by_dim + rows * 4 + rows.div_ceil(8) * 4
    }
}

/// The dQ kernel's shared memory: a block of keys (K and V by row, K by
/// dim), their validity by pair and each 16-key chunk's count of valid keys.
#[derive(CubeType)]
struct KeyBlock<F: Float> {
    k_rows: SharedMemory<Half4<F>>,
    v_rows: SharedMemory<Half4<F>>,
    k_dims: SharedMemory<Half4<F>>,
    valid: SharedMemory<ValidPair>,
    chunk_valid: SharedMemory<f32>,
}

/// The head's K and V rows in their buffers (offsets and dropout are the
/// launch's [`Scalars`]).
#[derive(CubeType)]
struct KeyViews {
    k: HeadRows,
    v: HeadRows,
}

/// A plane's 16 queries in the dQ kernel: the `Q` (scaled, biased) and `dO`
/// operands, `[lse(g), lse(g+8), Δ(g), Δ(g+8)]` and the unit's first row.
#[derive(CubeType)]
struct QueryRows<F: Float> {
    q_ops: RowOperands<F>,
    do_ops: RowOperands<F>,
    stats: Array<f32>,
    row0: usize,
}

/// dQ of one (n, h) and `Δ = rowsum(dO ⊙ O)` (f32, `[N·H, Tq]`), f16/bf16
/// on tensor cores (see the module doc). `keys` is `k.shape(2)` rounded up
/// (keys past it count as masked); `head_dim` 16, 32 or 64; `units` 32 a
/// plane. Where `keys ≤ block_keys` the cube loads all of the head's keys
/// once and its planes take blocks of 16 queries in turn; else (`keys` a
/// multiple of `block_keys`) each plane owns one block (cube y: which
/// `units / 32` blocks) and the keys stream through shared memory,
/// skipping blocks that are all padding.
///
/// Launch: cube x: n·H + h − bh_offset, y: query group; `units` units.
/// Unchecked (see `MmaBackward` in `forward.rs`): every global read is
/// guarded by the row and key counts.
#[cube(launch_unchecked, fast_math = FAST_EXP)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_dq_mma_half<F: Float, N: Size>(
    ops: &Operands<Pair<F>, Vector<F, N>, F>,
    out: &Tensor<Pair<F>>,
    dout: &Tensor<Pair<F>>,
    lse: &Tensor<f32>,
    dq: &mut Tensor<Pair<F>>,
    delta: &mut Tensor<f32>,
    call: &Scalars,
    #[comptime] head_dim: usize,
    #[comptime] keys: usize,
    #[comptime] block_keys: usize,
    #[comptime] units: usize,
    #[comptime] use_dropout: bool,
    #[comptime] with_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, bias, key_valid) = (&ops.q, &ops.k, &ops.v, &ops.bias, &ops.key_valid);
    let tq = q.shape(2);
    let head = cube_head(call.heads, call.bh_offset, call.seed);
    let rows = comptime!(block_rows(keys, block_keys, true));
    let mut stage = KeyBlock::<F> {
        k_rows: SharedMemory::<Half4<F>>::new(comptime!(
            block_rows(keys, block_keys, true) * half_stride(head_dim / 4)
        )),
        v_rows: SharedMemory::<Half4<F>>::new(comptime!(
            block_rows(keys, block_keys, true) * half_stride(head_dim / 4)
        )),
        k_dims: SharedMemory::<Half4<F>>::new(comptime!(
            head_dim * half_stride(block_rows(keys, block_keys, true) / 4)
        )),
        valid: SharedMemory::<ValidPair>::new(comptime!(block_rows(keys, block_keys, true) / 2)),
        chunk_valid: SharedMemory::<f32>::new(comptime!(
            block_rows(keys, block_keys, true).div_ceil(8)
        )),
    };
    let key_views = KeyViews {
        k: head_rows(k, call.k_offset, &head),
        v: head_rows(v, call.v_offset, &head),
    };
    let views = QueryViews {
        q: head_rows(q, 0u32, &head),
        out: head_rows(out, 0u32, &head),
        dout: head_rows(dout, 0u32, &head),
        dq: head_rows(dq, 0u32, &head),
    };
    let planes = comptime!(units / 32);
    if comptime!(keys <= block_keys) {
        load_keys::<F, N>(
            k, v, bias, key_valid, &head, &mut stage, &key_views, call, 0, keys, rows, head_dim,
            units, with_bias,
        );
        let mut block = UNIT_POS_X as usize / 32;
        while block < tq.div_ceil(16) {
            let query = query_rows::<F>(
                q, bias, out, dout, lse, delta, &head, &views, block, tq, call.scale, head_dim,
                with_bias,
            );
            let mut acc = zero_acc(head_dim);
            dq_block::<F>(
                &stage,
                &query,
                &mut acc,
                &head,
                call,
                0,
                keys,
                rows,
                head_dim,
                use_dropout,
            );
            write_dq::<F>(dq, &views.dq, &acc, query.row0, tq, call.scale, head_dim);
            block += planes;
        }
    } else {
        let block = CUBE_POS_Y as usize * planes + UNIT_POS_X as usize / 32;
        let query = query_rows::<F>(
            q, bias, out, dout, lse, delta, &head, &views, block, tq, call.scale, head_dim,
            with_bias,
        );
        let mut acc = zero_acc(head_dim);
        for b in 0..comptime!(keys / block_keys) {
            let start = b * block_keys;
            if load_keys::<F, N>(
                k, v, bias, key_valid, &head, &mut stage, &key_views, call, start, block_keys,
                rows, head_dim, units, with_bias,
            ) {
                dq_block::<F>(
                    &stage,
                    &query,
                    &mut acc,
                    &head,
                    call,
                    start,
                    block_keys,
                    rows,
                    head_dim,
                    use_dropout,
                );
            }
        }
        write_dq::<F>(dq, &views.dq, &acc, query.row0, tq, call.scale, head_dim);
    }
}

/// Loads keys `[start, start + count)` into `stage` (zero where masked or
/// past `count`) between two cube syncs; returns whether any is valid (the
/// same in every unit). Every unit must call it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_keys<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    bias: &Tensor<F>,
    key_valid: &Tensor<f32>,
    head: &CubeHead,
    stage: &mut KeyBlock<F>,
    views: &KeyViews,
    call: &Scalars,
    start: usize,
    #[comptime] count: usize,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
    #[comptime] with_bias: bool,
) -> bool {
    let any = load_validity(
        key_valid,
        head,
        &mut stage.valid,
        &mut stage.chunk_valid,
        start,
        count,
        rows,
        2usize,
        units,
    );
    if any {
        let k_bias = call.k_offset as usize + head.h * head_dim;
        let v_bias = call.v_offset as usize + head.h * head_dim;
        stage_rows::<F, N>(
            k,
            &views.k,
            bias,
            k_bias,
            &mut stage.k_rows,
            &mut stage.k_dims,
            &stage.valid,
            start,
            count,
            1.0f32,
            rows,
            head_dim,
            units,
            0usize,
            true,
            with_bias,
            false,
            true,
            true,
        );
        // V by row only (its by-dim buffer is K's, untouched): on the units
        // after K's.
        stage_rows::<F, N>(
            v,
            &views.v,
            bias,
            v_bias,
            &mut stage.v_rows,
            &mut stage.k_dims,
            &stage.valid,
            start,
            count,
            1.0f32,
            rows,
            head_dim,
            units,
            comptime!(rows / 4 * head_dim / 16),
            true,
            with_bias,
            false,
            true,
            false,
        );
    }
    sync_cube();
    any
}

/// The dQ kernel's query-side rows: Q, O, dO and dQ.
#[derive(CubeType)]
struct QueryViews {
    q: HeadRows,
    out: HeadRows,
    dout: HeadRows,
    dq: HeadRows,
}

/// A plane's [`QueryRows`] for query block `block`, computing and writing
/// its rows' `Δ = rowsum(dO ⊙ O)` (a unit sums its operand dims of its two
/// rows; the row's four units meet by two plane shuffles). Rows past `tq`
/// get `lse = +1e30` and `Δ = 0`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn query_rows<F: Float>(
    q: &Tensor<Pair<F>>,
    bias: &Tensor<F>,
    out: &Tensor<Pair<F>>,
    dout: &Tensor<Pair<F>>,
    lse: &Tensor<f32>,
    delta: &mut Tensor<f32>,
    head: &CubeHead,
    views: &QueryViews,
    block: usize,
    tq: usize,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] with_bias: bool,
) -> QueryRows<F> {
    let lane = UNIT_POS_X as usize % 32;
    let t = lane % 4;
    let row0 = block * 16 + lane / 4;
    let q_ops = row_operands::<F>(
        q,
        &views.q,
        bias,
        head.h * head_dim,
        block,
        tq,
        scale,
        head_dim,
        with_bias,
        true,
    );
    let do_ops = row_operands::<F>(
        dout,
        &views.dout,
        bias,
        0usize,
        block,
        tq,
        1.0f32,
        head_dim,
        false,
        false,
    );
    // Δ of rows g and g + 8: the unit's dims of dO are its operand's (no
    // second read of dO), times O's at the same dims.
    let mut sums = Array::<f32>::new(2usize);
    sums[0] = 0.0f32;
    sums[1] = 0.0f32;
    #[unroll]
    for s in 0..comptime!(head_dim / 16) {
        let ops = do_ops.index(s);
        #[unroll]
        for r in 0..4usize {
            let row = row0 + (r % 2) * 8;
            if row < tq {
                let d = s * 16 + t * 2 + (r / 2) * 8;
                let o = out[(views.out.base + row * views.out.stride + d) / 2];
                let pair = ops[r];
                sums[r % 2] += f32::cast_from(pair[0]) * f32::cast_from(o[0])
                    + f32::cast_from(pair[1]) * f32::cast_from(o[1]);
            }
        }
    }
    let mut stats = Array::<f32>::new(4usize);
    #[unroll]
    for r in 0..2usize {
        let row = row0 + r * 8;
        let mut sum = sums[r];
        let mut row_lse = 1.0e30f32;
        if row < tq {
            row_lse = lse[head.bh * tq + row];
        }
        sum += plane_shuffle_xor(sum, 1u32);
        sum += plane_shuffle_xor(sum, 2u32);
        if row < tq && t == 0 {
            delta[head.bh * tq + row] = sum;
        }
        stats[r] = row_lse;
        stats[2 + r] = sum;
    }
    QueryRows::<F> {
        q_ops,
        do_ops,
        stats,
        row0,
    }
}

/// Accumulators of 16 rows × `head_dim` (pairs by 8 dims), zeroed.
#[cube]
fn zero_acc(#[comptime] head_dim: usize) -> Sequence<Array<AccPair>> {
    let mut acc = Sequence::<Array<AccPair>>::new();
    #[unroll]
    for _ in 0..comptime!(head_dim / 8) {
        let mut pair = Array::<AccPair>::new(2usize);
        pair[0] = AccPair::new(0.0f32);
        pair[1] = AccPair::new(0.0f32);
        acc.push(pair);
    }
    acc
}

/// `dQ += dS·K` over a loaded block of `count` keys from key `start`, chunk
/// by chunk of 16 (chunks with no valid key skipped).
#[cube]
#[allow(clippy::too_many_arguments)]
fn dq_block<F: Float>(
    stage: &KeyBlock<F>,
    query: &QueryRows<F>,
    acc: &mut Sequence<Array<AccPair>>,
    head: &CubeHead,
    call: &Scalars,
    start: usize,
    #[comptime] count: usize,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] use_dropout: bool,
) {
    let t = UNIT_POS_X as usize % 4;
    let row_stride = comptime!(half_stride(head_dim / 4));
    let dim_stride = comptime!(half_stride(rows / 4));
    let lse0 = query.stats[0];
    let lse1 = query.stats[1];
    let delta0 = query.stats[2];
    let delta1 = query.stats[3];
    let row0 = query.row0 as u32;
    for c in 0..comptime!(count.div_ceil(16)) {
        if stage.chunk_valid[c] > 0.0 {
            let first = c * 2;
            let mut ds = scores_half::<F>(
                &stage.k_rows,
                &query.q_ops,
                first,
                2usize,
                head_dim,
                row_stride,
            );
            let dp = scores_half::<F>(
                &stage.v_rows,
                &query.do_ops,
                first,
                2usize,
                head_dim,
                row_stride,
            );
            #[unroll]
            for j in 0..2usize {
                let ok = stage.valid[(first + j) * 4 + t];
                let s = ds.index_mut(j);
                let g = dp.index(j);
                let mut w0 = s[0];
                let mut w1 = s[1];
                let g0 = g[0];
                let g1 = g[1];
                #[unroll]
                for e in 0..2usize {
                    let p0 = select(ok[e] > 0.0, (w0[e] - lse0).exp(), 0.0f32);
                    let p1 = select(ok[e] > 0.0, (w1[e] - lse1).exp(), 0.0f32);
                    let mut dp0 = g0[e];
                    let mut dp1 = g1[e];
                    if use_dropout {
                        let key = (start + (first + j) * 8 + t * 2 + e) as u32;
                        let keep0 = dropout_keep(head.head_key, row0, key, call.dropout_threshold);
                        let keep1 =
                            dropout_keep(head.head_key, row0 + 8, key, call.dropout_threshold);
                        dp0 = select(keep0, dp0 * call.dropout_scale, 0.0f32);
                        dp1 = select(keep1, dp1 * call.dropout_scale, 0.0f32);
                    }
                    w0[e] = select(ok[e] > 0.0, p0 * (dp0 - delta0), 0.0f32);
                    w1[e] = select(ok[e] > 0.0, p1 * (dp1 - delta1), 0.0f32);
                }
                s[0] = w0;
                s[1] = w1;
            }
            add_products_half::<F>(&ds, &stage.k_dims, acc, first, 2usize, head_dim, dim_stride);
        }
    }
}

/// Writes a plane's `scale · dQ` rows (accumulator layout: pair r at row
/// g + 8·r, columns 2t, 2t + 1 of each 8).
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_dq<F: Float>(
    dq: &mut Tensor<Pair<F>>,
    view: &HeadRows,
    acc: &Sequence<Array<AccPair>>,
    row0: usize,
    tq: usize,
    scale: f32,
    #[comptime] head_dim: usize,
) {
    let t = UNIT_POS_X as usize % 4;
    #[unroll]
    for dn in 0..comptime!(head_dim / 8) {
        let pair = acc.index(dn);
        #[unroll]
        for r in 0..2usize {
            let row = row0 + r * 8;
            if row < tq {
                store_pair::<F>(dq, view, row, dn * 8 + t * 2, pair[r], scale);
            }
        }
    }
}

/// The dK/dV kernel's shared memory: a block of queries (Q, scaled and
/// biased, and dO, by row and by dim) and their `lse` and `Δ` by pair.
#[derive(CubeType)]
struct QueryBlock<F: Float> {
    q_rows: SharedMemory<Half4<F>>,
    do_rows: SharedMemory<Half4<F>>,
    q_dims: SharedMemory<Half4<F>>,
    do_dims: SharedMemory<Half4<F>>,
    lse: SharedMemory<ValidPair>,
    delta: SharedMemory<ValidPair>,
}

/// A plane's 16 keys in the dK/dV kernel: the `K` and `V` operands, the
/// unit's two keys and their validity (1 or 0).
#[derive(CubeType)]
struct KeyRows<F: Float> {
    k_ops: RowOperands<F>,
    v_ops: RowOperands<F>,
    key0: usize,
    valid0: f32,
    valid1: f32,
}

/// dK and dV of one (n, h), f16/bf16 on tensor cores (see the module doc),
/// after [`attention_backward_dq_mma_half`] wrote `Δ`. A plane owns 16 keys
/// (cube y: which `units / 32` blocks of them); `queries` is `q.shape(2)`
/// rounded up to a multiple of `block_queries`, the rows of queries a cube
/// holds in shared memory at a time (all of them where they fit). dK and dV
/// go to `dkv` at `dk_offset` and `dv_offset` (0 for masked keys).
///
/// Launch: cube x: n·H + h − bh_offset, y: key group; `units` units.
/// Unchecked, as [`attention_backward_dq_mma_half`].
#[cube(launch_unchecked, fast_math = FAST_EXP)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_dkdv_mma_half<F: Float, N: Size>(
    ops: &Operands<Vector<F, N>, Pair<F>, F>,
    dout: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dkv: &mut Tensor<Pair<F>>,
    call: &Scalars,
    #[comptime] head_dim: usize,
    #[comptime] queries: usize,
    #[comptime] block_queries: usize,
    #[comptime] units: usize,
    #[comptime] use_dropout: bool,
    #[comptime] with_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, bias, key_valid) = (&ops.q, &ops.k, &ops.v, &ops.bias, &ops.key_valid);
    let tq = q.shape(2);
    let tk = k.shape(2);
    let head = cube_head(call.heads, call.bh_offset, call.seed);
    let planes = comptime!(units / 32);
    let mut stage = QueryBlock::<F> {
        q_rows: SharedMemory::<Half4<F>>::new(comptime!(block_queries * half_stride(head_dim / 4))),
        do_rows: SharedMemory::<Half4<F>>::new(comptime!(
            block_queries * half_stride(head_dim / 4)
        )),
        q_dims: SharedMemory::<Half4<F>>::new(comptime!(head_dim * half_stride(block_queries / 4))),
        do_dims: SharedMemory::<Half4<F>>::new(comptime!(
            head_dim * half_stride(block_queries / 4)
        )),
        lse: SharedMemory::<ValidPair>::new(comptime!(block_queries / 2)),
        delta: SharedMemory::<ValidPair>::new(comptime!(block_queries / 2)),
    };
    let mut cube_valid = SharedMemory::<f32>::new(1usize);
    let block = CUBE_POS_Y as usize * planes + UNIT_POS_X as usize / 32;
    let keys = key_rows::<F>(
        k, v, bias, key_valid, &head, block, tk, call, head_dim, with_bias,
    );
    let q_rows = head_rows(q, 0u32, &head);
    let do_rows = head_rows(dout, 0u32, &head);
    let plane_valid = plane_any(keys.valid0 + keys.valid1 > 0.0);
    // Whether any key of the cube is valid: else (padding past a sample's
    // ASVs) it only writes zeros.
    if UNIT_POS_X == 0 {
        cube_valid[0] = 0.0f32;
    }
    sync_cube();
    if plane_valid && UNIT_POS_X % 32 == 0 {
        cube_valid[0] = 1.0f32;
    }
    sync_cube();
    let any = cube_valid[0] > 0.0;
    let mut dk = zero_acc(head_dim);
    let mut dv = zero_acc(head_dim);
    if any {
        for b in 0..comptime!(queries / block_queries) {
            let start = b * block_queries;
            if start < tq {
                load_queries::<F, N>(
                    q,
                    &q_rows,
                    bias,
                    dout,
                    &do_rows,
                    lse,
                    delta,
                    &head,
                    &mut stage,
                    start,
                    tq,
                    call.scale,
                    block_queries,
                    head_dim,
                    units,
                    with_bias,
                );
                if plane_valid {
                    let chunks = (tq - start).div_ceil(16);
                    let mut c = 0usize;
                    while c < comptime!(block_queries / 16) && c < chunks {
                        dkdv_chunk::<F>(
                            &stage,
                            &keys,
                            &mut dk,
                            &mut dv,
                            &head,
                            c * 2,
                            start,
                            call,
                            block_queries,
                            head_dim,
                            use_dropout,
                        );
                        c += 1;
                    }
                }
            }
        }
    }
    write_dkdv::<F>(
        dkv,
        &head_rows(dkv, call.dk_offset, &head),
        &head_rows(dkv, call.dv_offset, &head),
        &dk,
        &dv,
        keys.key0,
        tk,
        head_dim,
    );
}

/// A plane's [`KeyRows`] for key block `block` (validity 0 past `tk`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn key_rows<F: Float>(
    k: &Tensor<Pair<F>>,
    v: &Tensor<Pair<F>>,
    bias: &Tensor<F>,
    key_valid: &Tensor<f32>,
    head: &CubeHead,
    block: usize,
    tk: usize,
    call: &Scalars,
    #[comptime] head_dim: usize,
    #[comptime] with_bias: bool,
) -> KeyRows<F> {
    let key0 = block * 16 + UNIT_POS_X as usize % 32 / 4;
    let k_ops = row_operands::<F>(
        k,
        &head_rows(k, call.k_offset, head),
        bias,
        call.k_offset as usize + head.h * head_dim,
        block,
        tk,
        1.0f32,
        head_dim,
        with_bias,
        false,
    );
    let v_ops = row_operands::<F>(
        v,
        &head_rows(v, call.v_offset, head),
        bias,
        call.v_offset as usize + head.h * head_dim,
        block,
        tk,
        1.0f32,
        head_dim,
        with_bias,
        false,
    );
    let mut valid0 = 0.0f32;
    let mut valid1 = 0.0f32;
    if key0 < tk {
        valid0 = key_valid[head.n * tk + key0];
    }
    if key0 + 8 < tk {
        valid1 = key_valid[head.n * tk + key0 + 8];
    }
    KeyRows::<F> {
        k_ops,
        v_ops,
        key0,
        valid0,
        valid1,
    }
}

/// Stages queries `[start, start + rows)` into `stage` (Q scaled and
/// biased; zeros, `lse = +1e30` and `Δ = 0` past `tq`) between two cube
/// syncs. Every unit must call it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_queries<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    q_rows: &HeadRows,
    bias: &Tensor<F>,
    dout: &Tensor<Vector<F, N>>,
    do_rows: &HeadRows,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    head: &CubeHead,
    stage: &mut QueryBlock<F>,
    start: usize,
    tq: usize,
    scale: f32,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
    #[comptime] with_bias: bool,
) {
    let end = tq - start;
    let items = comptime!(rows / 4 * head_dim / 16);
    sync_cube();
    stage_rows::<F, N>(
        q,
        q_rows,
        bias,
        head.h * head_dim,
        &mut stage.q_rows,
        &mut stage.q_dims,
        &stage.lse,
        start,
        end,
        scale,
        rows,
        head_dim,
        units,
        0usize,
        false,
        with_bias,
        true,
        true,
        true,
    );
    stage_rows::<F, N>(
        dout,
        do_rows,
        bias,
        0usize,
        &mut stage.do_rows,
        &mut stage.do_dims,
        &stage.lse,
        start,
        end,
        1.0f32,
        rows,
        head_dim,
        units,
        items,
        false,
        false,
        false,
        true,
        true,
    );
    // lse and Δ on the units after Q's and dO's.
    let unit = (UNIT_POS_X as usize + comptime!(2 * items)) % units;
    #[unroll]
    for i in 0..comptime!((rows / 2).div_ceil(units)) {
        let pair = i * units + unit;
        if pair < comptime!(rows / 2) {
            let mut l = ValidPair::new(1.0e30f32);
            let mut d = ValidPair::new(0.0f32);
            #[unroll]
            for e in 0..2usize {
                let row = pair * 2 + e;
                if row < end {
                    let at = head.bh * tq + start + row;
                    l[e] = lse[at];
                    d[e] = delta[at];
                }
            }
            stage.lse[pair] = l;
            stage.delta[pair] = d;
        }
    }
    sync_cube();
}

/// One chunk of 16 queries (tiles `first`, `first + 1` of the block at
/// query `start`): `Sᵀ`, `dPᵀ`, then `dV += P̃ᵀ·dO` and `dK += dSᵀ·Q`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn dkdv_chunk<F: Float>(
    stage: &QueryBlock<F>,
    keys: &KeyRows<F>,
    dk: &mut Sequence<Array<AccPair>>,
    dv: &mut Sequence<Array<AccPair>>,
    head: &CubeHead,
    first: usize,
    start: usize,
    call: &Scalars,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] use_dropout: bool,
) {
    let t = UNIT_POS_X as usize % 4;
    let row_stride = comptime!(half_stride(head_dim / 4));
    let dim_stride = comptime!(half_stride(rows / 4));
    let mut weights = scores_half::<F>(
        &stage.q_rows,
        &keys.k_ops,
        first,
        2usize,
        head_dim,
        row_stride,
    );
    let mut ds = scores_half::<F>(
        &stage.do_rows,
        &keys.v_ops,
        first,
        2usize,
        head_dim,
        row_stride,
    );
    let ok0 = keys.valid0 > 0.0;
    let ok1 = keys.valid1 > 0.0;
    let key0 = keys.key0 as u32;
    #[unroll]
    for j in 0..2usize {
        let lse = stage.lse[(first + j) * 4 + t];
        let delta = stage.delta[(first + j) * 4 + t];
        let s = weights.index_mut(j);
        let g = ds.index_mut(j);
        let mut w0 = s[0];
        let mut w1 = s[1];
        let mut g0 = g[0];
        let mut g1 = g[1];
        #[unroll]
        for e in 0..2usize {
            let p0 = select(ok0, (w0[e] - lse[e]).exp(), 0.0f32);
            let p1 = select(ok1, (w1[e] - lse[e]).exp(), 0.0f32);
            let mut z0 = 1.0f32;
            let mut z1 = 1.0f32;
            if use_dropout {
                let query = (start + (first + j) * 8 + t * 2 + e) as u32;
                z0 = select(
                    dropout_keep(head.head_key, query, key0, call.dropout_threshold),
                    call.dropout_scale,
                    0.0f32,
                );
                z1 = select(
                    dropout_keep(head.head_key, query, key0 + 8, call.dropout_threshold),
                    call.dropout_scale,
                    0.0f32,
                );
            }
            w0[e] = p0 * z0;
            w1[e] = p1 * z1;
            g0[e] = select(ok0, p0 * (g0[e] * z0 - delta[e]), 0.0f32);
            g1[e] = select(ok1, p1 * (g1[e] * z1 - delta[e]), 0.0f32);
        }
        s[0] = w0;
        s[1] = w1;
        g[0] = g0;
        g[1] = g1;
    }
    add_products_half::<F>(
        &weights,
        &stage.do_dims,
        dv,
        first,
        2usize,
        head_dim,
        dim_stride,
    );
    add_products_half::<F>(&ds, &stage.q_dims, dk, first, 2usize, head_dim, dim_stride);
}

/// Writes a plane's dK and dV rows (keys `key0`, `key0 + 8`; accumulator
/// layout as [`write_dq`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_dkdv<F: Float>(
    dkv: &mut Tensor<Pair<F>>,
    dk_rows: &HeadRows,
    dv_rows: &HeadRows,
    dk: &Sequence<Array<AccPair>>,
    dv: &Sequence<Array<AccPair>>,
    key0: usize,
    tk: usize,
    #[comptime] head_dim: usize,
) {
    let t = UNIT_POS_X as usize % 4;
    #[unroll]
    for dn in 0..comptime!(head_dim / 8) {
        let k_pair = dk.index(dn);
        let v_pair = dv.index(dn);
        #[unroll]
        for r in 0..2usize {
            let key = key0 + r * 8;
            if key < tk {
                let d = dn * 8 + t * 2;
                store_pair::<F>(dkv, dk_rows, key, d, k_pair[r], 1.0f32);
                store_pair::<F>(dkv, dv_rows, key, d, v_pair[r], 1.0f32);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ASV level's rows (151, rounded to 160) fit a cube in both
    /// kernels, so they are staged once; the sample level's 1,024 do not,
    /// and its blocks of 128 fit at every head dim the kernels take.
    #[test]
    fn staged_rows_fit_where_the_plan_expects() {
        let budget = 112 * 1024;
        for dkdv in [false, true] {
            assert!(mma_backward_shared_bytes(160, 32, dkdv) <= budget);
            assert!(mma_backward_shared_bytes(1024, 32, dkdv) > budget);
            for head_dim in [16, 32, 64] {
                assert!(mma_backward_shared_bytes(128, head_dim, dkdv) <= budget);
            }
        }
        // K and V by row and K by dim (dQ); Q and dO both ways (dK/dV).
        assert_eq!(
            mma_backward_shared_bytes(160, 32, false),
            2 * 160 * 12 * 8 + 32 * 44 * 8 + 160 * 4 + 20 * 4
        );
        assert_eq!(
            mma_backward_shared_bytes(160, 32, true),
            2 * (160 * 12 * 8 + 32 * 44 * 8) + 2 * 160 * 4
        );
    }
}
