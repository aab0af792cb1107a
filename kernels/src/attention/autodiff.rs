//! [`AttentionOps`] under `Autodiff<B>`: the fused forward saves its inputs
//! and row statistics, and the backward runs the dQ and dK/dV kernels, so a
//! training step never materialises the `[T, T]` attention matrix; on the
//! packed projection `qkv` it is one node from `qkv` to the merged context.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::ops::{BoolTensor, FloatTensor};

use crate::autodiff::backward_for_parent_counts;
use crate::{AttentionBackend, AttentionDropout, AttentionOps, KernelChoice};

impl<B: AttentionBackend, C: CheckpointStrategy> AttentionOps for Autodiff<B, C> {
    fn has_fused_attention() -> bool {
        B::has_fused_attention()
    }

    fn fused_packed_attention(
        qkv: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        key_padding_mask: Option<BoolTensor<Self>>,
        heads: usize,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> FloatTensor<Self> {
        // The forward and the state, the same with and without a bias
        // (whose node is the second parent).
        macro_rules! packed {
            ($prepared:expr) => {
                match $prepared.compute_bound().stateful() {
                    OpsKind::Tracked(mut prep) => {
                        let qkv_state = prep.checkpoint(&qkv);
                        let bias = bias.map(|b| b.primitive);
                        let (out, lse) = B::packed_attention_forward(
                            qkv.primitive,
                            bias.clone(),
                            key_padding_mask.clone(),
                            heads,
                            scale,
                            dropout,
                            kernels,
                        );
                        let state = (
                            qkv_state,
                            bias,
                            key_padding_mask,
                            out.clone(),
                            lse,
                            heads,
                            scale,
                            dropout,
                            kernels,
                        );
                        prep.finish(state, out)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(B::fused_packed_attention(
                        qkv.primitive,
                        bias.map(|b| b.primitive),
                        key_padding_mask,
                        heads,
                        scale,
                        dropout,
                        kernels,
                    )),
                }
            };
        }
        match &bias {
            Some(b) => {
                packed!(PackedAttentionBackward.prepare::<C>([qkv.node.clone(), b.node.clone()]))
            }
            None => packed!(PackedAttentionBackward.prepare::<C>([qkv.node.clone()])),
        }
    }

    fn fused_masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> FloatTensor<Self> {
        match FusedAttentionBackward
            .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let q_state = prep.checkpoint(&q);
                let k_state = prep.checkpoint(&k);
                let v_state = prep.checkpoint(&v);
                let (out, lse) = B::fused_attention_forward(
                    q.primitive,
                    k.primitive,
                    v.primitive,
                    key_padding_mask.clone(),
                    scale,
                    dropout,
                    kernels,
                );
                let state = (
                    q_state,
                    k_state,
                    v_state,
                    key_padding_mask,
                    out.clone(),
                    lse,
                    scale,
                    dropout,
                    kernels,
                );
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_masked_attention(
                q.primitive,
                k.primitive,
                v.primitive,
                key_padding_mask,
                scale,
                dropout,
                kernels,
            )),
        }
    }
}

#[derive(Debug)]
struct FusedAttentionBackward;

type State<B> = (
    NodeId,
    NodeId,
    NodeId,
    Option<BoolTensor<B>>,
    FloatTensor<B>,
    FloatTensor<B>,
    f64,
    AttentionDropout,
    KernelChoice,
);

impl<B: AttentionBackend> Backward<B, 3> for FusedAttentionBackward {
    type State = State<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v] = ops.parents;
        let dout = grads.consume::<B>(&ops.node);
        let (q_state, k_state, v_state, mask, out, lse, scale, dropout, kernels) = ops.state;
        let q: FloatTensor<B> = checkpointer.retrieve_node_output(q_state);
        let k: FloatTensor<B> = checkpointer.retrieve_node_output(k_state);
        let v: FloatTensor<B> = checkpointer.retrieve_node_output(v_state);
        let (dq, dk, dv) =
            B::fused_attention_backward(q, k, v, mask, out, lse, dout, scale, dropout, kernels);
        if let Some(node) = node_q {
            grads.register::<B>(node.id, dq);
        }
        if let Some(node) = node_k {
            grads.register::<B>(node.id, dk);
        }
        if let Some(node) = node_v {
            grads.register::<B>(node.id, dv);
        }
    }
}

/// Packed self-attention's backward: `dqkv` in one op from the saved `qkv`
/// (a checkpoint), mask, output and row statistics.
#[derive(Debug)]
struct PackedAttentionBackward;

/// `qkv`'s checkpoint, the bias, the mask, `out`, `lse`, heads, scale,
/// dropout and kernel choice.
type PackedState<B> = (
    NodeId,
    Option<FloatTensor<B>>,
    Option<BoolTensor<B>>,
    FloatTensor<B>,
    FloatTensor<B>,
    usize,
    f64,
    AttentionDropout,
    KernelChoice,
);

impl PackedAttentionBackward {
    /// `dqkv` for parent 0 (`qkv`) and, with a bias, its column sum for
    /// parent 1 (the bias was added to every row of `qkv`).
    fn run<B: AttentionBackend, const N: usize>(
        ops: Ops<PackedState<B>, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let dout = grads.consume::<B>(&ops.node);
        let (qkv_state, bias, mask, out, lse, heads, scale, dropout, kernels) = ops.state;
        let qkv: FloatTensor<B> = checkpointer.retrieve_node_output(qkv_state);
        let dqkv = B::packed_attention_backward(
            qkv, bias, mask, out, lse, dout, heads, scale, dropout, kernels,
        );
        if let Some(Some(node)) = ops.parents.get(1) {
            grads.register::<B>(node.id, crate::column_sum_last::<B>(dqkv.clone()));
        }
        if let Some(node) = &ops.parents[0] {
            grads.register::<B>(node.id, dqkv);
        }
    }
}

backward_for_parent_counts!(PackedAttentionBackward, PackedState, 1, 2);
