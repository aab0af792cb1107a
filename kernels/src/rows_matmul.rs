//! The dense layers' products on TF32 tensor cores, for AAM's tall, narrow
//! shapes. No Burn imports here.
//!
//! Why a kernel of our own: the ASV level packs every token of every
//! non-empty ASV into one row axis (302,000 rows at the reference's batch of
//! 2,000 ASVs) against widths of 128-512, so each of a layer's twelve
//! products (four forward, four `dx`, four weight gradients) moves a few
//! hundred megabytes and has almost no arithmetic per byte. CubeCL's fastest
//! kernel at those shapes (`simple_tma_mma`) ran them at ~35% of the H100's
//! bandwidth (`docs/performance.md`, 2026-11-26), and the products
//! were a third of the training step's GPU time.
//!
//! The kernel is a plain one, tuned only for that case: a cube of
//! `2 · row_planes` planes owns a `32·row_planes × block_n` output tile and
//! walks the inner dimension 32 at a time. Each unit loads its share of the next slice of both operands into
//! registers (16-byte loads along whichever axis is contiguous in memory)
//! while the planes multiply the current one from shared memory, so the
//! loads of one slice overlap the products of the last. Each plane owns a
//! `32 × block_n/2` part of the tile as `16 × 16` accumulators and stores
//! them straight to global memory.
//!
//! Operands may be transposed views: `A`'s rows or `B`'s columns may be the
//! contiguous axis (comptime flags), which covers the three products of a
//! dense layer without copies: `x·wᵀ` (the weight read along its rows),
//! `dy·w`, and the weight gradient's `dyᵀ·x` over parts of the rows (one
//! batch entry per part). Values are rounded to TF32 as they enter shared
//! memory and the sums are f32, as CubeCL's own tensor-core kernels do for
//! f32 operands.

use cubecl::cmma::{self, MatrixIdent, MatrixLayout};
use cubecl::prelude::*;

/// Inner-dimension slice loaded at a time.
pub const BLOCK_K: usize = 32;
/// Rows of the output each plane computes (two 16-row fragments).
pub const PLANE_ROWS: usize = 32;
/// Units a plane (the kernel is written for 32-unit planes).
pub const PLANE_SIZE: usize = 32;
/// Elements added to each row of a shared tile: rows stay 16-byte aligned
/// (TF32 fragment loads need a stride that is a multiple of 4) and 36
/// apart, so the rows of a fragment start in different banks.
pub const PAD: usize = 4;
/// Elements a vector load moves (16 bytes of f32).
pub const VECTOR: usize = 4;
/// TF32 fragment sides: `16 × 8` of `A`, `8 × 16` of `B`, `16 × 16` sums.
const TILE: usize = 16;
const TILE_K: usize = 8;
/// Row stride of both shared tiles.
const LD: usize = BLOCK_K + PAD;

/// `out[z] = A[z]·B[z]` for f32 operands, rows of `out` in blocks of
/// `32 · row_planes`.
///
/// `A(i, k)` is element `z·a_batch + i·a_stride + k` where `a_k_contiguous`,
/// else `z·a_batch + k·a_stride + i`; `B(k, j)` is `z·b_batch + j·b_stride +
/// k` where `b_k_contiguous`, else `z·b_batch + k·b_stride + j`. Rows `i ≥
/// rows` of `A` read as zeros; `out` is `[Z, out_rows, out_cols]` contiguous
/// with `out_rows` a multiple of the row block (the rows past `rows` are
/// written, with zeros' products).
///
/// Both shared tiles hold their operand with `k` along the row (`A` as
/// `[rows][k]`, `B` as `[columns][k]`), the layouts whose fragment loads
/// measured fastest; an operand contiguous along the other axis is
/// transposed as it is stored, each unit of a plane taking another `k` so
/// that the plane's stores fall in 32 different banks.
///
/// The caller guarantees: `inner` a multiple of [`BLOCK_K`], `out_cols` of
/// `block_n` (64 or 128), every stride, batch stride and buffer offset a
/// multiple of [`VECTOR`], and, where `A`'s rows are the contiguous axis,
/// `rows` a multiple of [`VECTOR`].
///
/// Launch: cube (x: column block, y: row block, z: batch entry), cube dim
/// (`PLANE_SIZE`, `2 · row_planes`): planes `2r` and `2r + 1` take rows
/// `32r ..` and each half of the columns; vector size [`VECTOR`] for `a`
/// and `b`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn rows_matmul_tf32<N: Size>(
    a: &Tensor<Vector<f32, N>>,
    b: &Tensor<Vector<f32, N>>,
    out: &mut Tensor<f32>,
    rows: u32,
    inner: u32,
    out_rows: u32,
    out_cols: u32,
    a_batch: u32,
    a_stride: u32,
    b_batch: u32,
    b_stride: u32,
    #[comptime] a_k_contiguous: bool,
    #[comptime] b_k_contiguous: bool,
    #[comptime] row_planes: usize,
    #[comptime] block_n: usize,
) {
    let block_m = comptime!(PLANE_ROWS * row_planes);
    let cube_units = comptime!(2 * row_planes * PLANE_SIZE);
    let unit = UNIT_POS as usize;
    let plane = UNIT_POS_Y as usize;
    let z = CUBE_POS_Z as usize;
    let row0 = CUBE_POS_Y as usize * block_m;
    let col0 = CUBE_POS_X as usize * block_n;
    // A's lines are its rows (zeros past `rows`); B's its columns, whole
    // blocks of them.
    let a_at = Operand {
        base: z * a_batch as usize,
        stride: a_stride as usize,
        first: row0,
        bound: rows as usize,
    };
    let b_at = Operand {
        base: z * b_batch as usize,
        stride: b_stride as usize,
        first: col0,
        bound: out_cols as usize,
    };

    let a_len = comptime!(block_m * LD);
    let b_len = comptime!(block_n * LD);
    let mut a_tile = SharedMemory::<tf32>::new_aligned(a_len, 32usize);
    let mut b_tile = SharedMemory::<tf32>::new_aligned(b_len, 32usize);
    let mut a_regs =
        Array::<Vector<f32, N>>::new(comptime!(block_m * BLOCK_K / VECTOR / cube_units));
    let mut b_regs =
        Array::<Vector<f32, N>>::new(comptime!(block_n * BLOCK_K / VECTOR / cube_units));

    // This plane's part of the tile as 2 × col_tiles accumulators.
    let col_tiles = comptime!(block_n / 2 / TILE);
    let plane_row = (plane / 2) * PLANE_ROWS;
    let plane_col = (plane % 2) * comptime!(block_n / 2);
    let mut acc = Sequence::<cmma::Matrix<f32>>::new();
    #[unroll]
    for _ in 0..comptime!(2 * col_tiles) {
        acc.push(cmma::Matrix::<f32>::from_value(
            MatrixIdent::Accumulator,
            TILE,
            TILE,
            TILE_K,
            MatrixLayout::Undefined,
            0.0,
        ));
    }

    let slices = inner as usize / BLOCK_K;
    load_slice::<N>(
        a,
        &mut a_regs,
        unit,
        0,
        &a_at,
        a_k_contiguous,
        block_m,
        cube_units,
    );
    load_slice::<N>(
        b,
        &mut b_regs,
        unit,
        0,
        &b_at,
        b_k_contiguous,
        block_n,
        cube_units,
    );
    for s in 0..slices {
        store_slice::<N>(
            &a_regs,
            &mut a_tile,
            unit,
            a_k_contiguous,
            block_m,
            cube_units,
        );
        store_slice::<N>(
            &b_regs,
            &mut b_tile,
            unit,
            b_k_contiguous,
            block_n,
            cube_units,
        );
        sync_cube();
        if s + 1 < slices {
            let k0 = (s + 1) * BLOCK_K;
            load_slice::<N>(
                a,
                &mut a_regs,
                unit,
                k0,
                &a_at,
                a_k_contiguous,
                block_m,
                cube_units,
            );
            load_slice::<N>(
                b,
                &mut b_regs,
                unit,
                k0,
                &b_at,
                b_k_contiguous,
                block_n,
                cube_units,
            );
        }
        #[unroll]
        for kk in 0..comptime!(BLOCK_K / TILE_K) {
            let mut b_frags = Sequence::<cmma::Matrix<tf32>>::new();
            #[unroll]
            for c in 0..col_tiles {
                let at = (plane_col + c * TILE) * LD + kk * TILE_K;
                b_frags.push(cmma::Matrix::<tf32>::from_slice(
                    MatrixIdent::B,
                    TILE,
                    TILE,
                    TILE_K,
                    MatrixLayout::ColMajor,
                    &b_tile.slice(at, b_len),
                    LD as u32,
                ));
            }
            #[unroll]
            for r in 0..2usize {
                let at = (plane_row + r * TILE) * LD + kk * TILE_K;
                let a_frag = cmma::Matrix::<tf32>::from_slice(
                    MatrixIdent::A,
                    TILE,
                    TILE,
                    TILE_K,
                    MatrixLayout::RowMajor,
                    &a_tile.slice(at, a_len),
                    LD as u32,
                );
                #[unroll]
                for c in 0..col_tiles {
                    let sum = acc.index(r * col_tiles + c);
                    cmma::execute::<tf32, tf32, f32, f32>(&a_frag, b_frags.index(c), sum, sum);
                }
            }
        }
        sync_cube();
    }

    let cols = out_cols as usize;
    let out_base = z * out_rows as usize * cols;
    let out_len = out.len();
    #[unroll]
    for r in 0..2usize {
        #[unroll]
        for c in 0..col_tiles {
            let at = out_base + (row0 + plane_row + r * TILE) * cols + col0 + plane_col + c * TILE;
            cmma::store(
                &mut out.slice_mut(at, out_len),
                acc.index(r * col_tiles + c),
                cols as u32,
                MatrixLayout::RowMajor,
            );
        }
    }
}

/// Where one operand of a cube is (see [`rows_matmul_tf32`]): its lines
/// (A's rows, B's columns) from `first`, those at or past `bound` read as
/// zeros, one `stride` apart along the axis that is not contiguous.
#[derive(CubeType)]
struct Operand {
    base: usize,
    stride: usize,
    first: usize,
    bound: usize,
}

/// Loads this unit's vectors of an operand's slice at `k0` (its `len`
/// lines) into registers. Vector `v` of the slice is, along k, line
/// `v / 8` and k `4 · (v % 8)`; across k (lines contiguous), k `v % 32`
/// and lines `4 · (v / 32)` (see [`store_slice`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_slice<N: Size>(
    t: &Tensor<Vector<f32, N>>,
    regs: &mut Array<Vector<f32, N>>,
    unit: usize,
    k0: usize,
    at: &Operand,
    #[comptime] k_contiguous: bool,
    #[comptime] len: usize,
    #[comptime] cube_units: usize,
) {
    #[unroll]
    for i in 0..comptime!(len * BLOCK_K / VECTOR / cube_units) {
        let v = unit + i * cube_units;
        let mut value = Vector::<f32, N>::new(0.0f32);
        if k_contiguous {
            let line = at.first + v / comptime!(BLOCK_K / VECTOR);
            let k = k0 + (v % comptime!(BLOCK_K / VECTOR)) * VECTOR;
            if line < at.bound {
                value = t[(at.base + line * at.stride + k) / VECTOR];
            }
        } else {
            let k = k0 + v % BLOCK_K;
            let line = at.first + (v / BLOCK_K) * VECTOR;
            if line < at.bound {
                value = t[(at.base + k * at.stride + line) / VECTOR];
            }
        }
        regs[i] = value;
    }
}

/// Writes this unit's registers to a shared tile of `[len][LD]` (k along
/// the row), rounded to TF32: a vector along k in place, a vector across
/// k as four elements of one column.
#[cube]
fn store_slice<N: Size>(
    regs: &Array<Vector<f32, N>>,
    tile: &mut SharedMemory<tf32>,
    unit: usize,
    #[comptime] k_contiguous: bool,
    #[comptime] len: usize,
    #[comptime] cube_units: usize,
) {
    #[unroll]
    for t in 0..comptime!(len * BLOCK_K / VECTOR / cube_units) {
        let v = unit + t * cube_units;
        let value = regs[t];
        if k_contiguous {
            let at =
                (v / comptime!(BLOCK_K / VECTOR)) * LD + (v % comptime!(BLOCK_K / VECTOR)) * VECTOR;
            #[unroll]
            for e in 0..VECTOR {
                tile[at + e] = <tf32 as Cast>::cast_from(value[e]);
            }
        } else {
            let at = (v / BLOCK_K) * VECTOR * LD + v % BLOCK_K;
            #[unroll]
            for e in 0..VECTOR {
                tile[at + e * LD] = <tf32 as Cast>::cast_from(value[e]);
            }
        }
    }
}
