//! [`SlotOps`] under `Autodiff<B>`: one node whose backward gathers.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;

use crate::{AttentionBackend, RowSlots, SlotOps};

impl<B: AttentionBackend, C: CheckpointStrategy> SlotOps for Autodiff<B, C> {
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
}

/// Unpacking rows' backward (`slots/mod.rs`): the packed rows' gradients
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
