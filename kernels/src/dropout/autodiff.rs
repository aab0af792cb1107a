//! [`DropoutOps`] under `Autodiff<B>`: nodes that keep nothing (the mask is
//! drawn again from the seed).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;

use crate::{AttentionBackend, AttentionDropout, DropoutOps};

impl<B: AttentionBackend, C: CheckpointStrategy> DropoutOps for Autodiff<B, C> {
    fn has_seeded_dropout() -> bool {
        B::has_seeded_dropout()
    }

    fn seeded_dropout(x: FloatTensor<Self>, dropout: AttentionDropout) -> FloatTensor<Self> {
        match SeededDropoutBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(dropout, B::seeded_dropout(x.primitive, dropout)),
            OpsKind::UnTracked(prep) => prep.finish(B::seeded_dropout(x.primitive, dropout)),
        }
    }

    fn seeded_dropout_add(
        residual: FloatTensor<Self>,
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        // Nothing is kept: the backward draws the mask again.
        match bias {
            None => {
                let prepared = SeededDropoutAddBackward
                    .prepare::<C>([residual.node.clone(), x.node.clone()])
                    .compute_bound()
                    .stateful();
                let out = B::seeded_dropout_add(residual.primitive, x.primitive, None, dropout);
                match prepared {
                    OpsKind::Tracked(prep) => prep.finish(dropout, out),
                    OpsKind::UnTracked(prep) => prep.finish(out),
                }
            }
            Some(bias) => {
                let prepared = SeededDropoutAddBackward
                    .prepare::<C>([residual.node.clone(), x.node.clone(), bias.node.clone()])
                    .compute_bound()
                    .stateful();
                let out = B::seeded_dropout_add(
                    residual.primitive,
                    x.primitive,
                    Some(bias.primitive),
                    dropout,
                );
                match prepared {
                    OpsKind::Tracked(prep) => prep.finish(dropout, out),
                    OpsKind::UnTracked(prep) => prep.finish(out),
                }
            }
        }
    }
}

/// Seeded dropout's backward: the same mask on the output gradient, drawn
/// again from the seed (nothing kept).
#[derive(Debug)]
struct SeededDropoutBackward;

impl<B: AttentionBackend> Backward<B, 1> for SeededDropoutBackward {
    type State = AttentionDropout;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let dropout = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::seeded_dropout(grad, dropout)
        });
    }
}

/// `residual + seeded_dropout(x + bias)`'s backward: the output gradient
/// for the residual, its seeded dropout (the same mask, drawn again) for
/// `x`, and that summed over the rows for the bias. `N` is 3 with a bias,
/// 2 without.
#[derive(Debug)]
struct SeededDropoutAddBackward;

impl SeededDropoutAddBackward {
    fn run<B: AttentionBackend, const N: usize>(
        ops: Ops<AttentionDropout, N>,
        grads: &mut Gradients,
    ) {
        let dropout = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let parents = &ops.parents;
        let bias = parents.get(2).and_then(|p| p.as_ref());
        let dx = match bias {
            Some(node) => {
                let (dx, db) = B::seeded_dropout_column_sum(grad.clone(), dropout);
                grads.register::<B>(node.id, db);
                Some(dx)
            }
            None => parents[1]
                .is_some()
                .then(|| B::seeded_dropout(grad.clone(), dropout)),
        };
        if let (Some(node), Some(dx)) = (&parents[1], dx) {
            grads.register::<B>(node.id, dx);
        }
        if let Some(residual) = &parents[0] {
            grads.register::<B>(residual.id, grad);
        }
    }
}

impl<B: AttentionBackend, const N: usize> Backward<B, N> for SeededDropoutAddBackward {
    type State = AttentionDropout;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        Self::run::<B, N>(ops, grads);
    }
}
