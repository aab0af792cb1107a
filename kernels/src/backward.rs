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
use burn::tensor::{Shape, TensorMetadata};

use crate::{as_rows, AttentionBackend, AttentionDropout, KernelChoice, RowSlots};

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

/// `Backward<B, N>` for each listed parent count `N`, by the node's own
/// `run::<B, N>`: a node with an optional parent (a bias, β) is prepared
/// with as many parents as it has.
macro_rules! backward_for_parent_counts {
    ($node:ty, $state:ident, $($n:literal),+) => {$(
        impl<B: AttentionBackend> Backward<B, $n> for $node {
            type State = $state<B>;

            fn backward(
                self,
                ops: Ops<Self::State, $n>,
                grads: &mut Gradients,
                checkpointer: &mut Checkpointer,
            ) {
                Self::run::<B, $n>(ops, grads, checkpointer);
            }
        }
    )+};
}

backward_for_parent_counts!(PackedAttentionBackward, PackedState, 1, 2);

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
/// summed over the rows in parts. The parents are `[x, weight]`, then the
/// bias where there is one, then `h_bias` where there is one (`N` from 2
/// to 4).
///
/// The state's `activation` is `Some` for
/// [`AttentionBackend::gelu_dropout_dense`]: then the node keeps `h`, not the
/// layer's input, and the backward recomputes the input
/// `gelu_exact_dropout(h, h_bias)` for the weight gradient, takes `dh`
/// through the fused GELU and dropout's backward, and sums it over the rows
/// for `h_bias`'s gradient.
#[derive(Debug)]
struct DenseBackward;

/// What [`DenseBackward`] keeps: the input (or `h`), the weight, whether a
/// bias is a parent, and a fused GELU before the layer.
#[derive(Clone, Debug)]
struct DenseSaved {
    x: NodeId,
    weight: NodeId,
    bias: bool,
    activation: Option<FusedGelu>,
}

/// The GELU and dropout fused before a dense layer, and the bias added to
/// its input `h` first (a parent of the node, last).
#[derive(Clone, Copy, Debug)]
struct FusedGelu {
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
    fn track<B, C, const N: usize>(
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

/// What the LayerNorm node keeps.
#[derive(Debug, Clone)]
struct LayerNormState<B: AttentionBackend> {
    saved: LayerNormSaved<B>,
    gamma: FloatTensor<B>,
    /// A handle on the input's node ([`input_handle`]).
    input: InputHandle<B>,
    /// The input's shape `[..., D]`: the node is the input's own (no reshape
    /// node between, whose gradient Burn would add to the residual's), and
    /// works on its rows.
    shape: Shape,
}

/// An autodiff tensor whose node is an op's input and whose value is a
/// stand-in: the key under which `Gradients` holds that input's gradient
/// (Burn names nodes' gradients only through tensors).
type InputHandle<B> = FloatTensor<Autodiff<B>>;

/// A handle on `x`'s node for its backward, holding `stand_in` (a small
/// tensor the node keeps anyway) instead of `x`'s value.
///
/// Why: in AAM's pre-norm blocks each LayerNorm's input also feeds the
/// residual sum, whose backward runs first (it is deeper in the graph) and
/// registers its gradient for the input. Burn would add LayerNorm's `dx`
/// to it in a pass of its own (on an H100 at the reference's batch, ~0.19
/// ms for each of the ASV level's eight such sums); the node instead takes
/// that gradient out and has the backward kernel add it as it writes `dx`.
fn input_handle<B: AttentionBackend>(
    x: &InputHandle<B>,
    stand_in: &FloatTensor<B>,
) -> InputHandle<B> {
    let mut handle = x.clone();
    handle.primitive = stand_in.clone();
    handle
}

impl LayerNormBackward {
    fn run<B: AttentionBackend, const N: usize>(
        ops: Ops<LayerNormState<B>, N>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let dy = grads.consume::<B>(&ops.node);
        let LayerNormState {
            saved,
            gamma,
            input,
            shape,
        } = ops.state;
        let (normalised, r) = match saved {
            LayerNormSaved::Normalised(normalised, r) => (normalised, r),
            LayerNormSaved::Input(x_state, eps) => {
                let x: FloatTensor<B> = checkpointer.retrieve_node_output(x_state);
                // The forward's own op, so `x̂` and `r` are bit for bit the
                // kept ones (its `y`, unused here, is the price).
                let (_, normalised, r) =
                    B::layer_norm_with_stats(as_rows::<B>(x), gamma.clone(), None, eps);
                (normalised, r)
            }
        };
        // The input's gradient from its other paths so far, if any, added
        // by the kernel (`input_handle`). One of another type (none in the
        // model) is put back for Burn to add.
        let mut dx_add = None;
        if ops.parents[0].is_some() {
            if let Some(add) = grads.remove::<B>(&input) {
                if add.dtype() == dy.dtype() && add.shape() == shape {
                    dx_add = Some(as_rows::<B>(add));
                } else {
                    grads.register::<B>(input.node.id, add);
                }
            }
        }
        let (dx, dgamma, dbeta) =
            B::layer_norm_backward(normalised, r, gamma, as_rows::<B>(dy), dx_add);
        let parents = &ops.parents;
        if let Some(node) = &parents[0] {
            grads.register::<B>(node.id, B::float_reshape(dx, shape));
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
    input: InputHandle<B>,
    gamma: FloatTensor<B>,
    beta: Option<FloatTensor<B>>,
    eps: f64,
    checkpointed: bool,
) -> (FloatTensor<B>, LayerNormState<B>) {
    let shape = x.shape();
    let (y, normalised, r) = B::layer_norm_with_stats(as_rows::<B>(x), gamma.clone(), beta, eps);
    let saved = if checkpointed {
        LayerNormSaved::Input(x_state(), eps)
    } else {
        LayerNormSaved::Normalised(normalised, r)
    };
    let state = LayerNormState {
        saved,
        gamma,
        input,
        shape: shape.clone(),
    };
    (B::float_reshape(y, shape), state)
}

backward_for_parent_counts!(LayerNormBackward, LayerNormState, 2, 3);

/// Attention pooling's closed-form backward (`pool.rs`).
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

    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        B::memory_reserved(device)
    }

    fn memory_in_use(device: &Self::Device) -> Option<u64> {
        B::memory_in_use(device)
    }

    fn has_seeded_dropout() -> bool {
        B::has_seeded_dropout()
    }

    fn has_collectives() -> bool {
        B::has_collectives()
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
                    let input = input_handle(&x, &gamma.primitive);
                    let (y, state) = layer_norm_tracked::<B>(
                        x.primitive.clone(),
                        || prep.checkpoint(&x),
                        input,
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
                    let input = input_handle(&x, &gamma.primitive);
                    let (y, state) = layer_norm_tracked::<B>(
                        x.primitive.clone(),
                        || prep.checkpoint(&x),
                        input,
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
