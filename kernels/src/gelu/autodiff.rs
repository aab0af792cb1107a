//! [`GeluOps`] under `Autodiff<B>`: nodes that keep only the input (and the
//! bias).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;

use crate::dense::autodiff::DenseBackward;
use crate::{AttentionBackend, AttentionDropout, GeluOps};

impl<B: AttentionBackend, C: CheckpointStrategy> GeluOps for Autodiff<B, C> {
    fn gelu_exact(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match GeluExactBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = prep.checkpoint(&x);
                prep.finish(state, B::gelu_exact(x.primitive))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::gelu_exact(x.primitive)),
        }
    }

    fn gelu_exact_dropout(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        match bias {
            None => match GeluExactDropoutBackward
                .prepare::<C>([x.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let state = (prep.checkpoint(&x), None, dropout);
                    prep.finish(state, B::gelu_exact_dropout(x.primitive, None, dropout))
                }
                OpsKind::UnTracked(prep) => {
                    prep.finish(B::gelu_exact_dropout(x.primitive, None, dropout))
                }
            },
            Some(bias) => match GeluExactDropoutBackward
                .prepare::<C>([x.node.clone(), bias.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let state = (prep.checkpoint(&x), Some(prep.checkpoint(&bias)), dropout);
                    prep.finish(
                        state,
                        B::gelu_exact_dropout(x.primitive, Some(bias.primitive), dropout),
                    )
                }
                OpsKind::UnTracked(prep) => prep.finish(B::gelu_exact_dropout(
                    x.primitive,
                    Some(bias.primitive),
                    dropout,
                )),
            },
        }
    }

    fn gelu_dropout_dense(
        h: FloatTensor<Self>,
        h_bias: Option<FloatTensor<Self>>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        let (has_bias, has_h_bias) = (bias.is_some(), h_bias.is_some());
        let forward = move |t: Vec<FloatTensor<B>>| {
            let mut t = t.into_iter();
            let (h, w) = (t.next().expect("h"), t.next().expect("weight"));
            let b = has_bias.then(|| t.next().expect("bias"));
            let hb = has_h_bias.then(|| t.next().expect("h_bias"));
            B::gelu_dropout_dense(h, hb, w, b, dropout)
        };
        let fused = Some(dropout);
        match (bias, h_bias) {
            (None, None) => DenseBackward::track::<B, C, 2>([h, weight], false, fused, forward),
            (Some(b), None) => {
                DenseBackward::track::<B, C, 3>([h, weight, b], true, fused, forward)
            }
            (None, Some(hb)) => {
                DenseBackward::track::<B, C, 3>([h, weight, hb], false, fused, forward)
            }
            (Some(b), Some(hb)) => {
                DenseBackward::track::<B, C, 4>([h, weight, b, hb], true, fused, forward)
            }
        }
    }
}

/// Exact GELU's backward: `dx = dy · (Φ(x) + x·φ(x))` from the saved `x`.
#[derive(Debug)]
struct GeluExactBackward;

impl<B: AttentionBackend> Backward<B, 1> for GeluExactBackward {
    type State = NodeId;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let x: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state);
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::gelu_exact_backward(x, grad)
        });
    }
}

/// The fused GELU and dropout's backward: keeps `x` (as [`GeluExactBackward`]),
/// the bias where there is one, and the dropout's seed, and draws the mask
/// again. `N` is 2 with a bias (whose gradient is `dx` summed over the
/// rows), 1 without.
#[derive(Debug)]
struct GeluExactDropoutBackward;

impl GeluExactDropoutBackward {
    fn run<B: AttentionBackend, const N: usize>(
        ops: Ops<(NodeId, Option<NodeId>, AttentionDropout), N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let (x, bias, dropout) = ops.state;
        let x: FloatTensor<B> = checkpointer.retrieve_node_output(x);
        let bias: Option<FloatTensor<B>> = bias.map(|b| checkpointer.retrieve_node_output(b));
        let dy = grads.consume::<B>(&ops.node);
        let bias_node = ops.parents.get(1).and_then(|p| p.as_ref());
        let dx = match bias_node {
            Some(node) => {
                let (dx, db) = B::gelu_exact_dropout_backward_column_sum(x, bias, dy, dropout);
                grads.register::<B>(node.id, db);
                dx
            }
            None => B::gelu_exact_dropout_backward(x, bias, dy, dropout),
        };
        if let Some(node) = &ops.parents[0] {
            grads.register::<B>(node.id, dx);
        }
    }
}

impl<B: AttentionBackend, const N: usize> Backward<B, N> for GeluExactDropoutBackward {
    type State = (NodeId, Option<NodeId>, AttentionDropout);

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        Self::run::<B, N>(ops, grads, checkpointer);
    }
}
