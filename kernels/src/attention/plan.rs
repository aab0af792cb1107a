//! Which attention kernels run a call, and how they split its work: the one
//! place that decides.
//!
//! [`AttentionPlan::new`] takes what the device can do ([`DeviceInfo`]), the
//! call's shape and type ([`AttentionShape`]) and what the caller allows
//! ([`KernelChoice`]; the default allows everything) and returns the forward
//! and backward kernels with their launch sizes. The launches in
//! `launch.rs` only carry a plan out. Plans are plain values: tests build them
//! for devices they do not have (the table in the module doc of
//! [`crate::attention`] is asserted by `plan_table` below), and the parity
//! tests pass a [`KernelChoice`] to run each fallback on the device they have.
//! The first plan of each shape is logged at debug level (`RUST_LOG=aam_kernels=debug`).
//!
//! The sizes come from measurements on an H100 and H200
//! (`docs/performance.md`); each is explained where it is chosen.

use burn::tensor::DType;

use super::KernelChoice;

use super::mma::{mma_key_rows, mma_shared_bytes, BLOCK_KEYS, CHUNK_TILES};
use super::mma_backward::mma_backward_shared_bytes;
use super::tensor_core::{shared_bytes, TC_TILE};
use super::tiled::{padded_key_quads, tiled_shared_bytes};

/// The largest head dimension the kernels take (registers per unit).
pub const MAX_HEAD_DIM: usize = 128;

/// The CubeCL runtime a device runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Runtime {
    Cuda,
    Hip,
    /// wgpu (Vulkan, Metal, DirectX; Mesa's lavapipe on the CPU in CI).
    Wgpu,
}

/// What the plan needs to know of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceInfo {
    pub runtime: Runtime,
    /// Plane (warp, subgroup) operations are available. CubeCL turns them off
    /// on CPU adapters (lavapipe); the plan then also leaves loops rolled,
    /// since CPU Vulkan drivers take minutes to compile the unrolled kernels.
    pub plane_ops: bool,
    /// The plane size where it is fixed (`plane_size_min == plane_size_max`).
    pub plane_size: Option<u32>,
    /// `mma.sync` products `m16n8k8` of TF32 into f32 (CUDA, sm_80 on).
    pub mma_tf32: bool,
    /// `mma.sync` products `m16n8k16` of f16 into f32.
    pub mma_f16: bool,
    /// `mma.sync` products `m16n8k16` of bf16 into f32.
    pub mma_bf16: bool,
    /// `cmma` 16×16×16 products of f16 into f32.
    pub cmma_f16: bool,
    /// `cmma` 16×16×16 products of bf16 into f32.
    pub cmma_bf16: bool,
}

impl DeviceInfo {
    /// What the runtime of `client` reports.
    pub fn of<R: cubecl::Runtime>(client: &cubecl::client::ComputeClient<R>) -> Self {
        use cubecl::ir::{ElemType, FloatKind, StorageType};
        let name = R::name(client);
        let runtime = match name {
            "cuda" => Runtime::Cuda,
            "hip" => Runtime::Hip,
            _ => Runtime::Wgpu,
        };
        let hardware = &client.properties().hardware;
        let features = client.features();
        let float = |kind| StorageType::Scalar(ElemType::Float(kind));
        let products = |operand: StorageType, [m, n, k]: [u32; 3]| cubecl::features::MmaConfig {
            a_type: operand,
            b_type: operand,
            cd_type: float(FloatKind::F32),
            m,
            n,
            k,
        };
        let mma = |kind, k| {
            features
                .matmul
                .mma
                .contains(&products(float(kind), [16, 8, k]))
        };
        let cmma = |kind| {
            features
                .matmul
                .cmma
                .contains(&products(float(kind), [16; 3]))
        };
        DeviceInfo {
            runtime,
            plane_ops: features.plane.contains(cubecl::features::Plane::Ops),
            plane_size: (hardware.plane_size_min == hardware.plane_size_max)
                .then_some(hardware.plane_size_max),
            mma_tf32: mma(FloatKind::TF32, 8),
            mma_f16: mma(FloatKind::F16, 16),
            mma_bf16: mma(FloatKind::BF16, 16),
            cmma_f16: cmma(FloatKind::F16),
            cmma_bf16: cmma(FloatKind::BF16),
        }
    }

    /// CUDA or HIP: a cube's units fill its planes in order (so adjacent
    /// units share a plane), and a cube may have 32 KiB of shared memory for
    /// the row kernels' tiles (48 KiB for the merged backward).
    fn native(&self) -> bool {
        matches!(self.runtime, Runtime::Cuda | Runtime::Hip)
    }

    fn mma_for(&self, dtype: DType) -> bool {
        self.runtime == Runtime::Cuda
            && match dtype {
                DType::F32 => self.mma_tf32,
                DType::F16 => self.mma_f16,
                DType::BF16 => self.mma_bf16,
                _ => false,
            }
    }

    fn cmma_for(&self, dtype: DType) -> bool {
        match dtype {
            DType::F16 => self.cmma_f16,
            DType::BF16 => self.cmma_bf16,
            _ => false,
        }
    }
}

/// One attention call as the plan sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionShape {
    /// Sequences × heads.
    pub batch_heads: usize,
    pub queries: usize,
    pub keys: usize,
    pub head_dim: usize,
    pub dtype: DType,
    /// Every row of every operand can be read by pairs of elements (even
    /// offsets and strides): the `mma` kernels need it.
    pub paired: bool,
}

/// The kernels of a call, forward and backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionPlan {
    pub forward: Forward,
    pub backward: Backward,
}

/// The forward kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Forward {
    /// `mma.sync` (`mma.rs`): f32 as split TF32, f16/bf16 as they are.
    Mma(MmaForward),
    /// `cmma` tiles (`tensor_core.rs`), f16/bf16.
    TensorCore(TensorCorePlan),
    /// CUDA cores, a row a unit or a few (`rows.rs`).
    Rows(RowsForward),
}

/// The backward kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backward {
    /// `mma.sync`, f16/bf16: dQ, then dK/dV (`mma_backward.rs`).
    Mma(MmaBackward),
    /// `cmma` tiles, f16/bf16: dQ, then dK/dV, each with its own plan.
    TensorCore {
        queries: TensorCorePlan,
        keys: TensorCorePlan,
    },
    /// One cube an (n, h) as register-tiled products (`tiled.rs`).
    Tiled(Tiled),
    /// One cube an (n, h), a key a unit, dQ from the same `dS` (`rows.rs`).
    Merged(MergedBackward),
    /// dQ, then dK/dV, a row a unit or a few (`rows.rs`).
    Rows(RowsBackward),
}

impl Forward {
    /// The kernel's name, for logs and tests.
    pub fn name(&self) -> &'static str {
        match self {
            Forward::Mma(plan) if plan.half => "mma f16/bf16",
            Forward::Mma(_) => "mma split-tf32",
            Forward::TensorCore(_) => "cmma",
            Forward::Rows(_) => "rows",
        }
    }
}

impl Backward {
    /// The kernels' name, for logs and tests.
    pub fn name(&self) -> &'static str {
        match self {
            Backward::Mma(_) => "mma f16/bf16",
            Backward::TensorCore { .. } => "cmma",
            Backward::Tiled(_) => "tiled",
            Backward::Merged(_) => "merged",
            Backward::Rows(_) => "rows",
        }
    }
}

impl AttentionPlan {
    /// The plan for `shape` on `device` within `choice`, logged at debug
    /// level the first time this process makes it.
    pub fn new(device: &DeviceInfo, shape: &AttentionShape, choice: KernelChoice) -> Self {
        assert!(
            shape.head_dim <= MAX_HEAD_DIM,
            "fused attention: head dim {} > {MAX_HEAD_DIM}",
            shape.head_dim
        );
        assert!(
            choice
                .lanes
                .is_none_or(|lanes| matches!(lanes, 1 | 2 | 4 | 8))
                && choice.parts.is_none_or(|parts| matches!(parts, 1 | 2)),
            "KernelChoice: lanes 1, 2, 4 or 8 and parts 1 or 2, not {choice:?}"
        );
        let plan = AttentionPlan {
            forward: forward(device, shape, choice),
            backward: backward(device, shape, choice),
        };
        log_once(device, shape, &plan);
        plan
    }
}

/// Logs `plan` at debug level the first time this process makes it for this
/// device and these lengths (the batch's size, which varies at the ASV level,
/// left out).
fn log_once(device: &DeviceInfo, shape: &AttentionShape, plan: &AttentionPlan) {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    type Key = (DeviceInfo, usize, usize, usize, DType, AttentionPlan);
    static SEEN: OnceLock<Mutex<HashSet<Key>>> = OnceLock::new();
    let key = (
        *device,
        shape.queries,
        shape.keys,
        shape.head_dim,
        shape.dtype,
        *plan,
    );
    let seen = SEEN.get_or_init(Default::default);
    if seen.lock().is_ok_and(|mut seen| seen.insert(key)) {
        tracing::debug!(
            "attention plan on {:?}: {} queries, {} keys, head dim {}, {:?}: forward {}, backward {} ({plan:?})",
            device.runtime,
            shape.queries,
            shape.keys,
            shape.head_dim,
            shape.dtype,
            plan.forward.name(),
            plan.backward.name(),
        );
    }
}

fn forward(device: &DeviceInfo, shape: &AttentionShape, choice: KernelChoice) -> Forward {
    if !choice.cuda_cores {
        if let Some(mma) = MmaForward::new(device, shape) {
            return Forward::Mma(mma);
        }
        if let Some(tc) = TensorCorePlan::new(device, shape, shape.queries, Pass::Forward) {
            return Forward::TensorCore(tc);
        }
    }
    Forward::Rows(RowLayout::new(device, shape.head_dim, choice).forward(shape))
}

fn backward(device: &DeviceInfo, shape: &AttentionShape, choice: KernelChoice) -> Backward {
    if !choice.cuda_cores {
        if let Some(mma) = MmaBackward::new(device, shape) {
            return Backward::Mma(mma);
        }
        let plans = (
            TensorCorePlan::new(device, shape, shape.queries, Pass::Backward),
            TensorCorePlan::new(device, shape, shape.keys, Pass::Backward),
        );
        if let (Some(queries), Some(keys)) = plans {
            return Backward::TensorCore { queries, keys };
        }
    }
    let layout = RowLayout::new(device, shape.head_dim, choice);
    if !choice.separate_backward {
        if let Some(tiled) = Tiled::new(device, shape) {
            return Backward::Tiled(tiled);
        }
        if let Some(merged) = layout.merged_backward(shape) {
            return Backward::Merged(merged);
        }
    }
    Backward::Rows(layout.backward(shape))
}

/// Units (rows × lanes) a call should have: a call with fewer rows splits
/// each row over up to 8 lanes until it has this many, and a call of at
/// most this many rows over at least 2. On the H100 the sample level
/// at 1,024 slots (8 × 4 heads × 1024 rows = 2^15) ran its forward in 0.143
/// ms with one lane per row in cubes of 256, in 0.159 ms over 8 lanes, and
/// in 0.117-0.126 ms over 2 (forward+backward 0.547 → 0.533-0.539 ms;
/// 2026-11-27). The ASV level (~10^6 rows) never splits.
const UNITS_TO_FILL: usize = 1 << 15;

/// Key sequences at least this long are taken for mostly padding (see
/// `RowLayout::key_lanes`).
const LONG_KEYS: usize = 512;

/// How the row kernels split one call's work: shared-memory tiles, and the
/// lanes (units) that share a row (see `rows.rs`).
#[derive(Clone, Copy, Debug)]
struct RowLayout {
    /// Keys (or queries) per shared-memory tile.
    tile: usize,
    /// Quads (four floats) between two rows of a tile.
    stride: usize,
    /// Lanes per row when fixed; `None`: by the call's rows.
    lanes: Option<usize>,
    /// Units per row's head dims.
    parts: usize,
    native: bool,
    head_dim: usize,
    unroll: bool,
}

impl RowLayout {
    /// Rows are split over lanes by default only on CUDA and HIP: there a
    /// cube's units fill its planes in order, so a group of adjacent units is
    /// in one plane. wgpu promises no such order for its subgroups (nor
    /// subgroups at all: CubeCL turns them off on CPU adapters); it runs one
    /// unit per row unless a [`KernelChoice`] asks for lanes (tests).
    /// Shared memory per cube for the two tiles: 16 KiB on wgpu (the WebGPU
    /// default limit, so the kernels run on every adapter), 32 KiB on CUDA
    /// and HIP. Where rows may split, they are padded by one quad against
    /// bank conflicts.
    fn new(device: &DeviceInfo, head_dim: usize, choice: KernelChoice) -> Self {
        let native = device.native();
        let lanes = match choice.lanes {
            None if !native => Some(1),
            lanes => lanes,
        };
        let split = lanes != Some(1);
        let bytes = if native { 32 * 1024 } else { 16 * 1024 };
        let quads = head_dim.div_ceil(4).max(1);
        let stride = if split { quads + 1 } else { quads };
        // At most 32 rows a tile, 16 for heads wider than 64: a unit keeps
        // its share of a tile's scores in registers beside its row and
        // accumulator.
        let most = if head_dim > 64 { 16 } else { 32 };
        let fit = (bytes / (2 * 16 * stride)).clamp(1, most);
        // The largest power of two that fits, so that lanes divide it.
        let tile = 1 << fit.ilog2();
        RowLayout {
            tile,
            stride,
            lanes,
            parts: choice.parts.unwrap_or(if native { 2 } else { 1 }),
            native,
            head_dim,
            unroll: device.plane_ops || device.runtime != Runtime::Wgpu,
        }
    }

    /// Lanes per row for `rows` rows: the fixed setting, or the fewest (a
    /// power of two up to 8) that give [`UNITS_TO_FILL`] units, and at least
    /// two for up to that many rows. Never more than the tile's rows.
    fn lanes(&self, rows: usize) -> usize {
        let lanes = self.lanes.unwrap_or_else(|| {
            let mut lanes = 1;
            while lanes < 8 && rows * lanes < UNITS_TO_FILL {
                lanes *= 2;
            }
            if rows <= UNITS_TO_FILL {
                lanes = lanes.max(2);
            }
            lanes
        });
        lanes.min(self.tile)
    }

    /// Lanes per key in the dK/dV kernel. Long key sequences are AAM's
    /// sample level, whose 1,024 slots are mostly padding (samples hold
    /// ~50-700 ASVs): a cube of padding keys exits at once, so the units
    /// that work are the few valid keys', each looping over all queries.
    /// There each key splits over 8 lanes (H100, real-sized batch: dK/dV
    /// 237 → 104 µs a sample-level layer, step 33.9 → 32.1 ms; the ASV
    /// level's 151 keys keep the rows' setting).
    fn key_lanes(&self, rows: usize, keys: usize) -> usize {
        match self.lanes {
            None if keys >= LONG_KEYS => 8.min(self.tile),
            _ => self.lanes(rows),
        }
    }

    /// Units that split each row's head dimensions. With whole rows the dQ
    /// and dK/dV kernels need 180 and 240 registers a unit, so an H100 SM
    /// held one cube of 160 units (Nsight Compute: 7.8% occupancy, 4.0 and
    /// 4.8 ms at the ASV level); split, 105 and 128, and the ASV
    /// forward+backward fell from 11.1 to 8.1 ms. The forward gains too
    /// (1.66 → 1.48 ms). Only with one lane per row (the shuffles pair
    /// adjacent units, as lanes do) and when each part is whole quads.
    fn parts(&self, lanes: usize) -> usize {
        if lanes == 1 && self.head_dim.is_multiple_of(4 * self.parts) {
            self.parts
        } else {
            1
        }
    }

    /// Units per cube for rows of length `len` (the rows of one (n, h)),
    /// each row taking `lanes` × `parts` units. Split into lanes: 128 units
    /// (64 for heads wider than 64, whose rows use more registers). One lane
    /// per row: the rows' units are spread evenly over as few cubes of at
    /// most 256 units (128) as hold them, rounded up to whole planes, so
    /// that the ASV level's 151 rows take one cube of 160 units, or two
    /// with `parts = 2` (not three of 64, a fifth of them idle, each loading
    /// every key).
    fn units(&self, lanes: usize, parts: usize, len: usize) -> usize {
        let wide = self.head_dim > 64;
        if lanes > 1 {
            return if wide { 64 } else { 128 };
        }
        let most = if wide { 128 } else { 256 };
        let len = len * parts;
        let cubes = len.div_ceil(most).max(1);
        len.div_ceil(cubes).next_multiple_of(32).min(most)
    }

    /// The side of `rows` rows a call (queries, or keys for dK/dV).
    fn rows(&self, lanes: usize, len: usize) -> RowSplit {
        let parts = self.parts(lanes);
        let units = self.units(lanes, parts, len);
        RowSplit {
            lanes,
            parts,
            units,
            cubes: len.div_ceil(units / (lanes * parts)),
        }
    }

    /// The forward. Keys per tile: at most 16 when rows have one lane each
    /// (the ASV level on the H100: 1.67 ms, against 1.82 with 32; a unit
    /// holds a tile's scores in registers), else the layout's tile.
    fn forward(&self, shape: &AttentionShape) -> RowsForward {
        let lanes = self.lanes(shape.batch_heads * shape.queries);
        let tile = if lanes == 1 {
            self.tile.min(16)
        } else {
            self.tile
        };
        RowsForward {
            rows: self.rows(lanes, shape.queries),
            tile,
            stride: self.stride,
            unroll: self.unroll,
        }
    }

    /// The dQ and dK/dV kernels (the backward keeps the full tile: no
    /// scores held; equal times).
    fn backward(&self, shape: &AttentionShape) -> RowsBackward {
        let lanes_k = self.key_lanes(shape.batch_heads * shape.keys, shape.keys);
        let lanes_q = self.lanes(shape.batch_heads * shape.queries);
        RowsBackward {
            queries: self.rows(lanes_q, shape.queries),
            keys: self.rows(lanes_k, shape.keys),
            tile: self.tile,
            stride: self.stride,
            unroll: self.unroll,
        }
    }

    /// The merged backward for `tk` keys, where one cube can hold them all,
    /// a lane each (with the key side's parts). Its shared memory (the query
    /// tile's rows and their shares of Δ, every key and a tile of dS) must
    /// fit the 48 KiB a CUDA cube may have statically (16 KiB on wgpu); the
    /// query tile halves until it does. The tile's dQ sums split the keys in
    /// up to 4 shares where the units and the dS tile's memory (which then
    /// holds the shares' sums) allow (`dq_from_ds_tile`). On the H100 the
    /// ASV level's 151 keys take 320 units (two parts a key), a tile of 32
    /// and 4 shares.
    fn merged_backward(&self, shape: &AttentionShape) -> Option<MergedBackward> {
        let tk = shape.keys;
        let lanes = self.key_lanes(shape.batch_heads * tk, tk);
        if lanes != 1 {
            return None;
        }
        let parts = self.parts(lanes);
        let (most_units, bytes) = if self.native {
            (384, 48 * 1024)
        } else {
            (256, 16 * 1024)
        };
        let units = (tk * parts).next_multiple_of(32);
        if units > most_units {
            return None;
        }
        let quads = self.head_dim.div_ceil(4);
        let shared = |tile: usize| {
            2 * tile * self.stride * 16
                + 2 * tile * 4
                + tile * quads * 4
                + tk * quads * 16
                + tk * tile * 4
        };
        let mut tile = self.tile.min(units);
        while tile > 4 && shared(tile) > bytes {
            tile /= 2;
        }
        if tile < 4 || shared(tile) > bytes {
            return None;
        }
        let items = tile / 4 * quads;
        let key_splits = [4, 2]
            .into_iter()
            .find(|&s| s * items <= units && s * quads * 4 <= tk)
            .unwrap_or(1);
        Some(MergedBackward {
            units,
            tile,
            key_splits,
            loads: (tile * quads).div_ceil(units),
            parts,
            validity_tile: self.tile,
            stride: self.stride,
            unroll: self.unroll,
        })
    }
}

/// One side's rows in the row kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowSplit {
    /// Adjacent units of a plane that share a row, merged by shuffles.
    pub lanes: usize,
    /// Units that split a row's head dimensions.
    pub parts: usize,
    /// Units a cube.
    pub units: usize,
    /// Cubes an (n, h).
    pub cubes: usize,
}

/// The row-kernel forward (`attention_forward` in `rows.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowsForward {
    pub rows: RowSplit,
    /// Keys a shared-memory tile (also the validity's tile).
    pub tile: usize,
    /// Quads between two rows of a tile.
    pub stride: usize,
    /// Unrolled loops over head dims and a tile's keys.
    pub unroll: bool,
}

/// The dQ and dK/dV row kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowsBackward {
    pub queries: RowSplit,
    pub keys: RowSplit,
    /// Rows a shared-memory tile (also the validity's tile).
    pub tile: usize,
    pub stride: usize,
    pub unroll: bool,
}

/// The merged backward (`attention_backward_merged` in `rows.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MergedBackward {
    /// Units in the one cube of an (n, h): its keys × parts, in whole planes.
    pub units: usize,
    /// Query rows a tile.
    pub tile: usize,
    /// Shares of the keys that a tile's dQ sums split into.
    pub key_splits: usize,
    /// Quads of a query tile's rows each unit loads.
    pub loads: usize,
    /// Units that split a key's head dims.
    pub parts: usize,
    /// Keys a tile of the validity counts.
    pub validity_tile: usize,
    pub stride: usize,
    pub unroll: bool,
}

/// Shared memory the tiled backward and the `mma` kernels may use a cube:
/// two cubes (and the 1 KiB each the driver reserves) fit an H100 SM's 228
/// KiB; the ASV level's 151 keys at head dim 32 take 112,512 bytes in the
/// tiled backward with query tiles of 32.
const TILED_SHARED_BYTES: usize = 112 * 1024;

/// The register-tiled backward (`attention_backward_tiled`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tiled {
    /// Units in the one cube of an (n, h): one a (key quad, dimension
    /// quad) block, whole planes since key quads are padded to eights.
    pub units: usize,
    /// Query rows a tile.
    pub tile: usize,
}

impl Tiled {
    /// On CUDA, for head dims 16, 32 and 64, where a cube has a unit for
    /// each (key quad, dimension quad) block of dK and dV (at most 1,024)
    /// and the shared memory for a query tile of 32 rows, or 16, fits
    /// [`TILED_SHARED_BYTES`]. The ASV level (151 keys, head dim 32): 320
    /// units, tiles of 32. (Its f32 backward on the H100: the merged
    /// kernel's 276 instructions a (query, key) pair become three small
    /// products; `tiled.rs`.)
    fn new(device: &DeviceInfo, shape: &AttentionShape) -> Option<Self> {
        let (tk, dh) = (shape.keys, shape.head_dim);
        if device.runtime != Runtime::Cuda || !matches!(dh, 16 | 32 | 64) {
            return None;
        }
        let units = padded_key_quads(tk) * dh / 4;
        if units > 1024 {
            return None;
        }
        let tile = [32, 16]
            .into_iter()
            .find(|&tile| tiled_shared_bytes(tk, dh, tile) <= TILED_SHARED_BYTES)?;
        Some(Tiled { units, tile })
    }
}

/// The most planes (of 32 units) a cube of the `mma.sync` kernels has: CUDA's
/// 1,024 units a cube. Where a call has more blocks of 16 queries than
/// planes (over 1,024 queries with keys that fit a cube), planes take
/// several in turn.
const MAX_MMA_PLANES: usize = 32;

/// Whether the `mma.sync` kernels can take the call: CUDA with `mma.sync`
/// for its type (sm_80 on), head dims 16, 32 and 64, paired rows, keys.
fn mma_fits(device: &DeviceInfo, shape: &AttentionShape) -> bool {
    device.mma_for(shape.dtype)
        && shape.paired
        && matches!(shape.head_dim, 16 | 32 | 64)
        && shape.keys > 0
}

/// The `mma.sync` forward (`attention_forward_mma`, over split-TF32
/// operands for f32 or f16/bf16's own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmaForward {
    /// Units in a cube: 32 a plane, each plane 16 queries at a time.
    pub units: usize,
    /// Cubes an (n, h): 1 where a cube holds all keys, else one a group of
    /// `units / 32` blocks of queries.
    pub groups: usize,
    /// The kernel's key count: the call's rounded up (see [`MmaForward::new`]).
    pub keys: usize,
    /// Keys in shared memory at a time (`≥ keys`: all of them, once).
    pub block_keys: usize,
    /// Key tiles (of 8) a step of the online softmax.
    pub chunk_tiles: usize,
    /// f16/bf16 (`m16n8k16` products), not f32 (split TF32).
    pub half: bool,
}

impl MmaForward {
    /// On CUDA with `mma.sync` for the type (sm_80 on), head dims 16, 32
    /// and 64, paired rows. Where a head's keys and values fit
    /// [`TILED_SHARED_BYTES`] (the ASV level's 151 keys: 88 KB in f32, 27
    /// KB in bf16) a cube holds them all; else ([`BLOCK_KEYS`] at a time) it
    /// streams them past sixteen planes of queries (the sample level).
    fn new(device: &DeviceInfo, shape: &AttentionShape) -> Option<Self> {
        let AttentionShape {
            queries: tq,
            keys: tk,
            head_dim,
            dtype,
            ..
        } = *shape;
        let half = matches!(dtype, DType::F16 | DType::BF16);
        if !mma_fits(device, shape) {
            return None;
        }
        let blocks = tq.div_ceil(16).max(1);
        // The kernels compile per key count (their loops are unrolled by
        // it), and the sample level's varies with each batch: counts are
        // rounded up (keys past the call's are masked) so that nearby
        // lengths share a kernel: to 8 up to the ASV level's 151 (152, as
        // its tiles need), to 32 beyond, to whole blocks where streamed.
        let keys = if tk <= 160 {
            tk.next_multiple_of(8)
        } else {
            tk.next_multiple_of(32)
        };
        if mma_shared_bytes(mma_key_rows(keys, half), head_dim, half) <= TILED_SHARED_BYTES {
            // All keys in the cube. f32 (88 KB of split keys and values at
            // the ASV level: two cubes an SM) takes a plane per block of 16
            // queries; f16/bf16 (27 KB) half as many planes, two blocks
            // each, so that more, smaller cubes share an SM and one's
            // loading overlaps another's products (H100, ASV level: 0.513
            // against 0.541 ms; f32 with five planes: 1.65 against 1.09).
            let planes = if half { blocks.div_ceil(2) } else { 16 }.min(MAX_MMA_PLANES);
            return Some(MmaForward {
                units: blocks.min(planes) * 32,
                groups: 1,
                keys,
                block_keys: keys,
                chunk_tiles: CHUNK_TILES,
                half,
            });
        }
        if mma_shared_bytes(BLOCK_KEYS, head_dim, half) > TILED_SHARED_BYTES {
            return None;
        }
        // Keys streamed a block at a time, a plane per block of queries,
        // sixteen planes (256 queries) a cube: at the sample level (1,024
        // queries and keys) on the H100, f32 forward 0.090 ms with 16
        // planes and blocks of 128 keys, 0.100 with 8, 0.129 with 4 and
        // blocks of 64, 0.257 with 2; the CUDA-core kernel 0.125.
        let planes = blocks.min(16);
        Some(MmaForward {
            units: planes * 32,
            groups: blocks.div_ceil(planes),
            keys: tk.next_multiple_of(BLOCK_KEYS),
            block_keys: BLOCK_KEYS,
            chunk_tiles: CHUNK_TILES,
            half,
        })
    }
}

/// The f16/bf16 backward on `mma.sync` (`attention_backward_dq_mma_half`,
/// then `attention_backward_dkdv_mma_half`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmaBackward {
    /// dQ: units in a cube (32 a plane, 16 queries a plane at a time).
    pub dq_units: usize,
    /// dQ: cubes an (n, h) (1 where a cube holds all keys).
    pub dq_groups: usize,
    /// dQ: the kernel's key count (the call's rounded up).
    pub keys: usize,
    /// dQ: keys in shared memory at a time (`≥ keys`: all, once).
    pub block_keys: usize,
    /// dK/dV: units in a cube (32 a plane, 16 keys a plane).
    pub dkdv_units: usize,
    /// dK/dV: cubes an (n, h).
    pub dkdv_groups: usize,
    /// dK/dV: the kernel's query count (the call's rounded up).
    pub queries: usize,
    /// dK/dV: queries in shared memory at a time.
    pub block_queries: usize,
}

impl MmaBackward {
    /// f16 and bf16 on CUDA with `mma.sync` (sm_80 on), head dims 16, 32
    /// and 64, paired rows. Each kernel holds all of the other side's rows
    /// where they fit [`TILED_SHARED_BYTES`] (the ASV level), else streams
    /// them [`BLOCK_KEYS`] at a time (the sample level). Counts are rounded
    /// up as the forward's (so that nearby lengths share compiled kernels).
    fn new(device: &DeviceInfo, shape: &AttentionShape) -> Option<Self> {
        let AttentionShape {
            queries: tq,
            keys: tk,
            head_dim,
            dtype,
            ..
        } = *shape;
        if !matches!(dtype, DType::F16 | DType::BF16) || !mma_fits(device, shape) || tq == 0 {
            return None;
        }
        let rounded = |len: usize| {
            if len <= 160 {
                len.next_multiple_of(16)
            } else {
                len.next_multiple_of(32)
            }
        };
        let fits = |rows: usize, dkdv: bool| {
            mma_backward_shared_bytes(rows, head_dim, dkdv) <= TILED_SHARED_BYTES
        };
        let query_blocks = tq.div_ceil(16);
        let key_blocks = tk.div_ceil(16);
        // dQ as the forward: all keys in the cube, half as many planes as
        // blocks of 16 queries (two each); else keys streamed past
        // sixteen planes, a block of queries each.
        let (dq_planes, dq_groups, keys, block_keys) = if fits(rounded(tk), false) {
            let planes = query_blocks.div_ceil(2).min(MAX_MMA_PLANES);
            (planes, 1, rounded(tk), rounded(tk))
        } else {
            let planes = query_blocks.min(16);
            (
                planes,
                query_blocks.div_ceil(planes),
                tk.next_multiple_of(BLOCK_KEYS),
                BLOCK_KEYS,
            )
        };
        let (queries, block_queries) = if fits(rounded(tq), true) {
            (rounded(tq), rounded(tq))
        } else {
            (tq.next_multiple_of(BLOCK_KEYS), BLOCK_KEYS)
        };
        if !fits(block_keys, false) || !fits(block_queries, true) {
            return None;
        }
        // dK/dV: a plane a block of 16 keys, sixteen a cube where a head's
        // queries are staged once (the ASV level's 10 in one), eight where
        // they stream (the sample level: its cubes with valid keys each walk
        // all 1,024 queries, so more, smaller cubes; H200, bf16
        // forward+backward, median of four: 0.129 ms against 0.149 with 16;
        // splitting a tile's queries over two or four planes, their sums
        // added in shared memory, gained nothing more: `docs/performance.md`).
        let planes = if queries == block_queries { 16 } else { 8 };
        let dkdv_planes = key_blocks.min(planes).min(MAX_MMA_PLANES);
        Some(MmaBackward {
            dq_units: dq_planes * 32,
            dq_groups,
            keys,
            block_keys,
            dkdv_units: dkdv_planes * 32,
            dkdv_groups: key_blocks.div_ceil(dkdv_planes),
            queries,
            block_queries,
        })
    }
}

/// Shared memory a tensor-core cube may use: under the 48 KiB static
/// limit, with room for the compiler's own.
const SHARED_BUDGET: usize = 46 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    Forward,
    Backward,
}

/// How the `cmma` kernels (`attention_forward_tc`, and the backward's
/// `attention_backward_{dq,dkdv}_tc`) run a call: f16 or bf16 storage, a
/// head dim that is a multiple of 16, a runtime with 16×16×16 `cmma` for
/// that type into f32 and one plane size of 32 or 64 (CUDA, HIP; wgpu's
/// WGSL has no cooperative matrices). f32 stays off `cmma`: its TF32 tiles
/// would lose the f32 precision the parity tests hold it to (the `mma`
/// forward splits f32 into TF32 pairs instead). Where `mma.sync` runs
/// (CUDA, sm_80 on) it takes these calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorCorePlan {
    pub head_dim: usize,
    /// Planes per cube, each owning 16 rows (queries, or keys for dK/dV).
    pub planes: usize,
    /// 16-row blocks of the other side (keys, or queries for dK/dV) a cube
    /// loads into shared memory at a time.
    pub blocks: usize,
    pub plane_size: usize,
}

impl TensorCorePlan {
    /// The plan for `rows` rows a launch (query rows, or keys for dK/dV).
    fn new(device: &DeviceInfo, shape: &AttentionShape, rows: usize, pass: Pass) -> Option<Self> {
        let head_dim = shape.head_dim;
        if !device.cmma_for(shape.dtype)
            || head_dim == 0
            || !head_dim.is_multiple_of(TC_TILE)
            || head_dim > MAX_HEAD_DIM
        {
            return None;
        }
        let plane_size = device.plane_size.filter(|size| matches!(size, 32 | 64))? as usize;
        // As many planes as the shared memory holds (a cube's static limit
        // is 48 KiB; see `shared_bytes`), at most 16 (512 units): tiles of
        // 4 blocks of the other side (2 for head dims over 64).
        let blocks = if head_dim <= 64 { 4 } else { 2 };
        let (own_blocks, f32_per_row) = match pass {
            Pass::Forward => (1, 1),
            Pass::Backward => (2, 2),
        };
        let storage_bytes = shape.dtype.size();
        let fits = |planes| {
            shared_bytes(
                head_dim,
                blocks,
                planes,
                own_blocks,
                f32_per_row,
                storage_bytes,
            ) <= SHARED_BUDGET
        };
        let most_planes = (1..=16)
            .take_while(|&planes| fits(planes))
            .last()
            .unwrap_or(1);
        // The row blocks spread evenly over as few cubes as hold them (the
        // ASV level's 10 blocks of 16 rows: one cube of 10 planes forward).
        let row_blocks = rows.div_ceil(TC_TILE).max(1);
        let cubes = row_blocks.div_ceil(most_planes);
        let planes = row_blocks.div_ceil(cubes);
        Some(TensorCorePlan {
            head_dim,
            planes,
            blocks,
            plane_size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An H100/H200 as CUDA reports it.
    const HOPPER: DeviceInfo = DeviceInfo {
        runtime: Runtime::Cuda,
        plane_ops: true,
        plane_size: Some(32),
        mma_tf32: true,
        mma_f16: true,
        mma_bf16: true,
        cmma_f16: true,
        cmma_bf16: true,
    };
    /// A CUDA GPU before Ampere (V100, T4): `cmma` for f16, no `mma.sync`.
    const VOLTA: DeviceInfo = DeviceInfo {
        mma_tf32: false,
        mma_f16: false,
        mma_bf16: false,
        cmma_bf16: false,
        ..HOPPER
    };
    /// An MI300A under HIP: 64-unit wavefronts, `cmma`, no `mma.sync`.
    const MI300: DeviceInfo = DeviceInfo {
        runtime: Runtime::Hip,
        plane_size: Some(64),
        mma_tf32: false,
        mma_f16: false,
        mma_bf16: false,
        ..HOPPER
    };
    /// A wgpu GPU adapter (Vulkan, Metal): subgroups of 32 or 64.
    const WGPU: DeviceInfo = DeviceInfo {
        runtime: Runtime::Wgpu,
        plane_ops: true,
        plane_size: None,
        mma_tf32: false,
        mma_f16: false,
        mma_bf16: false,
        cmma_f16: false,
        cmma_bf16: false,
    };
    /// Mesa's lavapipe (CI): no plane ops.
    const LAVAPIPE: DeviceInfo = DeviceInfo {
        plane_ops: false,
        ..WGPU
    };

    /// The default model's two levels at the reference's batch of 8: the
    /// ASV level (8 samples × ~400 ASVs, 4 heads, 151 tokens, head dim 32)
    /// and the sample level (8 × 4 heads, 1,024 slots).
    fn level(asv: bool, dtype: DType) -> AttentionShape {
        let (batch_heads, len) = if asv {
            (3_200 * 4, 151)
        } else {
            (8 * 4, 1_024)
        };
        AttentionShape {
            batch_heads,
            queries: len,
            keys: len,
            head_dim: 32,
            dtype,
            paired: true,
        }
    }

    fn names(device: &DeviceInfo, shape: &AttentionShape) -> (&'static str, &'static str) {
        let plan = AttentionPlan::new(device, shape, KernelChoice::AUTO);
        (plan.forward.name(), plan.backward.name())
    }

    /// The table in the module doc of `crate::attention`.
    #[test]
    fn plan_table() {
        use DType::{BF16, F16, F32};
        #[rustfmt::skip]
        let table = [
            // (device, dtype, (ASV level), (sample level))
            (HOPPER, F32, ("mma split-tf32", "tiled"), ("mma split-tf32", "rows")),
            (HOPPER, BF16, ("mma f16/bf16", "mma f16/bf16"), ("mma f16/bf16", "mma f16/bf16")),
            (HOPPER, F16, ("mma f16/bf16", "mma f16/bf16"), ("mma f16/bf16", "mma f16/bf16")),
            (VOLTA, F32, ("rows", "tiled"), ("rows", "rows")),
            (VOLTA, F16, ("cmma", "cmma"), ("cmma", "cmma")),
            (VOLTA, BF16, ("rows", "tiled"), ("rows", "rows")),
            (MI300, F32, ("rows", "merged"), ("rows", "rows")),
            (MI300, BF16, ("cmma", "cmma"), ("cmma", "cmma")),
            // 16 KiB of shared memory: 151 keys at head dim 32 do not fit a
            // cube (19 KiB), so no merged backward.
            (WGPU, F32, ("rows", "rows"), ("rows", "rows")),
            (WGPU, BF16, ("rows", "rows"), ("rows", "rows")),
            (LAVAPIPE, F32, ("rows", "rows"), ("rows", "rows")),
        ];
        for (device, dtype, asv, sample) in table {
            assert_eq!(
                names(&device, &level(true, dtype)),
                asv,
                "{device:?} {dtype:?} ASV level"
            );
            assert_eq!(
                names(&device, &level(false, dtype)),
                sample,
                "{device:?} {dtype:?} sample level"
            );
        }
    }

    #[test]
    fn choices_reach_every_fallback() {
        let asv = level(true, DType::F32);
        let cores = KernelChoice {
            cuda_cores: true,
            ..KernelChoice::AUTO
        };
        let plan = AttentionPlan::new(&HOPPER, &asv, cores);
        assert_eq!(
            (plan.forward.name(), plan.backward.name()),
            ("rows", "tiled")
        );
        let separate = KernelChoice {
            separate_backward: true,
            ..cores
        };
        assert_eq!(
            AttentionPlan::new(&HOPPER, &asv, separate).backward.name(),
            "rows"
        );
        let bf16 = AttentionPlan::new(&HOPPER, &level(true, DType::BF16), cores);
        assert_eq!(
            (bf16.forward.name(), bf16.backward.name()),
            ("rows", "tiled")
        );
        // Unpaired rows leave `mma` for the next kernel.
        let unpaired = AttentionShape {
            paired: false,
            ..asv
        };
        assert_eq!(
            AttentionPlan::new(&HOPPER, &unpaired, KernelChoice::AUTO)
                .forward
                .name(),
            "rows"
        );
    }

    #[test]
    fn row_layouts() {
        // ASV level on CUDA: a lane a row, head dims in two parts, keys in
        // tiles of 16 forward; the merged backward's 151 keys × 2 parts.
        let asv = level(true, DType::F32);
        let Forward::Rows(rows) = forward(
            &HOPPER,
            &asv,
            KernelChoice {
                cuda_cores: true,
                ..KernelChoice::AUTO
            },
        ) else {
            panic!("rows forward");
        };
        assert_eq!(
            rows.rows,
            RowSplit {
                lanes: 1,
                parts: 2,
                units: 160,
                cubes: 2
            }
        );
        assert_eq!((rows.tile, rows.stride), (16, 9));
        let merged = RowLayout::new(&MI300, 32, KernelChoice::AUTO)
            .merged_backward(&asv)
            .unwrap();
        assert_eq!((merged.units, merged.tile, merged.key_splits), (320, 32, 4));
        // Sample level on CUDA: 8 × 4 × 1024 = 2^15 rows, two lanes each;
        // dK/dV keys over 8 lanes.
        let sample = level(false, DType::F32);
        let backward = RowLayout::new(&MI300, 32, KernelChoice::AUTO).backward(&sample);
        assert_eq!((backward.queries.lanes, backward.keys.lanes), (2, 8));
        // wgpu: one unit a row, whole rows, rolled loops on lavapipe only.
        let wgpu = RowLayout::new(&WGPU, 32, KernelChoice::AUTO).forward(&asv);
        assert_eq!(
            (wgpu.rows.lanes, wgpu.rows.parts, wgpu.unroll),
            (1, 1, true)
        );
        assert!(
            !RowLayout::new(&LAVAPIPE, 32, KernelChoice::AUTO)
                .forward(&asv)
                .unroll
        );
        // A choice of lanes holds on wgpu too.
        let lanes = KernelChoice {
            lanes: Some(4),
            ..KernelChoice::AUTO
        };
        assert_eq!(
            RowLayout::new(&LAVAPIPE, 32, lanes)
                .forward(&asv)
                .rows
                .lanes,
            4
        );
    }
}
