//! [`RuntimeOps`] on the CubeCL backends: the memory pool's figures from the
//! compute client, and on CUDA the NCCL sums (`collective.rs`).

#[cfg(feature = "cuda")]
use burn::tensor::ops::FloatTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::RuntimeOps;

impl<R, F, I, BT> RuntimeOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    #[cfg(feature = "cuda")]
    fn has_collectives() -> bool {
        crate::runtime::collective::runtime_has_collectives::<R>()
    }

    #[cfg(feature = "cuda")]
    fn collective_sum(
        tensors: Vec<FloatTensor<Self>>,
        devices: &[Self::Device],
    ) -> Option<Vec<FloatTensor<Self>>> {
        crate::runtime::collective::cube_sum::<R, F, I, BT>(tensors, devices)
    }

    #[cfg(feature = "cuda")]
    fn process_group_id() -> Option<Result<[u8; 128], String>> {
        crate::runtime::collective::runtime_has_collectives::<R>()
            .then(cubecl::cuda::nccl_unique_id)
    }

    #[cfg(feature = "cuda")]
    fn join_process_group(device: &Self::Device, id: [u8; 128], rank: usize, ranks: usize) -> bool {
        crate::runtime::collective::join_process_group::<R>(device, id, rank, ranks)
    }

    #[cfg(feature = "cuda")]
    fn process_group_sum(
        tensors: Vec<FloatTensor<Self>>,
        device: &Self::Device,
    ) -> Option<Vec<FloatTensor<Self>>> {
        crate::runtime::collective::process_group_sum::<CubeBackend<R, F, I, BT>>(tensors, device)
    }

    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        R::client(device)
            .memory_usage()
            .ok()
            .map(|usage| usage.bytes_reserved)
    }

    fn memory_in_use(device: &Self::Device) -> Option<u64> {
        R::client(device)
            .memory_usage()
            .ok()
            .map(|usage| usage.bytes_in_use)
    }
}
