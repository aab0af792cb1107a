//! The f32 attention forward on tensor cores as split TF32 ("3xTF32"), with
//! the products' operands and results in registers (`mma.sync`, whose
//! register layout PTX defines), for heads whose keys fit one cube (the ASV
//! level's 151). CUDA only. No Burn imports here.
//!
//! Why: the CUDA-core forwards (`kernel.rs`, `tiled.rs`) are bound by issue
//! slots at 64 multiply-adds a (query, key) pair (1.50 ms at the ASV shape on
//! the H100, 0.63x PyTorch's `mem_efficient`). Tensor cores do those
//! products, but f32 needs the operands split: `x = hi + lo` with `hi` the
//! TF32 rounding of `x` and `lo` that of the rest, and `a·b ≈ a_hi·b_lo +
//! a_lo·b_hi + a_hi·b_hi` (the dropped `a_lo·b_lo` is ~2⁻²² of the product),
//! which leaves f32-level error. The thirteenth session tried this with
//! `cmma` fragments, whose layout is opaque, so scores went through shared
//! memory and the kernel was slower than the CUDA cores (`benches/RESULTS.md`).
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
//!
//! Semantics are `attention_forward`'s: q scaled (and biased) as loaded, a
//! masked key's probability 0, zero output and log-sum-exp for a row with
//! no valid key, the dropout hash of `(seed, bh, row, key)` (the row sum
//! counts undropped probabilities), so the CUDA-core backwards follow it.
//! Chunks whose 32 keys are all masked are skipped.

use cubecl::cmma::MmaDefinition;
use cubecl::prelude::*;

use crate::kernel::{bias_at, dropout_keep, row_start, FAST_EXP};
use crate::tiled::cube_head;

/// One TF32 operand element of `mma.sync.m16n8k8` (a unit's register).
type Tf32One = Vector<tf32, Const<1>>;
/// Two accumulator elements of a unit: one row, two adjacent columns.
type AccPair = Vector<f32, Const<2>>;
/// The hi and lo parts of two operand elements (shared memory).
type SplitQuad = Vector<tf32, Const<4>>;
/// The validity (1 or 0) of two adjacent keys.
type ValidPair = Vector<f32, Const<2>>;

/// Key tiles (of 8) a chunk of the online softmax takes by default.
pub const CHUNK_TILES: usize = 2;

/// Quads between two rows of `quads` quads, so that rows are 64 bytes apart
/// modulo 128 (see the module doc).
pub const fn split_stride(quads: usize) -> usize {
    quads + (12 - quads % 8) % 8
}

/// Keys the kernel stores: `keys` rounded up to whole tiles of 8.
pub const fn mma_key_rows(keys: usize) -> usize {
    keys.div_ceil(8) * 8
}

/// Shared memory (bytes) of [`attention_forward_mma`].
pub fn mma_shared_bytes(keys: usize, head_dim: usize) -> usize {
    let rows = mma_key_rows(keys);
    let k_quads = rows * split_stride(head_dim / 2);
    let v_quads = head_dim * split_stride(rows / 2);
    (k_quads + v_quads) * 16 + rows * 4 + keys.div_ceil(8) * 4
}

/// A plane's `Q` operand for one `k = 8` step: hi and lo.
#[derive(CubeType)]
struct QOperand {
    hi: Array<Tf32One>,
    lo: Array<Tf32One>,
}

/// The per-row state of a plane's online softmax: `[m(g), m(g+8), l(g),
/// l(g+8)]` (`l` is the unit's share of the row sum until the end).
type RowState = Array<f32>;

/// Forward of one (n, h) a cube: `out = softmax(q·kᵀ·scale, masked)·v` and
/// the row log-sum-exp, on tensor cores (see the module doc). `keys` is
/// `k.shape(2)`, `head_dim` 16, 32 or 64; `units` is 32 a plane, each plane
/// taking blocks of 16 queries in turn.
///
/// Launch: cube x: n·H + h − bh_offset; `units` units.
#[cube(launch, fast_math = FAST_EXP)]
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_mma<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    bias: &Tensor<F>,
    key_valid: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    heads: u32,
    bh_offset: u32,
    k_offset: u32,
    v_offset: u32,
    dropout_threshold: u32,
    dropout_scale: f32,
    seed: u32,
    #[comptime] head_dim: usize,
    #[comptime] keys: usize,
    #[comptime] units: usize,
    #[comptime] chunk_tiles: usize,
    #[comptime] use_dropout: bool,
    #[comptime] with_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let tq = q.shape(2);
    let head = cube_head(heads, bh_offset, seed);
    let unit = UNIT_POS_X as usize;
    let k_stride = comptime!(split_stride(head_dim / 2));
    let v_stride = comptime!(split_stride(mma_key_rows(keys) / 2));
    let chunk_keys = comptime!(chunk_tiles * 8);
    let chunks = comptime!(keys.div_ceil(chunk_tiles * 8));
    let mut kt = SharedMemory::<SplitQuad>::new(comptime!(
        mma_key_rows(keys) * split_stride(head_dim / 2)
    ));
    let mut vt = SharedMemory::<SplitQuad>::new(comptime!(
        head_dim * split_stride(mma_key_rows(keys) / 2)
    ));
    let mut valid = SharedMemory::<ValidPair>::new(comptime!(mma_key_rows(keys) / 2));
    let mut chunk_valid = SharedMemory::<f32>::new(chunks);

    // Key validity by pair, and each chunk's count of valid keys.
    let mut pair = unit;
    while pair < comptime!(mma_key_rows(keys) / 2) {
        let mut x = ValidPair::new(0.0f32);
        #[unroll]
        for e in 0..2usize {
            let key = pair * 2 + e;
            if key < keys {
                x[e] = key_valid[head.n * keys + key];
            }
        }
        valid[pair] = x;
        pair += units;
    }
    if unit < chunks {
        let mut count = 0.0f32;
        let mut key = unit * chunk_keys;
        while key < keys && key < (unit + 1) * chunk_keys {
            count += key_valid[head.n * keys + key];
            key += 1;
        }
        chunk_valid[unit] = count;
    }
    sync_cube();
    // K by key: quad `key·k_stride + 4·s + t` holds dims `d = 8s + t` and
    // `d + 4` (the two of a `B` operand), hi and lo each; zero if masked.
    let k_bias = k_offset as usize + head.h * head_dim;
    let mut item = unit;
    while item < comptime!(mma_key_rows(keys) * head_dim / 2) {
        let key = item / comptime!(head_dim / 2);
        let slot = item % comptime!(head_dim / 2);
        let d = (slot / 4) * 8 + slot % 4;
        let mut x = SplitQuad::new(to_tf32(0.0f32));
        if key < keys {
            if valid[key / 2][key % 2] > 0.0 {
                let at = row_start(k, k_offset, head.n, head.h, key);
                #[unroll]
                for e in 0..2usize {
                    let dim = d + e * 4;
                    let value = f32::cast_from(k[at + dim]) + bias_at(bias, k_bias + dim, with_bias);
                    let hi = to_tf32(value);
                    x[e] = hi;
                    x[e + 2] = to_tf32(value - f32::cast_from(hi));
                }
            }
        }
        kt[key * k_stride + slot] = x;
        item += units;
    }
    // V by dim: quad `d·v_stride + p` holds keys `2p`, `2p + 1` of dim `d`.
    let v_bias = v_offset as usize + head.h * head_dim;
    let mut item = unit;
    while item < comptime!(mma_key_rows(keys) / 2 * head_dim) {
        let p = item / head_dim;
        let d = item % head_dim;
        let mut x = SplitQuad::new(to_tf32(0.0f32));
        #[unroll]
        for e in 0..2usize {
            let key = p * 2 + e;
            if key < keys {
                if valid[p][e] > 0.0 {
                    let at = row_start(v, v_offset, head.n, head.h, key) + d;
                    let value = f32::cast_from(v[at]) + bias_at(bias, v_bias + d, with_bias);
                    let hi = to_tf32(value);
                    x[e] = hi;
                    x[e + 2] = to_tf32(value - f32::cast_from(hi));
                }
            }
        }
        vt[d * v_stride + p] = x;
        item += units;
    }
    sync_cube();

    let lane = unit % 32;
    let g = lane / 4;
    let t = lane % 4;
    let q_bias = head.h * head_dim;
    let blocks = tq.div_ceil(16);
    let mut block = unit / 32;
    while block < blocks {
        let row0 = block * 16 + g;
        let row1 = row0 + 8;
        // Q's operands: rows g, g+8 × dims t, t+4 of each step of 8.
        let mut q_ops = Sequence::<QOperand>::new();
        #[unroll]
        for s in 0..comptime!(head_dim / 8) {
            let mut hi = Array::<Tf32One>::new(4usize);
            let mut lo = Array::<Tf32One>::new(4usize);
            #[unroll]
            for r in 0..4usize {
                // PTX's A layout: element r at row g + 8·(r % 2), col t + 4·(r / 2).
                let row = row0 + (r % 2) * 8;
                let d = s * 8 + t + (r / 2) * 4;
                let mut value = 0.0f32;
                if row < tq {
                    let at = row_start(q, 0u32, head.n, head.h, row) + d;
                    value = (f32::cast_from(q[at]) + bias_at(bias, q_bias + d, with_bias)) * scale;
                }
                let h = to_tf32(value);
                hi[r] = Tf32One::new(h);
                lo[r] = Tf32One::new(to_tf32(value - f32::cast_from(h)));
            }
            q_ops.push(QOperand { hi, lo });
        }
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

        for c in 0..comptime!(keys / (chunk_tiles * 8)) {
            if chunk_valid[c] > 0.0 {
                attend_chunk(
                    &kt,
                    &vt,
                    &valid,
                    &q_ops,
                    &mut o,
                    &mut state,
                    c * chunk_tiles,
                    row0 as u32,
                    head.head_key,
                    dropout_threshold,
                    dropout_scale,
                    chunk_tiles,
                    head_dim,
                    k_stride,
                    v_stride,
                    use_dropout,
                );
            }
        }
        if comptime!(keys % (chunk_tiles * 8) > 0) {
            let c = comptime!(keys / (chunk_tiles * 8));
            if chunk_valid[c] > 0.0 {
                attend_chunk(
                    &kt,
                    &vt,
                    &valid,
                    &q_ops,
                    &mut o,
                    &mut state,
                    c * chunk_tiles,
                    row0 as u32,
                    head.head_key,
                    dropout_threshold,
                    dropout_scale,
                    comptime!(mma_key_rows(keys) / 8 - (keys / (chunk_tiles * 8)) * chunk_tiles),
                    head_dim,
                    k_stride,
                    v_stride,
                    use_dropout,
                );
            }
        }

        // The rows' sums over their four units; l ≥ 1 once a key is valid.
        let mut l0 = state[2];
        let mut l1 = state[3];
        l0 += plane_shuffle_xor(l0, 1u32);
        l0 += plane_shuffle_xor(l0, 2u32);
        l1 += plane_shuffle_xor(l1, 1u32);
        l1 += plane_shuffle_xor(l1, 2u32);
        let inv0 = select(l0 > 0.0, 1.0f32 / l0, 0.0f32);
        let inv1 = select(l1 > 0.0, 1.0f32 / l1, 0.0f32);
        // Accumulator layout: element e of pair r at row g + 8·r, col 2t + e.
        #[unroll]
        for dn in 0..comptime!(head_dim / 8) {
            let acc = o.index(dn);
            let d = dn * 8 + t * 2;
            if row0 < tq {
                let at = row_start(out, 0u32, head.n, head.h, row0) + d;
                let x = acc[0];
                out[at] = F::cast_from(x[0] * inv0);
                out[at + 1] = F::cast_from(x[1] * inv0);
            }
            if row1 < tq {
                let at = row_start(out, 0u32, head.n, head.h, row1) + d;
                let x = acc[1];
                out[at] = F::cast_from(x[0] * inv1);
                out[at + 1] = F::cast_from(x[1] * inv1);
            }
        }
        if t == 0 {
            if row0 < tq {
                lse[head.bh * tq + row0] = select(l0 > 0.0, state[0] + l0.ln(), 0.0f32);
            }
            if row1 < tq {
                lse[head.bh * tq + row1] = select(l1 > 0.0, state[1] + l1.ln(), 0.0f32);
            }
        }
        block += comptime!(units / 32);
    }
}

/// One chunk of `tiles` key tiles (8 keys each, from tile `first_tile`) for
/// a plane's 16 queries: scores, the online softmax's update of `state` and
/// `o`, and `o += P̃·V` (see the module doc). `row0` is the unit's first
/// query row (for the dropout hash). Every unit of the plane must call it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn attend_chunk(
    kt: &SharedMemory<SplitQuad>,
    vt: &SharedMemory<SplitQuad>,
    valid: &SharedMemory<ValidPair>,
    q_ops: &Sequence<QOperand>,
    o: &mut Sequence<Array<AccPair>>,
    state: &mut RowState,
    first_tile: usize,
    row0: u32,
    head_key: u32,
    dropout_threshold: u32,
    dropout_scale: f32,
    #[comptime] tiles: usize,
    #[comptime] head_dim: usize,
    #[comptime] k_stride: usize,
    #[comptime] v_stride: usize,
    #[comptime] use_dropout: bool,
) {
    let def = MmaDefinition::<tf32, tf32, f32>::new(16usize, 8usize, 8usize);
    let lane = UNIT_POS_X as usize % 32;
    let g = lane / 4;
    let t = lane % 4;

    // S = Q·Kᵀ: tile j's B operand is K[key 8j + g][dims t, t + 4].
    let mut scores = Sequence::<Array<AccPair>>::new();
    let mut m0 = state[0];
    let mut m1 = state[1];
    #[unroll]
    for j in 0..tiles {
        let mut s = Array::<AccPair>::new(2usize);
        s[0] = AccPair::new(0.0f32);
        s[1] = AccPair::new(0.0f32);
        let key = (first_tile + j) * 8 + g;
        #[unroll]
        for step in 0..comptime!(head_dim / 8) {
            let x = kt[key * k_stride + step * 4 + t];
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
        // Masked keys: -1e30, below any real score.
        let ok = valid[(first_tile + j) * 4 + t];
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
        scores.push(s);
    }
    m0 = f32::max(m0, plane_shuffle_xor(m0, 1u32));
    m0 = f32::max(m0, plane_shuffle_xor(m0, 2u32));
    m1 = f32::max(m1, plane_shuffle_xor(m1, 1u32));
    m1 = f32::max(m1, plane_shuffle_xor(m1, 2u32));
    let corr0 = (state[0] - m0).exp();
    let corr1 = (state[1] - m1).exp();
    let mut l0 = state[2] * corr0;
    let mut l1 = state[3] * corr1;
    state[0] = m0;
    state[1] = m1;
    #[unroll]
    for dn in 0..comptime!(head_dim / 8) {
        let acc = o.index_mut(dn);
        acc[0] = acc[0] * AccPair::new(corr0);
        acc[1] = acc[1] * AccPair::new(corr1);
    }

    // O += P̃·V, tile by tile: the A operand's element r is (row g + 8·(r % 2),
    // key 2t + r / 2), the B operand's element e (key 2t + e, dim g).
    #[unroll]
    for j in 0..tiles {
        let s = scores.index(j);
        let ok = valid[(first_tile + j) * 4 + t];
        let s0 = s[0];
        let s1 = s[1];
        let mut a_hi = Array::<Tf32One>::new(4usize);
        let mut a_lo = Array::<Tf32One>::new(4usize);
        #[unroll]
        for e in 0..2usize {
            let p0 = select(ok[e] > 0.0, (s0[e] - m0).exp(), 0.0f32);
            let p1 = select(ok[e] > 0.0, (s1[e] - m1).exp(), 0.0f32);
            l0 += p0;
            l1 += p1;
            let mut w0 = p0;
            let mut w1 = p1;
            if use_dropout {
                let key = ((first_tile + j) * 8 + t * 2 + e) as u32;
                let keep0 = dropout_keep(head_key, row0, key, dropout_threshold);
                let keep1 = dropout_keep(head_key, row0 + 8, key, dropout_threshold);
                w0 = select(keep0, p0 * dropout_scale, 0.0f32);
                w1 = select(keep1, p1 * dropout_scale, 0.0f32);
            }
            let h0 = to_tf32(w0);
            let h1 = to_tf32(w1);
            a_hi[2 * e] = Tf32One::new(h0);
            a_hi[2 * e + 1] = Tf32One::new(h1);
            a_lo[2 * e] = Tf32One::new(to_tf32(w0 - f32::cast_from(h0)));
            a_lo[2 * e + 1] = Tf32One::new(to_tf32(w1 - f32::cast_from(h1)));
        }
        #[unroll]
        for dn in 0..comptime!(head_dim / 8) {
            let x = vt[(dn * 8 + g) * v_stride + (first_tile + j) * 4 + t];
            let mut b_hi = Array::<Tf32One>::new(2usize);
            let mut b_lo = Array::<Tf32One>::new(2usize);
            b_hi[0] = Tf32One::new(x[0]);
            b_hi[1] = Tf32One::new(x[1]);
            b_lo[0] = Tf32One::new(x[2]);
            b_lo[1] = Tf32One::new(x[3]);
            let acc = o.index_mut(dn);
            def.execute_inplace(&a_lo, &b_hi, acc);
            def.execute_inplace(&a_hi, &b_lo, acc);
            def.execute_inplace(&a_hi, &b_hi, acc);
        }
    }
    state[2] = l0;
    state[3] = l1;
}

/// `x` rounded to TF32 (`cvt.rna.tf32.f32`).
#[cube]
fn to_tf32(x: f32) -> tf32 {
    <tf32 as Cast>::cast_from(x)
}
