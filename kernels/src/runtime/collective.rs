//! Sums across devices for data-parallel replicas: NCCL all-reduce on CUDA,
//! through Burn's `DistributedBackend` (CubeCL queues each all-reduce on the
//! device's communication stream, behind the compute stream's work, and
//! `sync_collective` makes later compute wait for it). Under Burn's fusion
//! backend one call is one custom op (`fusion.rs`).
//!
//! Only CUDA's CubeCL server has collectives (`SERVER_COMM_ENABLED`); HIP,
//! wgpu and the CPU backends return `None` and the trainer sums through the
//! host. NCCL has one rank per GPU, so replicas that share a device take the
//! host path too.

use burn::tensor::backend::distributed::{DistributedBackend, ReduceOperation};
use burn::tensor::backend::DeviceOps;
use burn::tensor::ops::FloatTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::server::ServerCommunication;

/// The devices' ids, sorted, where no two are the same device.
pub(crate) fn distinct_ids<D: DeviceOps>(
    devices: &[D],
) -> Option<Vec<burn::tensor::backend::DeviceId>> {
    let mut ids: Vec<_> = devices.iter().map(DeviceOps::id).collect();
    ids.sort();
    let n = ids.len();
    ids.dedup();
    (ids.len() == n).then_some(ids)
}

/// Whether CubeCL runtime `R` has collectives.
pub(crate) fn runtime_has_collectives<R: CubeRuntime>() -> bool {
    <<R as cubecl::Runtime>::Server as ServerCommunication>::SERVER_COMM_ENABLED
}

/// All-reduces (sum) each tensor over `devices` with backend `B`'s
/// collectives, then waits (on the device, not the host) for them.
pub(crate) fn all_reduce_sum<B: DistributedBackend>(
    tensors: Vec<FloatTensor<B>>,
    devices: &[B::Device],
) -> Option<Vec<FloatTensor<B>>> {
    let ids = distinct_ids(devices)?;
    let device = B::float_device(tensors.first()?);
    let sums = tensors
        .into_iter()
        .map(|t| {
            // SAFETY: every sum is resolved by the `sync_collective` below,
            // before any of them is returned.
            unsafe { B::all_reduce(t, ReduceOperation::Sum, ids.clone()).assume_resolved() }
        })
        .collect();
    B::sync_collective(&device);
    Some(sums)
}

/// [`crate::RuntimeOps::collective_sum`] of a CubeCL backend.
pub(crate) fn cube_sum<R, F, I, BT>(
    tensors: Vec<FloatTensor<CubeBackend<R, F, I, BT>>>,
    devices: &[burn::tensor::Device<CubeBackend<R, F, I, BT>>],
) -> Option<Vec<FloatTensor<CubeBackend<R, F, I, BT>>>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    if !runtime_has_collectives::<R>() {
        return None;
    }
    all_reduce_sum::<CubeBackend<R, F, I, BT>>(tensors, devices)
}
