//! [`PoolOps`] under `Autodiff<B>`: one node with the closed-form backward.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;

use crate::{AttentionBackend, PoolOps};

impl<B: AttentionBackend, C: CheckpointStrategy> PoolOps for Autodiff<B, C> {
    fn attention_pool(
        x: FloatTensor<Self>,
        query: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        match AttentionPoolBackward
            .prepare::<C>([x.node.clone(), query.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (pooled, lse) = B::attention_pool_with_stats(
                    x.primitive.clone(),
                    query.primitive.clone(),
                    valid.primitive.clone(),
                    scale,
                );
                let state = (x.primitive, query.primitive, valid.primitive, lse, scale);
                prep.finish(state, pooled)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::attention_pool(
                x.primitive,
                query.primitive,
                valid.primitive,
                scale,
            )),
        }
    }
}

/// Attention pooling's closed-form backward (`pool/mod.rs`).
#[derive(Debug)]
struct AttentionPoolBackward;

/// What the pooling node keeps: `x`, the query, `valid`, the row
/// log-sum-exps and the scale. The tensor ops it replaces kept `x` for
/// their backward too (and at the ASV level the nucleotide head keeps it),
/// so the node costs only the `[N]` log-sum-exps.
type AttentionPoolState<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    f64,
);

impl<B: AttentionBackend> Backward<B, 2> for AttentionPoolBackward {
    type State = AttentionPoolState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let dy = grads.consume::<B>(&ops.node);
        let (x, query, valid, lse, scale) = ops.state;
        let (dx, dquery) = B::attention_pool_backward(x, query, valid, lse, dy, scale);
        if let Some(node) = &ops.parents[0] {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = &ops.parents[1] {
            grads.register::<B>(node.id, dquery);
        }
    }
}
