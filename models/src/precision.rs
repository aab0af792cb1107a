//! Mixed precision (§4.6): the transformer stacks compute in bf16 or f16 while
//! the parameters, the residual stream, LayerNorms, softmax statistics and the
//! losses stay in f32.
//!
//! The reference runs its forward inside `torch.autocast`, which casts the
//! inputs of every matmul-like op to the low type and keeps norms and softmax
//! in f32. Burn has no autocast and no type promotion (an f32 + bf16 add is an
//! error), so aam-rs places the casts itself, where they pay: inside each
//! transformer layer, whose matmuls, attention, GELU and dropout hold nearly
//! all of a step's compute and activation memory. Per layer:
//!
//! ```text
//! x (f32) ─ LN1 (f32) ─ cast ─ in_proj · attention · out_proj · dropout (low) ─ cast ─ + x
//!         ─ LN2 (f32) ─ cast ─ linear1 · GELU · dropout · linear2 · dropout (low) ─ cast ─ + x
//! ```
//!
//! Weights are cast at use, so the optimiser updates f32 master weights (the
//! cast's backward hands f32 gradients to them). Embeddings, pooling, the
//! heads and the fusion modules run in f32; the final LayerNorm of each stack
//! sees the f32 residual stream.
//!
//! The choice is a scope, like `torch.autocast`: [`autocast`] sets it for the
//! current thread until its guard drops, and the layers read it in their
//! forward. Training wraps its forward in it; losses are computed in f32.
//! fp16's narrow range needs loss scaling; the training loop does it (a
//! dynamic scale, as torch's `GradScaler`).

use std::cell::Cell;

use burn::prelude::*;
use burn::tensor::DType;
use serde::{Deserialize, Serialize};

/// The low-precision type of a run's transformer compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum MixedPrecision {
    /// Everything in f32 (the reference default).
    #[default]
    None,
    /// bfloat16: f32's range, 8 bits of mantissa; no loss scaling needed.
    Bf16,
    /// IEEE half: 11 bits of mantissa, range ±65,504; trained with loss scaling.
    Fp16,
}

impl MixedPrecision {
    /// The compute type, `None` for full precision.
    pub fn dtype(self) -> Option<DType> {
        match self {
            MixedPrecision::None => None,
            MixedPrecision::Bf16 => Some(DType::BF16),
            MixedPrecision::Fp16 => Some(DType::F16),
        }
    }
}

thread_local! {
    static COMPUTE_DTYPE: Cell<Option<DType>> = const { Cell::new(None) };
}

/// Restores the previous precision scope when dropped.
#[must_use = "the precision applies only while the guard lives"]
pub struct Autocast {
    previous: Option<DType>,
}

impl Drop for Autocast {
    fn drop(&mut self) {
        COMPUTE_DTYPE.with(|c| c.set(self.previous));
    }
}

/// Runs the transformer layers of this thread in `precision` until the
/// returned guard drops.
pub fn autocast(precision: MixedPrecision) -> Autocast {
    let previous = COMPUTE_DTYPE.with(|c| c.replace(precision.dtype()));
    Autocast { previous }
}

/// The low-precision type of the current scope, if any.
pub(crate) fn compute_dtype() -> Option<DType> {
    COMPUTE_DTYPE.with(|c| c.get())
}

/// `x` in `dtype`; no op (and no autodiff node) when it is already.
pub(crate) fn cast_to<B: Backend, const D: usize>(x: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    if x.dtype() == dtype {
        x
    } else {
        x.cast(dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn autocast_scopes_nest_and_restore() {
        assert_eq!(compute_dtype(), None);
        {
            let _outer = autocast(MixedPrecision::Bf16);
            assert_eq!(compute_dtype(), Some(DType::BF16));
            {
                let _inner = autocast(MixedPrecision::None);
                assert_eq!(compute_dtype(), None);
            }
            assert_eq!(compute_dtype(), Some(DType::BF16));
        }
        assert_eq!(compute_dtype(), None);
    }
}
