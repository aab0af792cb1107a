//! [`RuntimeOps`] under `Autodiff<B>`: the inner backend's answers.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;

use crate::{AttentionBackend, RuntimeOps};

impl<B: AttentionBackend, C: CheckpointStrategy> RuntimeOps for Autodiff<B, C> {
    fn fuses_elementwise() -> bool {
        B::fuses_elementwise()
    }

    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        B::memory_reserved(device)
    }

    fn memory_in_use(device: &Self::Device) -> Option<u64> {
        B::memory_in_use(device)
    }

    fn has_collectives() -> bool {
        B::has_collectives()
    }

    fn process_group_id() -> Option<Result<[u8; 128], String>> {
        B::process_group_id()
    }

    fn join_process_group(device: &Self::Device, id: [u8; 128], rank: usize, ranks: usize) -> bool {
        B::join_process_group(device, id, rank, ranks)
    }
}
