//! The `#[cube]` kernel of the Adam and AdamW steps.

use cubecl::prelude::*;

/// The Adam/AdamW steps of one or several parameters in one launch, op for
/// op as [`crate::adam_step_ops`] computes them ([`crate::AdamStep`]), each
/// parameter with its own coefficients (row `k` of `coefficients`: decay,
/// l2, β₁, 1 − β₁, β₂, 1 − β₂, √(1 − β₂ᵗ), ε, step size, each rounded to
/// `F`), its moments updated in place.
///
/// Why: one launch per parameter (~170 a step), each with three new buffers,
/// cost CubeCL's server thread a launch and three allocations each, and the
/// training step waits on that thread.
///
/// Launch: cube row `y = k` for parameter `k` (a sequence is indexed at
/// compile time: each cube takes the one branch of its row, uniformly), one
/// unit per element along x; every tensor contiguous, the moments and
/// outputs as long as their parameter.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn adam_steps_elements<F: Float>(
    params: &Sequence<Tensor<F>>,
    grads: &Sequence<Tensor<F>>,
    firsts: &mut Sequence<Tensor<F>>,
    seconds: &mut Sequence<Tensor<F>>,
    params_out: &mut Sequence<Tensor<F>>,
    coefficients: &Tensor<f32>,
    #[define(F)] _dtype: StorageType,
) {
    let item = CUBE_POS_Y as usize;
    let i = ABSOLUTE_POS_X as usize;
    let count = params.len().comptime();
    #[unroll]
    for k in 0..count {
        if item == k && i < params.index(k).len() {
            let mut p = params.index(k)[i];
            let mut g = grads.index(k)[i];
            let c = k * 9;
            let l2 = coefficients[c + 1];
            if l2 != 0.0 {
                g += p * F::cast_from(l2);
            }
            let decay = coefficients[c];
            if decay != 1.0 {
                p *= F::cast_from(decay);
            }
            let m = firsts.index(k)[i] * F::cast_from(coefficients[c + 2])
                + g * F::cast_from(coefficients[c + 3]);
            let v = seconds.index(k)[i] * F::cast_from(coefficients[c + 4])
                + g * g * F::cast_from(coefficients[c + 5]);
            let denom =
                F::sqrt(v) / F::cast_from(coefficients[c + 6]) + F::cast_from(coefficients[c + 7]);
            params_out.index_mut(k)[i] = p - m / denom * F::cast_from(coefficients[c + 8]);
            firsts.index_mut(k)[i] = m;
            seconds.index_mut(k)[i] = v;
        }
    }
}
