use std::{collections::HashMap, sync::OnceLock};

use cubecl_core::{
    device::DeviceId,
    ir::ElemType,
    server::{CommunicationId, ReduceOperation},
    stub::Mutex,
};

/// Global state map from [`CommunicationId`] to boxed [`cudarc::nccl::sys::ncclUniqueId`].
static UNIQUE_IDS_MAP: OnceLock<Mutex<HashMap<CommunicationId, cudarc::nccl::sys::ncclUniqueId>>> =
    OnceLock::new();

/// aam-rs patch: communicators whose ranks live in several processes, by the
/// device list that names them in `all_reduce`: the NCCL unique id that every
/// rank received from rank 0, this process's rank, and the number of ranks.
/// Upstream derives the rank from the device's index among the listed
/// devices and makes the unique id in process, so ranks in other processes
/// (other nodes) cannot join.
static PROCESS_GROUPS: OnceLock<Mutex<HashMap<CommunicationId, (cudarc::nccl::sys::ncclUniqueId, i32, i32)>>> =
    OnceLock::new();

/// aam-rs patch: a new NCCL unique id, as bytes to send to the other ranks.
pub fn nccl_unique_id() -> Result<[u8; 128], String> {
    let id = cudarc::nccl::result::get_uniqueid().map_err(|e| format!("{e:?}"))?;
    Ok(id.internal.map(|b| b as u8))
}

/// aam-rs patch: makes the communicator that `device_ids` name (in
/// `all_reduce`) rank `rank` of `ranks`, formed from `unique_id` (made by
/// rank 0 with [`nccl_unique_id`]). Register before the first collective on
/// that list; the first one blocks until every rank has joined.
pub fn register_process_group(device_ids: Vec<DeviceId>, unique_id: [u8; 128], rank: usize, ranks: usize) {
    let id = cudarc::nccl::sys::ncclUniqueId {
        internal: unique_id.map(|b| b as _),
    };
    PROCESS_GROUPS
        .get_or_init(Default::default)
        .lock()
        .unwrap()
        .insert(CommunicationId::from(device_ids), (id, rank as i32, ranks as i32));
}

/// aam-rs patch: the unique id, rank and number of ranks registered for
/// `device_ids`.
pub(crate) fn process_group(
    device_ids: &[DeviceId],
) -> Option<(cudarc::nccl::sys::ncclUniqueId, i32, i32)> {
    PROCESS_GROUPS
        .get()?
        .lock()
        .unwrap()
        .get(&CommunicationId::from(device_ids.to_vec()))
        .copied()
}

pub(crate) fn get_nccl_comm_id(device_ids: Vec<DeviceId>) -> cudarc::nccl::sys::ncclUniqueId {
    let mut unique_ids_map = UNIQUE_IDS_MAP.get_or_init(Default::default).lock().unwrap();
    let comm_id = CommunicationId::from(device_ids);
    match unique_ids_map.get_mut(&comm_id) {
        Some(id) => *id,
        None => {
            let id = cudarc::nccl::result::get_uniqueid().unwrap();
            unique_ids_map.insert(comm_id, id);
            id
        }
    }
}

pub(crate) fn to_nccl_op(op: ReduceOperation) -> cudarc::nccl::sys::ncclRedOp_t {
    match op {
        ReduceOperation::Sum => cudarc::nccl::sys::ncclRedOp_t::ncclSum,
        ReduceOperation::Mean => cudarc::nccl::sys::ncclRedOp_t::ncclAvg,
    }
}

pub(crate) fn get_nccl_dtype_count(
    dtype: ElemType,
    size: u64,
) -> (cudarc::nccl::sys::ncclDataType_t, usize) {
    match dtype {
        ElemType::Float(
            cubecl_core::ir::FloatKind::E2M1
            | cubecl_core::ir::FloatKind::E2M3
            | cubecl_core::ir::FloatKind::E3M2
            | cubecl_core::ir::FloatKind::UE8M0,
        ) => panic!("Minifloat not supported in NCCL"),
        ElemType::Float(cubecl_core::ir::FloatKind::E4M3) => (
            cudarc::nccl::sys::ncclDataType_t::ncclFloat8e4m3,
            size as usize,
        ),
        ElemType::Float(cubecl_core::ir::FloatKind::E5M2) => (
            cudarc::nccl::sys::ncclDataType_t::ncclFloat8e5m2,
            size as usize,
        ),
        ElemType::Float(cubecl_core::ir::FloatKind::F16) => (
            cudarc::nccl::sys::ncclDataType_t::ncclFloat16,
            (size / 2) as usize,
        ),
        ElemType::Float(cubecl_core::ir::FloatKind::BF16) => (
            cudarc::nccl::sys::ncclDataType_t::ncclBfloat16,
            (size / 2) as usize,
        ),
        ElemType::Float(cubecl_core::ir::FloatKind::Flex32) => {
            panic!("NCCL doesn't support Flex32 format.")
        }

        ElemType::Float(cubecl_core::ir::FloatKind::F32) => (
            cudarc::nccl::sys::ncclDataType_t::ncclFloat32,
            (size / 4) as usize,
        ),
        ElemType::Float(cubecl_core::ir::FloatKind::TF32) => {
            panic!("NCCL doesn't support TF32 format.")
        }
        ElemType::Float(cubecl_core::ir::FloatKind::F64) => (
            cudarc::nccl::sys::ncclDataType_t::ncclFloat64,
            (size / 8) as usize,
        ),
        ElemType::Int(int_kind) => match int_kind {
            cubecl_core::ir::IntKind::I8 => {
                (cudarc::nccl::sys::ncclDataType_t::ncclInt8, size as usize)
            }
            cubecl_core::ir::IntKind::I16 => panic!("NCCL doesn't support Int16 format."),
            cubecl_core::ir::IntKind::I32 => (
                cudarc::nccl::sys::ncclDataType_t::ncclInt32,
                (size / 4) as usize,
            ),
            cubecl_core::ir::IntKind::I64 => (
                cudarc::nccl::sys::ncclDataType_t::ncclInt64,
                (size / 8) as usize,
            ),
        },
        ElemType::UInt(uint_kind) => match uint_kind {
            cubecl_core::ir::UIntKind::U8 => {
                (cudarc::nccl::sys::ncclDataType_t::ncclUint8, size as usize)
            }
            cubecl_core::ir::UIntKind::U16 => panic!("NCCL doesn't support UInt16 format."),
            cubecl_core::ir::UIntKind::U32 => (
                cudarc::nccl::sys::ncclDataType_t::ncclUint32,
                (size / 4) as usize,
            ),
            cubecl_core::ir::UIntKind::U64 => (
                cudarc::nccl::sys::ncclDataType_t::ncclUint64,
                (size / 8) as usize,
            ),
        },
        ElemType::Bool => panic!("NCCL doesn't support Bool format."),
    }
}
