//! [`DenseOps`] under `Autodiff<B>`: the dense layer as one node whose
//! backward sums the weight and bias gradients over the rows in parts (also
//! the node of [`GeluOps::gelu_dropout_dense`], which keeps `h` instead of
//! the layer's input).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;

use super::ahead::{Ahead, DenseProblem};
use crate::{AttentionBackend, AttentionDropout, DenseOps};

impl<B: AttentionBackend, C: CheckpointStrategy> DenseOps for Autodiff<B, C> {
    fn dense(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        let forward = |t: Vec<FloatTensor<B>>| {
            let mut t = t.into_iter();
            let (x, w) = (t.next().expect("x"), t.next().expect("weight"));
            B::dense(x, w, t.next())
        };
        match bias {
            Some(b) => DenseBackward::track::<B, C, 3>([x, weight, b], true, None, forward),
            None => DenseBackward::track::<B, C, 2>([x, weight], false, None, forward),
        }
    }
}

/// The dense layer's backward (`dense/mod.rs`): `dx = dy·w`, and `dw`, `db`
/// summed over the rows in parts. The parents are `[x, weight]`, then the
/// bias where there is one, then `h_bias` where there is one (`N` from 2
/// to 4).
///
/// The state's `activation` is `Some` for
/// [`GeluOps::gelu_dropout_dense`]: then the node keeps `h`, not the
/// layer's input, and the backward recomputes the input
/// `gelu_exact_dropout(h, h_bias)` for the weight gradient, takes `dh`
/// through the fused GELU and dropout's backward, and sums it over the rows
/// for `h_bias`'s gradient.
#[derive(Debug)]
pub(crate) struct DenseBackward;

/// What [`DenseBackward`] keeps: the input (or `h`), the weight, whether a
/// bias is a parent, and a fused GELU before the layer.
#[derive(Clone, Debug)]
pub(crate) struct DenseSaved {
    x: NodeId,
    weight: NodeId,
    bias: bool,
    activation: Option<FusedGelu>,
}

/// The GELU and dropout fused before a dense layer, and the bias added to
/// its input `h` first (a parent of the node, last).
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedGelu {
    dropout: AttentionDropout,
    h_bias: Option<NodeId>,
}

impl DenseBackward {
    fn run<B: AttentionBackend, const N: usize>(
        ops: Ops<DenseSaved, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let dy = grads.consume::<B>(&ops.node);
        let saved = ops.state;
        let kept: FloatTensor<B> = checkpointer.retrieve_node_output(saved.x);
        let w: FloatTensor<B> = checkpointer.retrieve_node_output(saved.weight);
        let parents = &ops.parents;
        let bias_node = saved.bias.then(|| parents[2].as_ref()).flatten();
        let h_bias_node = saved
            .activation
            .and_then(|a| a.h_bias)
            .and_then(|_| parents[2 + saved.bias as usize].as_ref());
        let want = [
            parents[0].is_some() || h_bias_node.is_some(),
            parents[1].is_some(),
            bias_node.is_some(),
        ];
        // With a fused GELU before the layer, `kept` is `h` and stays for `dh`;
        // otherwise it is the input itself, moved into the backward.
        let (x, fused) = match saved.activation {
            Some(gelu) => {
                let h_bias: Option<FloatTensor<B>> =
                    gelu.h_bias.map(|b| checkpointer.retrieve_node_output(b));
                let x = B::gelu_exact_dropout(kept.clone(), h_bias.clone(), gelu.dropout);
                (x, Some((kept, h_bias, gelu.dropout)))
            }
            None => (kept, None),
        };
        let (dx, dw, db) = B::dense_backward(x, w, dy, want);
        if let Some(dx) = dx {
            let dx = match (fused, h_bias_node) {
                (Some((h, h_bias, dropout)), Some(node)) => {
                    let (dh, dh_bias) =
                        B::gelu_exact_dropout_backward_column_sum(h, h_bias, dx, dropout);
                    grads.register::<B>(node.id, dh_bias);
                    dh
                }
                (Some((h, h_bias, dropout)), None) => {
                    B::gelu_exact_dropout_backward(h, h_bias, dx, dropout)
                }
                (None, _) => dx,
            };
            if let Some(node) = &parents[0] {
                grads.register::<B>(node.id, dx);
            }
        }
        if let (Some(node), Some(dw)) = (&parents[1], dw) {
            grads.register::<B>(node.id, dw);
        }
        if let (Some(node), Some(db)) = (bias_node, db) {
            grads.register::<B>(node.id, db);
        }
    }

    /// The node for `forward([x, weight, bias?, h_bias?])` (the tensors in
    /// that order, `N` of them), keeping `x` and `weight` (and `h_bias`).
    pub(crate) fn track<B, C, const N: usize>(
        tensors: [FloatTensor<Autodiff<B, C>>; N],
        bias: bool,
        activation: Option<AttentionDropout>,
        forward: impl FnOnce(Vec<FloatTensor<B>>) -> FloatTensor<B>,
    ) -> FloatTensor<Autodiff<B, C>>
    where
        B: AttentionBackend,
        C: CheckpointStrategy,
        DenseBackward: Backward<B, N, State = DenseSaved>,
    {
        let h_bias = activation.is_some() && N == 3 + bias as usize;
        let nodes = core::array::from_fn(|i| tensors[i].node.clone());
        match DenseBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(mut prep) => {
                super::ahead::announce(|| {
                    use burn::tensor::TensorMetadata;
                    let tracked = |i: usize| !tensors[i].node.requirement.is_none();
                    let [rows, inputs] = tensors[0].primitive.shape().dims::<2>();
                    Ahead::Dense(DenseProblem {
                        rows,
                        inputs,
                        outputs: tensors[1].primitive.shape().dims::<2>()[0],
                        dtype: tensors[0].primitive.dtype(),
                        bias,
                        forward: false,
                        want: [
                            tracked(0) || (h_bias && tracked(N - 1)),
                            tracked(1),
                            bias && tracked(2),
                        ],
                    })
                });
                let state = DenseSaved {
                    x: prep.checkpoint(&tensors[0]),
                    weight: prep.checkpoint(&tensors[1]),
                    bias,
                    activation: activation.map(|dropout| FusedGelu {
                        dropout,
                        h_bias: h_bias.then(|| prep.checkpoint(&tensors[N - 1])),
                    }),
                };
                prep.finish(state, forward(tensors.map(|t| t.primitive).into()))
            }
            OpsKind::UnTracked(prep) => prep.finish(forward(tensors.map(|t| t.primitive).into())),
        }
    }
}

impl<B: AttentionBackend, const N: usize> Backward<B, N> for DenseBackward {
    type State = DenseSaved;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        Self::run::<B, N>(ops, grads, checkpointer);
    }
}
