//! The `#[cube]` kernels of exact GELU and its gradient.

use cubecl::prelude::*;

use crate::cube::element_keep;

/// Exact GELU per element, `y = x·Φ(x)`, `Φ(x) = ½·(1 + erf(x/√2))`, in f32;
/// with `use_dropout`, then the seeded dropout of `y` ([`dropout_elements`]'
/// mask for the same seed): the feed-forward's activation and its dropout
/// in one pass over the layer's widest activation instead of two. With
/// `with_bias`, `x` is first shifted by its column's `bias` (in f32): the
/// preceding dense layer's bias, which then needs no pass of its own
/// (otherwise `bias` is any tensor, unread).
///
/// Launch: one unit per vector of `N` elements (see [`dropout_elements`]).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn gelu_elements<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    y: &mut Tensor<Vector<F, N>>,
    threshold: u32,
    scale: f32,
    seed: u32,
    #[comptime] use_dropout: bool,
    #[comptime] with_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < y.len() {
        let width = x.vector_size();
        let xs = x[i];
        let bs = if with_bias { bias[i % bias.len()] } else { xs };
        let mut out = xs;
        #[unroll]
        for c in 0..width {
            let mut v = f32::cast_from(xs[c]);
            if with_bias {
                v += f32::cast_from(bs[c]);
            }
            let cdf = 0.5f32 * (1.0f32 + Erf::erf(v * 0.707_106_77f32));
            let mut value = v * cdf;
            if use_dropout {
                let at = (i * width + c) as u32;
                value = select(element_keep(seed, at, threshold), value * scale, 0.0f32);
            }
            out[c] = F::cast_from(value);
        }
        y[i] = out;
    }
}

/// Exact GELU's input gradient per element, `dx = dy·(Φ(x) + x·φ(x))`,
/// `φ(x) = exp(−x²/2)/√(2π)`, in f32; with `use_dropout`, `dy` first goes
/// through the forward's dropout mask (drawn again from `seed`); with
/// `with_bias`, at `x` shifted by its column's `bias`, as
/// [`gelu_elements`].
///
/// Launch: one unit per vector of `N` elements.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn gelu_backward_elements<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    dx: &mut Tensor<Vector<F, N>>,
    threshold: u32,
    scale: f32,
    seed: u32,
    #[comptime] use_dropout: bool,
    #[comptime] with_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < dx.len() {
        let width = x.vector_size();
        let xs = x[i];
        let bs = if with_bias { bias[i % bias.len()] } else { xs };
        let dys = dy[i];
        let mut out = xs;
        #[unroll]
        for c in 0..width {
            let mut v = f32::cast_from(xs[c]);
            if with_bias {
                v += f32::cast_from(bs[c]);
            }
            let cdf = 0.5f32 * (1.0f32 + Erf::erf(v * 0.707_106_77f32));
            let pdf = f32::exp(-0.5f32 * v * v) * 0.398_942_3f32;
            let mut g = f32::cast_from(dys[c]);
            if use_dropout {
                let at = (i * width + c) as u32;
                g = select(element_keep(seed, at, threshold), g * scale, 0.0f32);
            }
            out[c] = F::cast_from(g * (cdf + v * pdf));
        }
        dx[i] = out;
    }
}
