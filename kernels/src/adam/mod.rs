//! One Adam / AdamW update of one parameter as one op: [`AdamStep`] and
//! [`adam_step_ops`], the update as Burn tensor ops (the default of
//! [`AdamOps::adam_step`](crate::AdamOps::adam_step) and the
//! test oracle of the kernel).
//!
//! Why an op of its own: under Burn's fusion backend each parameter's update
//! (a dozen element-wise ops) already fuses into one kernel, but the host
//! still records, fuses and launches every op one by one. For the default
//! model's ~170 parameters that is ~2,000 ops a step, and an H100 training
//! step is bound by the host's work per op (`docs/performance.md`). As one
//! custom op the update of a parameter is one op and one kernel; and the
//! updates of all parameters of a step ([`AdamItem`]s) are one op under
//! fusion, with no reshapes around them.

use burn::prelude::*;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorPrimitive;

#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "fusion")]
mod fusion;
#[cfg(feature = "cubecl")]
mod kernel;

/// One Adam or AdamW step of a parameter, or of many, as one op.
pub trait AdamOps: Backend {
    /// One Adam or AdamW step of one parameter: `(param, first, second)`
    /// after it (see [`AdamStep`] for the formulas).
    ///
    /// The default is [`adam_step_ops`], a dozen element-wise ops; the CubeCL
    /// backends run one kernel, and Burn's fusion backend one custom op, so
    /// the host queues one op per parameter instead of a dozen.
    ///
    /// # Shapes
    /// - param, grad, first, second: `[n]`, one float type; outputs the same
    fn adam_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        first: FloatTensor<Self>,
        second: FloatTensor<Self>,
        step: AdamStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let wrap = |t| Tensor::<Self, 1>::from_primitive(TensorPrimitive::Float(t));
        let (p, m, v) = adam_step_ops(wrap(param), wrap(grad), wrap(first), wrap(second), step);
        let unwrap = |t: Tensor<Self, 1>| t.into_primitive().tensor();
        (unwrap(p), unwrap(m), unwrap(v))
    }

    /// The Adam or AdamW steps of many parameters, each as
    /// [`AdamOps::adam_step`]: `[param, first, second]` after it,
    /// the parameter in its own shape, the moments flat.
    ///
    /// The default is one flat [`AdamOps::adam_step`] per item; the
    /// CubeCL backends launch one kernel per 32 parameters, and Burn's fusion
    /// backend records the whole list as one custom op, where one op a
    /// parameter and the reshapes around it cost the host ~4 ops a parameter
    /// (~700 a step for the default model).
    fn adam_steps(items: Vec<AdamItem<Self>>) -> Vec<[FloatTensor<Self>; 3]> {
        use burn::tensor::TensorMetadata;
        items
            .into_iter()
            .map(|item| {
                let shape = item.param.shape();
                let flat = Shape::new([shape.num_elements()]);
                let (p, m, v) = Self::adam_step(
                    Self::float_reshape(item.param, flat.clone()),
                    Self::float_reshape(item.grad, flat),
                    item.first,
                    item.second,
                    item.step,
                );
                [Self::float_reshape(p, shape), m, v]
            })
            .collect()
    }
}

/// The coefficients of one Adam or AdamW step, computed in f64 on the host
/// as the optimiser's formulas do, and rounded to the element type where
/// they meet a tensor (as Burn's tensor-by-scalar ops round them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    /// Decoupled weight decay (AdamW): `p ← p·decay` before the update;
    /// `1 − lr·wd`, or 1 for none.
    pub decay: f64,
    /// L2 weight decay (Adam): `g ← g + l2·p`; 0 for none.
    pub l2: f64,
    /// β₁: `m ← m·β₁ + g·(1 − β₁)`.
    pub beta1: f64,
    /// β₂: `v ← v·β₂ + g²·(1 − β₂)`.
    pub beta2: f64,
    /// `√(1 − β₂ᵗ)`: `denom = √v / bias2_sqrt + eps`.
    pub bias2_sqrt: f64,
    /// ε of the denominator.
    pub eps: f64,
    /// `lr / (1 − β₁ᵗ)`: `p ← p − m / denom · step_size`.
    pub step_size: f64,
}

impl AdamStep {
    /// Step `t` (1 for the first) at learning rate `lr`; `decoupled` picks
    /// AdamW's weight decay over Adam's L2 term.
    pub fn new(
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        decoupled: bool,
        t: i32,
    ) -> Self {
        let (decay, l2) = match (weight_decay != 0.0, decoupled) {
            (false, _) => (1.0, 0.0),
            (true, true) => (1.0 - lr * weight_decay, 0.0),
            (true, false) => (1.0, weight_decay),
        };
        Self {
            decay,
            l2,
            beta1,
            beta2,
            bias2_sqrt: (1.0 - beta2.powi(t)).sqrt(),
            eps,
            step_size: lr / (1.0 - beta1.powi(t)),
        }
    }
}

/// The step as tensor ops: `(p, m, v)` after the step.
///
/// # Shapes
/// - param, grad, first, second: `[n]`; outputs the same
pub fn adam_step_ops<B: Backend>(
    param: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    first: Tensor<B, 1>,
    second: Tensor<B, 1>,
    step: AdamStep,
) -> (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>) {
    // Adam's L2 term reads the parameter before AdamW's decay would (only
    // one of them is ever on).
    let grad = if step.l2 != 0.0 {
        grad + param.clone() * step.l2
    } else {
        grad
    };
    let param = if step.decay != 1.0 {
        param * step.decay
    } else {
        param
    };
    let first = first * step.beta1 + grad.clone() * (1.0 - step.beta1);
    let second = second * step.beta2 + grad.powi_scalar(2) * (1.0 - step.beta2);
    let denom = second.clone().sqrt() / step.bias2_sqrt + step.eps;
    let param = param - first.clone() / denom * step.step_size;
    (param, first, second)
}

/// One parameter's part of [`AdamOps::adam_steps`](crate::AdamOps::adam_steps).
///
/// # Shapes
/// - param, grad: the parameter's shape (any rank), `n` elements
/// - first, second: `[n]`
#[derive(Debug)]
pub struct AdamItem<B: Backend> {
    /// The parameter's value.
    pub param: FloatTensor<B>,
    /// Its gradient.
    pub grad: FloatTensor<B>,
    /// Adam's first moment, flat.
    pub first: FloatTensor<B>,
    /// Adam's second moment, flat.
    pub second: FloatTensor<B>,
    /// The step's coefficients.
    pub step: AdamStep,
}

/// Under autodiff the optimiser steps the inner tensors: the defaults.
impl<
        B: crate::AttentionBackend,
        C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy,
    > AdamOps for burn::backend::Autodiff<B, C>
{
}
