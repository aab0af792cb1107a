//! LayerNorm on rows as one autodiff node with a hand-written backward.
//!
//! Why: Burn 0.21's autodiff differentiates LayerNorm through its
//! decomposition (mean, centre, variance, square root, divide, scale, shift),
//! so a training step records each of those ops, keeps several of their
//! outputs, and in the backward pass runs the backward of each, with a
//! reduction for every broadcast operand. A step of the default model holds
//! ~28 LayerNorms over up to ~63,000 rows, and on the H100 the step is bound by
//! the host's work per op (`docs/performance.md`, 2026-11-24). As one node
//! the backward is the closed form, from the normalised rows `x̂` and the
//! reciprocal standard deviations `r`:
//!
//! - `g = dy·γ`,
//! - `dx = r·(g − mean(g) − x̂·mean(g·x̂))` (means over the row),
//! - `dγ = Σ_rows dy·x̂`, `dβ = Σ_rows dy`, summed in parts ([`crate::sum_rows`]).
//!
//! The node's parent is the input itself, of any rank (its rows are taken
//! by reshapes of the inner tensors, which no autodiff node records): in
//! AAM's pre-norm blocks the input also feeds the residual sum, whose
//! backward runs first and registers its gradient for the input, and the
//! node takes that gradient out of Burn's container and has the backward
//! add it to `dx` as it writes it (`autodiff.rs`, `input_handle`). Behind a
//! reshape node the two gradients would meet at the input's node instead,
//! and Burn would add them in a pass of its own (eight a step at the ASV level,
//! ~0.19 ms each on the H100 at the reference's batch).
//!
//! Here as tensor ops, the default of
//! [`LayerNormOps::layer_norm_with_stats`](crate::LayerNormOps::layer_norm_with_stats)
//! and [`LayerNormOps::layer_norm_backward`](crate::LayerNormOps::layer_norm_backward);
//! the CubeCL backends compute the same in kernels (`kernel.rs`: one unit
//! per row, f32 sums), one op for the host instead of a dozen or two.
//!
//! Without gradient checkpointing the node keeps `x̂` and `r` from the
//! forward pass (as much memory as keeping its input, which nothing else
//! keeps). With it, the node keeps its input as a checkpoint and recomputes
//! `x̂` and `r` from it with the same code, so a checkpointed run trains the
//! same model bit for bit (`gradient_checkpointing_trains_the_same_model`).
//! The cost: on the H100 a real-sized batch's checkpointed live peak was
//! 3,944 MiB, against 3,601 with Burn's decomposition, whose memory-bound ops
//! the strategy recomputes (`docs/performance.md`, 2026-11-24). Making the
//! node memory-bound with a retro-forward would recover that.

use burn::prelude::*;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorPrimitive;

use crate::sum_rows;

mod autodiff;
#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "fusion")]
mod fusion;
#[cfg(feature = "cubecl")]
mod kernel;

/// LayerNorm over the last axis with the closed-form backward.
pub trait LayerNormOps: Backend {
    /// LayerNorm over the last axis of rows (biased variance, as
    /// `torch.nn.LayerNorm`), with optional shift.
    ///
    /// A backend extension for its gradient, not its value: `Autodiff<B>`
    /// overrides it with one node whose backward is the closed form (see
    /// the module doc), instead of the backward of each op of Burn's decomposed
    /// `layer_norm`.
    ///
    /// # Shapes
    /// - x: `[..., D]`, gamma / beta: `[D]`
    /// - output: `[..., D]`
    fn lean_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        eps: f64,
    ) -> FloatTensor<Self> {
        // Burn's op: backends may fuse it.
        Self::layer_norm(x, gamma, beta, eps)
    }

    /// LayerNorm over the last axis of rows with the statistics its backward
    /// needs: `(y, x̂, r)`, `x̂ = (x − mean)·r`, `r = 1/√(var + ε)` (biased
    /// variance), `y = x̂·γ (+ β)`.
    ///
    /// The default is a dozen tensor ops (the module doc); the CubeCL backends run
    /// one kernel, and Burn's fusion backend one custom op: on a GPU the
    /// training step is bound by the host's work per op.
    ///
    /// # Shapes
    /// - x: `[M, D]`, gamma / beta: `[D]`
    /// - y, x̂: `[M, D]`, r: `[M, 1]`
    fn layer_norm_with_stats(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (y, normalised, r) = layer_norm_with_stats_ops::<Self>(
            Tensor::from_primitive(TensorPrimitive::Float(x)),
            Tensor::from_primitive(TensorPrimitive::Float(gamma)),
            beta.map(|b| Tensor::from_primitive(TensorPrimitive::Float(b))),
            eps,
        );
        (
            y.into_primitive().tensor(),
            normalised.into_primitive().tensor(),
            r.into_primitive().tensor(),
        )
    }

    /// LayerNorm's backward from [`LayerNormOps::layer_norm_with_stats`]'s
    /// `x̂` and `r`: `(dx, dγ, dβ)` (the closed form of the module doc; dγ and dβ
    /// summed over the rows in parts), with `dx_add` (the input's gradient
    /// along its other paths, e.g. a residual connection) added to `dx` in
    /// the same pass. One kernel launch sequence and one custom op where the
    /// backend has them, else tensor ops.
    ///
    /// # Shapes
    /// - normalised, dy, dx_add: `[M, D]`, r: `[M, 1]`, gamma: `[D]`
    /// - dx: `[M, D]`, dγ / dβ: `[D]`
    fn layer_norm_backward(
        normalised: FloatTensor<Self>,
        r: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        dx_add: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dgamma, dbeta) = layer_norm_backward_ops::<Self>(
            Tensor::from_primitive(TensorPrimitive::Float(normalised)),
            Tensor::from_primitive(TensorPrimitive::Float(r)),
            Tensor::from_primitive(TensorPrimitive::Float(gamma)),
            Tensor::from_primitive(TensorPrimitive::Float(dy)),
        );
        let dx = match dx_add {
            Some(add) => dx + Tensor::from_primitive(TensorPrimitive::Float(add)),
            None => dx,
        };
        (
            dx.into_primitive().tensor(),
            dgamma.into_primitive().tensor(),
            dbeta.into_primitive().tensor(),
        )
    }
}

/// LayerNorm over the last axis, through
/// [`LayerNormOps::lean_layer_norm`]: Burn's `layer_norm` in value, and
/// under autodiff one node with the closed-form backward, whose parent is
/// `x` itself (its rows are taken inside the node), so that it can add
/// the gradient `x` has from a residual path in the same pass.
///
/// # Shapes
/// - x: `[..., D]`, gamma / beta: `[D]`
/// - output: `[..., D]`
pub fn layer_norm<B: LayerNormOps, const R: usize>(
    x: Tensor<B, R>,
    gamma: Tensor<B, 1>,
    beta: Option<Tensor<B, 1>>,
    eps: f64,
) -> Tensor<B, R> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lean_layer_norm(
        x.into_primitive().tensor(),
        gamma.into_primitive().tensor(),
        beta.map(|b| b.into_primitive().tensor()),
        eps,
    )))
}

/// `(x̂, r)`: the normalised rows and each row's reciprocal standard
/// deviation (biased variance, as `torch.nn.LayerNorm`).
///
/// # Shapes
/// - x: `[M, D]`
/// - x̂: `[M, D]`, r: `[M, 1]`
pub(crate) fn normalise<B: Backend>(x: Tensor<B, 2>, eps: f64) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let mean = x.clone().mean_dim(1);
    let centred = x - mean;
    let var = centred.clone().square().mean_dim(1);
    let r = (var + eps).sqrt().recip();
    (centred * r.clone(), r)
}

/// `(y, x̂, r)` as tensor ops: [`normalise`], then the scale and shift.
///
/// # Shapes
/// - x: `[M, D]`, gamma / beta: `[D]`
/// - y, x̂: `[M, D]`, r: `[M, 1]`
pub(crate) fn layer_norm_with_stats_ops<B: Backend>(
    x: Tensor<B, 2>,
    gamma: Tensor<B, 1>,
    beta: Option<Tensor<B, 1>>,
    eps: f64,
) -> (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>) {
    let (normalised, r) = normalise(x, eps);
    let y = normalised.clone() * gamma.unsqueeze();
    let y = match beta {
        Some(beta) => y + beta.unsqueeze(),
        None => y,
    };
    (y, normalised, r)
}

/// `(dx, dγ, dβ)` of LayerNorm from its normalised rows `x̂`, reciprocal
/// standard deviations `r`, `γ` and the output gradient, as tensor ops.
///
/// # Shapes
/// - normalised, dy: `[M, D]`, r: `[M, 1]`, gamma: `[D]`
/// - dx: `[M, D]`, dγ / dβ: `[D]`
pub(crate) fn layer_norm_backward_ops<B: Backend>(
    normalised: Tensor<B, 2>,
    r: Tensor<B, 2>,
    gamma: Tensor<B, 1>,
    dy: Tensor<B, 2>,
) -> (Tensor<B, 2>, Tensor<B, 1>, Tensor<B, 1>) {
    let g = dy.clone() * gamma.unsqueeze();
    let mean_g = g.clone().mean_dim(1);
    let mean_gx = (g.clone() * normalised.clone()).mean_dim(1);
    let dx = (g - mean_g - normalised.clone() * mean_gx) * r;
    let dgamma = sum_rows(dy.clone() * normalised);
    let dbeta = sum_rows(dy);
    (dx, dgamma, dbeta)
}

#[cfg(test)]
mod tests {
    use crate::layer_norm;
    use burn::backend::{Autodiff, NdArray};
    use burn::prelude::*;
    use burn::tensor::{Distribution, TensorPrimitive, Tolerance};

    use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;

    /// `layer_norm` against Burn's `layer_norm` op (differentiated through its
    /// decomposition): value and the gradients of x, γ and β, with and
    /// without β, at row counts below and above one split of the sums; with
    /// the statistics kept (no checkpointing) and recomputed (checkpointing);
    /// alone and inside a residual sum `x + LN(x)`, whose gradient for x the
    /// node adds to its own.
    #[test]
    fn layer_norm_equals_burns() {
        check::<Autodiff<NdArray<f64>>>();
        check::<Autodiff<NdArray<f64>, BalancedCheckpointing>>();
    }

    fn check<Ad>()
    where
        Ad: crate::AttentionBackend<Device = burn::backend::ndarray::NdArrayDevice>
            + burn::tensor::backend::AutodiffBackend,
    {
        let device = Default::default();
        for (rows, with_beta, residual) in [
            (7, true, false),
            (7, true, true),
            (crate::ROWS_PER_PART * 2 + 5, true, true),
            (9, false, false),
            (9, false, true),
        ] {
            let d = 12;
            // Rows with an offset and a spread, as activations have.
            let x = Tensor::<Ad, 2>::random([rows, d], Distribution::Normal(0.5, 2.0), &device);
            let gamma = Tensor::<Ad, 1>::random([d], Distribution::Normal(1.0, 0.5), &device);
            let beta = Tensor::<Ad, 1>::random([d], Distribution::Normal(0.0, 0.5), &device);
            let dy = Tensor::<Ad, 2>::random([rows, d], Distribution::Normal(0.0, 1.0), &device);
            let run = |ours: bool| {
                let (x, gamma, beta) = (
                    x.clone().require_grad(),
                    gamma.clone().require_grad(),
                    beta.clone().require_grad(),
                );
                let b = with_beta.then(|| beta.clone());
                let y = if ours {
                    layer_norm(x.clone(), gamma.clone(), b, 1e-5)
                } else {
                    Tensor::from_primitive(TensorPrimitive::Float(Ad::layer_norm(
                        x.clone().into_primitive().tensor(),
                        gamma.clone().into_primitive().tensor(),
                        b.map(|b| b.into_primitive().tensor()),
                        1e-5,
                    )))
                };
                let out = if residual {
                    x.clone() + y.clone()
                } else {
                    y.clone()
                };
                let grads = (out * dy.clone()).sum().backward();
                (
                    y.into_data(),
                    x.grad(&grads).unwrap().into_data(),
                    gamma.grad(&grads).unwrap().into_data(),
                    beta.grad(&grads).map(|g| g.into_data()),
                )
            };
            let (want, got) = (run(false), run(true));
            let tol = Tolerance::<f64>::rel_abs(1e-9, 1e-9);
            want.0.assert_approx_eq::<f64>(&got.0, tol);
            want.1.assert_approx_eq::<f64>(&got.1, tol);
            want.2.assert_approx_eq::<f64>(&got.2, tol);
            assert_eq!(got.3.is_some(), with_beta, "rows {rows}");
            if let (Some(want), Some(got)) = (want.3, got.3) {
                want.assert_approx_eq::<f64>(&got, tol);
            }
        }
    }
}
