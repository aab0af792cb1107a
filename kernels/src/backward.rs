//! [`AttentionBackend`] for `Autodiff<B>`: the fused forward saves its inputs
//! and row statistics, and the backward runs the dQ and dK/dV kernels, so a
//! training step never materialises the `[T, T]` attention matrix; on the
//! packed projection `qkv` it is one node from `qkv` to the merged context. Exact GELU
//! is one node that keeps only its input, LayerNorm one with the closed-form
//! backward, the dense layer one whose backward sums its weight and bias
//! gradients over rows in parts, seeded dropout (alone or plus a residual)
//! one that keeps nothing, and unpacking rows to their slots one whose
//! backward gathers.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{CheckpointStrategy, NoCheckpointing};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::ops::{BoolTensor, FloatTensor};

use crate::{AttentionBackend, AttentionDropout, RowSlots};

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
        let (q_state, k_state, v_state, mask, out, lse, scale, dropout) = ops.state;
        let q: FloatTensor<B> = checkpointer.retrieve_node_output(q_state);
        let k: FloatTensor<B> = checkpointer.retrieve_node_output(k_state);
        let v: FloatTensor<B> = checkpointer.retrieve_node_output(v_state);
        let (dq, dk, dv) =
            B::fused_attention_backward(q, k, v, mask, out, lse, dout, scale, dropout);
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

/// `qkv`'s checkpoint, the mask, `out`, `lse`, heads, scale and dropout.
type PackedState<B> = (
    NodeId,
    Option<BoolTensor<B>>,
    FloatTensor<B>,
    FloatTensor<B>,
    usize,
    f64,
    AttentionDropout,
);

impl<B: AttentionBackend> Backward<B, 1> for PackedAttentionBackward {
    type State = PackedState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let (qkv_state, mask, out, lse, heads, scale, dropout) = ops.state;
        let qkv: FloatTensor<B> = checkpointer.retrieve_node_output(qkv_state);
        unary::<B, _>(ops.parents, ops.node, grads, |dout| {
            B::packed_attention_backward(qkv, mask, out, lse, dout, heads, scale, dropout)
        });
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

/// The fused GELU and dropout's backward: keeps `x` (as [`GeluExactBackward`])
/// and the dropout's seed, and draws the mask again.
#[derive(Debug)]
struct GeluExactDropoutBackward;

impl<B: AttentionBackend> Backward<B, 1> for GeluExactDropoutBackward {
    type State = (NodeId, AttentionDropout);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let (x, dropout) = ops.state;
        let x: FloatTensor<B> = checkpointer.retrieve_node_output(x);
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::gelu_exact_dropout_backward(x, grad, dropout)
        });
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

/// `residual + seeded_dropout(x)`'s backward: the output gradient for the
/// residual, and its seeded dropout (the same mask, drawn again) for `x`.
#[derive(Debug)]
struct SeededDropoutAddBackward;

impl<B: AttentionBackend> Backward<B, 2> for SeededDropoutAddBackward {
    type State = AttentionDropout;

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let dropout = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let [residual, x] = ops.parents;
        if let Some(x) = x {
            grads.register::<B>(x.id, B::seeded_dropout(grad.clone(), dropout));
        }
        if let Some(residual) = residual {
            grads.register::<B>(residual.id, grad);
        }
    }
}

/// Unpacking rows' backward (`slots.rs`): the packed rows' gradients
/// gathered from their slots, the fill row's summed over the empty slots.
#[derive(Debug)]
struct UnpackRowsBackward;

impl<B: AttentionBackend> Backward<B, 2> for UnpackRowsBackward {
    type State = RowSlots;

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_packed, node_fill] = ops.parents;
        let dout = grads.consume::<B>(&ops.node);
        let (dpacked, dfill) = B::unpack_rows_backward(dout, &ops.state);
        if let Some(node) = node_packed {
            grads.register::<B>(node.id, dpacked);
        }
        if let Some(node) = node_fill {
            grads.register::<B>(node.id, dfill);
        }
    }
}

/// The dense layer's backward (`dense.rs`): `dx = dy·w`, and `dw`, `db`
/// summed over the rows in parts. `N` is 3 with a bias, 2 without.
///
/// The state's dropout is `Some` for [`AttentionBackend::gelu_dropout_dense`]:
/// then the node kept `h`, not the layer's input, and the backward
/// recomputes the input `gelu_exact_dropout(h)` for the weight gradient and
/// takes `dh` through the fused GELU and dropout's backward.
#[derive(Debug)]
struct DenseBackward;

/// What [`DenseBackward`] keeps: the input (or `h`), the weight, and the
/// dropout of a fused GELU before the layer.
type DenseSaved = (NodeId, NodeId, Option<AttentionDropout>);

impl DenseBackward {
    fn run<B: AttentionBackend, const N: usize>(
        ops: Ops<DenseSaved, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let dy = grads.consume::<B>(&ops.node);
        let (x_state, w_state, activation) = ops.state;
        let kept: FloatTensor<B> = checkpointer.retrieve_node_output(x_state);
        let w: FloatTensor<B> = checkpointer.retrieve_node_output(w_state);
        let want = core::array::from_fn(|i| ops.parents.get(i).is_some_and(|p| p.is_some()));
        // With a fused GELU before the layer, `kept` is `h` and stays for `dh`;
        // otherwise it is the input itself, moved into the backward.
        let (x, h) = match activation {
            Some(dropout) => (
                B::gelu_exact_dropout(kept.clone(), dropout),
                Some((kept, dropout)),
            ),
            None => (kept, None),
        };
        let (dx, dw, db) = B::dense_backward(x, w, dy, want);
        let parents = &ops.parents;
        if let (Some(node), Some(dx)) = (&parents[0], dx) {
            let dx = match h {
                Some((h, dropout)) => B::gelu_exact_dropout_backward(h, dx, dropout),
                None => dx,
            };
            grads.register::<B>(node.id, dx);
        }
        if let (Some(node), Some(dw)) = (&parents[1], dw) {
            grads.register::<B>(node.id, dw);
        }
        if let (Some(Some(node)), Some(db)) = (parents.get(2), db) {
            grads.register::<B>(node.id, db);
        }
    }

    /// The node for `forward(x, weight, bias)`, keeping `x` and `weight`
    /// (`activation`: see [`DenseBackward`]).
    fn track<B, C>(
        x: FloatTensor<Autodiff<B, C>>,
        weight: FloatTensor<Autodiff<B, C>>,
        bias: Option<FloatTensor<Autodiff<B, C>>>,
        activation: Option<AttentionDropout>,
        forward: impl FnOnce(FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>) -> FloatTensor<B>,
    ) -> FloatTensor<Autodiff<B, C>>
    where
        B: AttentionBackend,
        C: CheckpointStrategy,
    {
        match bias {
            Some(bias) => match DenseBackward
                .prepare::<C>([x.node.clone(), weight.node.clone(), bias.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let state = (prep.checkpoint(&x), prep.checkpoint(&weight), activation);
                    prep.finish(
                        state,
                        forward(x.primitive, weight.primitive, Some(bias.primitive)),
                    )
                }
                OpsKind::UnTracked(prep) => {
                    prep.finish(forward(x.primitive, weight.primitive, Some(bias.primitive)))
                }
            },
            None => match DenseBackward
                .prepare::<C>([x.node.clone(), weight.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let state = (prep.checkpoint(&x), prep.checkpoint(&weight), activation);
                    prep.finish(state, forward(x.primitive, weight.primitive, None))
                }
                OpsKind::UnTracked(prep) => {
                    prep.finish(forward(x.primitive, weight.primitive, None))
                }
            },
        }
    }
}

impl<B: AttentionBackend> Backward<B, 3> for DenseBackward {
    type State = DenseSaved;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        Self::run::<B, 3>(ops, grads, checkpointer);
    }
}

impl<B: AttentionBackend> Backward<B, 2> for DenseBackward {
    type State = DenseSaved;

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        Self::run::<B, 2>(ops, grads, checkpointer);
    }
}

/// LayerNorm's closed-form backward (`norm.rs`). `N` is 3 with a shift, 2
/// without.
#[derive(Debug)]
struct LayerNormBackward;

/// What the LayerNorm node keeps for its backward (`norm.rs` says why).
#[derive(Debug, Clone)]
enum LayerNormSaved<B: AttentionBackend> {
    /// Without gradient checkpointing: `x̂` and `r` from the forward pass.
    Normalised(FloatTensor<B>, FloatTensor<B>),
    /// With it: the input's checkpoint and ε, to recompute them.
    Input(NodeId, f64),
}

/// What the node keeps, and γ.
type LayerNormState<B> = (LayerNormSaved<B>, FloatTensor<B>);

impl LayerNormBackward {
    fn run<B: AttentionBackend, const N: usize>(
        ops: Ops<LayerNormState<B>, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let dy = grads.consume::<B>(&ops.node);
        let (saved, gamma) = ops.state;
        let (normalised, r) = match saved {
            LayerNormSaved::Normalised(normalised, r) => (normalised, r),
            LayerNormSaved::Input(x_state, eps) => {
                let x: FloatTensor<B> = checkpointer.retrieve_node_output(x_state);
                // The forward's own op, so `x̂` and `r` are bit for bit the
                // kept ones (its `y`, unused here, is the price).
                let (_, normalised, r) = B::layer_norm_with_stats(x, gamma.clone(), None, eps);
                (normalised, r)
            }
        };
        let (dx, dgamma, dbeta) = B::layer_norm_backward(normalised, r, gamma, dy);
        let parents = &ops.parents;
        if let Some(node) = &parents[0] {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = &parents[1] {
            grads.register::<B>(node.id, dgamma);
        }
        if let Some(Some(node)) = parents.get(2) {
            grads.register::<B>(node.id, dbeta);
        }
    }
}

/// The tracked LayerNorm forward: the output and what the node keeps. The
/// output is computed the same way with and without checkpointing, and the
/// recomputed `x̂`, `r` equal the kept ones, so both train the same model.
fn layer_norm_tracked<B: AttentionBackend>(
    x: FloatTensor<B>,
    x_state: impl FnOnce() -> NodeId,
    gamma: FloatTensor<B>,
    beta: Option<FloatTensor<B>>,
    eps: f64,
    checkpointed: bool,
) -> (FloatTensor<B>, LayerNormState<B>) {
    let (y, normalised, r) = B::layer_norm_with_stats(x, gamma.clone(), beta, eps);
    let saved = if checkpointed {
        LayerNormSaved::Input(x_state(), eps)
    } else {
        LayerNormSaved::Normalised(normalised, r)
    };
    (y, (saved, gamma))
}

impl<B: AttentionBackend> Backward<B, 3> for LayerNormBackward {
    type State = LayerNormState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        Self::run::<B, 3>(ops, grads, checkpointer);
    }
}

impl<B: AttentionBackend> Backward<B, 2> for LayerNormBackward {
    type State = LayerNormState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        Self::run::<B, 2>(ops, grads, checkpointer);
    }
}

impl<B: AttentionBackend, C: CheckpointStrategy> AttentionBackend for Autodiff<B, C> {
    fn has_fused_attention() -> bool {
        B::has_fused_attention()
    }

    fn fuses_elementwise() -> bool {
        B::fuses_elementwise()
    }

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

    fn gelu_exact_dropout(x: FloatTensor<Self>, dropout: AttentionDropout) -> FloatTensor<Self> {
        match GeluExactDropoutBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = prep.checkpoint(&x);
                prep.finish(
                    (state, dropout),
                    B::gelu_exact_dropout(x.primitive, dropout),
                )
            }
            OpsKind::UnTracked(prep) => prep.finish(B::gelu_exact_dropout(x.primitive, dropout)),
        }
    }

    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        B::memory_reserved(device)
    }

    fn memory_in_use(device: &Self::Device) -> Option<u64> {
        B::memory_in_use(device)
    }

    fn has_seeded_dropout() -> bool {
        B::has_seeded_dropout()
    }

    fn unpack_rows(
        packed: FloatTensor<Self>,
        fill: FloatTensor<Self>,
        slots: &RowSlots,
    ) -> FloatTensor<Self> {
        match UnpackRowsBackward
            .prepare::<C>([packed.node.clone(), fill.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                slots.clone(),
                B::unpack_rows(packed.primitive, fill.primitive, slots),
            ),
            OpsKind::UnTracked(prep) => {
                prep.finish(B::unpack_rows(packed.primitive, fill.primitive, slots))
            }
        }
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
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        // Nothing is kept: the backward draws the mask again.
        let prepared = SeededDropoutAddBackward
            .prepare::<C>([residual.node.clone(), x.node.clone()])
            .compute_bound()
            .stateful();
        let out = B::seeded_dropout_add(residual.primitive, x.primitive, dropout);
        match prepared {
            OpsKind::Tracked(prep) => prep.finish(dropout, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn dense(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        DenseBackward::track::<B, C>(x, weight, bias, None, B::dense)
    }

    fn gelu_dropout_dense(
        h: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        DenseBackward::track::<B, C>(h, weight, bias, Some(dropout), |h, w, b| {
            B::gelu_dropout_dense(h, w, b, dropout)
        })
    }

    fn lean_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        eps: f64,
    ) -> FloatTensor<Self> {
        let checkpointed =
            core::any::TypeId::of::<C>() != core::any::TypeId::of::<NoCheckpointing>();
        match beta {
            Some(beta) => match LayerNormBackward
                .prepare::<C>([x.node.clone(), gamma.node.clone(), beta.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let (y, state) = layer_norm_tracked::<B>(
                        x.primitive.clone(),
                        || prep.checkpoint(&x),
                        gamma.primitive,
                        Some(beta.primitive),
                        eps,
                        checkpointed,
                    );
                    prep.finish(state, y)
                }
                OpsKind::UnTracked(prep) => prep.finish(B::lean_layer_norm(
                    x.primitive,
                    gamma.primitive,
                    Some(beta.primitive),
                    eps,
                )),
            },
            None => match LayerNormBackward
                .prepare::<C>([x.node.clone(), gamma.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let (y, state) = layer_norm_tracked::<B>(
                        x.primitive.clone(),
                        || prep.checkpoint(&x),
                        gamma.primitive,
                        None,
                        eps,
                        checkpointed,
                    );
                    prep.finish(state, y)
                }
                OpsKind::UnTracked(prep) => {
                    prep.finish(B::lean_layer_norm(x.primitive, gamma.primitive, None, eps))
                }
            },
        }
    }

    fn fused_packed_attention(
        qkv: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        heads: usize,
        scale: f64,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        match PackedAttentionBackward
            .prepare::<C>([qkv.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let qkv_state = prep.checkpoint(&qkv);
                let (out, lse) = B::packed_attention_forward(
                    qkv.primitive,
                    key_padding_mask.clone(),
                    heads,
                    scale,
                    dropout,
                );
                let state = (
                    qkv_state,
                    key_padding_mask,
                    out.clone(),
                    lse,
                    heads,
                    scale,
                    dropout,
                );
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_packed_attention(
                qkv.primitive,
                key_padding_mask,
                heads,
                scale,
                dropout,
            )),
        }
    }

    fn fused_masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        scale: f64,
        dropout: AttentionDropout,
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
            )),
        }
    }
}
