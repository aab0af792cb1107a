//! The attention forward on tensor cores with the products' operands and
//! results in registers (`mma.sync`, whose register layout PTX defines): f32
//! as split TF32 ("3xTF32") and f16/bf16 as they are, one kernel
//! ([`attention_forward_mma`]) over the two operand families ([`SplitTf32`],
//! [`HalfMma`]: [`MmaOperands`]). CUDA only. No Burn imports here.
//!
//! Why: the CUDA-core forwards (`rows.rs`, `tiled.rs`) are bound by issue
//! slots at 64 multiply-adds a (query, key) pair (1.50 ms at the ASV shape on
//! the H100, 0.63x PyTorch's `mem_efficient`). Tensor cores do those
//! products, but f32 needs the operands split: `x = hi + lo` with `hi` the
//! TF32 rounding of `x` and `lo` that of the rest, and `a·b ≈ a_hi·b_lo +
//! a_lo·b_hi + a_hi·b_hi` (the dropped `a_lo·b_lo` is ~2⁻²² of the product),
//! which leaves f32-level error. With `cmma` fragments, whose layout is
//! opaque, the scores go through shared memory and the kernel is slower than
//! the CUDA cores (`docs/performance.md`, 2026-11-25).
//! Here the layout is PTX's `m16n8k8` one, so the softmax runs on the
//! accumulator registers and `P` becomes the next product's operand without
//! leaving them, as in FlashAttention-2:
//!
//! - A plane owns 16 queries. Its `Q` operands (hi and lo, scaled, with the
//!   bias) stay in registers; unit `lane` holds rows `g = lane/4` and `g + 8`
//!   and dims `t = lane % 4`, `t + 4` of every 8.
//! - Keys come in chunks of two tiles of 8 ([`CHUNK_TILES`]; chunks of
//!   four took the kernel to 168 registers and one cube an SM, 1.56 ms
//!   against 1.09 with two at 95 registers): `S = Q·Kᵀ` in registers
//!   (unit: rows `g`, `g+8`, keys `2t`, `2t+1` of each tile), an online
//!   softmax whose row maximum is four units' (two plane shuffles), then
//!   `O += P̃·V`. A tile's `P` is the `A` operand of `P̃·V` as it stands if
//!   the product's `k` index `t` means key `2t` and `t + 4` key `2t + 1`;
//!   `V`'s operand is loaded in the same order.
//! - `K` and `V` of the head sit in shared memory already split (a quad
//!   holds the hi and lo of two operand elements a unit needs together), so
//!   a tile's operand is one 16-byte load per unit and no conversions
//!   (hi, hi, lo, lo: each pair lands in the two adjacent registers an
//!   operand needs, with no moves);
//!   rows are 64 bytes (mod 128) apart, so that the eight units of a
//!   quarter plane hit different banks.
//! - Where a head's keys fit a cube (the ASV level's 151: 88 KB split) the
//!   cube loads them once and its planes take blocks of queries in turn;
//!   else (the sample level's 1,024) each plane keeps one block of queries
//!   and the cube streams the keys past sixteen planes [`BLOCK_KEYS`] at a
//!   time, skipping blocks of padding whole ([`block_rows`]).
//!
//! With [`HalfMma`] (f16/bf16) the kernel runs `m16n8k16` products, no split:
//! there a pair of 8-key tiles' scores is `P̃·V`'s `A` operand in PTX's own
//! order (FlashAttention-2's layout), and `K`, `V` quads hold the four
//! elements of a unit's `B` operand. It replaces `tensor_core.rs`'s `cmma`
//! forward where it applies (at the ASV shape on the H100, 2026-11-28: 0.35
//! ms staging K and V by 16-byte vectors, `mma_io.rs`, 0.48 element by
//! element, against the `cmma` kernel's 0.79, whose scores go through shared
//! memory; f32 0.78 ms, staged by vectors too, against the CUDA cores' 1.51:
//! `docs/performance.md`).
//!
//! Semantics are `attention_forward`'s: q scaled (and biased) as loaded, a
//! masked key's probability 0, zero output and log-sum-exp for a row with
//! no valid key, the dropout hash of `(seed, bh, row, key)` (the row sum
//! counts undropped probabilities), so every backward (CUDA-core for f32;
//! for f16/bf16 `mma_backward.rs`'s on these layouts, or `cmma`) follows
//! it. Chunks (and streamed blocks) whose keys are all masked are skipped.
//! Kernels compile per key count, which the caller rounds up (keys past the
//! call's are masked: `MmaForward` in `plan.rs`).

use cubecl::cmma::MmaDefinition;
use cubecl::prelude::*;

use super::args::{Operands, Scalars};
use super::mma_io::{
    half_stride, head_rows, read_quad, row_operands, stage_rows, store_pair, AccPair, Half4,
    HeadRows, Pair, RowOperands, ValidPair,
};
use crate::cube::{bias_at, cube_head, dropout_keep, CubeHead, Quad, FAST_EXP};

/// One TF32 operand element of `mma.sync.m16n8k8` (a unit's register).
type Tf32One = Vector<tf32, Const<1>>;
/// The hi and lo parts of two operand elements (shared memory).
type SplitQuad = Vector<tf32, Const<4>>;

/// Key tiles (of 8) a chunk of the online softmax takes by default (the
/// f16/bf16 kernel needs an even number: its `k = 16` steps).
pub const CHUNK_TILES: usize = 2;

/// Quads between two rows of `quads` quads, so that rows are 64 bytes apart
/// modulo 128 (see the module doc).
pub const fn split_stride(quads: usize) -> usize {
    quads + (12 - quads % 8) % 8
}

/// Keys the kernels store: `keys` rounded up to whole tiles of 8 (f32) or
/// pairs of them (f16/bf16: one `k = 16` step of `P̃·V`).
pub const fn mma_key_rows(keys: usize, half: bool) -> usize {
    if half {
        keys.div_ceil(16) * 16
    } else {
        keys.div_ceil(8) * 8
    }
}

/// Keys a block of the streamed kernels takes by default (see
/// [`block_rows`]): 76 KB of split f32 keys and values at head dim 32 (256
/// did not fit; 64 was slower at the sample level, `docs/performance.md`).
pub const BLOCK_KEYS: usize = 128;

/// Key rows a cube holds in shared memory at a time: all of a head's keys
/// (rounded up to whole tiles) where `keys ≤ block_keys`, else blocks of
/// `block_keys` (a multiple of 16 and of the chunk's keys), loaded in turn.
pub const fn block_rows(keys: usize, block_keys: usize, half: bool) -> usize {
    if keys <= block_keys {
        mma_key_rows(keys, half)
    } else {
        block_keys
    }
}

/// Shared memory (bytes) of [`attention_forward_mma`] (`half`: with
/// [`HalfMma`]) holding `rows` key rows (see [`block_rows`]).
pub fn mma_shared_bytes(rows: usize, head_dim: usize, half: bool) -> usize {
    let operands = if half {
        (rows * half_stride(head_dim / 4) + head_dim * half_stride(rows / 4)) * 8
    } else {
        (rows * split_stride(head_dim / 2) + head_dim * split_stride(rows / 2)) * 16
    };
    operands + rows * 4 + rows.div_ceil(8) * 4
}

/// A plane's `Q` operand for one `k = 8` step: hi and lo.
#[derive(CubeType)]
pub(crate) struct QOperand {
    hi: Array<Tf32One>,
    lo: Array<Tf32One>,
}

/// The per-row state of a plane's online softmax: `[m(g), m(g+8), l(g),
/// l(g+8)]` (`l` is the unit's share of the row sum until the end).
type RowState = Array<f32>;

/// The work of one plane's 16 queries that does not depend on the operand
/// type: the output accumulators (`o[dn]`: dims `8·dn..`, rows `g`, `g+8`),
/// the softmax state, and the unit's rows.
#[derive(CubeType)]
pub(crate) struct PlaneRows {
    o: Sequence<Array<AccPair>>,
    state: RowState,
    row0: usize,
}

/// The shared memory of a cube: a block of keys and values in the
/// family's operand layout (`E`: split TF32 quads or f16/bf16 quads, see
/// [`MmaOperands::stage_keys`]), their validity by pair and each chunk's
/// count of valid keys.
#[derive(CubeType)]
pub(crate) struct KeyStage<E: CubePrimitive> {
    kt: SharedMemory<E>,
    vt: SharedMemory<E>,
    valid: SharedMemory<ValidPair>,
    chunk_valid: SharedMemory<f32>,
}

/// A [`KeyStage`] of `rows` keys whose K and V take `k_len` and `v_len`
/// elements.
#[cube]
fn key_stage<E: CubePrimitive>(
    #[comptime] k_len: usize,
    #[comptime] v_len: usize,
    #[comptime] rows: usize,
) -> KeyStage<E> {
    KeyStage::<E> {
        kt: SharedMemory::<E>::new(k_len),
        vt: SharedMemory::<E>::new(v_len),
        valid: SharedMemory::<ValidPair>::new(comptime!(rows / 2)),
        chunk_valid: SharedMemory::<f32>::new(comptime!(rows.div_ceil(8))),
    }
}

/// The rows of Q, K, V and the output of the cube's head.
#[derive(CubeType)]
pub(crate) struct ForwardViews {
    q: HeadRows,
    k: HeadRows,
    v: HeadRows,
    out: HeadRows,
}

/// What the split-TF32 (f32) and the f16/bf16 forwards differ in: the
/// element K and V are staged in, Q's element and operands, and one chunk's
/// products. [`attention_forward_mma`], the rest (key blocks, query blocks,
/// the online softmax, the output), is the same for both.
#[cube]
pub(crate) trait MmaOperands<F: Float, N: Size>: 'static + Send + Sync {
    /// Whether these are f16/bf16's operands (keys in steps of 16).
    const HALF: bool;
    /// The element of the staged keys and values.
    type Staged: CubePrimitive;
    /// Q's element in its buffer.
    type Query: CubePrimitive;
    /// A plane's Q operands for a block of 16 queries.
    type QueryOps: CubeType;

    /// A cube's stage of `rows` keys.
    fn new_stage(#[comptime] rows: usize, #[comptime] head_dim: usize) -> KeyStage<Self::Staged>;

    /// Writes keys `[start, start + count)` of the head into `stage` in the
    /// family's layout (zero where masked or past `count`), their validity
    /// being loaded. Every unit must call it.
    #[allow(clippy::too_many_arguments)]
    fn stage_keys(
        k: &Tensor<Vector<F, N>>,
        v: &Tensor<Vector<F, N>>,
        views: &ForwardViews,
        bias: &Tensor<F>,
        head: &CubeHead,
        stage: &mut KeyStage<Self::Staged>,
        call: &Scalars,
        start: usize,
        #[comptime] count: usize,
        #[comptime] rows: usize,
        #[comptime] head_dim: usize,
        #[comptime] units: usize,
        #[comptime] with_bias: bool,
    );

    /// Q's operands (scaled, biased; zero past `tq`) of query block `block`.
    #[allow(clippy::too_many_arguments)]
    fn query_operands(
        q: &Tensor<Self::Query>,
        views: &ForwardViews,
        bias: &Tensor<F>,
        head: &CubeHead,
        block: usize,
        tq: usize,
        scale: f32,
        #[comptime] head_dim: usize,
        #[comptime] with_bias: bool,
    ) -> Self::QueryOps;

    /// One chunk of `tiles` key tiles from tile `first` of the block at key
    /// `start`: scores, the softmax step and `o += P̃·V`.
    #[allow(clippy::too_many_arguments)]
    fn attend_chunk(
        stage: &KeyStage<Self::Staged>,
        q_ops: &Self::QueryOps,
        plane: &mut PlaneRows,
        head: &CubeHead,
        call: &Scalars,
        first: usize,
        start: usize,
        #[comptime] tiles: usize,
        #[comptime] rows: usize,
        #[comptime] head_dim: usize,
        #[comptime] use_dropout: bool,
    );
}

/// f32 as split TF32 (`m16n8k8`): K by key (quad `key·stride + 4·s + t`
/// holds dims `d = 8s + t` and `d + 4`, the two of a `B` operand, his then
/// los), V by dim (quad `d·stride + p` holds keys `2p`, `2p + 1`).
pub(crate) struct SplitTf32;

#[cube]
impl<F: Float, N: Size> MmaOperands<F, N> for SplitTf32 {
    const HALF: bool = false;
    type Staged = SplitQuad;
    type Query = F;
    type QueryOps = Sequence<QOperand>;

    fn new_stage(#[comptime] rows: usize, #[comptime] head_dim: usize) -> KeyStage<SplitQuad> {
        key_stage::<SplitQuad>(
            comptime!(rows * split_stride(head_dim / 2)),
            comptime!(head_dim * split_stride(rows / 2)),
            rows,
        )
    }

    fn stage_keys(
        k: &Tensor<Vector<F, N>>,
        v: &Tensor<Vector<F, N>>,
        views: &ForwardViews,
        bias: &Tensor<F>,
        head: &CubeHead,
        stage: &mut KeyStage<SplitQuad>,
        call: &Scalars,
        start: usize,
        #[comptime] _count: usize,
        #[comptime] rows: usize,
        #[comptime] head_dim: usize,
        #[comptime] units: usize,
        #[comptime] with_bias: bool,
    ) {
        let unit = UNIT_POS_X as usize;
        let k_stride = comptime!(split_stride(head_dim / 2));
        let v_stride = comptime!(split_stride(rows / 2));
        let k_bias = call.k_offset as usize + head.h * head_dim;
        let v_bias = call.v_offset as usize + head.h * head_dim;
        // K by key: a unit reads 8 dims of a key (two vector loads of four
        // where `N` is 4) and writes its four split quads (dims `8s + t` and
        // `+ 4`).
        let mut item = unit;
        while item < comptime!(rows * head_dim / 8) {
            let key = item / comptime!(head_dim / 8);
            let s = item % comptime!(head_dim / 8);
            let mut low = Quad::new(0.0f32);
            let mut high = Quad::new(0.0f32);
            if stage.valid[key / 2][key % 2] > 0.0 {
                let at = views.k.base + (start + key) * views.k.stride + s * 8;
                low = read_quad::<F, N>(k, at);
                high = read_quad::<F, N>(k, at + 4);
                #[unroll]
                for c in 0..4usize {
                    low[c] += bias_at(bias, k_bias + s * 8 + c, with_bias);
                    high[c] += bias_at(bias, k_bias + s * 8 + 4 + c, with_bias);
                }
            }
            #[unroll]
            for t in 0..4usize {
                stage.kt[key * k_stride + s * 4 + t] = split_pair(low[t], high[t]);
            }
            item += units;
        }
        // V by dim: a unit reads a quad of dims of a pair of keys and writes
        // the four dims' split quads.
        let mut item = unit;
        while item < comptime!(rows / 2 * head_dim / 4) {
            let p = item / comptime!(head_dim / 4);
            let d = (item % comptime!(head_dim / 4)) * 4;
            let mut first = Quad::new(0.0f32);
            let mut second = Quad::new(0.0f32);
            if stage.valid[p][0] > 0.0 {
                first = read_quad::<F, N>(v, views.v.base + (start + p * 2) * views.v.stride + d);
            }
            if stage.valid[p][1] > 0.0 {
                second =
                    read_quad::<F, N>(v, views.v.base + (start + p * 2 + 1) * views.v.stride + d);
            }
            #[unroll]
            for c in 0..4usize {
                let b = bias_at(bias, v_bias + d + c, with_bias);
                // A masked key's value stays 0 (its bias is not added).
                let x0 = select(stage.valid[p][0] > 0.0, first[c] + b, 0.0f32);
                let x1 = select(stage.valid[p][1] > 0.0, second[c] + b, 0.0f32);
                stage.vt[(d + c) * v_stride + p] = split_pair(x0, x1);
            }
            item += units;
        }
    }

    /// PTX's A layout: element r at row g + 8·(r % 2), col t + 4·(r / 2) of
    /// each step of 8 dims, hi and lo.
    fn query_operands(
        q: &Tensor<F>,
        views: &ForwardViews,
        bias: &Tensor<F>,
        head: &CubeHead,
        block: usize,
        tq: usize,
        scale: f32,
        #[comptime] head_dim: usize,
        #[comptime] with_bias: bool,
    ) -> Sequence<QOperand> {
        let lane = UNIT_POS_X as usize % 32;
        let q_bias = head.h * head_dim;
        let mut q_ops = Sequence::<QOperand>::new();
        #[unroll]
        for s in 0..comptime!(head_dim / 8) {
            let mut hi = Array::<Tf32One>::new(4usize);
            let mut lo = Array::<Tf32One>::new(4usize);
            #[unroll]
            for r in 0..4usize {
                let row = block * 16 + lane / 4 + (r % 2) * 8;
                let d = s * 8 + lane % 4 + (r / 2) * 4;
                let mut value = 0.0f32;
                if row < tq {
                    let at = views.q.base + row * views.q.stride + d;
                    value = (f32::cast_from(q[at]) + bias_at(bias, q_bias + d, with_bias)) * scale;
                }
                let h = to_tf32(value);
                hi[r] = Tf32One::new(h);
                lo[r] = Tf32One::new(to_tf32(value - f32::cast_from(h)));
            }
            q_ops.push(QOperand { hi, lo });
        }
        q_ops
    }

    fn attend_chunk(
        stage: &KeyStage<SplitQuad>,
        q_ops: &Sequence<QOperand>,
        plane: &mut PlaneRows,
        head: &CubeHead,
        call: &Scalars,
        first: usize,
        start: usize,
        #[comptime] tiles: usize,
        #[comptime] rows: usize,
        #[comptime] head_dim: usize,
        #[comptime] use_dropout: bool,
    ) {
        let mut scores = scores_tf32(
            &stage.kt,
            q_ops,
            first,
            tiles,
            head_dim,
            comptime!(split_stride(head_dim / 2)),
        );
        softmax_step(
            &mut scores,
            &stage.valid,
            plane,
            first,
            start,
            head,
            call.dropout_threshold,
            call.dropout_scale,
            tiles,
            head_dim,
            use_dropout,
        );
        add_weights_times_values_tf32(
            &scores,
            &stage.vt,
            plane,
            first,
            tiles,
            head_dim,
            comptime!(split_stride(rows / 2)),
        );
    }
}

/// Two f32 values split into TF32 `[hi(a), hi(b), lo(a), lo(b)]`, the
/// layout of [`SplitTf32`]'s staged quads.
#[cube]
fn split_pair(a: f32, b: f32) -> SplitQuad {
    let mut x = SplitQuad::new(to_tf32(0.0f32));
    let ha = to_tf32(a);
    let hb = to_tf32(b);
    x[0] = ha;
    x[1] = hb;
    x[2] = to_tf32(a - f32::cast_from(ha));
    x[3] = to_tf32(b - f32::cast_from(hb));
    x
}

/// f16/bf16 as they are (`m16n8k16`), staged by 16-byte vectors
/// ([`stage_rows`]): K by key (unit `key·stride + 4·s + t` holds dims
/// `16s + 2t`, `+1`, `+8`, `+9`, a `B` operand's four), V by dim (unit
/// `d·stride + 4·p + t` holds keys `16p + 2t`, `+1`, `+8`, `+9`).
pub(crate) struct HalfMma;

#[cube]
impl<F: Float, N: Size> MmaOperands<F, N> for HalfMma {
    const HALF: bool = true;
    type Staged = Half4<F>;
    type Query = Pair<F>;
    type QueryOps = RowOperands<F>;

    fn new_stage(#[comptime] rows: usize, #[comptime] head_dim: usize) -> KeyStage<Half4<F>> {
        key_stage::<Half4<F>>(
            comptime!(rows * half_stride(head_dim / 4)),
            comptime!(head_dim * half_stride(rows / 4)),
            rows,
        )
    }

    fn stage_keys(
        k: &Tensor<Vector<F, N>>,
        v: &Tensor<Vector<F, N>>,
        views: &ForwardViews,
        bias: &Tensor<F>,
        head: &CubeHead,
        stage: &mut KeyStage<Half4<F>>,
        call: &Scalars,
        start: usize,
        #[comptime] count: usize,
        #[comptime] rows: usize,
        #[comptime] head_dim: usize,
        #[comptime] units: usize,
        #[comptime] with_bias: bool,
    ) {
        let k_bias = call.k_offset as usize + head.h * head_dim;
        let v_bias = call.v_offset as usize + head.h * head_dim;
        stage_rows::<F, N>(
            k,
            &views.k,
            bias,
            k_bias,
            &mut stage.kt,
            &mut stage.vt,
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
            false,
        );
        stage_rows::<F, N>(
            v,
            &views.v,
            bias,
            v_bias,
            &mut stage.kt,
            &mut stage.vt,
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
            false,
            true,
        );
    }

    fn query_operands(
        q: &Tensor<Pair<F>>,
        views: &ForwardViews,
        bias: &Tensor<F>,
        head: &CubeHead,
        block: usize,
        tq: usize,
        scale: f32,
        #[comptime] head_dim: usize,
        #[comptime] with_bias: bool,
    ) -> RowOperands<F> {
        row_operands::<F>(
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
        )
    }

    fn attend_chunk(
        stage: &KeyStage<Half4<F>>,
        q_ops: &RowOperands<F>,
        plane: &mut PlaneRows,
        head: &CubeHead,
        call: &Scalars,
        first: usize,
        start: usize,
        #[comptime] tiles: usize,
        #[comptime] rows: usize,
        #[comptime] head_dim: usize,
        #[comptime] use_dropout: bool,
    ) {
        let mut scores = scores_half::<F>(
            &stage.kt,
            q_ops,
            first,
            tiles,
            head_dim,
            comptime!(half_stride(head_dim / 4)),
        );
        softmax_step(
            &mut scores,
            &stage.valid,
            plane,
            first,
            start,
            head,
            call.dropout_threshold,
            call.dropout_scale,
            tiles,
            head_dim,
            use_dropout,
        );
        add_products_half::<F>(
            &scores,
            &stage.vt,
            &mut plane.o,
            first,
            tiles,
            head_dim,
            comptime!(half_stride(rows / 4)),
        );
    }
}

/// Forward of one (n, h) a cube: `out = softmax(q·kᵀ·scale, masked)·v` and
/// the row log-sum-exp, on tensor cores: f32 as split TF32 (`M` = [`SplitTf32`]), f16/bf16 as
/// they are (`M` = [`HalfMma`], `m16n8k16`; `chunk_tiles` even; see the
/// module doc).
/// `keys` is `k.shape(2)` rounded up (keys past it count as masked, so that
/// calls of nearby lengths share a compiled kernel), `head_dim` 16, 32 or
/// 64; `units` is 32 a plane;
/// `chunk_tiles` key tiles of 8 a step of the online softmax. Where `keys ≤
/// block_keys` the cube loads all of the head's keys once and its planes
/// take blocks of 16 queries in turn; else (`keys` a multiple of
/// `block_keys`) each plane owns one block of queries (cube y: which
/// `units / 32` blocks) and the cube streams the keys through shared memory
/// `block_keys` at a time, skipping blocks that are all padding.
///
/// Launch: cube x: n·H + h − bh_offset, y: query group; `units` units.
#[cube(launch, fast_math = FAST_EXP)]
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_mma<F: Float, N: Size, M: MmaOperands<F, N>>(
    ops: &Operands<M::Query, Vector<F, N>, F>,
    out: &mut Tensor<Pair<F>>,
    lse: &mut Tensor<f32>,
    call: &Scalars,
    #[comptime] head_dim: usize,
    #[comptime] keys: usize,
    #[comptime] block_keys: usize,
    #[comptime] units: usize,
    #[comptime] chunk_tiles: usize,
    #[comptime] use_dropout: bool,
    #[comptime] with_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (q, k, v, bias, key_valid) = (&ops.q, &ops.k, &ops.v, &ops.bias, &ops.key_valid);
    let tq = q.shape(2);
    let head = cube_head(call.heads, call.bh_offset, call.seed);
    let rows = comptime!(block_rows(keys, block_keys, M::HALF));
    let mut stage = M::new_stage(rows, head_dim);
    let views = ForwardViews {
        q: head_rows(q, 0u32, &head),
        k: head_rows(k, call.k_offset, &head),
        v: head_rows(v, call.v_offset, &head),
        out: head_rows(out, 0u32, &head),
    };
    let planes = comptime!(units / 32);
    if comptime!(keys <= block_keys) {
        load_block::<F, N, M>(
            k,
            v,
            &views,
            bias,
            key_valid,
            &head,
            &mut stage,
            call,
            0,
            keys,
            rows,
            head_dim,
            chunk_tiles,
            units,
            with_bias,
        );
        let mut block = UNIT_POS_X as usize / 32;
        while block < tq.div_ceil(16) {
            let q_ops = M::query_operands(
                q, &views, bias, &head, block, tq, call.scale, head_dim, with_bias,
            );
            let mut plane = plane_rows(block, head_dim);
            attend_block::<F, N, M>(
                &stage,
                &q_ops,
                &mut plane,
                &head,
                call,
                0,
                keys,
                rows,
                head_dim,
                chunk_tiles,
                use_dropout,
            );
            write_rows::<F>(out, &views.out, lse, &plane, &head, tq, head_dim);
            block += planes;
        }
    } else {
        let block = CUBE_POS_Y as usize * planes + UNIT_POS_X as usize / 32;
        let q_ops = M::query_operands(
            q, &views, bias, &head, block, tq, call.scale, head_dim, with_bias,
        );
        let mut plane = plane_rows(block, head_dim);
        for b in 0..comptime!(keys / block_keys) {
            let start = b * block_keys;
            if load_block::<F, N, M>(
                k,
                v,
                &views,
                bias,
                key_valid,
                &head,
                &mut stage,
                call,
                start,
                block_keys,
                rows,
                head_dim,
                chunk_tiles,
                units,
                with_bias,
            ) {
                attend_block::<F, N, M>(
                    &stage,
                    &q_ops,
                    &mut plane,
                    &head,
                    call,
                    start,
                    block_keys,
                    rows,
                    head_dim,
                    chunk_tiles,
                    use_dropout,
                );
            }
        }
        write_rows::<F>(out, &views.out, lse, &plane, &head, tq, head_dim);
    }
}

/// Loads keys `[start, start + count)` of the head into `stage` (see
/// [`MmaOperands::stage_keys`]), after a cube sync (the last block's
/// readers are done) and with one after. Returns whether any key of the
/// block is valid (the same in every unit: the cube skips the block
/// otherwise). Every unit must call it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_block<F: Float, N: Size, M: MmaOperands<F, N>>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    views: &ForwardViews,
    bias: &Tensor<F>,
    key_valid: &Tensor<f32>,
    head: &CubeHead,
    stage: &mut KeyStage<M::Staged>,
    call: &Scalars,
    start: usize,
    #[comptime] count: usize,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] chunk_tiles: usize,
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
        chunk_tiles,
        units,
    );
    if any {
        M::stage_keys(
            k, v, views, bias, head, stage, call, start, count, rows, head_dim, units, with_bias,
        );
    }
    sync_cube();
    any
}

/// A plane's online softmax and `P̃·V` over a loaded block of `count` keys
/// from key `start` (`rows` rows in `stage`), chunk by chunk, skipping
/// chunks with no valid key.
#[cube]
#[allow(clippy::too_many_arguments)]
fn attend_block<F: Float, N: Size, M: MmaOperands<F, N>>(
    stage: &KeyStage<M::Staged>,
    q_ops: &M::QueryOps,
    plane: &mut PlaneRows,
    head: &CubeHead,
    call: &Scalars,
    start: usize,
    #[comptime] count: usize,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] chunk_tiles: usize,
    #[comptime] use_dropout: bool,
) {
    let full_chunks = comptime!(count / (chunk_tiles * 8));
    let last_tiles =
        comptime!(mma_key_rows(count, M::HALF) / 8 - count / (chunk_tiles * 8) * chunk_tiles);
    for c in 0..full_chunks {
        if stage.chunk_valid[c] > 0.0 {
            M::attend_chunk(
                stage,
                q_ops,
                plane,
                head,
                call,
                c * chunk_tiles,
                start,
                chunk_tiles,
                rows,
                head_dim,
                use_dropout,
            );
        }
    }
    if comptime!(last_tiles > 0) {
        if stage.chunk_valid[full_chunks] > 0.0 {
            M::attend_chunk(
                stage,
                q_ops,
                plane,
                head,
                call,
                full_chunks * chunk_tiles,
                start,
                last_tiles,
                rows,
                head_dim,
                use_dropout,
            );
        }
    }
}

/// Loads the validity of keys `[start, start + count)` by pair (0 past
/// them and past the call's keys, up to `rows` keys) and each chunk's count of valid keys, syncing
/// the cube before (the last block's readers are done) and after. Returns
/// whether any is valid. Every unit must call it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_validity(
    key_valid: &Tensor<f32>,
    head: &CubeHead,
    valid: &mut SharedMemory<ValidPair>,
    chunk_valid: &mut SharedMemory<f32>,
    start: usize,
    #[comptime] count: usize,
    #[comptime] rows: usize,
    #[comptime] chunk_tiles: usize,
    #[comptime] units: usize,
) -> bool {
    let unit = UNIT_POS_X as usize;
    let chunk_keys = comptime!(chunk_tiles * 8);
    let chunks = comptime!(count.div_ceil(chunk_tiles * 8));
    // The call's keys (`key_valid` is `[N, Tk]`): `count` may run past them
    // (the kernels' key count is rounded up, see `MmaForward`).
    let tk = key_valid.shape(1);
    let base = head.n * tk + start;
    let end = select(tk > start, tk - start, 0);
    sync_cube();
    let mut pair = unit;
    while pair < comptime!(rows / 2) {
        let mut x = ValidPair::new(0.0f32);
        #[unroll]
        for e in 0..2usize {
            let key = pair * 2 + e;
            if key < count && key < end {
                x[e] = key_valid[base + key];
            }
        }
        valid[pair] = x;
        pair += units;
    }
    // Each chunk's count from shared memory, not from `key_valid` by a unit
    // a chunk (16 dependent global loads a block).
    sync_cube();
    if unit < chunks {
        let mut total = 0.0f32;
        #[unroll]
        for i in 0..comptime!(chunk_keys / 2) {
            let at = unit * comptime!(chunk_keys / 2) + i;
            if at < comptime!(rows / 2) {
                let x = valid[at];
                total += x[0] + x[1];
            }
        }
        chunk_valid[unit] = total;
    }
    sync_cube();
    let mut any = 0.0f32;
    for c in 0..chunks {
        any += chunk_valid[c];
    }
    any > 0.0
}

/// A plane's [`PlaneRows`] for query block `block`, zeroed.
#[cube]
fn plane_rows(block: usize, #[comptime] head_dim: usize) -> PlaneRows {
    let lane = UNIT_POS_X as usize % 32;
    let mut o = Sequence::<Array<AccPair>>::new();
    #[unroll]
    for _ in 0..comptime!(head_dim / 8) {
        let mut acc = Array::<AccPair>::new(2usize);
        acc[0] = AccPair::new(0.0f32);
        acc[1] = AccPair::new(0.0f32);
        o.push(acc);
    }
    let mut state = RowState::new(4usize);
    state[0] = -1.0e30f32;
    state[1] = -1.0e30f32;
    state[2] = 0.0f32;
    state[3] = 0.0f32;
    PlaneRows {
        o,
        state,
        row0: block * 16 + lane / 4,
    }
}

/// `S = Q·Kᵀ` of `tiles` key tiles from tile `first`, split TF32: tile j's
/// `B` operand is K[key 8j + g][dims t, t + 4] of each step.
#[cube]
fn scores_tf32(
    kt: &SharedMemory<SplitQuad>,
    q_ops: &Sequence<QOperand>,
    first: usize,
    #[comptime] tiles: usize,
    #[comptime] head_dim: usize,
    #[comptime] k_stride: usize,
) -> Sequence<Array<AccPair>> {
    let def = MmaDefinition::<tf32, tf32, f32>::new(16usize, 8usize, 8usize);
    let lane = UNIT_POS_X as usize % 32;
    let mut scores = Sequence::<Array<AccPair>>::new();
    #[unroll]
    for j in 0..tiles {
        let mut s = Array::<AccPair>::new(2usize);
        s[0] = AccPair::new(0.0f32);
        s[1] = AccPair::new(0.0f32);
        let key = (first + j) * 8 + lane / 4;
        #[unroll]
        for step in 0..comptime!(head_dim / 8) {
            let x = kt[key * k_stride + step * 4 + lane % 4];
            let mut b_hi = Array::<Tf32One>::new(2usize);
            let mut b_lo = Array::<Tf32One>::new(2usize);
            b_hi[0] = Tf32One::new(x[0]);
            b_hi[1] = Tf32One::new(x[1]);
            b_lo[0] = Tf32One::new(x[2]);
            b_lo[1] = Tf32One::new(x[3]);
            let a = q_ops.index(step);
            def.execute_inplace(&a.lo, &b_hi, &mut s);
            def.execute_inplace(&a.hi, &b_lo, &mut s);
            def.execute_inplace(&a.hi, &b_hi, &mut s);
        }
        scores.push(s);
    }
    scores
}

/// `S = Q·Kᵀ` of `tiles` key tiles from tile `first`, f16/bf16: tile j's
/// `B` operand is the unit `4·s + t` of key 8j + g (see the kernel).
#[cube]
pub(crate) fn scores_half<F: Float>(
    kt: &SharedMemory<Vector<F, Const<4>>>,
    q_ops: &Sequence<Array<Vector<F, Const<2>>>>,
    first: usize,
    #[comptime] tiles: usize,
    #[comptime] head_dim: usize,
    #[comptime] k_stride: usize,
) -> Sequence<Array<AccPair>> {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_X as usize % 32;
    let mut scores = Sequence::<Array<AccPair>>::new();
    #[unroll]
    for j in 0..tiles {
        let mut s = Array::<AccPair>::new(2usize);
        s[0] = AccPair::new(0.0f32);
        s[1] = AccPair::new(0.0f32);
        let key = (first + j) * 8 + lane / 4;
        #[unroll]
        for step in 0..comptime!(head_dim / 16) {
            let b = half_operand::<F>(kt[key * k_stride + step * 4 + lane % 4]);
            def.execute_inplace(q_ops.index(step), &b, &mut s);
        }
        scores.push(s);
    }
    scores
}

/// The two pairs of a unit's f16/bf16 `B` operand from one 8-byte unit.
#[cube]
fn half_operand<F: Float>(x: Vector<F, Const<4>>) -> Array<Vector<F, Const<2>>> {
    let mut b = Array::<Vector<F, Const<2>>>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        let mut pair = Vector::<F, Const<2>>::new(x[2 * r]);
        pair[1] = x[2 * r + 1];
        b[r] = pair;
    }
    b
}

/// One step of the online softmax over `tiles` tiles of scores from tile
/// `first` of the block at key `key_base`: masks them (-1e30), moves the
/// rows' maximum (four units a row: two plane shuffles), rescales the
/// output and the unit's share of the row sums, and turns the scores into
/// the weights `P̃` of `P̃·V` (dropout applied; the sums count undropped
/// probabilities).
#[cube]
#[allow(clippy::too_many_arguments)]
fn softmax_step(
    scores: &mut Sequence<Array<AccPair>>,
    valid: &SharedMemory<ValidPair>,
    rows: &mut PlaneRows,
    first: usize,
    key_base: usize,
    head: &CubeHead,
    dropout_threshold: u32,
    dropout_scale: f32,
    #[comptime] tiles: usize,
    #[comptime] head_dim: usize,
    #[comptime] use_dropout: bool,
) {
    let t = UNIT_POS_X as usize % 4;
    let mut m0 = rows.state[0];
    let mut m1 = rows.state[1];
    #[unroll]
    for j in 0..tiles {
        let s = scores.index_mut(j);
        let ok = valid[(first + j) * 4 + t];
        let mut s0 = s[0];
        let mut s1 = s[1];
        #[unroll]
        for e in 0..2usize {
            s0[e] = select(ok[e] > 0.0, s0[e], -1.0e30f32);
            s1[e] = select(ok[e] > 0.0, s1[e], -1.0e30f32);
            m0 = f32::max(m0, s0[e]);
            m1 = f32::max(m1, s1[e]);
        }
        s[0] = s0;
        s[1] = s1;
    }
    m0 = f32::max(m0, plane_shuffle_xor(m0, 1u32));
    m0 = f32::max(m0, plane_shuffle_xor(m0, 2u32));
    m1 = f32::max(m1, plane_shuffle_xor(m1, 1u32));
    m1 = f32::max(m1, plane_shuffle_xor(m1, 2u32));
    let corr0 = (rows.state[0] - m0).exp();
    let corr1 = (rows.state[1] - m1).exp();
    let mut l0 = rows.state[2] * corr0;
    let mut l1 = rows.state[3] * corr1;
    #[unroll]
    for dn in 0..comptime!(head_dim / 8) {
        let acc = rows.o.index_mut(dn);
        acc[0] = acc[0] * AccPair::new(corr0);
        acc[1] = acc[1] * AccPair::new(corr1);
    }
    let row0 = rows.row0 as u32;
    #[unroll]
    for j in 0..tiles {
        let s = scores.index_mut(j);
        let ok = valid[(first + j) * 4 + t];
        let mut w0 = s[0];
        let mut w1 = s[1];
        #[unroll]
        for e in 0..2usize {
            let p0 = select(ok[e] > 0.0, (w0[e] - m0).exp(), 0.0f32);
            let p1 = select(ok[e] > 0.0, (w1[e] - m1).exp(), 0.0f32);
            l0 += p0;
            l1 += p1;
            w0[e] = p0;
            w1[e] = p1;
            if use_dropout {
                let key = (key_base + (first + j) * 8 + t * 2 + e) as u32;
                let keep0 = dropout_keep(head.head_key, row0, key, dropout_threshold);
                let keep1 = dropout_keep(head.head_key, row0 + 8, key, dropout_threshold);
                w0[e] = select(keep0, p0 * dropout_scale, 0.0f32);
                w1[e] = select(keep1, p1 * dropout_scale, 0.0f32);
            }
        }
        s[0] = w0;
        s[1] = w1;
    }
    rows.state[0] = m0;
    rows.state[1] = m1;
    rows.state[2] = l0;
    rows.state[3] = l1;
}

/// `o += P̃·V` over `tiles` tiles from tile `first`, split TF32: a tile's
/// `A` operand element r is (row g + 8·(r % 2), key 2t + r / 2), the `B`
/// operand's element e (key 2t + e, dim g) (see the module doc).
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_weights_times_values_tf32(
    weights: &Sequence<Array<AccPair>>,
    vt: &SharedMemory<SplitQuad>,
    rows: &mut PlaneRows,
    first: usize,
    #[comptime] tiles: usize,
    #[comptime] head_dim: usize,
    #[comptime] v_stride: usize,
) {
    let def = MmaDefinition::<tf32, tf32, f32>::new(16usize, 8usize, 8usize);
    let lane = UNIT_POS_X as usize % 32;
    #[unroll]
    for j in 0..tiles {
        let w = weights.index(j);
        let w0 = w[0];
        let w1 = w[1];
        let mut a_hi = Array::<Tf32One>::new(4usize);
        let mut a_lo = Array::<Tf32One>::new(4usize);
        #[unroll]
        for e in 0..2usize {
            let h0 = to_tf32(w0[e]);
            let h1 = to_tf32(w1[e]);
            a_hi[2 * e] = Tf32One::new(h0);
            a_hi[2 * e + 1] = Tf32One::new(h1);
            a_lo[2 * e] = Tf32One::new(to_tf32(w0[e] - f32::cast_from(h0)));
            a_lo[2 * e + 1] = Tf32One::new(to_tf32(w1[e] - f32::cast_from(h1)));
        }
        #[unroll]
        for dn in 0..comptime!(head_dim / 8) {
            let x = vt[(dn * 8 + lane / 4) * v_stride + (first + j) * 4 + lane % 4];
            let mut b_hi = Array::<Tf32One>::new(2usize);
            let mut b_lo = Array::<Tf32One>::new(2usize);
            b_hi[0] = Tf32One::new(x[0]);
            b_hi[1] = Tf32One::new(x[1]);
            b_lo[0] = Tf32One::new(x[2]);
            b_lo[1] = Tf32One::new(x[3]);
            let acc = rows.o.index_mut(dn);
            def.execute_inplace(&a_lo, &b_hi, acc);
            def.execute_inplace(&a_hi, &b_lo, acc);
            def.execute_inplace(&a_hi, &b_hi, acc);
        }
    }
}

/// `acc += W·M` over `tiles` tiles (an even number) of `W` from tile
/// `first`, f16/bf16: `W` in accumulator layout (a product's result, 8
/// columns a tile), `M` by dim in shared memory (unit `d·stride + 4·p + t`
/// holds its rows `16p + 2t`, `+1`, `+8`, `+9`). Tiles `2i`, `2i + 1` are
/// one `k = 16` step, whose `A` operand is their elements as they stand (see
/// the module doc). `o += P̃·V` in the forward; `dQ += dS·K`, `dV += P̃ᵀ·dO`
/// and `dK += dSᵀ·Q` in the backward.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_products_half<F: Float>(
    weights: &Sequence<Array<AccPair>>,
    vt: &SharedMemory<Vector<F, Const<4>>>,
    acc: &mut Sequence<Array<AccPair>>,
    first: usize,
    #[comptime] tiles: usize,
    #[comptime] head_dim: usize,
    #[comptime] v_stride: usize,
) {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_X as usize % 32;
    #[unroll]
    for i in 0..comptime!(tiles / 2) {
        let low = weights.index(2 * i);
        let high = weights.index(2 * i + 1);
        let mut a = Array::<Vector<F, Const<2>>>::new(4usize);
        a[0] = Vector::<F, Const<2>>::cast_from(low[0]);
        a[1] = Vector::<F, Const<2>>::cast_from(low[1]);
        a[2] = Vector::<F, Const<2>>::cast_from(high[0]);
        a[3] = Vector::<F, Const<2>>::cast_from(high[1]);
        #[unroll]
        for dn in 0..comptime!(head_dim / 8) {
            let b = half_operand::<F>(
                vt[(dn * 8 + lane / 4) * v_stride + (first / 2 + i) * 4 + lane % 4],
            );
            def.execute_inplace(&a, &b, acc.index_mut(dn));
        }
    }
}

/// A plane's rows' `l` (rows g and g + 8): the sums over their four
/// units; `l ≥ 1` once a key is valid.
#[cube]
fn row_sums(rows: &PlaneRows) -> Array<f32> {
    let mut sums = Array::<f32>::new(2usize);
    #[unroll]
    for r in 0..2usize {
        let mut l = rows.state[2 + r];
        l += plane_shuffle_xor(l, 1u32);
        l += plane_shuffle_xor(l, 2u32);
        sums[r] = l;
    }
    sums
}

/// A plane's rows' log-sum-exp `m + ln l` (0 for a row with no valid key).
#[cube]
fn write_lse(
    lse: &mut Tensor<f32>,
    rows: &PlaneRows,
    sums: &Array<f32>,
    head: &CubeHead,
    tq: usize,
) {
    if UNIT_POS_X % 4 == 0 {
        #[unroll]
        for r in 0..2usize {
            let row = rows.row0 + r * 8;
            if row < tq {
                lse[head.bh * tq + row] =
                    select(sums[r] > 0.0, rows.state[r] + sums[r].ln(), 0.0f32);
            }
        }
    }
}

/// Writes a plane's rows: `o / l` and the log-sum-exp (zeros for a row with
/// no valid key). Accumulator layout: element e of pair r at row g + 8·r,
/// column 2t + e.
#[cube]
fn write_rows<F: Float>(
    out: &mut Tensor<Pair<F>>,
    view: &HeadRows,
    lse: &mut Tensor<f32>,
    rows: &PlaneRows,
    head: &CubeHead,
    tq: usize,
    #[comptime] head_dim: usize,
) {
    let t = UNIT_POS_X as usize % 4;
    let sums = row_sums(rows);
    #[unroll]
    for dn in 0..comptime!(head_dim / 8) {
        let acc = rows.o.index(dn);
        #[unroll]
        for r in 0..2usize {
            let row = rows.row0 + r * 8;
            if row < tq {
                let inv = select(sums[r] > 0.0, 1.0f32 / sums[r], 0.0f32);
                store_pair::<F>(out, view, row, dn * 8 + t * 2, acc[r], inv);
            }
        }
    }
    write_lse(lse, rows, &sums, head, tq);
}

/// `x` rounded to TF32 (`cvt.rna.tf32.f32`).
#[cube]
fn to_tf32(x: f32) -> tf32 {
    <tf32 as Cast>::cast_from(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// The strides keep a wavefront's loads in different banks: two rows ×
    /// four 16-byte quads (a quarter plane's split operands), four rows ×
    /// four 8-byte units (a half plane's f16/bf16 operands).
    #[test]
    fn operand_rows_fall_in_different_banks() {
        for width in 4..400 {
            let stride = split_stride(width);
            assert!(stride >= width && stride < width + 8);
            let quads: HashSet<usize> = (0..2)
                .flat_map(|g| (0..4).map(move |t| (g * stride + t) * 16 % 128))
                .collect();
            assert_eq!(quads.len(), 8, "split stride {stride} for {width} quads");
            let stride = half_stride(width);
            assert!(stride >= width && stride < width + 8);
            let units: HashSet<usize> = (0..4)
                .flat_map(|g| (0..4).map(move |t| (g * stride + t) * 8 % 128))
                .collect();
            assert_eq!(units.len(), 16, "half stride {stride} for {width} units");
        }
    }

    /// A cube holds a head's keys up to the ASV level's and beyond; blocks
    /// of streamed keys fit the budget the plan checks.
    #[test]
    fn key_rows_and_blocks() {
        assert_eq!(mma_key_rows(151, false), 152);
        assert_eq!(mma_key_rows(151, true), 160);
        assert_eq!(block_rows(152, 152, false), 152);
        assert_eq!(block_rows(1024, BLOCK_KEYS, true), BLOCK_KEYS);
        assert!(mma_shared_bytes(152, 32, false) < 112 * 1024);
        assert!(mma_shared_bytes(BLOCK_KEYS, 32, false) < 112 * 1024);
        assert!(mma_shared_bytes(BLOCK_KEYS, 64, true) < 112 * 1024);
    }
}
