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
//!
//! **Process groups.** Replicas in several processes (nodes) sum through one
//! NCCL communicator whose ranks are the run's replicas: rank 0 makes the
//! unique id, the trainer's rendezvous hands it to every process, and each
//! replica registers its rank with CubeCL under a device list of its own
//! (its device and [`PROCESS_GROUP_MARK`]), which every later all-reduce on
//! that list then uses. Registering a rank is the patch in
//! `vendor/cubecl-cuda` (upstream forms communicators within one process).

use burn::tensor::backend::distributed::{DistributedBackend, ReduceOperation};
use std::sync::Mutex;

use burn::tensor::backend::{DeviceId, DeviceOps};
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

/// All-reduces (sum) each tensor over the communicator that `ids` name with
/// backend `B`'s collectives, then makes later compute wait for them (on the
/// device, not the host): with `sync_collective` for an in-process
/// communicator, while a process group's all-reduce has the compute stream
/// wait for it already (the patch in `vendor/cubecl-cuda`).
pub(crate) fn all_reduce_sum<B: DistributedBackend>(
    tensors: Vec<FloatTensor<B>>,
    ids: Vec<DeviceId>,
    sync: bool,
) -> Option<Vec<FloatTensor<B>>> {
    let device = B::float_device(tensors.first()?);
    let sums = tensors
        .into_iter()
        .map(|t| {
            // SAFETY: every sum is resolved before any of them is returned:
            // by the `sync_collective` below, or (a process group) by the
            // compute stream's wait inside the all-reduce.
            unsafe { B::all_reduce(t, ReduceOperation::Sum, ids.clone()).assume_resolved() }
        })
        .collect();
    if sync {
        B::sync_collective(&device);
    }
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
    all_reduce_sum::<CubeBackend<R, F, I, BT>>(tensors, distinct_ids(devices)?, true)
}

/// The type id of the second device in a process group's device list: no
/// runtime has it, so the list names no in-process communicator.
pub(crate) const PROCESS_GROUP_MARK: u16 = u16::MAX;

/// The devices of this process whose replica joined a process group.
static JOINED: Mutex<Vec<DeviceId>> = Mutex::new(Vec::new());

/// The device list that names the process group of `device`'s replica.
fn process_group_ids<D: DeviceOps>(device: &D) -> Vec<DeviceId> {
    vec![device.id(), DeviceId::new(PROCESS_GROUP_MARK, 0)]
}

/// Whether `device`'s replica joined a process group.
pub(crate) fn in_process_group<D: DeviceOps>(device: &D) -> bool {
    JOINED
        .lock()
        .is_ok_and(|joined| joined.contains(&device.id()))
}

/// [`crate::RuntimeOps::join_process_group`] on CubeCL runtime `R`.
pub(crate) fn join_process_group<R: CubeRuntime>(
    device: &R::Device,
    id: [u8; 128],
    rank: usize,
    ranks: usize,
) -> bool {
    if !runtime_has_collectives::<R>() {
        return false;
    }
    cubecl::cuda::register_process_group(process_group_ids(device), id, rank, ranks);
    if let Ok(mut joined) = JOINED.lock() {
        joined.push(device.id());
    }
    true
}

/// [`crate::RuntimeOps::process_group_sum`] with backend `B`'s collectives.
pub(crate) fn process_group_sum<B: DistributedBackend>(
    tensors: Vec<FloatTensor<B>>,
    device: &B::Device,
) -> Option<Vec<FloatTensor<B>>> {
    if !in_process_group(device) {
        return None;
    }
    all_reduce_sum::<B>(tensors, process_group_ids(device), false)
}
