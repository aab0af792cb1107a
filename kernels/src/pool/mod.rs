//! Attention pooling over a row's tokens as one op each way.
//!
//! AAM pools each ASV's 151 token states into one vector with a learned
//! query (reference §1.4): scores `s = x·q·scale`, a softmax over the valid
//! tokens (a row with none gets uniform weights), the weights renormalised
//! by their sum + 1e-8, and `Σ_t w_t·x_t`. As tensor ops the query's product
//! and the weighted sum each have a unit dimension, so each is a broadcast
//! multiply and a sum over the ASV level's `[rows, 151, 128]` states (see
//! [`crate::matmul`]), and their backward passes are more of them: on the
//! H100 at the reference's batch, ~0.65 ms forward and ~1.2 ms backward a
//! step in seven passes over the states (`docs/performance.md`, 2026-11-27).
//! The CubeCL kernels read the states once each way:
//!
//! - forward: per row, an online softmax over the tokens (running max and
//!   sum, as the attention kernels) accumulating the weighted sum, and the
//!   row's log-sum-exp `lse` for the backward;
//! - backward: with `w_t = exp(s_t − lse)` and `g_t = dy·x_t`, the softmax's
//!   gradient `ds_t = w_t·(g_t − Σ_u w_u·g_u)`, then `dx_t = w_t·dy +
//!   ds_t·q·scale` and `dq = scale·Σ_rows Σ_t ds_t·x_t`. The sum over the
//!   tokens is needed before any `ds_t`, so the kernel reads a row's states
//!   twice (the second time mostly from L2); `Σ_t ds_t·x_t` is gathered in
//!   the first read as `Σ_t w_t·g_t·x_t − (Σ_t w_t·g_t)·Σ_t w_t·x_t`.
//!
//! The renormalisation by `Σ w + 1e-8` changes the weights by ~1e-8 of
//! themselves, below f32's resolution, and is left out of the kernels;
//! [`attention_pool_ops`] keeps it, as the reference (the parity tests
//! compare the two).

use burn::prelude::*;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorPrimitive;

use burn::tensor::activation;

mod autodiff;
#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "fusion")]
mod fusion;
#[cfg(feature = "cubecl")]
mod kernel;

/// Attention pooling of a row's tokens with a learned query.
pub trait PoolOps: Backend {
    /// Attention pooling over each row's tokens (the module doc): the pooled rows
    /// and each row's log-sum-exp of its scores, for the backward. `valid`
    /// is 1 at tokens that count and 0 at padding. The default is tensor
    /// ops; the CubeCL backends run one kernel that reads `x` once, and
    /// Burn's fusion backend one custom op.
    ///
    /// # Shapes
    /// - x: `[N, T, D]`, query: `[D]`, valid: `[N, T]`
    /// - pooled: `[N, D]`, lse: `[N]` (f32 on the CubeCL backends)
    fn attention_pool_with_stats(
        x: FloatTensor<Self>,
        query: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (pooled, lse) = attention_pool_ops::<Self>(
            Tensor::from_primitive(TensorPrimitive::Float(x)),
            Tensor::from_primitive(TensorPrimitive::Float(query)),
            Tensor::from_primitive(TensorPrimitive::Float(valid)),
            scale,
        );
        (
            pooled.into_primitive().tensor(),
            lse.into_primitive().tensor(),
        )
    }

    /// `(dx, dquery)` of [`PoolOps::attention_pool_with_stats`]
    /// from its inputs, its `lse` and the pooled rows' gradient (the closed
    /// form of the module doc).
    ///
    /// # Shapes
    /// - x: `[N, T, D]`, query: `[D]`, valid: `[N, T]`, lse: `[N]`, dy: `[N, D]`
    /// - dx: `[N, T, D]`, dquery: `[D]`
    fn attention_pool_backward(
        x: FloatTensor<Self>,
        query: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let wrap3 = |t| Tensor::<Self, 3>::from_primitive(TensorPrimitive::Float(t));
        let (dx, dquery) = attention_pool_backward_ops::<Self>(
            wrap3(x),
            Tensor::from_primitive(TensorPrimitive::Float(query)),
            Tensor::from_primitive(TensorPrimitive::Float(valid)),
            Tensor::from_primitive(TensorPrimitive::Float(lse)),
            Tensor::from_primitive(TensorPrimitive::Float(dy)),
            scale,
        );
        (
            dx.into_primitive().tensor(),
            dquery.into_primitive().tensor(),
        )
    }

    /// The pooled rows of [`PoolOps::attention_pool_with_stats`];
    /// under autodiff one node whose backward is
    /// [`PoolOps::attention_pool_backward`].
    ///
    /// # Shapes
    /// - x: `[N, T, D]`, query: `[D]`, valid: `[N, T]`
    /// - output: `[N, D]`
    fn attention_pool(
        x: FloatTensor<Self>,
        query: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        Self::attention_pool_with_stats(x, query, valid, scale).0
    }
}

/// Attention pooling of each row's tokens with a learned query (reference
/// §1.4; the module doc): scores `x·query·scale`, a softmax over the tokens where
/// `valid` (uniform weights for a row with none), and the weighted sum,
/// through [`PoolOps::attention_pool`] (one kernel each way on the
/// CubeCL backends).
///
/// # Shapes
/// - x: `[N, T, D]`, query: `[D]`, valid: `[N, T]` (true = counts)
/// - output: `[N, D]`
pub fn attention_pool<B: PoolOps>(
    x: Tensor<B, 3>,
    query: Tensor<B, 1>,
    valid: Tensor<B, 2, Bool>,
    scale: f64,
) -> Tensor<B, 2> {
    let valid = valid.float().cast(x.dtype());
    Tensor::from_primitive(TensorPrimitive::Float(B::attention_pool(
        x.into_primitive().tensor(),
        query.into_primitive().tensor(),
        valid.into_primitive().tensor(),
        scale,
    )))
}

/// `(scores, ignore, all_padding)`: `x·query·scale` as the reference masks
/// it, −∞ at the padding of a row with a valid token (`ignore`) and 0 at
/// every token of a row with none (`all_padding`).
///
/// # Shapes
/// - x: `[N, T, D]`, query: `[D]`, valid: `[N, T]` (1 valid, 0 padding)
/// - scores, ignore, all_padding: `[N, T]`
fn masked_scores<B: Backend>(
    x: Tensor<B, 3>,
    query: Tensor<B, 1>,
    valid: Tensor<B, 2>,
    scale: f64,
) -> (Tensor<B, 2>, Tensor<B, 2, Bool>, Tensor<B, 2, Bool>) {
    let [n, t, d] = x.dims();
    let scores = crate::matmul(x, query.reshape([1, d, 1])).reshape([n, t]) * scale;
    let valid = valid.greater_elem(0.5);
    let all_padding = valid.clone().any_dim(1).bool_not().expand([n, t]);
    let ignore = valid.bool_not().bool_and(all_padding.clone().bool_not());
    let scores = scores
        .mask_fill(ignore.clone(), f32::NEG_INFINITY)
        .mask_fill(all_padding.clone(), 0.0);
    (scores, ignore, all_padding)
}

/// `(pooled, lse)` as tensor ops: the reference's pooling (module doc) and
/// each row's log-sum-exp of its scores over the tokens it weights (all of
/// them, at score 0, for a row with no valid token).
///
/// # Shapes
/// - x: `[N, T, D]`, query: `[D]`, valid: `[N, T]` (1 valid, 0 padding)
/// - pooled: `[N, D]`, lse: `[N]`
pub(crate) fn attention_pool_ops<B: Backend>(
    x: Tensor<B, 3>,
    query: Tensor<B, 1>,
    valid: Tensor<B, 2>,
    scale: f64,
) -> (Tensor<B, 2>, Tensor<B, 1>) {
    let [n, t, d] = x.dims();
    let (scores, ignore, _) = masked_scores(x.clone(), query, valid, scale);
    let max = scores.clone().max_dim(1);
    let lse = ((scores.clone() - max.clone()).exp().sum_dim(1).log() + max).reshape([n]);
    // Softmax, padding zeroed, renormalised (+1e-8 as the reference).
    let w = activation::softmax(scores, 1).mask_fill(ignore, 0.0);
    let total = w.clone().sum_dim(1) + 1e-8;
    let w = w / total;
    let pooled = crate::matmul(w.reshape([n, 1, t]), x).reshape([n, d]);
    (pooled, lse)
}

/// `(dx, dquery)` of [`attention_pool_ops`]' pooled output from its
/// inputs, the row log-sum-exps and the output gradient, in closed form as
/// tensor ops (module doc).
///
/// # Shapes
/// - x: `[N, T, D]`, query: `[D]`, valid: `[N, T]`, lse: `[N]`, dy: `[N, D]`
/// - dx: `[N, T, D]`, dquery: `[D]`
pub(crate) fn attention_pool_backward_ops<B: Backend>(
    x: Tensor<B, 3>,
    query: Tensor<B, 1>,
    valid: Tensor<B, 2>,
    lse: Tensor<B, 1>,
    dy: Tensor<B, 2>,
    scale: f64,
) -> (Tensor<B, 3>, Tensor<B, 1>) {
    let [n, t, d] = x.dims();
    // exp(−∞ − lse) = 0 at the tokens the forward ignored.
    let (scores, _, all_padding) = masked_scores(x.clone(), query.clone(), valid, scale);
    let w = (scores - lse.reshape([n, 1])).exp();
    let g = crate::matmul(x.clone(), dy.clone().reshape([n, d, 1])).reshape([n, t]);
    let c = (w.clone() * g.clone()).sum_dim(1);
    // All-padding rows' scores are the constant 0: no gradient to them.
    let ds = (w.clone() * (g - c)).mask_fill(all_padding, 0.0);
    let dx = w.reshape([n, t, 1]) * dy.reshape([n, 1, d])
        + ds.clone().reshape([n, t, 1]) * (query.reshape([1, 1, d]) * scale);
    let dquery = crate::sum_rows((x * ds.reshape([n, t, 1])).sum_dim(1).reshape([n, d])) * scale;
    (dx, dquery)
}

#[cfg(test)]
mod tests {
    use crate::attention_pool;
    use burn::backend::{Autodiff, NdArray};
    use burn::prelude::*;
    use burn::tensor::{Distribution, Tolerance};

    type Ad = Autodiff<NdArray<f64>>;

    /// The pooling node (closed-form backward) against Burn's autodiff
    /// through [`super::attention_pool_ops`], in f64: rows with several
    /// valid tokens, one, and none.
    #[test]
    fn pooling_node_equals_autodiff_through_the_ops() {
        let device = Default::default();
        let (n, t, d) = (4, 7, 5);
        let x = Tensor::<Ad, 3>::random([n, t, d], Distribution::Normal(0.0, 1.0), &device);
        let q = Tensor::<Ad, 1>::random([d], Distribution::Normal(0.0, 1.0), &device);
        let dy = Tensor::<Ad, 2>::random([n, d], Distribution::Normal(0.0, 1.0), &device);
        let lengths = [7, 3, 1, 0];
        let valid: Vec<bool> = lengths
            .iter()
            .flat_map(|&l| (0..t).map(move |i| i < l))
            .collect();
        let valid = Tensor::<Ad, 2, Bool>::from_data(TensorData::new(valid, [n, t]), &device);
        let run = |node: bool| {
            let (x, q) = (x.clone().require_grad(), q.clone().require_grad());
            let pooled = if node {
                attention_pool(x.clone(), q.clone(), valid.clone(), 0.4)
            } else {
                super::attention_pool_ops(x.clone(), q.clone(), valid.clone().float(), 0.4).0
            };
            let grads = (pooled.clone() * dy.clone()).sum().backward();
            (
                pooled.into_data(),
                x.grad(&grads).unwrap().into_data(),
                q.grad(&grads).unwrap().into_data(),
            )
        };
        let (want, got) = (run(false), run(true));
        let tol = Tolerance::<f64>::rel_abs(1e-7, 1e-7);
        want.0.assert_approx_eq::<f64>(&got.0, tol);
        want.1.assert_approx_eq::<f64>(&got.1, tol);
        want.2.assert_approx_eq::<f64>(&got.2, tol);
    }
}
