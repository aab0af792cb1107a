//! `#[cube]` helpers that several ops' kernels share: the tile element
//! [`Quad`], fast `exp`, the dropout hash (attention probabilities and
//! elements draw their masks from the same mixer, so forward and backward
//! redraw them without storing them), row addressing in strided head views,
//! a packed projection's bias, and sums over a row's lanes.

use cubecl::prelude::*;

/// Hardware `exp` and `log` (CUDA's `__expf`, `__logf`: a few ulp, where
/// `expf` is a dozen instructions per probability). Only these two change:
/// division stays exact. Arguments are finite (masked scores are `-1e30`),
/// and `__expf` of a large negative argument is 0. Other targets ignore it.
pub(crate) const FAST_EXP: enumset::EnumSet<FastMath> =
    enumset::enum_set!(FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf);

/// Four floats: the element of the shared-memory tiles (one 16-byte load).
pub type Quad = Vector<f32, Const<4>>;

/// One round of a 32-bit integer mix (murmur3's finaliser).
#[cube]
pub(crate) fn mix(value: u32) -> u32 {
    let mut x = value;
    x ^= x >> 16;
    x *= 0x85eb_ca6bu32;
    x ^= x >> 13;
    x *= 0xc2b2_ae35u32;
    x ^= x >> 16;
    x
}

/// The per-head part of the attention dropout hash ([`dropout_keep`]):
/// computed once per unit, as every unit of a cube works on one head.
#[cube]
pub(crate) fn dropout_head_key(seed: u32, bh: u32) -> u32 {
    mix(seed ^ bh)
}

/// Whether attention probability `(row, col)` of the head with
/// `head_key = dropout_head_key(seed, bh)` survives dropout: a
/// counter-based hash, so forward and backward draw the same mask without
/// storing it. Kept when the hash is at least `threshold = p·2³²`.
///
/// One mix round per probability: the row and column enter through odd
/// multipliers (a bijection each, spreading them over the high bits) and
/// the round's avalanche decorrelates neighbours. The row's product is
/// loop-invariant for the forward and dQ kernels (a unit owns a row) and the
/// column's for dK/dV (a unit owns a key). Three chained rounds, one each
/// for head, row and column, made the hash ~25 integer operations per
/// probability, as many as the f32 forward's arithmetic per key.
#[cube]
pub(crate) fn dropout_keep(head_key: u32, row: u32, col: u32, threshold: u32) -> bool {
    let x = mix(head_key ^ (row * 0x9e37_79b1u32) ^ (col * 0x85eb_ca77u32));
    x >= threshold
}

/// The element of row 0, dimension 0 of head `(n, h)` in a `[N, H, T, Dh]`
/// view (any strides, the last 1) whose first element is at `offset`: the
/// heads of a packed `qkv [N, T, 3D]` or `out [N, T, D]` are read and written
/// in place this way, without splitting them into copies.
#[cube]
pub(crate) fn head_start<F: Float>(t: &Tensor<F>, offset: u32, n: usize, h: usize) -> usize {
    offset as usize + n * t.stride(0) + h * t.stride(1)
}

/// The element of row `row`, dimension 0 of head `(n, h)` (see [`head_start`]).
#[cube]
pub(crate) fn row_start<F: Float>(
    t: &Tensor<F>,
    offset: u32,
    n: usize,
    h: usize,
    row: usize,
) -> usize {
    head_start(t, offset, n, h) + row * t.stride(2)
}

/// `bias[at]` in f32 where `with_bias`, else 0 (and no read).
///
/// The packed kernels add the input projection's bias to q, k and v as they
/// load them: a pass of its own over `qkv [N, T, 3D]` took ~0.34 ms an
/// ASV-level layer on the H100 at the reference's batch. Element `d` of
/// head `h` of the part at column `offset` of `qkv` (0, D, 2D) has the bias
/// at `offset + h·head_dim + d`.
#[cube]
pub(crate) fn bias_at<F: Float>(bias: &Tensor<F>, at: usize, #[comptime] with_bias: bool) -> f32 {
    let mut b = 0.0f32;
    if with_bias {
        b = f32::cast_from(bias[at]);
    }
    b
}

/// Whether element `index` of a tensor survives the element-wise dropout
/// with `seed`: the attention kernels' mixer, keyed by the flat index, so the
/// backward pass draws the same mask without storing it.
#[cube]
pub(crate) fn element_keep(seed: u32, index: u32, threshold: u32) -> bool {
    mix(mix(mix(seed) ^ index)) >= threshold
}

/// The sum of `value` over the `lanes` adjacent units of a row group
/// (butterfly, `lanes` a power of two ≤ 32 within one plane); every unit of
/// the plane must call it.
#[cube]
pub(crate) fn sum_over_lanes(value: f32, #[comptime] lanes: usize) -> f32 {
    let mut sum = value;
    if comptime!(lanes >= 32) {
        sum += plane_shuffle_xor(sum, 16u32);
    }
    if comptime!(lanes >= 16) {
        sum += plane_shuffle_xor(sum, 8u32);
    }
    if comptime!(lanes >= 8) {
        sum += plane_shuffle_xor(sum, 4u32);
    }
    if comptime!(lanes >= 4) {
        sum += plane_shuffle_xor(sum, 2u32);
    }
    if comptime!(lanes >= 2) {
        sum += plane_shuffle_xor(sum, 1u32);
    }
    sum
}

/// The (n, h) a cube of the attention kernels that take one head a cube
/// (tiled, `mma`) works on, and its part of the dropout hash.
#[derive(CubeType)]
pub(crate) struct CubeHead {
    pub(crate) n: usize,
    pub(crate) h: usize,
    pub(crate) bh: usize,
    pub(crate) head_key: u32,
}

/// This cube's [`CubeHead`]: `bh = n·H + h` is the cube's x plus
/// `bh_offset` (launches of more than 65,535 heads come in chunks).
#[cube]
pub(crate) fn cube_head(heads: u32, bh_offset: u32, seed: u32) -> CubeHead {
    let bh = (CUBE_POS_X + bh_offset) as usize;
    CubeHead {
        n: bh / heads as usize,
        h: bh % heads as usize,
        bh,
        head_key: dropout_head_key(seed, bh as u32),
    }
}
