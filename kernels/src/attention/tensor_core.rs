//! Attention on tensor cores, for f16 and bf16 (`cmma`, 16×16×16 tiles with
//! f32 accumulators): the forward and both backward kernels (dQ; dK and dV).
//! On CUDA (sm_80 on, head dims 16-64) `mma.rs` and `mma_backward.rs` run
//! instead, with the scores in the products' registers; these run on HIP,
//! at other head dims and before sm_80 (`plan.rs`). No Burn imports here.
//!
//! Why a second set of kernels: the CUDA-core kernels of `rows.rs` run
//! every product on FMA units and feed them from shared memory, which bounds
//! them (bf16 at the ASV shape on the H100: forward 1.40 ms and
//! forward+backward 6.13 ms, against 0.94 and 3.26 ms for PyTorch's best
//! tensor-core kernels). Here a plane owns 16 rows (queries, or keys for
//! dK/dV) and does the products for 16 rows of the other side at a time as
//! cooperative matrix products; its units only do the softmax and its
//! gradient, a few values each (forward 0.82 ms, forward+backward 3.97 ms;
//! `docs/performance.md`).
//!
//! The accumulator's element-to-unit layout is opaque (it differs between
//! CUDA, HIP and Vulkan), so the scores go through shared memory: the plane
//! stores `S` (f32), each unit reads the scores of its row and keys, updates
//! the row's running max and sum, and writes `P` (the storage type, with
//! dropout applied) for the `P·V` product. A row belongs to
//! `plane_size / 16` units (2 on CUDA, 4 on 64-wide AMD planes); unit `sub`
//! of a row takes keys (and output columns) `sub`, `sub + units`, … of
//! every 16, so that a plane's reads of a scratch row fall in different
//! banks, and the row's max and sum are merged by plane shuffles.
//!
//! The output stays in accumulator fragments. Rescaling it by the online
//! softmax's correction needs the row of each element, which only a trip
//! through shared memory gives, so the running max moves lazily: a row
//! keeps its max until a block's scores exceed it by more than
//! [`RESCALE_MARGIN`] (so `P ≤ e^8` before dropout, far inside f16's
//! range), and the plane rescales only when some row moved. The sum and the
//! output share that max, so the result is the same; for real scores the
//! first block sets a max the rest rarely exceed by 8.
//!
//! Shared-memory rows are padded ([`ROW_PAD`], [`SCRATCH_LD`],
//! [`WEIGHT_LD`]) so that fragment loads and the units' scratch reads do
//! not fall into the same banks.
//!
//! Semantics are those of `attention_forward` exactly: the same masked
//! score (`-1e30`), zero probabilities for masked keys, zero output and
//! log-sum-exp for a row with no valid key, the same dropout hash of
//! `(seed, bh, row, key)`, so either backward (these or the CUDA-core ones)
//! reproduces the mask and recomputes `P` from the log-sum-exp written here.
//! The difference is precision: `P` (and `dS` in the backward) is rounded to
//! the storage type before its product, as every tensor-core attention does
//! (well inside the f16/bf16 tolerance; `kernels/tests/half_precision.rs`).
//!
//! Blocks of 16 keys that are all padding are skipped one by one (per-block
//! valid counts computed before launch); a cube loads `blocks` of them at a
//! time into shared memory for all its planes.

use cubecl::cmma::{self, MatrixIdent, MatrixLayout};
use cubecl::prelude::*;

use super::args::{Operands, Scalars};
use crate::cube::{dropout_head_key, dropout_keep, FAST_EXP};

/// Side of a tensor-core tile: 16 rows, 16 keys, 16 head dims.
pub const TC_TILE: usize = 16;
/// Elements added to each `head_dim`-long row in shared memory: rows 16
/// bytes apart from a multiple of 128 put the 16 rows a fragment load reads
/// in different banks (a multiple of 8 elements, as fragment loads need).
pub const ROW_PAD: usize = 8;
/// Row stride (f32) of the 16×16 scratch tiles the fragments are stored
/// to: 20 puts the 16 rows two units at a time read in 16 banks.
pub const SCRATCH_LD: usize = 20;
/// Row stride (storage type) of the 16×16 weight tiles (`P`, `dS`).
pub const WEIGHT_LD: usize = 24;
/// How far (in natural-log units) a block's scores may exceed a row's
/// running max before the forward rescales its output (see the module doc).
pub const RESCALE_MARGIN: f32 = 8.0;

/// Shared memory (bytes) a cube of `planes` planes uses: the tiles of
/// `blocks · 16` rows of the other side (keys and values, or queries and
/// dO, and one or two f32 per row), each plane's own 16 rows (`own_blocks`
/// blocks of them: 1 forward, 2 backward), and its scratch and weights.
pub fn shared_bytes(
    head_dim: usize,
    blocks: usize,
    planes: usize,
    own_blocks: usize,
    f32_per_row: usize,
    storage_bytes: usize,
) -> usize {
    let ld = head_dim + ROW_PAD;
    let tile_rows = blocks * TC_TILE;
    let tiles = 2 * tile_rows * ld * storage_bytes + f32_per_row * tile_rows * 4;
    let per_plane = own_blocks * TC_TILE * ld * storage_bytes
        + TC_TILE * SCRATCH_LD * 4
        + TC_TILE * WEIGHT_LD * storage_bytes;
    tiles + planes * per_plane
}

/// Forward: `out = softmax(q·kᵀ·scale, masked)·v` and the row log-sum-exp,
/// for f16/bf16 storage with `head_dim` a multiple of 16.
///
/// Launch: cube (x: n·H + h − bh_offset, y: block of `16 · planes` query
/// rows), cube dim (`plane_size`, `planes`): unit x is the lane, unit y the
/// plane. `block_valid` is `[N, ceil(Tk/16)]`: valid keys per 16-key block.
#[cube(launch, fast_math = FAST_EXP)]
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_tc<F: Float>(
    ops: &Operands<F, F, F>,
    block_valid: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    call: &Scalars,
    #[comptime] head_dim: usize,
    #[comptime] blocks: usize,
    #[comptime] planes: usize,
    #[comptime] plane_size: usize,
    #[comptime] use_dropout: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, key_valid) = (&ops.q, &ops.k, &ops.v, &ops.key_valid);
    let tq = q.shape(2);
    let tk = k.shape(2);
    let bh = (CUBE_POS_X + call.bh_offset) as usize;
    let head_key = dropout_head_key(call.seed, bh as u32);
    let n = bh / call.heads as usize;
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let units_per_row = comptime!(plane_size / TC_TILE);
    let cols = comptime!(TC_TILE / units_per_row);
    let ld = comptime!(head_dim + ROW_PAD);
    let tile_keys = comptime!(blocks * TC_TILE);
    let row_in_block = lane / units_per_row;
    let sub = lane % units_per_row;
    let first_row = (CUBE_POS_Y as usize * planes + plane) * TC_TILE;
    let row = first_row + row_in_block;
    let n_blocks = tk.div_ceil(TC_TILE);
    let n_tiles = n_blocks.div_ceil(blocks);
    let kv_base = bh * tk * head_dim;
    let q_base = bh * tq * head_dim;
    // The plane's 16×16 scratch (f32) and weight (`P`) tiles, and this
    // unit's row in them.
    let scratch_at = plane * comptime!(TC_TILE * SCRATCH_LD);
    let my_scores = scratch_at + row_in_block * SCRATCH_LD + sub;
    let p_at = plane * comptime!(TC_TILE * WEIGHT_LD);
    let my_weights = p_at + row_in_block * WEIGHT_LD + sub;

    let mut k_tile = SharedMemory::<F>::new_aligned(comptime!(tile_keys * ld), 32usize);
    let mut v_tile = SharedMemory::<F>::new_aligned(comptime!(tile_keys * ld), 32usize);
    let mut valid_tile = SharedMemory::<f32>::new(tile_keys);
    let mut q_block = SharedMemory::<F>::new_aligned(comptime!(planes * TC_TILE * ld), 32usize);
    let mut scratch =
        SharedMemory::<f32>::new_aligned(comptime!(planes * TC_TILE * SCRATCH_LD), 32usize);
    let mut p_block =
        SharedMemory::<F>::new_aligned(comptime!(planes * TC_TILE * WEIGHT_LD), 32usize);

    let rows_at = plane * comptime!(TC_TILE * ld);
    load_plane_rows::<F>(
        q,
        &mut q_block,
        rows_at,
        q_base,
        first_row,
        tq,
        head_dim,
        plane_size,
    );
    sync_plane();

    let o_acc = zero_accumulators(head_dim);
    let mut scores = Array::<f32>::new(cols);
    // See `attention_forward` for why the masked score is written 0 − 1e30.
    let mut m = 0.0f32;
    m -= 1.0e30;
    let mut l = 0.0f32;

    for t in 0..n_tiles {
        let mut tile_valid = 0.0f32;
        #[unroll]
        for b in 0..blocks {
            let block = t * blocks + b;
            if block < n_blocks {
                tile_valid += block_valid[n * n_blocks + block];
            }
        }
        // Uniform over the cube: every unit takes the same branch.
        if tile_valid > 0.0 {
            load_tile::<F>(
                k,
                v,
                key_valid,
                &mut k_tile,
                &mut v_tile,
                &mut valid_tile,
                kv_base,
                n * tk,
                t * tile_keys,
                tk,
                head_dim,
                tile_keys,
            );
            sync_cube();
            #[unroll]
            for b in 0..blocks {
                let block = t * blocks + b;
                let mut live = block < n_blocks;
                if live {
                    live = block_valid[n * n_blocks + block] > 0.0;
                }
                // Uniform over the plane (the mask is per sequence).
                if live {
                    let key_at = b * TC_TILE * ld;
                    let s = rows_times_rows::<F>(&q_block, rows_at, &k_tile, key_at, head_dim);
                    cmma::store(
                        &mut scratch.slice_mut(scratch_at, scratch_at + TC_TILE * SCRATCH_LD),
                        &s,
                        SCRATCH_LD as u32,
                        MatrixLayout::RowMajor,
                    );
                    sync_plane();

                    // Online softmax over this unit's `cols` keys of the block.
                    let first_key = b * TC_TILE + sub;
                    let mut block_max = 0.0f32;
                    block_max -= 1.0e30;
                    #[unroll]
                    for j in 0..cols {
                        let score = select(
                            valid_tile[first_key + j * units_per_row] > 0.0,
                            scratch[my_scores + j * units_per_row] * call.scale,
                            -1.0e30f32,
                        );
                        scores[j] = score;
                        block_max = f32::max(block_max, score);
                    }
                    block_max = row_max(block_max, units_per_row);
                    // The lazy max (module doc). A row with no valid key so
                    // far has m = −1e30 and takes any valid score's max.
                    let moves = block_max > m + RESCALE_MARGIN;
                    let m_new = select(moves, block_max, m);
                    let correction = (m - m_new).exp();
                    let mut block_sum = 0.0f32;
                    #[unroll]
                    for j in 0..cols {
                        let key = first_key + j * units_per_row;
                        let p = select(valid_tile[key] > 0.0, (scores[j] - m_new).exp(), 0.0f32);
                        block_sum += p;
                        let mut weight = p;
                        if use_dropout {
                            let col = (t * tile_keys + key) as u32;
                            let keep =
                                dropout_keep(head_key, row as u32, col, call.dropout_threshold);
                            weight = select(keep, p * call.dropout_scale, 0.0f32);
                        }
                        p_block[my_weights + j * units_per_row] = F::cast_from(weight);
                    }
                    block_sum = row_sum(block_sum, units_per_row);
                    l = l * correction + block_sum;
                    // Only a row that had seen a valid key has output to
                    // rescale (before, its output is zeros).
                    if plane_any(moves && m > -1.0e29) {
                        // Every unit is done reading the scores.
                        sync_plane();
                        scale_accumulator_rows(
                            &o_acc,
                            &mut scratch,
                            scratch_at,
                            correction,
                            head_dim,
                            plane_size,
                        );
                    }
                    m = m_new;
                    // P written, and every unit done reading the scratch.
                    sync_plane();
                    accumulate_weighted_rows::<F>(
                        &o_acc, &p_block, p_at, &v_tile, key_at, head_dim,
                    );
                }
            }
            sync_cube();
        }
    }

    // l ≥ 1 once any key was valid; a row with no valid key gets zeros.
    let seen = l > 0.0;
    write_accumulators::<F>(
        &o_acc,
        &mut scratch,
        scratch_at,
        out,
        q_base,
        first_row,
        tq,
        select(seen, 1.0f32 / l, 0.0f32),
        head_dim,
        plane_size,
    );
    if row < tq && sub == 0 {
        lse[bh * tq + row] = select(seen, m + l.ln(), 0.0f32);
    }
}

/// Multiplies row `r` of each accumulator by the `factor` of the units of
/// row `r` (every unit of a row passes the same), through the plane's
/// scratch tile. Every unit of the plane must call it, after the plane is
/// done with the scratch.
#[cube]
fn scale_accumulator_rows(
    acc: &Sequence<cmma::Matrix<f32>>,
    scratch: &mut SharedMemory<f32>,
    scratch_at: usize,
    factor: f32,
    #[comptime] head_dim: usize,
    #[comptime] plane_size: usize,
) {
    let units_per_row = comptime!(plane_size / TC_TILE);
    let cols = comptime!(TC_TILE / units_per_row);
    let lane = UNIT_POS_X as usize;
    let mine = scratch_at + (lane / units_per_row) * SCRATCH_LD + lane % units_per_row;
    #[unroll]
    for c in 0..comptime!(head_dim / TC_TILE) {
        let tile = acc.index(c);
        cmma::store(
            &mut scratch.slice_mut(scratch_at, scratch_at + TC_TILE * SCRATCH_LD),
            tile,
            SCRATCH_LD as u32,
            MatrixLayout::RowMajor,
        );
        sync_plane();
        #[unroll]
        for j in 0..cols {
            let at = mine + j * units_per_row;
            scratch[at] *= factor;
        }
        sync_plane();
        cmma::load_with_layout(
            tile,
            &scratch.slice(scratch_at, scratch_at + TC_TILE * SCRATCH_LD),
            SCRATCH_LD as u32,
            MatrixLayout::RowMajor,
        );
        sync_plane();
    }
}

/// The maximum over the `units` adjacent units that share a row (a power
/// of two ≤ 4). Every unit of the plane must call it.
#[cube]
fn row_max(x: f32, #[comptime] units: usize) -> f32 {
    let mut r = x;
    if comptime!(units >= 4) {
        r = f32::max(r, plane_shuffle_xor(r, 2u32));
    }
    if comptime!(units >= 2) {
        r = f32::max(r, plane_shuffle_xor(r, 1u32));
    }
    r
}

/// The sum over the `units` adjacent units that share a row, as [`row_max`].
#[cube]
fn row_sum(x: f32, #[comptime] units: usize) -> f32 {
    let mut r = x;
    if comptime!(units >= 4) {
        r += plane_shuffle_xor(r, 2u32);
    }
    if comptime!(units >= 2) {
        r += plane_shuffle_xor(r, 1u32);
    }
    r
}

/// Loads keys and values `[start, start + tile_keys)` of one (n, h) into
/// shared memory in the storage type (rows `head_dim + ROW_PAD` apart,
/// zeros past `tk`), and the validity of each key. All units of the cube
/// share it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_tile<F: Float>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    key_valid: &Tensor<f32>,
    k_tile: &mut SharedMemory<F>,
    v_tile: &mut SharedMemory<F>,
    valid_tile: &mut SharedMemory<f32>,
    kv_base: usize,
    valid_base: usize,
    start: usize,
    tk: usize,
    #[comptime] head_dim: usize,
    #[comptime] tile_keys: usize,
) {
    let units = (CUBE_DIM_X * CUBE_DIM_Y) as usize;
    let mut idx = UNIT_POS as usize;
    while idx < comptime!(tile_keys * head_dim) {
        let j = start + idx / head_dim;
        let mut kx = F::from_int(0);
        let mut vx = F::from_int(0);
        if j < tk {
            let at = kv_base + start * head_dim + idx;
            kx = k[at];
            vx = v[at];
        }
        let at = (idx / head_dim) * comptime!(head_dim + ROW_PAD) + idx % head_dim;
        k_tile[at] = kx;
        v_tile[at] = vx;
        idx += units;
    }
    let mut jj = UNIT_POS as usize;
    while jj < tile_keys {
        let j = start + jj;
        let mut valid = 0.0f32;
        if j < tk {
            valid = key_valid[valid_base + j];
        }
        valid_tile[jj] = valid;
        jj += units;
    }
}

/// `X·Yᵀ` for 16 rows of `x` (at `x_at`) and 16 rows of `y` (at `y_at`),
/// both rows `head_dim + ROW_PAD` apart in shared memory: the scores `Q·Kᵀ`, `Kᵀ`'s
/// transpose `K·Qᵀ`, and `dO·Vᵀ` / `V·dOᵀ`. An f32 accumulator.
#[cube]
fn rows_times_rows<F: Float>(
    x: &SharedMemory<F>,
    x_at: usize,
    y: &SharedMemory<F>,
    y_at: usize,
    #[comptime] head_dim: usize,
) -> cmma::Matrix<f32> {
    let product = cmma::Matrix::<f32>::from_value(
        MatrixIdent::Accumulator,
        TC_TILE,
        TC_TILE,
        TC_TILE,
        MatrixLayout::Undefined,
        0.0,
    );
    let ld = comptime!(head_dim + ROW_PAD);
    #[unroll]
    for c in 0..comptime!(head_dim / TC_TILE) {
        let a = cmma::Matrix::<F>::from_slice(
            MatrixIdent::A,
            TC_TILE,
            TC_TILE,
            TC_TILE,
            MatrixLayout::RowMajor,
            &x.slice(x_at + c * TC_TILE, x_at + TC_TILE * ld),
            ld as u32,
        );
        // Yᵀ: element (d, row) at row·ld + d, column-major.
        let b = cmma::Matrix::<F>::from_slice(
            MatrixIdent::B,
            TC_TILE,
            TC_TILE,
            TC_TILE,
            MatrixLayout::ColMajor,
            &y.slice(y_at + c * TC_TILE, y_at + TC_TILE * ld),
            ld as u32,
        );
        cmma::execute::<F, F, f32, f32>(&a, &b, &product, &product);
    }
    product
}

/// `acc[c] += W·Y[:, 16c..16c+16]` for the 16×16 weights `w` (at `w_at`,
/// rows `WEIGHT_LD` apart) and 16 rows of `y` (at `y_at`, rows
/// `head_dim + ROW_PAD` apart): `P·V`, `dS·K`, `P̃ᵀ·dO` and `dSᵀ·Q`.
#[cube]
fn accumulate_weighted_rows<F: Float>(
    acc: &Sequence<cmma::Matrix<f32>>,
    w: &SharedMemory<F>,
    w_at: usize,
    y: &SharedMemory<F>,
    y_at: usize,
    #[comptime] head_dim: usize,
) {
    let a = cmma::Matrix::<F>::from_slice(
        MatrixIdent::A,
        TC_TILE,
        TC_TILE,
        TC_TILE,
        MatrixLayout::RowMajor,
        &w.slice(w_at, w_at + TC_TILE * WEIGHT_LD),
        WEIGHT_LD as u32,
    );
    let ld = comptime!(head_dim + ROW_PAD);
    #[unroll]
    for c in 0..comptime!(head_dim / TC_TILE) {
        let b = cmma::Matrix::<F>::from_slice(
            MatrixIdent::B,
            TC_TILE,
            TC_TILE,
            TC_TILE,
            MatrixLayout::RowMajor,
            &y.slice(y_at + c * TC_TILE, y_at + TC_TILE * ld),
            ld as u32,
        );
        let sum = acc.index(c);
        cmma::execute::<F, F, f32, f32>(&a, &b, sum, sum);
    }
}

/// `head_dim / 16` accumulators of zeros.
#[cube]
fn zero_accumulators(#[comptime] head_dim: usize) -> Sequence<cmma::Matrix<f32>> {
    let mut acc = Sequence::new();
    #[unroll]
    for _ in 0..comptime!(head_dim / TC_TILE) {
        acc.push(cmma::Matrix::<f32>::from_value(
            MatrixIdent::Accumulator,
            TC_TILE,
            TC_TILE,
            TC_TILE,
            MatrixLayout::Undefined,
            0.0,
        ));
    }
    acc
}

/// Writes `row_scale · acc` to the 16 rows of `dst` starting at row
/// `first` (`[rows][head_dim]` at `base`), rows `< len` only, through the
/// plane's scratch tile; `row_scale` is the unit's (the same for the units
/// of a row). Every unit of the plane must call it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_accumulators<F: Float>(
    acc: &Sequence<cmma::Matrix<f32>>,
    scratch: &mut SharedMemory<f32>,
    scratch_at: usize,
    dst: &mut Tensor<F>,
    base: usize,
    first: usize,
    len: usize,
    row_scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] plane_size: usize,
) {
    let units_per_row = comptime!(plane_size / TC_TILE);
    let cols = comptime!(TC_TILE / units_per_row);
    let lane = UNIT_POS_X as usize;
    let r = lane / units_per_row;
    let sub = lane % units_per_row;
    let mine = scratch_at + r * SCRATCH_LD + sub;
    let row_at = base + (first + r) * head_dim + sub;
    // The plane may still be reading the scratch.
    sync_plane();
    #[unroll]
    for c in 0..comptime!(head_dim / TC_TILE) {
        cmma::store(
            &mut scratch.slice_mut(scratch_at, scratch_at + TC_TILE * SCRATCH_LD),
            acc.index(c),
            SCRATCH_LD as u32,
            MatrixLayout::RowMajor,
        );
        sync_plane();
        if first + r < len {
            #[unroll]
            for j in 0..cols {
                let x = scratch[mine + j * units_per_row];
                dst[row_at + c * TC_TILE + j * units_per_row] = F::cast_from(x * row_scale);
            }
        }
        sync_plane();
    }
}

/// Loads 16 rows of `src` (`[len][head_dim]` at `base`), starting at row
/// `first`, into `dst` at `dst_at` (rows `head_dim + ROW_PAD` apart), zeros
/// past `len`. The plane's units share it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_plane_rows<F: Float>(
    src: &Tensor<F>,
    dst: &mut SharedMemory<F>,
    dst_at: usize,
    base: usize,
    first: usize,
    len: usize,
    #[comptime] head_dim: usize,
    #[comptime] plane_size: usize,
) {
    let mut idx = UNIT_POS_X as usize;
    while idx < comptime!(TC_TILE * head_dim) {
        let r = first + idx / head_dim;
        let mut x = F::from_int(0);
        if r < len {
            x = src[base + r * head_dim + idx % head_dim];
        }
        dst[dst_at + (idx / head_dim) * comptime!(head_dim + ROW_PAD) + idx % head_dim] = x;
        idx += plane_size;
    }
}

/// Backward, query side, on tensor cores: `dQ = scale · dS·K` with
/// `dS = P ⊙ (dP − Δ)`, `P` recomputed from the log-sum-exp and
/// `dP = Z ⊙ (dO·Vᵀ)` (`Z`: the dropout mask over `1 − p`); `Δ_i =
/// rowsum(dO_i ⊙ O_i)` is computed here in f32 and written to `delta` for
/// [`attention_backward_dkdv_tc`]. `dS` is rounded to the storage type for
/// its product, as `P` is in the forward.
///
/// Launch: as [`attention_forward_tc`].
#[cube(launch, fast_math = FAST_EXP)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_dq_tc<F: Float>(
    ops: &Operands<F, F, F>,
    out: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    block_valid: &Tensor<f32>,
    dq: &mut Tensor<F>,
    delta: &mut Tensor<f32>,
    call: &Scalars,
    #[comptime] head_dim: usize,
    #[comptime] blocks: usize,
    #[comptime] planes: usize,
    #[comptime] plane_size: usize,
    #[comptime] use_dropout: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, key_valid) = (&ops.q, &ops.k, &ops.v, &ops.key_valid);
    let tq = q.shape(2);
    let tk = k.shape(2);
    let bh = (CUBE_POS_X + call.bh_offset) as usize;
    let head_key = dropout_head_key(call.seed, bh as u32);
    let n = bh / call.heads as usize;
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let units_per_row = comptime!(plane_size / TC_TILE);
    let cols = comptime!(TC_TILE / units_per_row);
    let chunks = comptime!(head_dim / TC_TILE);
    let tile_keys = comptime!(blocks * TC_TILE);
    let ld = comptime!(head_dim + ROW_PAD);
    let row_in_block = lane / units_per_row;
    let sub = lane % units_per_row;
    let first_row = (CUBE_POS_Y as usize * planes + plane) * TC_TILE;
    let row = first_row + row_in_block;
    let n_blocks = tk.div_ceil(TC_TILE);
    let n_tiles = n_blocks.div_ceil(blocks);
    let kv_base = bh * tk * head_dim;
    let q_base = bh * tq * head_dim;
    let scratch_at = plane * comptime!(TC_TILE * SCRATCH_LD);
    let my_scores = scratch_at + row_in_block * SCRATCH_LD + sub;
    let w_at = plane * comptime!(TC_TILE * WEIGHT_LD);
    let my_weights = w_at + row_in_block * WEIGHT_LD + sub;

    let mut k_tile = SharedMemory::<F>::new_aligned(comptime!(tile_keys * ld), 32usize);
    let mut v_tile = SharedMemory::<F>::new_aligned(comptime!(tile_keys * ld), 32usize);
    let mut valid_tile = SharedMemory::<f32>::new(tile_keys);
    let mut q_block = SharedMemory::<F>::new_aligned(comptime!(planes * TC_TILE * ld), 32usize);
    let mut do_block = SharedMemory::<F>::new_aligned(comptime!(planes * TC_TILE * ld), 32usize);
    let mut scratch =
        SharedMemory::<f32>::new_aligned(comptime!(planes * TC_TILE * SCRATCH_LD), 32usize);
    let mut ds_block =
        SharedMemory::<F>::new_aligned(comptime!(planes * TC_TILE * WEIGHT_LD), 32usize);

    let rows_at = plane * comptime!(TC_TILE * ld);
    load_plane_rows::<F>(
        q,
        &mut q_block,
        rows_at,
        q_base,
        first_row,
        tq,
        head_dim,
        plane_size,
    );
    load_plane_rows::<F>(
        dout,
        &mut do_block,
        rows_at,
        q_base,
        first_row,
        tq,
        head_dim,
        plane_size,
    );

    // Δ of this unit's row, from its columns, summed over the row's units.
    let mut row_delta = 0.0f32;
    let mut row_lse = 0.0f32;
    if row < tq {
        let at = q_base + row * head_dim + sub;
        #[unroll]
        for c in 0..chunks {
            #[unroll]
            for j in 0..cols {
                let d = at + c * TC_TILE + j * units_per_row;
                row_delta += f32::cast_from(dout[d]) * f32::cast_from(out[d]);
            }
        }
        row_lse = lse[bh * tq + row];
    }
    row_delta = row_sum(row_delta, units_per_row);
    if row < tq && sub == 0 {
        delta[bh * tq + row] = row_delta;
    }
    sync_plane();

    let dq_acc = zero_accumulators(head_dim);
    let mut probs = Array::<f32>::new(cols);

    for t in 0..n_tiles {
        let mut tile_valid = 0.0f32;
        #[unroll]
        for b in 0..blocks {
            let block = t * blocks + b;
            if block < n_blocks {
                tile_valid += block_valid[n * n_blocks + block];
            }
        }
        if tile_valid > 0.0 {
            load_tile::<F>(
                k,
                v,
                key_valid,
                &mut k_tile,
                &mut v_tile,
                &mut valid_tile,
                kv_base,
                n * tk,
                t * tile_keys,
                tk,
                head_dim,
                tile_keys,
            );
            sync_cube();
            #[unroll]
            for b in 0..blocks {
                let block = t * blocks + b;
                let mut live = block < n_blocks;
                if live {
                    live = block_valid[n * n_blocks + block] > 0.0;
                }
                if live {
                    let key_at = b * TC_TILE * ld;
                    let first_key = b * TC_TILE + sub;
                    let s = rows_times_rows::<F>(&q_block, rows_at, &k_tile, key_at, head_dim);
                    cmma::store(
                        &mut scratch.slice_mut(scratch_at, scratch_at + TC_TILE * SCRATCH_LD),
                        &s,
                        SCRATCH_LD as u32,
                        MatrixLayout::RowMajor,
                    );
                    sync_plane();
                    #[unroll]
                    for j in 0..cols {
                        probs[j] = select(
                            valid_tile[first_key + j * units_per_row] > 0.0,
                            (scratch[my_scores + j * units_per_row] * call.scale - row_lse).exp(),
                            0.0f32,
                        );
                    }
                    sync_plane();
                    let dp = rows_times_rows::<F>(&do_block, rows_at, &v_tile, key_at, head_dim);
                    cmma::store(
                        &mut scratch.slice_mut(scratch_at, scratch_at + TC_TILE * SCRATCH_LD),
                        &dp,
                        SCRATCH_LD as u32,
                        MatrixLayout::RowMajor,
                    );
                    sync_plane();
                    #[unroll]
                    for j in 0..cols {
                        let mut dp_ij = scratch[my_scores + j * units_per_row];
                        if use_dropout {
                            let col = (t * tile_keys + first_key + j * units_per_row) as u32;
                            let keep =
                                dropout_keep(head_key, row as u32, col, call.dropout_threshold);
                            dp_ij = select(keep, dp_ij * call.dropout_scale, 0.0f32);
                        }
                        ds_block[my_weights + j * units_per_row] =
                            F::cast_from(probs[j] * (dp_ij - row_delta));
                    }
                    sync_plane();
                    accumulate_weighted_rows::<F>(
                        &dq_acc, &ds_block, w_at, &k_tile, key_at, head_dim,
                    );
                }
            }
            sync_cube();
        }
    }
    write_accumulators::<F>(
        &dq_acc,
        &mut scratch,
        scratch_at,
        dq,
        q_base,
        first_row,
        tq,
        call.scale,
        head_dim,
        plane_size,
    );
}

/// Backward, key side, on tensor cores: `dV = P̃ᵀ·dO` and
/// `dK = scale · dSᵀ·Q` for the plane's 16 keys, over all queries in tiles
/// of `blocks · 16` (`P̃`: after dropout; `Δ` from
/// [`attention_backward_dq_tc`], launched before on the same stream).
/// Masked keys get zero gradients (their probabilities are 0), and a plane
/// whose 16 keys are all masked skips the products.
///
/// Launch: cube (x: n·H + h − bh_offset, y: block of `16 · planes` keys),
/// cube dim (`plane_size`, `planes`).
#[cube(launch, fast_math = FAST_EXP)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_dkdv_tc<F: Float>(
    ops: &Operands<F, F, F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    block_valid: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    call: &Scalars,
    #[comptime] head_dim: usize,
    #[comptime] blocks: usize,
    #[comptime] planes: usize,
    #[comptime] plane_size: usize,
    #[comptime] use_dropout: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, key_valid) = (&ops.q, &ops.k, &ops.v, &ops.key_valid);
    let tq = q.shape(2);
    let tk = k.shape(2);
    let bh = (CUBE_POS_X + call.bh_offset) as usize;
    let head_key = dropout_head_key(call.seed, bh as u32);
    let n = bh / call.heads as usize;
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let units_per_row = comptime!(plane_size / TC_TILE);
    let cols = comptime!(TC_TILE / units_per_row);
    let tile_rows = comptime!(blocks * TC_TILE);
    let ld = comptime!(head_dim + ROW_PAD);
    let key_in_block = lane / units_per_row;
    let sub = lane % units_per_row;
    let first_key = (CUBE_POS_Y as usize * planes + plane) * TC_TILE;
    let key = first_key + key_in_block;
    let n_key_blocks = tk.div_ceil(TC_TILE);
    let kv_base = bh * tk * head_dim;
    let q_base = bh * tq * head_dim;
    let scratch_at = plane * comptime!(TC_TILE * SCRATCH_LD);
    let my_scores = scratch_at + key_in_block * SCRATCH_LD + sub;
    let w_at = plane * comptime!(TC_TILE * WEIGHT_LD);
    let my_weights = w_at + key_in_block * WEIGHT_LD + sub;

    // Whether this plane's keys, and any plane's of this cube, hold a valid
    // key: the first is uniform over the plane, the second over the cube.
    let key_block = first_key / TC_TILE;
    let mut plane_live = false;
    if key_block < n_key_blocks {
        plane_live = block_valid[n * n_key_blocks + key_block] > 0.0;
    }
    let cube_first_block = CUBE_POS_Y as usize * planes;
    let mut cube_valid = 0.0f32;
    #[unroll]
    for p in 0..planes {
        if cube_first_block + p < n_key_blocks {
            cube_valid += block_valid[n * n_key_blocks + cube_first_block + p];
        }
    }
    let mut n_tiles = 0usize;
    if cube_valid > 0.0 {
        n_tiles = tq.div_ceil(tile_rows);
    }
    let mut key_ok = false;
    if key < tk {
        key_ok = key_valid[n * tk + key] > 0.0;
    }

    let mut q_tile = SharedMemory::<F>::new_aligned(comptime!(tile_rows * ld), 32usize);
    let mut do_tile = SharedMemory::<F>::new_aligned(comptime!(tile_rows * ld), 32usize);
    let mut lse_tile = SharedMemory::<f32>::new(tile_rows);
    let mut delta_tile = SharedMemory::<f32>::new(tile_rows);
    let mut k_block = SharedMemory::<F>::new_aligned(comptime!(planes * TC_TILE * ld), 32usize);
    let mut v_block = SharedMemory::<F>::new_aligned(comptime!(planes * TC_TILE * ld), 32usize);
    let mut scratch =
        SharedMemory::<f32>::new_aligned(comptime!(planes * TC_TILE * SCRATCH_LD), 32usize);
    let mut w_block =
        SharedMemory::<F>::new_aligned(comptime!(planes * TC_TILE * WEIGHT_LD), 32usize);

    let rows_at = plane * comptime!(TC_TILE * ld);
    load_plane_rows::<F>(
        k,
        &mut k_block,
        rows_at,
        kv_base,
        first_key,
        tk,
        head_dim,
        plane_size,
    );
    load_plane_rows::<F>(
        v,
        &mut v_block,
        rows_at,
        kv_base,
        first_key,
        tk,
        head_dim,
        plane_size,
    );
    sync_plane();

    let dk_acc = zero_accumulators(head_dim);
    let dv_acc = zero_accumulators(head_dim);
    let mut probs = Array::<f32>::new(cols);
    let units = (CUBE_DIM_X * CUBE_DIM_Y) as usize;

    for t in 0..n_tiles {
        let start = t * tile_rows;
        let mut idx = UNIT_POS as usize;
        while idx < comptime!(tile_rows * head_dim) {
            let i = start + idx / head_dim;
            let mut qx = F::from_int(0);
            let mut dox = F::from_int(0);
            if i < tq {
                let at = q_base + start * head_dim + idx;
                qx = q[at];
                dox = dout[at];
            }
            let at = (idx / head_dim) * ld + idx % head_dim;
            q_tile[at] = qx;
            do_tile[at] = dox;
            idx += units;
        }
        let mut ii = UNIT_POS as usize;
        while ii < tile_rows {
            let i = start + ii;
            // Rows past the end: lse = +big makes p = 0 (their q and dO are 0).
            let mut lse_i = 1.0e30f32;
            let mut delta_i = 0.0f32;
            if i < tq {
                lse_i = lse[bh * tq + i];
                delta_i = delta[bh * tq + i];
            }
            lse_tile[ii] = lse_i;
            delta_tile[ii] = delta_i;
            ii += units;
        }
        sync_cube();
        if plane_live {
            #[unroll]
            for b in 0..blocks {
                if start + b * TC_TILE < tq {
                    let rows_b = b * TC_TILE * ld;
                    let first_q = b * TC_TILE + sub;
                    // Sᵀ = K·Qᵀ: this unit's key against its `cols` queries.
                    let st = rows_times_rows::<F>(&k_block, rows_at, &q_tile, rows_b, head_dim);
                    cmma::store(
                        &mut scratch.slice_mut(scratch_at, scratch_at + TC_TILE * SCRATCH_LD),
                        &st,
                        SCRATCH_LD as u32,
                        MatrixLayout::RowMajor,
                    );
                    sync_plane();
                    #[unroll]
                    for j in 0..cols {
                        // 0 for a masked key: its exp(s − lse) could overflow.
                        let p = select(
                            key_ok,
                            (scratch[my_scores + j * units_per_row] * call.scale
                                - lse_tile[first_q + j * units_per_row])
                                .exp(),
                            0.0f32,
                        );
                        probs[j] = p;
                        let mut kept = p;
                        if use_dropout {
                            let i = (start + first_q + j * units_per_row) as u32;
                            let keep =
                                dropout_keep(head_key, i, key as u32, call.dropout_threshold);
                            kept = select(keep, p * call.dropout_scale, 0.0f32);
                        }
                        w_block[my_weights + j * units_per_row] = F::cast_from(kept);
                    }
                    sync_plane();
                    accumulate_weighted_rows::<F>(
                        &dv_acc, &w_block, w_at, &do_tile, rows_b, head_dim,
                    );
                    // dPᵀ = V·dOᵀ.
                    let dpt = rows_times_rows::<F>(&v_block, rows_at, &do_tile, rows_b, head_dim);
                    cmma::store(
                        &mut scratch.slice_mut(scratch_at, scratch_at + TC_TILE * SCRATCH_LD),
                        &dpt,
                        SCRATCH_LD as u32,
                        MatrixLayout::RowMajor,
                    );
                    sync_plane();
                    #[unroll]
                    for j in 0..cols {
                        let mut dp = scratch[my_scores + j * units_per_row];
                        if use_dropout {
                            let i = (start + first_q + j * units_per_row) as u32;
                            let keep =
                                dropout_keep(head_key, i, key as u32, call.dropout_threshold);
                            dp = select(keep, dp * call.dropout_scale, 0.0f32);
                        }
                        w_block[my_weights + j * units_per_row] =
                            F::cast_from(probs[j] * (dp - delta_tile[first_q + j * units_per_row]));
                    }
                    sync_plane();
                    accumulate_weighted_rows::<F>(
                        &dk_acc, &w_block, w_at, &q_tile, rows_b, head_dim,
                    );
                    // The next block's Sᵀ overwrites the scratch and w_block
                    // only after every unit passed this point.
                    sync_plane();
                }
            }
        }
        sync_cube();
    }
    write_accumulators::<F>(
        &dk_acc,
        &mut scratch,
        scratch_at,
        dk,
        kv_base,
        first_key,
        tk,
        call.scale,
        head_dim,
        plane_size,
    );
    write_accumulators::<F>(
        &dv_acc,
        &mut scratch,
        scratch_at,
        dv,
        kv_base,
        first_key,
        tk,
        1.0f32,
        head_dim,
        plane_size,
    );
}
