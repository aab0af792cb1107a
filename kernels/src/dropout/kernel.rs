//! The `#[cube]` kernel of seeded dropout (with a bias and a residual).

use cubecl::prelude::*;

use crate::cube::element_keep;

/// Dropout of a contiguous tensor, or the gradient of one (the same mask):
/// `output[i] = input[i]·scale` where element `i` is kept, else 0; with
/// `with_bias`, `input[i]` plus its column's `bias` first (a dense layer's
/// bias added here instead of in a pass of its own); with `with_residual`,
/// plus `residual[i]` (a residual branch in one pass). An operand left out
/// is any tensor, unread.
///
/// Launch: one unit per vector of `N` elements (4 where the element count
/// allows: one 16-byte load per tensor and unit, where one float a unit
/// leaves these passes at about half of the H100's memory bandwidth), cubes from
/// `calculate_cube_count_elemwise`. Element `i·N + c`'s mask is the same
/// whatever `N`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn dropout_elements<F: Float, N: Size>(
    input: &Tensor<Vector<F, N>>,
    residual: &Tensor<Vector<F, N>>,
    bias: &Tensor<Vector<F, N>>,
    output: &mut Tensor<Vector<F, N>>,
    threshold: u32,
    scale: f32,
    seed: u32,
    #[comptime] with_residual: bool,
    #[comptime] with_bias: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < output.len() {
        let width = input.vector_size();
        let mut xs = input[i];
        if with_bias {
            // A row is a whole number of vectors (the launch's choice of N).
            xs += bias[i % bias.len()];
        }
        let mut y = xs;
        #[unroll]
        for c in 0..width {
            let keep = element_keep(seed, (i * width + c) as u32, threshold);
            y[c] = select(keep, xs[c] * F::cast_from(scale), F::new(0.0));
        }
        if with_residual {
            y += residual[i];
        }
        output[i] = y;
    }
}
