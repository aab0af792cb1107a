//! Global memory to registers and shared memory, for the `mma.sync`
//! kernels on f16/bf16 (`mma.rs`'s forward, `mma_backward.rs`): a head's
//! rows staged in the products' shared-memory layouts by 16-byte vectors,
//! a plane's own rows read and its results written by pair.
//!
//! Why: read one element at a time, the backward's loads are most of its
//! time. Nsight Compute at the ASV shape on the H100 (bf16), element by
//! element: 59% of the global sectors read were excess, and waits on
//! global loads were most of both backward kernels' stall samples, in the
//! staging and row loads rather than the products. With these the bf16
//! forward+backward takes 1.65 ms against 2.17 element by element
//! (`docs/performance.md`, 2026-11-28).
//!
//! A unit reads rows at `base + row · stride + dim` ([`HeadRows`], computed
//! once a kernel: a tensor's strides are a global read each). The views
//! are `Tensor<Vector<F, N>>` (staging: `N` = 8 where offsets, strides and
//! the buffer's start allow, else 4 or 2; `row_vector_width` in
//! `launch.rs`) and `Tensor<Pair<F>>` (a plane's own rows and results).
//! [`read_quad`] reads four elements as f32 for the f32 kernels (the split
//! TF32 forward's staging, `tiled.rs`'s backward). No Burn imports here.

use cubecl::prelude::*;

use crate::cube::{bias_at, CubeHead, Quad};

/// Two accumulator elements of a unit: one row, two adjacent columns.
pub(crate) type AccPair = Vector<f32, Const<2>>;
/// The validity (1 or 0) of two adjacent keys.
pub(crate) type ValidPair = Vector<f32, Const<2>>;

/// Vectors of 4 halves (8 bytes) between two rows of `units` of them, so
/// that rows are 32 bytes apart modulo 128 (units `g·stride + t` of a half
/// plane's 16-unit wavefront fall in different banks).
pub const fn half_stride(units: usize) -> usize {
    units + (12 - units % 8) % 8
}

/// Two f16/bf16 elements: a register of an `mma` operand, and the unit of
/// the kernels' reads of their own rows and writes of their results.
pub(crate) type Pair<F> = Vector<F, Const<2>>;
/// Four f16/bf16 elements (8 bytes): one unit of the shared-memory layouts.
pub(crate) type Half4<F> = Vector<F, Const<4>>;
/// Eight f16/bf16 elements (16 bytes): what a unit stages at a time.
pub(crate) type Half8<F> = Vector<F, Const<8>>;
/// A unit's `A` operands of 16 rows: pairs by step of 16 head dims.
pub(crate) type RowOperands<F> = Sequence<Array<Pair<F>>>;

/// Where one tensor's rows of a cube's head start and how far apart they
/// are (elements), computed once a kernel: every load below is
/// `base + row · stride + dim`, with no metadata read of its own.
#[derive(CubeType, Clone)]
pub(crate) struct HeadRows {
    pub(crate) base: usize,
    pub(crate) stride: usize,
}

/// [`HeadRows`] of head `(n, h)` of a `[N, H, T, Dh]` view of `t` whose
/// first element is at `offset` (the packed `qkv`'s parts).
#[cube]
pub(crate) fn head_rows<E: CubePrimitive>(t: &Tensor<E>, offset: u32, head: &CubeHead) -> HeadRows {
    HeadRows {
        base: offset as usize + head.n * t.stride(0) + head.h * t.stride(1),
        stride: t.stride(2),
    }
}

/// Elements `at..at + 8` of `src` (`at` a multiple of 8), as `8 / N`
/// vectors of `N` (one 16-byte load where `N` is 8).
#[cube]
fn read8<F: Float, N: Size>(src: &Tensor<Vector<F, N>>, at: usize) -> Half8<F> {
    let width = src.vector_size();
    let mut x = Half8::<F>::new(F::cast_from(0.0f32));
    #[unroll]
    for c in 0..comptime!(8 / width) {
        let part = src[at / width + c];
        #[unroll]
        for e in 0..width {
            x[c * width + e] = part[e];
        }
    }
    x
}

/// `(x + bias[at..at + 8]) · scale` rounded to `F` where `with_bias` or
/// `scaled`, else `x` as it is.
#[cube]
fn biased8<F: Float>(
    x: Half8<F>,
    bias: &Tensor<F>,
    at: usize,
    scale: f32,
    #[comptime] with_bias: bool,
    #[comptime] scaled: bool,
) -> Half8<F> {
    let mut y = x;
    if comptime!(with_bias || scaled) {
        #[unroll]
        for e in 0..8usize {
            y[e] = F::cast_from((f32::cast_from(x[e]) + bias_at(bias, at + e, with_bias)) * scale);
        }
    }
    y
}

/// Copies rows `[start, start + rows)` of a head of `src` (`view`; its bias
/// from `bias_start` added, times `scale` where `scaled`) into `by_row`
/// where `with_rows` and `by_dim` where `with_dims`. By row, unit
/// `row·stride + 4·s + t` holds dims `16s + 2t`, `+1`, `+8`, `+9` (the four
/// of a unit's `B` operand of a product over head dims); by dim, unit
/// `d·stride + 4·p + t` holds rows `16p + 2t`, `+1`, `+8`, `+9` of dim `d`
/// (a product over rows, `add_products_half` in `mma.rs`). Zero for rows at or past `end` (relative
/// to `start`) and, where `masked`, rows whose `valid` entry is 0.
///
/// A unit takes those four rows × 16 dims: eight 16-byte loads in flight
/// at once (where `N` is 8), then both layouts from registers. Nsight
/// Compute on kernels that read one element at a time: global-load
/// waits were most of both kernels' stalls, and 59% of the sectors read
/// were excess. Units start at `first_unit` (mod `units`), so that two
/// calls in a row keep different units busy.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_rows<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    view: &HeadRows,
    bias: &Tensor<F>,
    bias_start: usize,
    by_row: &mut SharedMemory<Half4<F>>,
    by_dim: &mut SharedMemory<Half4<F>>,
    valid: &SharedMemory<ValidPair>,
    start: usize,
    end: usize,
    scale: f32,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
    #[comptime] first_unit: usize,
    #[comptime] masked: bool,
    #[comptime] with_bias: bool,
    #[comptime] scaled: bool,
    #[comptime] with_rows: bool,
    #[comptime] with_dims: bool,
) {
    let row_stride = comptime!(half_stride(head_dim / 4));
    let dim_stride = comptime!(half_stride(rows / 4));
    let groups = comptime!(head_dim / 16);
    let items = comptime!(rows / 4 * head_dim / 16);
    let unit = (UNIT_POS_X as usize + first_unit) % units;
    #[unroll]
    for i in 0..comptime!(items.div_ceil(units)) {
        let item = i * units + unit;
        if item < items {
            let quad = item / groups;
            let s = item % groups;
            let mut parts = Sequence::<Half8<F>>::new();
            #[unroll]
            for e in 0..4usize {
                let row = (quad / 4) * 16 + (quad % 4) * 2 + (e / 2) * 8 + e % 2;
                let mut load = row < end;
                if comptime!(masked) {
                    load = load && valid[row / 2][e % 2] > 0.0;
                }
                let mut lo = Half8::<F>::new(F::cast_from(0.0f32));
                let mut hi = Half8::<F>::new(F::cast_from(0.0f32));
                if load {
                    let at = view.base + (start + row) * view.stride + s * 16;
                    let dim = bias_start + s * 16;
                    lo = biased8::<F>(read8::<F, N>(src, at), bias, dim, scale, with_bias, scaled);
                    hi = biased8::<F>(
                        read8::<F, N>(src, at + 8),
                        bias,
                        dim + 8,
                        scale,
                        with_bias,
                        scaled,
                    );
                }
                if comptime!(with_rows) {
                    #[unroll]
                    for t in 0..4usize {
                        let mut x = Half4::<F>::new(F::cast_from(0.0f32));
                        x[0] = lo[2 * t];
                        x[1] = lo[2 * t + 1];
                        x[2] = hi[2 * t];
                        x[3] = hi[2 * t + 1];
                        by_row[row * row_stride + s * 4 + t] = x;
                    }
                }
                parts.push(lo);
                parts.push(hi);
            }
            if comptime!(with_dims) {
                #[unroll]
                for d in 0..16usize {
                    let mut x = Half4::<F>::new(F::cast_from(0.0f32));
                    #[unroll]
                    for e in 0..4usize {
                        x[e] = parts.index(2 * e + d / 8)[d % 8];
                    }
                    by_dim[(s * 16 + d) * dim_stride + quad] = x;
                }
            }
        }
    }
}

/// The `A` operands of rows `16·block..` of a head of `src` (`view`; its
/// bias from `bias_start` added, times `scale` where `scaled`), read by
/// pair (PTX's A layout for 16-bit types: pair r holds row g + 8·(r % 2),
/// dims 16s + 2t + 8·(r / 2) and the next; zero past row `len`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn row_operands<F: Float>(
    src: &Tensor<Pair<F>>,
    view: &HeadRows,
    bias: &Tensor<F>,
    bias_start: usize,
    block: usize,
    len: usize,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] with_bias: bool,
    #[comptime] scaled: bool,
) -> RowOperands<F> {
    let lane = UNIT_POS_X as usize % 32;
    let mut ops = RowOperands::<F>::new();
    #[unroll]
    for s in 0..comptime!(head_dim / 16) {
        let mut a = Array::<Pair<F>>::new(4usize);
        #[unroll]
        for r in 0..4usize {
            let row = block * 16 + lane / 4 + (r % 2) * 8;
            let d = s * 16 + (lane % 4) * 2 + (r / 2) * 8;
            let mut x = Pair::<F>::new(F::cast_from(0.0f32));
            if row < len {
                x = src[(view.base + row * view.stride + d) / 2];
                if comptime!(with_bias || scaled) {
                    #[unroll]
                    for e in 0..2usize {
                        x[e] = F::cast_from(
                            (f32::cast_from(x[e]) + bias_at(bias, bias_start + d + e, with_bias))
                                * scale,
                        );
                    }
                }
            }
            a[r] = x;
        }
        ops.push(a);
    }
    ops
}

/// Stores pair `x · scale` at row `row`, dim `d` (even) of a head of `dst`.
#[cube]
pub(crate) fn store_pair<F: Float>(
    dst: &mut Tensor<Pair<F>>,
    view: &HeadRows,
    row: usize,
    d: usize,
    x: AccPair,
    scale: f32,
) {
    let mut y = x;
    y[0] = x[0] * scale;
    y[1] = x[1] * scale;
    dst[(view.base + row * view.stride + d) / 2] = Pair::<F>::cast_from(y);
}

/// Elements `at..at + 4` of `src` (`at` a multiple of 4) in f32, as
/// `4 / N` vectors of `N` (one 16-byte load of f32 where `N` is 4).
#[cube]
pub(crate) fn read_quad<F: Float, N: Size>(src: &Tensor<Vector<F, N>>, at: usize) -> Quad {
    let width = src.vector_size();
    let mut x = Quad::new(0.0f32);
    #[unroll]
    for c in 0..comptime!(4 / width) {
        let part = src[at / width + c];
        #[unroll]
        for e in 0..width {
            x[c * width + e] = f32::cast_from(part[e]);
        }
    }
    x
}
