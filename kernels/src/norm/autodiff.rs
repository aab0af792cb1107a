//! [`LayerNormOps`] under `Autodiff<B>`: one node with the closed-form
//! backward, which adds the gradient its input has from a residual path
//! (see `mod.rs`).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{CheckpointStrategy, NoCheckpointing};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};

use crate::autodiff::backward_for_parent_counts;
use crate::{as_rows, AttentionBackend, LayerNormOps};

impl<B: AttentionBackend, C: CheckpointStrategy> LayerNormOps for Autodiff<B, C> {
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
}

/// LayerNorm's closed-form backward (`norm/mod.rs`). `N` is 3 with a shift, 2
/// without.
#[derive(Debug)]
struct LayerNormBackward;

/// What the LayerNorm node keeps for its backward (`norm/mod.rs` says why).
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
