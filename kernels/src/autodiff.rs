//! What the ops' autodiff nodes share.

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

pub(crate) use backward_for_parent_counts;
