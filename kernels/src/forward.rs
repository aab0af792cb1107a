//! [`AttentionBackend`] for the CubeCL backends (wgpu, CUDA, ROCm/HIP): make
//! the inputs contiguous, turn the mask into per-key and per-tile validity,
//! allocate the outputs and launch. The attention kernels index their
//! operands as `[N, H, T, Dh]` views with any strides: split heads are dense
//! views, and a packed `qkv [N, T, 3D]` or `out [N, T, D]` is viewed in place
//! (`heads_view`), so packed self-attention needs no split or merge copies.

use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::{DType, Shape, Tensor};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{CubeCount, CubeDim};

use crate::kernel::{
    adam_steps_elements, attention_backward_dkdv, attention_backward_dq, attention_backward_merged,
    attention_forward, attention_pool_backward_rows, attention_pool_rows, column_partial_sums,
    dropout_elements, gelu_backward_elements, gelu_elements, gradient_column_partials,
    key_validity, layer_norm_backward_rows, layer_norm_backward_rows_sums, layer_norm_rows,
    sum_partials, SUM_PARTIALS_COLUMNS,
};
use crate::mma::{
    attention_forward_mma, attention_forward_mma_half, mma_key_rows, mma_shared_bytes, BLOCK_KEYS,
    CHUNK_TILES,
};
use crate::mma_backward::{
    attention_backward_dkdv_mma_half, attention_backward_dq_mma_half, mma_backward_shared_bytes,
};
use crate::rows_matmul::rows_matmul_tf32;
use crate::tensor_core::{
    attention_backward_dkdv_tc, attention_backward_dq_tc, attention_forward_tc, shared_bytes,
    TC_TILE,
};
use crate::tiled::{
    attention_backward_tiled, attention_forward_tiled, padded_key_quads, tiled_shared_bytes,
};
use crate::tma_tiling::{TmaTiling, TunedTmaDoubleBuffering};
use crate::{AdamItem, AdamStep, AttentionBackend, AttentionDropout};

/// How the kernels split one call's work: shared-memory tiles, and the
/// lanes (units) that share a row (see `kernel.rs`).
#[derive(Clone, Copy, Debug)]
struct Layout {
    /// Keys (or queries) per shared-memory tile.
    tile: usize,
    /// Quads (four floats) between two rows of a tile.
    stride: usize,
    /// How rows are split across lanes (plane shuffles).
    lanes: LanesSetting,
    /// How the kernels split a row's head dimensions.
    parts: PartsSetting,
    /// CUDA or HIP (plane order follows unit order).
    native: bool,
    /// CUDA (the tiled kernels: their shared memory, see [`Layout::tiled`]).
    cuda: bool,
    head_dim: usize,
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
/// `Layout::key_lanes`).
const LONG_KEYS: usize = 512;

impl Layout {
    /// Rows are split over lanes by default only on CUDA and HIP: there a
    /// cube's units fill its planes in order, so a group of adjacent units is
    /// in one plane. wgpu promises no such order for its subgroups (nor
    /// subgroups at all: CubeCL turns them off on CPU adapters); it runs one
    /// unit per row unless `AAM_KERNEL_LANES` forces lanes (tests).
    /// Shared memory per cube for the two tiles: 16 KiB on wgpu (the WebGPU
    /// default limit, so the kernels run on every adapter), 32 KiB on CUDA
    /// and HIP. With lanes, rows are padded by one quad against bank
    /// conflicts.
    fn new<R: CubeRuntime>(client: &cubecl::client::ComputeClient<R>, head_dim: usize) -> Self {
        let native = matches!(R::name(client), "cuda" | "hip");
        let cuda = R::name(client) == "cuda";
        let lanes = match lanes_setting() {
            LanesSetting::Auto if native => LanesSetting::Auto,
            LanesSetting::Auto => LanesSetting::Fixed(1),
            fixed => fixed,
        };
        let split = lanes != LanesSetting::Fixed(1);
        let bytes = if native { 32 * 1024 } else { 16 * 1024 };
        let quads = head_dim.div_ceil(4).max(1);
        let stride = if split { quads + 1 } else { quads };
        // At most 32 rows a tile, 16 for heads wider than 64: a unit keeps
        // its share of a tile's scores in registers beside its row and
        // accumulator.
        let most = tile_setting().unwrap_or(if head_dim > 64 { 16 } else { 32 });
        let fit = (bytes / (2 * 16 * stride)).clamp(1, most);
        // The largest power of two that fits, so that lanes divide it.
        let tile = 1 << fit.ilog2();
        Layout {
            tile,
            stride,
            lanes,
            parts: parts_setting(),
            native,
            cuda,
            head_dim,
        }
    }

    /// Lanes per row for `rows` rows: the fixed setting, or the fewest (a
    /// power of two up to 8) that give [`UNITS_TO_FILL`] units, and at least
    /// two for up to that many rows. Never more than the tile's rows.
    fn lanes(&self, rows: usize) -> usize {
        let lanes = match self.lanes {
            LanesSetting::Fixed(lanes) => lanes,
            LanesSetting::Auto => {
                let mut lanes = 1;
                while lanes < 8 && rows * lanes < UNITS_TO_FILL {
                    lanes *= 2;
                }
                if rows <= UNITS_TO_FILL {
                    lanes = lanes.max(2);
                }
                lanes
            }
        };
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
            LanesSetting::Auto if keys >= LONG_KEYS => 8.min(self.tile),
            _ => self.lanes(rows),
        }
    }

    /// Keys per tile in the forward: at most 16 when rows have one lane each
    /// (the ASV level on the H100: 1.67 ms, against 1.82 with 32; a unit
    /// holds a tile's scores in registers), else the layout's tile. The
    /// backward keeps the full tile (no scores held; equal times).
    fn forward_tile(&self, lanes: usize) -> usize {
        if lanes == 1 && tile_setting().is_none() {
            self.tile.min(16)
        } else {
            self.tile
        }
    }

    /// Units that split each row's head dimensions (`parts`, see
    /// `attention_backward_dq`). With whole rows the dQ and dK/dV kernels
    /// need 180 and 240 registers a unit, so an H100 SM held one cube of 160
    /// units (Nsight Compute: 7.8% occupancy, 4.0 and 4.8 ms at the ASV
    /// level); split, 105 and 128, and the ASV forward+backward fell from
    /// 11.1 to 8.1 ms. The forward gains too (1.66 → 1.48 ms). Only with one
    /// lane per row (the shuffles pair adjacent units, as lanes do) and when
    /// each part is whole quads.
    fn parts(&self, lanes: usize) -> usize {
        let parts = match self.parts {
            PartsSetting::Auto if self.native => 2,
            PartsSetting::Auto => 1,
            PartsSetting::Fixed(parts) => parts,
        };
        if lanes == 1 && self.head_dim.is_multiple_of(4 * parts) {
            parts
        } else {
            1
        }
    }

    /// The merged backward ([`attention_backward_merged`]) for `tk` keys,
    /// where one cube can hold them all, a lane each (`lanes` and `parts`
    /// are the key side's layout). Its shared memory (the query tile's rows
    /// and their shares of Δ, every key and a tile of dS) must fit the 48
    /// KiB a CUDA cube may have statically (16 KiB on wgpu); the query tile
    /// halves until it does. The tile's dQ sums split the keys in up to 4
    /// shares where the units and the dS tile's memory (which then holds the
    /// shares' sums) allow (`dq_from_ds_tile`). On the H100 the ASV level's
    /// 151 keys take 320 units (two parts a key), a tile of 32 and 4 shares.
    fn merged_backward(&self, lanes: usize, parts: usize, tk: usize) -> Option<MergedBackward> {
        if !merged_backward_setting() || lanes != 1 {
            return None;
        }
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
            units: units as u32,
            tile,
            key_splits,
            loads: (tile * quads).div_ceil(units),
        })
    }

    /// The register-tiled forward and backward ([`attention_forward_tiled`],
    /// [`attention_backward_tiled`]) for `tk` keys: on CUDA, for head dims
    /// 16, 32 and 64, where a cube has a unit for each (key quad, dimension
    /// quad) block of dK and dV (at most 1,024) and the backward's shared
    /// memory for a query tile of 32 rows, or 16, fits [`TILED_SHARED_BYTES`]
    /// (the forward needs less). The ASV level (151 keys, head dim 32): 320
    /// units, tiles of 32.
    fn tiled(&self, tk: usize) -> Option<Tiled> {
        if !self.cuda || !matches!(self.head_dim, 16 | 32 | 64) {
            return None;
        }
        let units = padded_key_quads(tk) * self.head_dim / 4;
        if units > 1024 {
            return None;
        }
        let tile = [32, 16]
            .into_iter()
            .filter(|&tile| tile_setting().is_none_or(|setting| setting == tile))
            .find(|&tile| tiled_shared_bytes(tk, self.head_dim, tile) <= TILED_SHARED_BYTES)?;
        Some(Tiled { units, tile })
    }

    /// Units per cube for rows of length `len` (the rows of one (n, h)),
    /// each row taking `lanes` × `parts` units. Split into lanes: 128 units
    /// (64 for heads wider than 64, whose rows use more registers). One lane
    /// per row: the rows' units are spread evenly over as few cubes of at
    /// most 256 units (128) as hold them, rounded up to whole planes, so
    /// that the ASV level's 151 rows take one cube of 160 units, or two
    /// with `parts = 2` (not three of 64, a fifth of them idle, each loading
    /// every key).
    fn units(&self, lanes: usize, parts: usize, len: usize) -> u32 {
        let wide = self.head_dim > 64;
        if lanes > 1 {
            return if wide { 64 } else { 128 };
        }
        let most = if wide { 128 } else { 256 };
        let len = len * parts;
        let cubes = len.div_ceil(most).max(1);
        (len.div_ceil(cubes).next_multiple_of(32).min(most)) as u32
    }
}

/// Shared memory the tiled backward may use a cube: two cubes (and the
/// 1 KiB each the driver reserves) fit an H100 SM's 228 KiB; the ASV
/// level's 151 keys at head dim 32 take 112,512 bytes with query tiles of 32.
const TILED_SHARED_BYTES: usize = 112 * 1024;

/// How [`attention_forward_tiled`] and [`attention_backward_tiled`] run
/// ([`Layout::tiled`]).
#[derive(Clone, Copy, Debug)]
struct Tiled {
    /// Units in the one cube of an (n, h): one a (key quad, dimension
    /// quad) block, whole planes since key quads are padded to eights.
    units: usize,
    /// Query rows a tile.
    tile: usize,
}

/// Tensor-core products of `operand` into f32 of shape `[m, n, k]` (to ask
/// the runtime whether it has them).
fn into_f32_products(
    operand: cubecl::ir::StorageType,
    [m, n, k]: [u32; 3],
) -> cubecl::features::MmaConfig {
    cubecl::features::MmaConfig {
        a_type: operand,
        b_type: operand,
        cd_type: cubecl::ir::StorageType::Scalar(cubecl::ir::ElemType::Float(
            cubecl::ir::FloatKind::F32,
        )),
        m,
        n,
        k,
    }
}

/// The most planes (of 32 units) a cube of the `mma.sync` kernels has: CUDA's
/// 1,024 units a cube. Where a call has more blocks of 16 queries than
/// planes (over 1,024 queries with keys that fit a cube), planes take
/// several in turn.
const MAX_MMA_PLANES: usize = 32;

/// Whether the runtime has `mma.sync` products `m16n8k{k}` of `operand`
/// into f32 (the manual MMA the `mma.rs` kernels use).
fn has_f32_products<R: CubeRuntime>(
    client: &cubecl::client::ComputeClient<R>,
    operand: cubecl::ir::StorageType,
    k: u32,
) -> bool {
    client
        .features()
        .matmul
        .mma
        .contains(&into_f32_products(operand, [16, 8, k]))
}

/// How [`attention_forward_mma`] (f32) or [`attention_forward_mma_half`]
/// (f16/bf16) runs a call ([`MmaForward::new`]).
#[derive(Clone, Copy, Debug)]
struct MmaForward {
    /// Units in a cube: 32 a plane, each plane 16 queries at a time.
    units: usize,
    /// Cubes an (n, h): 1 where a cube holds all keys, else one a group of
    /// `units / 32` blocks of queries.
    groups: usize,
    /// The kernel's key count: the call's rounded up (see [`MmaForward::new`]).
    keys: usize,
    /// Keys in shared memory at a time (`≥ keys`: all of them, once).
    block_keys: usize,
    /// Key tiles (of 8) a step of the online softmax.
    chunk_tiles: usize,
    /// f16/bf16 (`m16n8k16` products), not f32 (split TF32).
    half: bool,
}

impl MmaForward {
    /// The plan for `tq` queries and `tk` keys of head dim `head_dim`: on
    /// CUDA with `mma.sync` for the type (sm_80 on), head dims 16, 32 and
    /// 64; `AAM_KERNEL_MMA=0` turns it off. Where a head's keys and values
    /// fit [`TILED_SHARED_BYTES`] (the ASV level's 151 keys: 88 KB in f32, 27
    /// KB in bf16) a cube holds them all; else ([`BLOCK_KEYS`] at a time, or
    /// `AAM_KERNEL_MMA_BLOCK`) it streams them past sixteen planes of
    /// queries (the sample level). Planes as below, or `AAM_KERNEL_MMA_PLANES`;
    /// [`CHUNK_TILES`] key tiles a softmax step, or `AAM_KERNEL_MMA_CHUNK`.
    fn new<R: CubeRuntime>(
        client: &cubecl::client::ComputeClient<R>,
        dtype: DType,
        head_dim: usize,
        tq: usize,
        tk: usize,
    ) -> Option<Self> {
        let half = matches!(dtype, DType::F16 | DType::BF16);
        if R::name(client) != "cuda" || !mma_setting().forward || !(half || dtype == DType::F32) {
            return None;
        }
        if !matches!(head_dim, 16 | 32 | 64) || tk == 0 {
            return None;
        }
        let (operand, k) = if half {
            (dtype.into(), 16)
        } else {
            (
                cubecl::ir::StorageType::Scalar(cubecl::ir::ElemType::Float(
                    cubecl::ir::FloatKind::TF32,
                )),
                8,
            )
        };
        if !has_f32_products(client, operand, k) {
            return None;
        }
        let chunk_tiles = env_usize("AAM_KERNEL_MMA_CHUNK").unwrap_or(CHUNK_TILES);
        assert!(
            !half || chunk_tiles.is_multiple_of(2),
            "AAM_KERNEL_MMA_CHUNK must be even for f16/bf16"
        );
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
            let planes = env_usize("AAM_KERNEL_MMA_PLANES")
                .unwrap_or(if half { blocks.div_ceil(2) } else { 16 })
                .min(MAX_MMA_PLANES);
            return Some(MmaForward {
                units: blocks.min(planes) * 32,
                groups: 1,
                keys,
                block_keys: keys,
                chunk_tiles,
                half,
            });
        }
        // Keys streamed a block at a time, a plane per block of queries.
        let block_keys = env_usize("AAM_KERNEL_MMA_BLOCK").unwrap_or(BLOCK_KEYS);
        assert!(
            block_keys.is_multiple_of(16) && block_keys.is_multiple_of(chunk_tiles * 8),
            "AAM_KERNEL_MMA_BLOCK must be a multiple of 16 and of the chunk's keys"
        );
        if mma_shared_bytes(block_keys, head_dim, half) > TILED_SHARED_BYTES {
            return None;
        }
        // Sixteen planes (256 queries) a cube: at the sample level (1,024
        // queries and keys) on the H100, f32 forward 0.090 ms with 16
        // planes and blocks of 128 keys, 0.100 with 8, 0.129 with 4 and
        // blocks of 64, 0.257 with 2; the CUDA-core kernel 0.125.
        let planes = blocks.min(
            env_usize("AAM_KERNEL_MMA_PLANES")
                .unwrap_or(16)
                .min(MAX_MMA_PLANES),
        );
        Some(MmaForward {
            units: planes * 32,
            groups: blocks.div_ceil(planes),
            keys: tk.next_multiple_of(block_keys),
            block_keys,
            chunk_tiles,
            half,
        })
    }
}

/// How the f16/bf16 backward on `mma.sync` runs a call
/// ([`attention_backward_dq_mma_half`], then
/// [`attention_backward_dkdv_mma_half`]; [`MmaBackward::new`]).
#[derive(Clone, Copy, Debug)]
struct MmaBackward {
    /// dQ: units in a cube (32 a plane, 16 queries a plane at a time).
    dq_units: usize,
    /// dQ: cubes an (n, h) (1 where a cube holds all keys).
    dq_groups: usize,
    /// dQ: the kernel's key count (the call's rounded up).
    keys: usize,
    /// dQ: keys in shared memory at a time (`≥ keys`: all, once).
    block_keys: usize,
    /// dK/dV: units in a cube (32 a plane, 16 keys a plane).
    dkdv_units: usize,
    /// dK/dV: cubes an (n, h).
    dkdv_groups: usize,
    /// dK/dV: the kernel's query count (the call's rounded up).
    queries: usize,
    /// dK/dV: queries in shared memory at a time.
    block_queries: usize,
}

impl MmaBackward {
    /// The plan for `tq` queries and `tk` keys of head dim `head_dim`, f16
    /// and bf16 on CUDA with `mma.sync` (sm_80 on), head dims 16, 32 and 64;
    /// `AAM_KERNEL_MMA=0` or `forward` turns it off. Each kernel holds all
    /// of the other side's rows where they fit [`TILED_SHARED_BYTES`] (the
    /// ASV level), else streams them [`BLOCK_KEYS`] at a time (the sample
    /// level). Counts are rounded up as the forward's (so that nearby
    /// lengths share compiled kernels).
    fn new<R: CubeRuntime>(
        client: &cubecl::client::ComputeClient<R>,
        dtype: DType,
        head_dim: usize,
        tq: usize,
        tk: usize,
    ) -> Option<Self> {
        if R::name(client) != "cuda"
            || !mma_setting().backward
            || !matches!(dtype, DType::F16 | DType::BF16)
            || !matches!(head_dim, 16 | 32 | 64)
            || tk == 0
            || tq == 0
        {
            return None;
        }
        if !has_f32_products(client, dtype.into(), 16) {
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
            let planes = env_usize("AAM_KERNEL_MMA_DQ_PLANES")
                .unwrap_or(query_blocks.div_ceil(2))
                .min(query_blocks)
                .min(MAX_MMA_PLANES);
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
        let default_planes = if queries == block_queries { 16 } else { 8 };
        let dkdv_planes = key_blocks
            .min(env_usize("AAM_KERNEL_MMA_DKDV_PLANES").unwrap_or(default_planes))
            .min(MAX_MMA_PLANES);
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

/// The widest vector (8, 4, 2 or 1 elements) in which every head row of
/// these `[N, H, T, Dh]` views (each at its element offset) can be read:
/// offsets, row and head strides, head dim and the buffer's start in bytes
/// all multiples of it.
fn row_vector_width<R: CubeRuntime>(views: &[(&CubeTensor<R>, usize)]) -> usize {
    let fits = |width: usize, (t, offset): &(&CubeTensor<R>, usize)| {
        let strides = t.meta.strides();
        let shape = t.meta.shape();
        let rank = strides.len();
        let start = t.handle.offset_start.unwrap_or(0);
        offset % width == 0
            && strides[..rank - 1].iter().all(|s| s % width == 0)
            && strides[rank - 1] == 1
            && shape[rank - 1] % width == 0
            && start % (width * t.dtype.size()) as u64 == 0
    };
    [8, 4, 2]
        .into_iter()
        .find(|&width| views.iter().all(|view| fits(width, view)))
        .unwrap_or(1)
}

/// A positive integer from the environment variable `name`, if set.
fn env_usize(name: &str) -> Option<usize> {
    let value = std::env::var(name).ok()?;
    match value.parse() {
        Ok(n) if n > 0 => Some(n),
        _ => panic!("{name} must be a positive integer, not {value:?}"),
    }
}

/// How [`attention_backward_merged`] runs ([`Layout::merged_backward`]).
#[derive(Clone, Copy, Debug)]
struct MergedBackward {
    /// Units in the one cube of an (n, h): its keys × parts, in whole planes.
    units: u32,
    /// Query rows a tile.
    tile: usize,
    /// Shares of the keys that a tile's dQ sums split into.
    key_splits: usize,
    /// Quads of a query tile's rows each unit loads.
    loads: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PartsSetting {
    /// Split head dimensions in two on CUDA and HIP.
    Auto,
    /// This many units per row's dimensions (1 or 2) on every runtime.
    Fixed(usize),
}

/// `AAM_KERNEL_PARTS`: unset or `auto` splits rows' head dims in two
/// where the runtime allows it (see [`Layout::parts`]); `1` never does;
/// `2` always does, on every runtime (for tests, as `AAM_KERNEL_LANES`).
fn parts_setting() -> PartsSetting {
    static PARTS: std::sync::OnceLock<PartsSetting> = std::sync::OnceLock::new();
    *PARTS.get_or_init(|| match std::env::var("AAM_KERNEL_PARTS").as_deref() {
        Ok("1") => PartsSetting::Fixed(1),
        Ok("2") => PartsSetting::Fixed(2),
        Ok("auto") | Err(_) => PartsSetting::Auto,
        Ok(other) => panic!("AAM_KERNEL_PARTS must be auto, 1 or 2, not {other:?}"),
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LanesSetting {
    /// Split rows when a call has too few to fill the GPU (CUDA, HIP).
    Auto,
    /// This many lanes per row (1, 2, 4 or 8) on every runtime.
    Fixed(usize),
}

/// `AAM_KERNEL_TILE`: rows per shared-memory tile, a power of two from 8
/// to 64 (at most what fits; for measurements). Unset: the largest that
/// fits, at most 32 (16 for heads wider than 64).
fn tile_setting() -> Option<usize> {
    static TILE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *TILE.get_or_init(|| match std::env::var("AAM_KERNEL_TILE").as_deref() {
        Err(_) => None,
        Ok(v) => match v.parse::<usize>() {
            Ok(t @ (8 | 16 | 32 | 64)) => Some(t),
            _ => panic!("AAM_KERNEL_TILE must be 8, 16, 32 or 64, not {v:?}"),
        },
    })
}

/// `AAM_KERNEL_LANES`: unset or `auto` splits rows over lanes where the
/// runtime allows it (see [`Layout::new`]); `1` never does (for
/// comparisons); `2`, `4` or `8` always does, on every runtime (for tests:
/// on wgpu that needs subgroups that follow the unit order).
fn lanes_setting() -> LanesSetting {
    static LANES: std::sync::OnceLock<LanesSetting> = std::sync::OnceLock::new();
    *LANES.get_or_init(|| match std::env::var("AAM_KERNEL_LANES").as_deref() {
        Ok("1") => LanesSetting::Fixed(1),
        Ok("2") => LanesSetting::Fixed(2),
        Ok("4") => LanesSetting::Fixed(4),
        Ok("8") => LanesSetting::Fixed(8),
        Ok("auto") | Err(_) => LanesSetting::Auto,
        Ok(other) => panic!("AAM_KERNEL_LANES must be auto, 1, 2, 4 or 8, not {other:?}"),
    })
}

/// `AAM_KERNEL_MERGED_BACKWARD`: unset or `1` runs the attention backward
/// as one kernel where one cube holds a head's keys
/// ([`Layout::merged_backward`]); `0` always runs the dQ and dK/dV kernels.
fn merged_backward_setting() -> bool {
    static MERGED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *MERGED.get_or_init(
        || match std::env::var("AAM_KERNEL_MERGED_BACKWARD").as_deref() {
            Ok("1") | Err(_) => true,
            Ok("0") => false,
            Ok(other) => panic!("AAM_KERNEL_MERGED_BACKWARD must be 0 or 1, not {other:?}"),
        },
    )
}

/// Which passes run register-tiled where they can ([`Layout::tiled`]).
#[derive(Clone, Copy, Debug)]
struct TiledSetting {
    forward: bool,
    backward: bool,
}

/// `AAM_KERNEL_MMA`: unset or `1` runs the f32 forward on tensor cores as
/// split TF32, f16/bf16 likewise and their backward, where it can
/// ([`MmaForward::new`], [`MmaBackward::new`]); `forward` only the forward;
/// `0` leaves them to the CUDA-core (f32) and `cmma` (f16/bf16) kernels.
fn mma_setting() -> MmaSetting {
    static MMA: std::sync::OnceLock<MmaSetting> = std::sync::OnceLock::new();
    *MMA.get_or_init(|| match std::env::var("AAM_KERNEL_MMA").as_deref() {
        Err(_) | Ok("1") => MmaSetting {
            forward: true,
            backward: true,
        },
        Ok("forward") => MmaSetting {
            forward: true,
            backward: false,
        },
        Ok("0") => MmaSetting {
            forward: false,
            backward: false,
        },
        Ok(other) => panic!("AAM_KERNEL_MMA must be 1, forward or 0, not {other:?}"),
    })
}

/// Which passes run on `mma.sync` (see [`mma_setting`]).
#[derive(Clone, Copy, Debug)]
struct MmaSetting {
    forward: bool,
    backward: bool,
}

/// `AAM_KERNEL_TILED`: unset or `1` runs both attention passes as
/// register-tiled products where they can ([`Layout::tiled`]);
/// `forward` or `backward` only that one; `0` neither (the scalar forward,
/// and the merged backward or the dQ and dK/dV kernels).
fn tiled_setting() -> TiledSetting {
    static TILED: std::sync::OnceLock<TiledSetting> = std::sync::OnceLock::new();
    *TILED.get_or_init(|| {
        let (forward, backward) = match std::env::var("AAM_KERNEL_TILED").as_deref() {
            Ok("1") | Err(_) => (true, true),
            Ok("forward") => (true, false),
            Ok("backward") => (false, true),
            Ok("0") => (false, false),
            Ok(other) => {
                panic!("AAM_KERNEL_TILED must be 1, forward, backward or 0, not {other:?}")
            }
        };
        TiledSetting { forward, backward }
    })
}

/// Whether the kernels unroll their loops over the head dimension and a
/// tile's keys. On by default (the rows and scores then live in registers);
/// `AAM_KERNEL_UNROLL=0` turns it off, which only changes code generation:
/// CPU Vulkan drivers (Mesa lavapipe, used in CI) take minutes to compile
/// the unrolled kernels.
fn unroll_loops() -> bool {
    static UNROLL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *UNROLL.get_or_init(|| {
        std::env::var("AAM_KERNEL_UNROLL")
            .map(|v| v != "0")
            .unwrap_or(true)
    })
}
/// How the tensor-core kernels ([`attention_forward_tc`] and the backward's
/// `attention_backward_{dq,dkdv}_tc`) run a call, when they can: f16 or
/// bf16 storage, a head dim that is a multiple of 16, a runtime with
/// 16×16×16 `cmma` for that type into f32 and one plane size of 32 or 64
/// (CUDA, HIP; wgpu's WGSL has no cooperative matrices), and `AAM_KERNEL_TC`
/// allowing the pass (see [`tensor_core_setting`]). f32 stays off `cmma`: its TF32 tiles
/// would lose the f32 precision the parity tests hold it to (the forward of
/// [`MmaForward`] splits f32 into TF32 pairs instead). Where [`MmaForward`] applies it
/// runs the f16/bf16 forward in place of these.
#[derive(Clone, Copy, Debug)]
struct TensorCorePlan {
    head_dim: usize,
    /// Planes per cube, each owning 16 rows (queries, or keys for dK/dV).
    planes: usize,
    /// 16-row blocks of the other side (keys, or queries for dK/dV) a cube
    /// loads into shared memory at a time.
    blocks: usize,
    plane_size: usize,
}

impl TensorCorePlan {
    /// The plan for `rows` rows a launch (query rows, or keys for dK/dV).
    fn new<R: CubeRuntime>(
        client: &cubecl::client::ComputeClient<R>,
        dtype: DType,
        head_dim: usize,
        rows: usize,
        pass: Pass,
    ) -> Option<Self> {
        let wanted = match tensor_core_setting() {
            TensorCoreSetting::Auto => true,
            TensorCoreSetting::ForwardOnly => pass == Pass::Forward,
            TensorCoreSetting::Off => false,
        };
        if !wanted || !matches!(dtype, DType::F16 | DType::BF16) {
            return None;
        }
        if head_dim == 0 || !head_dim.is_multiple_of(TC_TILE) || head_dim > MAX_HEAD_DIM {
            return None;
        }
        let hardware = &client.properties().hardware;
        let plane_size = hardware.plane_size_max as usize;
        if hardware.plane_size_min as usize != plane_size || !matches!(plane_size, 32 | 64) {
            return None;
        }
        let storage: cubecl::ir::StorageType = dtype.into();
        let tile = TC_TILE as u32;
        if !client
            .features()
            .matmul
            .cmma
            .contains(&into_f32_products(storage, [tile; 3]))
        {
            return None;
        }
        // As many planes as the shared memory holds (a cube's static limit
        // is 48 KiB; see `shared_bytes`), at most 16 (512 units), or the
        // `AAM_KERNEL_TC_PLANES` cap: tiles of 4 blocks of the other side
        // (2 for head dims over 64).
        let blocks = if head_dim <= 64 { 4 } else { 2 };
        let (own_blocks, f32_per_row) = match pass {
            Pass::Forward => (1, 1),
            Pass::Backward => (2, 2),
        };
        let storage_bytes = dtype.size();
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
            .unwrap_or(1)
            .min(tensor_core_planes_cap());
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

    /// Launches the forward; returns `(out, lse)` as the CUDA-core one.
    fn launch<R, F, I, BT>(
        self,
        q: CubeTensor<R>,
        k: CubeTensor<R>,
        v: CubeTensor<R>,
        key_padding_mask: Option<BoolTensor<CubeBackend<R, F, I, BT>>>,
        scale: f64,
        dropout: AttentionDropout,
    ) -> (CubeTensor<R>, CubeTensor<R>)
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        let [n, h, tq, dh] = dims4(&q);
        let tk = dims4(&k)[2];
        let client = q.client.clone();
        let (key_valid, block_valid) =
            validity::<R, F, I, BT>(key_padding_mask, n, tk, TC_TILE, &q.device);
        let out = empty_device_contiguous_dtype::<R>(
            client.clone(),
            q.device.clone(),
            Shape::new([n, h, tq, dh]),
            q.dtype,
        );
        let lse = empty_device_contiguous_dtype::<R>(
            client.clone(),
            q.device.clone(),
            Shape::new([n, h, tq]),
            DType::F32,
        );
        let (use_dropout, threshold, drop_scale, seed) = dropout_args(dropout);
        let rows_per_cube = self.planes * TC_TILE;
        for (offset, count) in bh_chunks(n * h) {
            attention_forward_tc::launch::<R>(
                &client,
                CubeCount::Static(count, tq.div_ceil(rows_per_cube) as u32, 1),
                CubeDim::new_2d(self.plane_size as u32, self.planes as u32),
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                key_valid.clone().into_tensor_arg(),
                block_valid.clone().into_tensor_arg(),
                out.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                scale as f32,
                h as u32,
                offset,
                threshold,
                drop_scale,
                seed,
                self.head_dim,
                self.blocks,
                self.planes,
                self.plane_size,
                use_dropout,
                q.dtype.into(),
            );
        }
        (out, lse)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    Forward,
    Backward,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TensorCoreSetting {
    Auto,
    ForwardOnly,
    Off,
}

/// The backward on tensor cores: the dQ kernel (which writes `Δ`), then
/// the dK/dV kernel, as the CUDA-core pair. Inputs contiguous.
fn tensor_core_backward<R, F, I, BT>(
    plan_q: TensorCorePlan,
    plan_k: TensorCorePlan,
    [q, k, v, out, lse, dout]: [CubeTensor<R>; 6],
    key_padding_mask: Option<BoolTensor<CubeBackend<R, F, I, BT>>>,
    scale: f64,
    dropout: AttentionDropout,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let [n, h, tq, dh] = dims4(&q);
    let tk = dims4(&k)[2];
    let client = q.client.clone();
    let (key_valid, block_valid) =
        validity::<R, F, I, BT>(key_padding_mask, n, tk, TC_TILE, &q.device);
    let out = into_contiguous(out);
    let lse = into_contiguous(lse);
    let delta = empty_device_contiguous_dtype::<R>(
        client.clone(),
        q.device.clone(),
        Shape::new([n, h, tq]),
        DType::F32,
    );
    let alloc = |t: usize| {
        empty_device_contiguous_dtype::<R>(
            client.clone(),
            q.device.clone(),
            Shape::new([n, h, t, dh]),
            q.dtype,
        )
    };
    let (dq, dk, dv) = (alloc(tq), alloc(tk), alloc(tk));
    let (use_dropout, threshold, drop_scale, seed) = dropout_args(dropout);
    for (offset, count) in bh_chunks(n * h) {
        attention_backward_dq_tc::launch::<R>(
            &client,
            CubeCount::Static(count, tq.div_ceil(plan_q.planes * TC_TILE) as u32, 1),
            CubeDim::new_2d(plan_q.plane_size as u32, plan_q.planes as u32),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            key_valid.clone().into_tensor_arg(),
            block_valid.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            scale as f32,
            h as u32,
            offset,
            threshold,
            drop_scale,
            seed,
            dh,
            plan_q.blocks,
            plan_q.planes,
            plan_q.plane_size,
            use_dropout,
            q.dtype.into(),
        );
        attention_backward_dkdv_tc::launch::<R>(
            &client,
            CubeCount::Static(count, tk.div_ceil(plan_k.planes * TC_TILE) as u32, 1),
            CubeDim::new_2d(plan_k.plane_size as u32, plan_k.planes as u32),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            key_valid.clone().into_tensor_arg(),
            block_valid.clone().into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
            scale as f32,
            h as u32,
            offset,
            threshold,
            drop_scale,
            seed,
            dh,
            plan_k.blocks,
            plan_k.planes,
            plan_k.plane_size,
            use_dropout,
            q.dtype.into(),
        );
    }
    (dq, dk, dv)
}

/// `AAM_KERNEL_TC`: unset or `auto` runs f16/bf16 attention (forward and
/// backward) on tensor cores where the runtime has them (see
/// [`TensorCorePlan`]); `forward` only the forward; `0` neither (the
/// CUDA-core kernels, for comparisons).
fn tensor_core_setting() -> TensorCoreSetting {
    static TC: std::sync::OnceLock<TensorCoreSetting> = std::sync::OnceLock::new();
    *TC.get_or_init(|| match std::env::var("AAM_KERNEL_TC").as_deref() {
        Ok("0") => TensorCoreSetting::Off,
        Ok("forward") => TensorCoreSetting::ForwardOnly,
        Ok("auto") | Err(_) => TensorCoreSetting::Auto,
        Ok(other) => panic!("AAM_KERNEL_TC must be auto, forward or 0, not {other:?}"),
    })
}

/// `AAM_KERNEL_TC_PLANES`: the most planes (16 rows each) a tensor-core
/// cube may have, below what its shared memory allows; a tuning knob,
/// unset by default.
fn tensor_core_planes_cap() -> usize {
    static CAP: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| match std::env::var("AAM_KERNEL_TC_PLANES") {
        Err(_) => usize::MAX,
        Ok(value) => match value.parse::<usize>() {
            Ok(cap) if cap > 0 => cap,
            _ => panic!("AAM_KERNEL_TC_PLANES must be a positive integer, not {value:?}"),
        },
    })
}

/// Shared memory a tensor-core cube may use: under the 48 KiB static
/// limit, with room for the compiler's own.
const SHARED_BUDGET: usize = 46 * 1024;

/// The largest head dimension the kernels take (registers per unit).
pub const MAX_HEAD_DIM: usize = 128;
/// wgpu's (and WebGPU's) limit on cubes per grid dimension.
const MAX_CUBES_PER_DIM: usize = 65_535;

/// Dropout as the kernels take it: `(use, threshold = p·2³², 1/(1−p), seed)`.
fn dropout_args(dropout: AttentionDropout) -> (bool, u32, f32, u32) {
    let p = dropout.prob.clamp(0.0, 1.0);
    if p <= 0.0 {
        return (false, 0, 1.0, 0);
    }
    let threshold = (p * 4_294_967_296.0).min(u32::MAX as f64) as u32;
    let scale = if p < 1.0 {
        (1.0 / (1.0 - p)) as f32
    } else {
        0.0
    };
    (true, threshold, scale, dropout.seed)
}

/// Per-key validity `[N, Tk]` (1 = attend) and valid keys per tile `[N, tiles]`, as f32.
fn validity<R, F, I, BT>(
    mask: Option<BoolTensor<CubeBackend<R, F, I, BT>>>,
    n: usize,
    tk: usize,
    tile_keys: usize,
    device: &R::Device,
) -> (CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let tiles = tk.div_ceil(tile_keys);
    let Some(mask) = mask else {
        // No mask: every key valid, and every tile full but the last.
        type B<R, F, I, BT> = CubeBackend<R, F, I, BT>;
        let valid = Tensor::<B<R, F, I, BT>, 2>::ones([n, tk], device).cast(DType::F32);
        let per_tile: Vec<f32> = (0..tiles)
            .map(|t| (tk - t * tile_keys).min(tile_keys) as f32)
            .collect();
        let per_tile = Tensor::<B<R, F, I, BT>, 1>::from_floats(per_tile.as_slice(), device)
            .cast(DType::F32)
            .reshape([1, tiles])
            .expand([n, tiles]);
        return (
            into_contiguous(valid.into_primitive().tensor()),
            into_contiguous(per_tile.into_primitive().tensor()),
        );
    };
    let mask = into_contiguous(mask);
    let key_valid = empty(&mask, Shape::new([n, tk]), DType::F32);
    let tile_valid = empty(&mask, Shape::new([n, tiles]), DType::F32);
    // A cube holds whole tiles: `tile_keys` is a power of two up to 32.
    const UNITS: usize = 256;
    assert!(
        UNITS.is_multiple_of(tile_keys),
        "key validity: tiles of {tile_keys} keys"
    );
    let (cubes, cube_dim) = one_unit_each(&mask.client, n * tiles * tile_keys, UNITS as u32);
    key_validity::launch::<R>(
        &mask.client,
        cubes,
        cube_dim,
        mask.clone().into_tensor_arg(),
        key_valid.clone().into_tensor_arg(),
        tile_valid.clone().into_tensor_arg(),
        tile_keys,
        UNITS,
        mask.dtype.into(),
    );
    (key_valid, tile_valid)
}

fn dims4<R: CubeRuntime>(t: &CubeTensor<R>) -> [usize; 4] {
    let s = t.meta.shape();
    [s[0], s[1], s[2], s[3]]
}

/// Splits `n·H` sequences into launches of at most 65,535 cubes along x.
fn bh_chunks(bh: usize) -> impl Iterator<Item = (u32, u32)> {
    (0..bh)
        .step_by(MAX_CUBES_PER_DIM)
        .map(move |start| (start as u32, (bh - start).min(MAX_CUBES_PER_DIM) as u32))
}

impl<R, F, I, BT> AttentionBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn has_fused_attention() -> bool {
        true
    }

    fn has_seeded_dropout() -> bool {
        true
    }

    fn dense_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        if rows_matmul_enabled() {
            if let Some(out) = rows_matmul(&a, &b) {
                return out;
            }
        }
        match dense_matmul_choice() {
            DenseMatmul::Tuned => tuned_matmul(a, b),
            DenseMatmul::Validated => validated_matmul(a, b),
            DenseMatmul::Autotune => {
                <Self as burn::tensor::ops::FloatTensorOps<Self>>::float_matmul(a, b)
            }
        }
    }

    fn seeded_dropout(x: FloatTensor<Self>, dropout: AttentionDropout) -> FloatTensor<Self> {
        let (use_dropout, ..) = dropout_args(dropout);
        if !use_dropout {
            return x;
        }
        seeded_dropout_launch(into_contiguous(x), None, None, dropout)
    }

    fn seeded_dropout_add(
        residual: FloatTensor<Self>,
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        let [residual, x] = [residual, x].map(into_contiguous);
        assert_eq!(
            residual.meta.shape(),
            x.meta.shape(),
            "seeded_dropout_add: shapes differ"
        );
        assert_eq!(residual.dtype, x.dtype, "seeded_dropout_add: types differ");
        // p = 0 runs the same kernel: its mask then keeps every element at
        // scale 1 (`dropout_args`), and the bias and residual still join in
        // one pass.
        seeded_dropout_launch(x, Some(residual), bias, dropout)
    }

    fn adam_steps(items: Vec<AdamItem<Self>>) -> Vec<[FloatTensor<Self>; 3]> {
        let Some(any) = items.first() else {
            return Vec::new();
        };
        // Five tensors a parameter are bound per launch, within the
        // runtime's limit on bindings (wgpu's is small), at most 32.
        let bindings = any.param.client.properties().hardware.max_bindings as usize;
        let chunk = (bindings.saturating_sub(4) / 5).clamp(1, 32);
        let mut items = items.into_iter().peekable();
        let mut out = Vec::new();
        while items.peek().is_some() {
            out.extend(adam_steps_launch::<R, F, I, BT>(
                items.by_ref().take(chunk).collect(),
            ));
        }
        out
    }

    fn adam_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        first: FloatTensor<Self>,
        second: FloatTensor<Self>,
        step: AdamStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let item = AdamItem {
            param,
            grad,
            first,
            second,
            step,
        };
        let [[p, m, v]] = <[_; 1]>::try_from(adam_steps_launch::<R, F, I, BT>(vec![item]))
            .unwrap_or_else(|_| unreachable!("one parameter in, one out"));
        (p, m, v)
    }

    fn gelu_exact(x: FloatTensor<Self>) -> FloatTensor<Self> {
        gelu_launch(x, None, AttentionDropout::NONE)
    }

    fn gelu_exact_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        gelu_backward_launch(x, None, dy, AttentionDropout::NONE)
    }

    fn gelu_exact_dropout(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        gelu_launch(x, bias, dropout)
    }

    fn gelu_exact_dropout_backward(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        gelu_backward_launch(x, bias, dy, dropout)
    }

    fn attention_pool_with_stats(
        x: FloatTensor<Self>,
        query: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [x, query, valid] = [x, query, valid].map(into_contiguous);
        let [n, t, d] = pool_dims(&x, &query, &valid);
        let client = x.client.clone();
        let pooled = empty(&x, Shape::new([n, d]), x.dtype);
        let lse = empty(&x, Shape::new([n]), DType::F32);
        let (cubes, cube_dim, lanes) = pool_cubes(&client, n);
        attention_pool_rows::launch::<R>(
            &client,
            cubes,
            cube_dim,
            x.clone().into_tensor_arg(),
            query.into_tensor_arg(),
            valid.into_tensor_arg(),
            pooled.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            t as u32,
            scale as f32,
            lanes,
            POOL_PLANES,
            d.div_ceil(lanes),
            x.dtype.into(),
        );
        (pooled, lse)
    }

    fn attention_pool_backward(
        x: FloatTensor<Self>,
        query: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [x, query, valid, lse, dy] = [x, query, valid, lse, dy].map(into_contiguous);
        let [n, t, d] = pool_dims(&x, &query, &valid);
        assert_eq!(
            dy.meta.shape().dims::<2>(),
            [n, d],
            "attention pool: dy's shape"
        );
        assert_eq!(
            lse.dtype,
            DType::F32,
            "attention pool: lse must be the forward's (f32)"
        );
        let client = x.client.clone();
        let dx = empty(&x, x.meta.shape().clone(), x.dtype);
        let dquery_rows = empty(&x, Shape::new([n, d]), x.dtype);
        let (cubes, cube_dim, lanes) = pool_cubes(&client, n);
        attention_pool_backward_rows::launch::<R>(
            &client,
            cubes,
            cube_dim,
            x.clone().into_tensor_arg(),
            query.into_tensor_arg(),
            valid.into_tensor_arg(),
            lse.into_tensor_arg(),
            dy.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            dquery_rows.clone().into_tensor_arg(),
            t as u32,
            scale as f32,
            lanes,
            POOL_PLANES,
            d.div_ceil(lanes),
            x.dtype.into(),
        );
        (dx, Self::column_sum(dquery_rows))
    }

    fn layer_norm_with_stats(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let x = into_contiguous(x);
        let gamma = into_contiguous(gamma);
        let beta = beta.map(into_contiguous);
        let dims = x.meta.shape().clone();
        let [rows, width] = [dims[0], dims[1]];
        assert_eq!(
            gamma.meta.shape().num_elements(),
            width,
            "layer norm: γ's width"
        );
        let client = x.client.clone();
        let (y, normalised, r) = (
            empty(&x, dims.clone(), x.dtype),
            empty(&x, dims.clone(), x.dtype),
            empty(&x, Shape::new([rows, 1]), x.dtype),
        );
        let (cubes, cube_dim, lanes) = row_groups(&client, rows);
        let with_beta = beta.is_some();
        layer_norm_rows::launch::<R>(
            &client,
            cubes,
            cube_dim,
            x.clone().into_tensor_arg(),
            gamma.clone().into_tensor_arg(),
            beta.unwrap_or(gamma).into_tensor_arg(),
            y.clone().into_tensor_arg(),
            normalised.clone().into_tensor_arg(),
            r.clone().into_tensor_arg(),
            eps as f32,
            lanes,
            with_beta,
            x.dtype.into(),
        );
        (y, normalised, r)
    }

    fn layer_norm_backward(
        normalised: FloatTensor<Self>,
        r: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        dx_add: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let [normalised, r, gamma, dy] = [normalised, r, gamma, dy].map(into_contiguous);
        // Without a gradient to add, the kernels are compiled without the
        // read (`accumulate`), and `dy` stands in for the unused argument.
        let accumulate = dx_add.is_some();
        let dx_add = dx_add.map(into_contiguous).unwrap_or_else(|| dy.clone());
        let dims = dy.meta.shape().clone();
        let rows = dims[0];
        let client = dy.client.clone();
        let dx = empty(&dy, dims.clone(), dy.dtype);
        let (cubes, cube_dim, lanes) = row_groups(&client, rows);
        let width = dims[1];
        let groups = 256 / lanes;
        // γ's and β's gradients summed in the same pass where the cube's
        // shared sums fit 32 KiB (D ≤ 512 at 32 lanes a row).
        if 2 * groups * width * 4 <= 32 * 1024 && rows > 0 {
            let steps = rows.div_ceil(groups * LAYER_NORM_MAX_PARTS).max(1);
            let parts = rows.div_ceil(groups * steps);
            let partial = empty(&dy, Shape::new([2, parts, width]), DType::F32);
            layer_norm_backward_rows_sums::launch::<R>(
                &client,
                CubeCount::Static(parts as u32, 1, 1),
                cube_dim,
                normalised.into_tensor_arg(),
                r.into_tensor_arg(),
                gamma.into_tensor_arg(),
                dy.clone().into_tensor_arg(),
                dx_add.into_tensor_arg(),
                dx.clone().into_tensor_arg(),
                partial.clone().into_tensor_arg(),
                steps as u32,
                lanes,
                width,
                accumulate,
                dy.dtype.into(),
            );
            let (dbeta, dgamma) = sum_partials_launch(&dy, partial, parts, width, true);
            return (dx, dgamma.expect("Σ dy·x̂ was asked for"), dbeta);
        }
        layer_norm_backward_rows::launch::<R>(
            &client,
            cubes,
            cube_dim,
            normalised.clone().into_tensor_arg(),
            r.into_tensor_arg(),
            gamma.into_tensor_arg(),
            dy.clone().into_tensor_arg(),
            dx_add.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            lanes,
            accumulate,
            dy.dtype.into(),
        );
        let (dbeta, dgamma) = column_sums::<R>(&dy, Some(&normalised));
        (dx, dgamma.expect("Σ dy·x̂ was asked for"), dbeta)
    }

    fn column_sum(t: FloatTensor<Self>) -> FloatTensor<Self> {
        column_sums::<R>(&into_contiguous(t), None).0
    }

    fn seeded_dropout_column_sum(
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        gradient_column_sums(None, dy, dropout)
    }

    fn gelu_exact_dropout_backward_column_sum(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        gradient_column_sums(Some((x, bias)), dy, dropout)
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

    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        scale: f64,
        dropout: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let q = into_contiguous(q);
        let k = into_contiguous(k);
        let v = into_contiguous(v);
        let [n, h, tq, dh] = dims4(&q);
        let mma = MmaForward::new(&q.client, q.dtype, dh, tq, dims4(&k)[2]).is_some();
        if let Some(plan) = TensorCorePlan::new(&q.client, q.dtype, dh, tq, Pass::Forward) {
            if !mma {
                return plan.launch::<R, F, I, BT>(q, k, v, key_padding_mask, scale, dropout);
            }
        }
        // The kernels write their outputs at the strides they are given.
        // CubeCL's plain `empty` may hand out a pitched layout (rows padded
        // for alignment, as CUDA does for a last dimension like T = 151) that
        // a later reader taking the tensor as dense would misread: the
        // outputs are allocated contiguous.
        let out = empty(&q, Shape::new([n, h, tq, dh]), q.dtype);
        let lse = scalar_forward::<R, F, I, BT>(
            [&q, &k, &v],
            [0, 0],
            None,
            &out,
            key_padding_mask,
            scale,
            dropout,
        );
        (out, lse)
    }

    #[allow(clippy::too_many_arguments)]
    fn fused_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        scale: f64,
        dropout: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let q = into_contiguous(q);
        let k = into_contiguous(k);
        let v = into_contiguous(v);
        let dout = into_contiguous(dout);
        let [n, h, tq, dh] = dims4(&q);
        let tk = dims4(&k)[2];
        let plans = (
            TensorCorePlan::new(&q.client, q.dtype, dh, tq, Pass::Backward),
            TensorCorePlan::new(&q.client, q.dtype, dh, tk, Pass::Backward),
        );
        let mma = MmaBackward::new(&q.client, q.dtype, dh, tq, tk).is_some();
        if let (Some(plan_q), Some(plan_k), false) = (plans.0, plans.1, mma) {
            return tensor_core_backward::<R, F, I, BT>(
                plan_q,
                plan_k,
                [q, k, v, out, lse, dout],
                key_padding_mask,
                scale,
                dropout,
            );
        }
        let out = into_contiguous(out);
        let dq = empty(&q, Shape::new([n, h, tq, dh]), q.dtype);
        // dK and dV from one binding (two writable bindings of one buffer
        // are refused by wgpu, and the packed path writes both into `dqkv`):
        // `[2N, H, Tk, Dh]`, whose first N sequences are dK's and whose last
        // N (at dV's offset) are dV's, then cut in two by views.
        let dkv = empty(&q, Shape::new([2 * n, h, tk, dh]), q.dtype);
        scalar_backward::<R, F, I, BT>(
            [&q, &k, &v],
            [0, 0],
            None,
            [&out, &dout],
            into_contiguous(lse),
            key_padding_mask,
            &dq,
            &dkv,
            [0, n * h * tk * dh],
            scale,
            dropout,
        );
        let dkv = Tensor::<Self, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(dkv));
        let [dk, dv] =
            [0, n].map(|start| dkv.clone().narrow(0, start, n).into_primitive().tensor());
        (dq, dk, dv)
    }

    fn packed_attention_forward(
        qkv: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        key_padding_mask: Option<BoolTensor<Self>>,
        heads: usize,
        scale: f64,
        dropout: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let qkv = into_contiguous(qkv);
        let [n, t, d3] = dims3(&qkv);
        let (d, dh) = (d3 / 3, d3 / 3 / heads);
        if TensorCorePlan::new(&qkv.client, qkv.dtype, dh, t, Pass::Forward).is_some()
            && MmaForward::new(&qkv.client, qkv.dtype, dh, t, t).is_none()
        {
            return crate::packed::packed_forward_ops::<Self>(
                qkv,
                bias,
                key_padding_mask,
                heads,
                scale,
                dropout,
            );
        }
        let out = empty(&qkv, Shape::new([n, t, d]), qkv.dtype);
        let qkv_heads = heads_view(&qkv, heads, dh);
        let bias = bias.map(|b| packed_bias(b, d3, qkv.dtype));
        let lse = scalar_forward::<R, F, I, BT>(
            [&qkv_heads, &qkv_heads, &qkv_heads],
            [d, 2 * d],
            bias.as_ref(),
            &heads_view(&out, heads, dh),
            key_padding_mask,
            scale,
            dropout,
        );
        (out, lse)
    }

    #[allow(clippy::too_many_arguments)]
    fn packed_attention_backward(
        qkv: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        key_padding_mask: Option<BoolTensor<Self>>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        let qkv = into_contiguous(qkv);
        let [_, t, d3] = dims3(&qkv);
        let (d, dh) = (d3 / 3, d3 / 3 / heads);
        if TensorCorePlan::new(&qkv.client, qkv.dtype, dh, t, Pass::Backward).is_some()
            && MmaBackward::new(&qkv.client, qkv.dtype, dh, t, t).is_none()
        {
            return crate::packed::packed_backward_ops::<Self>(
                qkv,
                bias,
                key_padding_mask,
                out,
                lse,
                dout,
                heads,
                scale,
                dropout,
            );
        }
        let [out, dout] = [out, dout].map(into_contiguous);
        let dqkv = empty(&qkv, qkv.meta.shape().clone(), qkv.dtype);
        let [qkv_heads, dqkv_heads] = [&qkv, &dqkv].map(|x| heads_view(x, heads, dh));
        let bias = bias.map(|b| packed_bias(b, d3, qkv.dtype));
        scalar_backward::<R, F, I, BT>(
            [&qkv_heads, &qkv_heads, &qkv_heads],
            [d, 2 * d],
            bias.as_ref(),
            [&heads_view(&out, heads, dh), &heads_view(&dout, heads, dh)],
            into_contiguous(lse),
            key_padding_mask,
            &dqkv_heads,
            &dqkv_heads,
            [d, 2 * d],
            scale,
            dropout,
        );
        dqkv
    }
}

/// The packed kernels' bias operand: `[3D]`, contiguous, of `qkv`'s type
/// (the kernels read it as `qkv`'s element type).
fn packed_bias<R: CubeRuntime>(bias: CubeTensor<R>, width: usize, dtype: DType) -> CubeTensor<R> {
    assert_eq!(
        bias.meta.shape().num_elements(),
        width,
        "packed attention: a bias of {} elements for qkv rows of {width}",
        bias.meta.shape().num_elements()
    );
    assert_eq!(
        bias.dtype, dtype,
        "packed attention: the bias's type differs from qkv's"
    );
    into_contiguous(bias)
}

/// `[N, T, W]` of a 3-d tensor.
fn dims3<R: CubeRuntime>(t: &CubeTensor<R>) -> [usize; 3] {
    let s = t.meta.shape();
    [s[0], s[1], s[2]]
}

/// The heads of a contiguous `[N, T, W]` tensor (`W` a multiple of
/// `heads · head_dim`: `qkv`, `out` and their gradients) as a `[N, H, T, Dh]`
/// view of the same memory, without a copy: head `h` of row `t` starts at
/// `t·W + h·Dh`. The parts of `qkv` after the first (k, v) are reached by the
/// kernels' element offsets.
fn heads_view<R: CubeRuntime>(t: &CubeTensor<R>, heads: usize, head_dim: usize) -> CubeTensor<R> {
    let [n, len, width] = dims3(t);
    let strides = t.meta.strides();
    assert_eq!(
        strides[2], 1,
        "heads_view: the last dimension must be dense"
    );
    assert!(
        width.is_multiple_of(heads * head_dim),
        "heads_view: width {width} is not a multiple of {heads} heads × {head_dim}"
    );
    CubeTensor::new(
        t.client.clone(),
        t.handle.clone(),
        cubecl::zspace::metadata::Metadata::new(
            [n, heads, len, head_dim],
            [strides[0], head_dim, strides[1], 1],
        ),
        t.device.clone(),
        t.dtype,
    )
}

/// The scalar (CUDA-core) forward on `[N, H, T, Dh]` views `q, k, v` (any
/// strides, the last 1; `k` and `v` start `kv_offsets` elements into their
/// buffers) into the view `out`; returns the row log-sum-exp `[N, H, Tq]`.
fn scalar_forward<R, F, I, BT>(
    [q, k, v]: [&CubeTensor<R>; 3],
    kv_offsets: [usize; 2],
    bias: Option<&CubeTensor<R>>,
    out: &CubeTensor<R>,
    key_padding_mask: Option<BoolTensor<CubeBackend<R, F, I, BT>>>,
    scale: f64,
    dropout: AttentionDropout,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let [n, h, tq, dh] = dims4(q);
    let tk = dims4(k)[2];
    assert!(
        dh <= MAX_HEAD_DIM,
        "fused attention: head dim {dh} > {MAX_HEAD_DIM}"
    );
    let client = q.client.clone();
    let layout = Layout::new(&client, dh);
    let lanes = layout.lanes(n * h * tq);
    let parts = layout.parts(lanes);
    let units = layout.units(lanes, parts, tq);
    let tile = layout.forward_tile(lanes);
    let (key_valid, tile_valid) = validity::<R, F, I, BT>(key_padding_mask, n, tk, tile, &q.device);
    let lse = empty(q, Shape::new([n, h, tq]), DType::F32);
    let (use_dropout, threshold, drop_scale, seed) = dropout_args(dropout);
    let rows_per_cube = units as usize / (lanes * parts);
    let [k_offset, v_offset] = kv_offsets.map(element_offset);
    // Both kernels write their rows by pair; the f16/bf16 one reads Q by
    // pair and stages K and V by vectors of `width` (16 bytes where it is
    // 8), the split-TF32 one by vectors of up to four.
    let width = row_vector_width(&[(q, 0), (k, kv_offsets[0]), (v, kv_offsets[1]), (out, 0)]);
    let mma = MmaForward::new(&client, q.dtype, dh, tq, tk).filter(|_| width >= 2);
    if let Some(mma) = mma {
        // One argument list for both kernels, each with its staging
        // vectors' width after the cube dim.
        macro_rules! launch_mma {
            ($kernel:ident, $offset:expr, $count:expr, $width:expr) => {
                $kernel::launch::<R>(
                    &client,
                    CubeCount::Static($count, mma.groups as u32, 1),
                    CubeDim::new_1d(mma.units as u32),
                    $width,
                    q.clone().into_tensor_arg(),
                    k.clone().into_tensor_arg(),
                    v.clone().into_tensor_arg(),
                    bias.unwrap_or(q).clone().into_tensor_arg(),
                    key_valid.clone().into_tensor_arg(),
                    out.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    scale as f32,
                    h as u32,
                    $offset,
                    k_offset,
                    v_offset,
                    threshold,
                    drop_scale,
                    seed,
                    dh,
                    mma.keys,
                    mma.block_keys,
                    mma.units,
                    mma.chunk_tiles,
                    use_dropout,
                    bias.is_some(),
                    q.dtype.into(),
                )
            };
        }
        for (offset, count) in bh_chunks(n * h) {
            if mma.half {
                launch_mma!(attention_forward_mma_half, offset, count, width);
            } else {
                launch_mma!(attention_forward_mma, offset, count, width.min(4));
            }
        }
        return lse;
    }
    if let Some(tiled) = layout.tiled(tk).filter(|_| tiled_setting().forward) {
        for (offset, count) in bh_chunks(n * h) {
            attention_forward_tiled::launch::<R>(
                &client,
                CubeCount::Static(count, 1, 1),
                CubeDim::new_1d(tiled.units as u32),
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                bias.unwrap_or(q).clone().into_tensor_arg(),
                key_valid.clone().into_tensor_arg(),
                out.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                scale as f32,
                h as u32,
                offset,
                k_offset,
                v_offset,
                threshold,
                drop_scale,
                seed,
                dh,
                tk,
                tiled.tile,
                tiled.units,
                use_dropout,
                bias.is_some(),
                q.dtype.into(),
            );
        }
        return lse;
    }
    for (offset, count) in bh_chunks(n * h) {
        attention_forward::launch::<R>(
            &client,
            CubeCount::Static(count, tq.div_ceil(rows_per_cube) as u32, 1),
            CubeDim::new_1d(units),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            bias.unwrap_or(q).clone().into_tensor_arg(),
            key_valid.clone().into_tensor_arg(),
            tile_valid.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            scale as f32,
            h as u32,
            offset,
            k_offset,
            v_offset,
            threshold,
            drop_scale,
            seed,
            dh,
            tile,
            lanes,
            parts,
            layout.stride,
            use_dropout,
            bias.is_some(),
            unroll_loops(),
            q.dtype.into(),
        );
    }
    lse
}

/// The scalar backward on `[N, H, T, Dh]` views (see [`scalar_forward`]):
/// dQ into the view `dq`, dK and dV into the one view `dkv` at
/// `dkv_offsets` elements.
#[allow(clippy::too_many_arguments)]
fn scalar_backward<R, F, I, BT>(
    [q, k, v]: [&CubeTensor<R>; 3],
    kv_offsets: [usize; 2],
    bias: Option<&CubeTensor<R>>,
    [out, dout]: [&CubeTensor<R>; 2],
    lse: CubeTensor<R>,
    key_padding_mask: Option<BoolTensor<CubeBackend<R, F, I, BT>>>,
    dq: &CubeTensor<R>,
    dkv: &CubeTensor<R>,
    dkv_offsets: [usize; 2],
    scale: f64,
    dropout: AttentionDropout,
) where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let [n, h, tq, dh] = dims4(q);
    let tk = dims4(k)[2];
    let layout = Layout::new(&q.client, dh);
    let (key_valid, tile_valid) =
        validity::<R, F, I, BT>(key_padding_mask, n, tk, layout.tile, &q.device);
    let client = q.client.clone();
    let (use_dropout, threshold, drop_scale, seed) = dropout_args(dropout);
    let lanes_k = layout.key_lanes(n * h * tk, tk);
    let parts_k = layout.parts(lanes_k);
    let [k_offset, v_offset] = kv_offsets.map(element_offset);
    let [dk_offset, dv_offset] = dkv_offsets.map(element_offset);
    // The mma kernels read and write their rows by pair at least, and stage
    // the other side's by vectors of `width` (16 bytes where it is 8).
    let width = row_vector_width(&[
        (q, 0),
        (k, kv_offsets[0]),
        (v, kv_offsets[1]),
        (out, 0),
        (dout, 0),
        (dq, 0),
        (dkv, dkv_offsets[0]),
        (dkv, dkv_offsets[1]),
    ]);
    let mma = MmaBackward::new(&client, q.dtype, dh, tq, tk).filter(|_| width >= 2);
    if let Some(mma) = mma {
        // Δ = rowsum(dO ⊙ O) in f32: written by the dQ kernel, read by the
        // dK/dV kernel launched after it.
        let delta = empty(q, Shape::new([n, h, tq]), DType::F32);
        for (offset, count) in bh_chunks(n * h) {
            // SAFETY: unchecked launches skip CubeCL's clamping of global
            // reads; the kernels read rows below `tq`/`tk` of views whose
            // shapes and strides are the tensors', keys' validity below `tk`,
            // and `lse`/`Δ` below `n·h·tq`, each behind its own guard.
            unsafe {
                attention_backward_dq_mma_half::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(count, mma.dq_groups as u32, 1),
                    CubeDim::new_1d(mma.dq_units as u32),
                    width,
                    q.clone().into_tensor_arg(),
                    k.clone().into_tensor_arg(),
                    v.clone().into_tensor_arg(),
                    bias.unwrap_or(q).clone().into_tensor_arg(),
                    out.clone().into_tensor_arg(),
                    dout.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    key_valid.clone().into_tensor_arg(),
                    dq.clone().into_tensor_arg(),
                    delta.clone().into_tensor_arg(),
                    scale as f32,
                    h as u32,
                    offset,
                    k_offset,
                    v_offset,
                    threshold,
                    drop_scale,
                    seed,
                    dh,
                    mma.keys,
                    mma.block_keys,
                    mma.dq_units,
                    use_dropout,
                    bias.is_some(),
                    q.dtype.into(),
                );
                attention_backward_dkdv_mma_half::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(count, mma.dkdv_groups as u32, 1),
                    CubeDim::new_1d(mma.dkdv_units as u32),
                    width,
                    q.clone().into_tensor_arg(),
                    k.clone().into_tensor_arg(),
                    v.clone().into_tensor_arg(),
                    bias.unwrap_or(q).clone().into_tensor_arg(),
                    dout.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    delta.clone().into_tensor_arg(),
                    key_valid.clone().into_tensor_arg(),
                    dkv.clone().into_tensor_arg(),
                    scale as f32,
                    h as u32,
                    offset,
                    k_offset,
                    v_offset,
                    dk_offset,
                    dv_offset,
                    threshold,
                    drop_scale,
                    seed,
                    dh,
                    mma.queries,
                    mma.block_queries,
                    mma.dkdv_units,
                    use_dropout,
                    bias.is_some(),
                    q.dtype.into(),
                );
            }
        }
        return;
    }
    if let Some(tiled) = layout.tiled(tk).filter(|_| tiled_setting().backward) {
        // Rows read by vectors of up to four (16 bytes of f32).
        let read_width = row_vector_width(&[
            (q, 0),
            (k, kv_offsets[0]),
            (v, kv_offsets[1]),
            (out, 0),
            (dout, 0),
        ])
        .min(4);
        for (offset, count) in bh_chunks(n * h) {
            attention_backward_tiled::launch::<R>(
                &client,
                CubeCount::Static(count, 1, 1),
                CubeDim::new_1d(tiled.units as u32),
                read_width,
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                bias.unwrap_or(q).clone().into_tensor_arg(),
                dout.clone().into_tensor_arg(),
                out.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                key_valid.clone().into_tensor_arg(),
                dkv.clone().into_tensor_arg(),
                dq.clone().into_tensor_arg(),
                scale as f32,
                h as u32,
                offset,
                k_offset,
                v_offset,
                dk_offset,
                dv_offset,
                threshold,
                drop_scale,
                seed,
                dh,
                tk,
                tiled.tile,
                tiled.units,
                use_dropout,
                bias.is_some(),
                q.dtype.into(),
            );
        }
        return;
    }
    if let Some(merged) = layout.merged_backward(lanes_k, parts_k, tk) {
        for (offset, count) in bh_chunks(n * h) {
            attention_backward_merged::launch::<R>(
                &client,
                CubeCount::Static(count, 1, 1),
                CubeDim::new_1d(merged.units),
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                bias.unwrap_or(q).clone().into_tensor_arg(),
                dout.clone().into_tensor_arg(),
                out.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                key_valid.clone().into_tensor_arg(),
                dkv.clone().into_tensor_arg(),
                dq.clone().into_tensor_arg(),
                scale as f32,
                h as u32,
                offset,
                k_offset,
                v_offset,
                dk_offset,
                dv_offset,
                threshold,
                drop_scale,
                seed,
                dh,
                merged.tile,
                parts_k,
                layout.stride,
                use_dropout,
                bias.is_some(),
                tk,
                merged.key_splits,
                merged.loads,
                unroll_loops(),
                q.dtype.into(),
            );
        }
        return;
    }
    let lanes_q = layout.lanes(n * h * tq);
    let parts_q = layout.parts(lanes_q);
    let units_q = layout.units(lanes_q, parts_q, tq);
    let units_k = layout.units(lanes_k, parts_k, tk);
    let key_blocks = tk.div_ceil(units_k as usize / (lanes_k * parts_k)) as u32;
    // Δ_i = rowsum(dO_i ⊙ O_i) in f32: written by the dQ kernel, read by
    // the dK/dV kernel launched after it.
    let delta = empty(q, Shape::new([n, h, tq]), DType::F32);
    for (offset, count) in bh_chunks(n * h) {
        attention_backward_dq::launch::<R>(
            &client,
            CubeCount::Static(
                count,
                tq.div_ceil(units_q as usize / (lanes_q * parts_q)) as u32,
                1,
            ),
            CubeDim::new_1d(units_q),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            bias.unwrap_or(q).clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            key_valid.clone().into_tensor_arg(),
            tile_valid.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            scale as f32,
            h as u32,
            offset,
            k_offset,
            v_offset,
            threshold,
            drop_scale,
            seed,
            dh,
            layout.tile,
            lanes_q,
            parts_q,
            layout.stride,
            use_dropout,
            bias.is_some(),
            unroll_loops(),
            q.dtype.into(),
        );
        attention_backward_dkdv::launch::<R>(
            &client,
            CubeCount::Static(count, key_blocks, 1),
            CubeDim::new_1d(units_k),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            bias.unwrap_or(q).clone().into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            key_valid.clone().into_tensor_arg(),
            tile_valid.clone().into_tensor_arg(),
            dkv.clone().into_tensor_arg(),
            scale as f32,
            h as u32,
            offset,
            k_offset,
            v_offset,
            dk_offset,
            dv_offset,
            threshold,
            drop_scale,
            seed,
            dh,
            layout.tile,
            lanes_k,
            parts_k,
            layout.stride,
            use_dropout,
            bias.is_some(),
            unroll_loops(),
            q.dtype.into(),
        );
    }
}

/// [`gelu_elements`] on `x` (made contiguous), shifted by a per-column
/// `bias` where given, with the seeded dropout of its output when
/// `dropout.prob > 0`.
fn gelu_launch<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    dropout: AttentionDropout,
) -> CubeTensor<R> {
    let (use_dropout, threshold, scale, seed) = dropout_args(dropout);
    let x = into_contiguous(x);
    let bias = bias.map(|b| row_bias(&x, b, "gelu"));
    let shape = x.meta.shape().clone();
    let elements = dropout_elements_count(&shape);
    let client = x.client.clone();
    let y = empty(&x, shape, x.dtype);
    let (cubes, cube_dim, width) = elementwise_launch(&client, elements, bias.as_ref());
    gelu_elements::launch::<R>(
        &client,
        cubes,
        cube_dim,
        width,
        x.clone().into_tensor_arg(),
        bias.as_ref().unwrap_or(&x).clone().into_tensor_arg(),
        y.clone().into_tensor_arg(),
        threshold,
        scale,
        seed,
        use_dropout,
        bias.is_some(),
        x.dtype.into(),
    );
    y
}

/// [`gelu_backward_elements`]: `x`'s gradient from `dy`, at `x` shifted by
/// `bias` where given, through [`gelu_launch`]'s dropout mask when
/// `dropout.prob > 0`.
fn gelu_backward_launch<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    dy: CubeTensor<R>,
    dropout: AttentionDropout,
) -> CubeTensor<R> {
    let (use_dropout, threshold, scale, seed) = dropout_args(dropout);
    let [x, dy] = [x, dy].map(into_contiguous);
    let bias = bias.map(|b| row_bias(&x, b, "gelu backward"));
    let shape = dy.meta.shape().clone();
    let elements = dropout_elements_count(&shape);
    let client = dy.client.clone();
    let dx = empty(&dy, shape, dy.dtype);
    let (cubes, cube_dim, width) = elementwise_launch(&client, elements, bias.as_ref());
    gelu_backward_elements::launch::<R>(
        &client,
        cubes,
        cube_dim,
        width,
        x.clone().into_tensor_arg(),
        bias.as_ref().unwrap_or(&x).clone().into_tensor_arg(),
        dy.clone().into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        threshold,
        scale,
        seed,
        use_dropout,
        bias.is_some(),
        dy.dtype.into(),
    );
    dx
}

/// `bias` (made contiguous) checked against `x`: one value per column of
/// `x`'s last axis, of `x`'s type.
fn row_bias<R: CubeRuntime>(x: &CubeTensor<R>, bias: CubeTensor<R>, op: &str) -> CubeTensor<R> {
    let columns = x.meta.shape()[x.meta.shape().num_dims() - 1];
    assert_eq!(
        bias.meta.shape().as_slice(),
        &[columns],
        "{op}: the bias must have one value per column ({columns})"
    );
    assert_eq!(
        bias.dtype, x.dtype,
        "{op}: the bias's type differs from x's"
    );
    into_contiguous(bias)
}

/// The launch of an element-wise kernel ([`dropout_elements`],
/// [`gelu_elements`]) over `elements` contiguous ones: `(cubes, cube_dim,
/// width)`, each unit taking `width` elements, 4 where they divide (and,
/// with a per-column `bias`, where they divide a row, so that a unit's
/// elements share a row).
fn elementwise_launch<R: CubeRuntime>(
    client: &cubecl::client::ComputeClient<R>,
    elements: usize,
    bias: Option<&CubeTensor<R>>,
) -> (CubeCount, CubeDim, usize) {
    let divides = |n: usize| n.is_multiple_of(4);
    let width = if divides(elements) && bias.is_none_or(|b| divides(b.meta.shape()[0])) {
        4
    } else {
        1
    };
    let (cubes, cube_dim) = one_unit_each(client, elements / width, 256);
    (cubes, cube_dim, width)
}

/// The elements of a tensor whose dropout mask is hashed from the element
/// index (a u32 in the kernels).
fn dropout_elements_count(shape: &Shape) -> usize {
    let elements = shape.num_elements();
    assert!(
        elements <= u32::MAX as usize,
        "dropout: {elements} elements exceed the kernel's u32 index"
    );
    elements
}

/// One launch of [`dropout_elements`]: the seeded dropout of contiguous `x`
/// (shifted by a per-column `bias` where given), plus contiguous `residual`
/// where given.
fn seeded_dropout_launch<R: CubeRuntime>(
    x: CubeTensor<R>,
    residual: Option<CubeTensor<R>>,
    bias: Option<CubeTensor<R>>,
    dropout: AttentionDropout,
) -> CubeTensor<R> {
    let (_, threshold, scale, seed) = dropout_args(dropout);
    let bias = bias.map(|b| row_bias(&x, b, "seeded dropout"));
    let shape = x.meta.shape().clone();
    let elements = dropout_elements_count(&shape);
    let client = x.client.clone();
    let out = empty(&x, shape, x.dtype);
    let (cubes, cube_dim, width) = elementwise_launch(&client, elements, bias.as_ref());
    dropout_elements::launch::<R>(
        &client,
        cubes,
        cube_dim,
        width,
        x.clone().into_tensor_arg(),
        residual.as_ref().unwrap_or(&x).clone().into_tensor_arg(),
        bias.as_ref().unwrap_or(&x).clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        threshold,
        scale,
        seed,
        residual.is_some(),
        bias.is_some(),
        x.dtype.into(),
    );
    out
}

/// How the dense layers' products pick their kernel (`AAM_DENSE_MATMUL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DenseMatmul {
    /// `tuned` (default): autotune over [`dense_matmul_candidates`] only.
    Tuned,
    /// `validated`: the first of [`dense_matmul_candidates`]' fixed order
    /// that runs, no autotune.
    Validated,
    /// `autotune`: Burn's autotuned matmul over all of CubeCL's kernels,
    /// three of them wrong on some shapes (to compare; see
    /// [`dense_matmul_candidates`]).
    Autotune,
}

fn dense_matmul_choice() -> DenseMatmul {
    static CHOICE: std::sync::OnceLock<DenseMatmul> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| match std::env::var("AAM_DENSE_MATMUL").as_deref() {
        Err(_) | Ok("tuned") => DenseMatmul::Tuned,
        Ok("validated") => DenseMatmul::Validated,
        Ok("autotune") => DenseMatmul::Autotune,
        Ok(other) => {
            panic!("AAM_DENSE_MATMUL must be tuned, validated or autotune, not {other:?}")
        }
    })
}

/// The CubeCL matmul kernels the dense layers' products may run on, each
/// checked against a float64 product in every operand layout the dense
/// backward makes (`kernels/tests/matmul_kernels.rs`, on CUDA also over
/// every inner size modulo 64).
///
/// Why not all of Burn's autotune candidates: autotune times the candidates
/// once per *bucket* of problems (sizes rounded to a coarse grid, layouts)
/// and reuses the winner for every problem in the bucket, and three
/// candidates are wrong on problems their bucket admits (`docs/performance.md`,
/// 2026-11-26):
/// - `specialized_cyclic_{cmma,mma}` with a transposed left operand whose
///   inner size is 32 more than a multiple of 64 (on an H100: relative error
///   8-23 at `[128, 1952]ᵀ·[1952, 512]`). The dense weight gradient's leftover
///   rows hit this once every ~64 batch sizes; if autotune picks it on a
///   batch where it is right, two batches an epoch of oral2550 get weight
///   gradients ~5,000x too large and real-data pretraining on CUDA diverges.
/// - `double_unit` with a transposed right operand (CUDA and lavapipe,
///   e.g. `[1000, 24]·[24, 16]`, relative error 0.1-1.5).
/// - `double_cyclic_mma` (specialized) with a transposed right operand and
///   an inner size 32 more than a multiple of 64 (on an H100: relative
///   error 0.13-5 at `[128, 1952]·[1952, 512]ᵀ`, `[40, 608]·[608, 16]ᵀ` and
///   `[24, 96]·[96, 40]ᵀ`; 2026-11-26). It is the fastest kernel on the
///   weight gradient's leftover rows; `kernels/tests/matmul_kernels.rs`
///   finds it wrong.
///
/// Autotune over this list is safe because every member is right wherever
/// it runs, whichever wins a bucket. The unit kernel comes first: it runs
/// everywhere (lavapipe in CI), and a tuner's first candidate is its
/// fallback. TMA needs an sm_90 GPU (Hopper and later), CMMA/MMA tensor
/// cores; a kernel that cannot run on the device or operands is skipped.
pub fn dense_matmul_candidates() -> Vec<DenseKernel> {
    use cubek::matmul::components::tile::TileMatmulKind::{Cmma, Mma};
    use cubek::matmul::launch::Strategy;
    use cubek::matmul::routines::{
        double_buffering::DoubleBufferingArgs, simple::SimpleArgs, BlueprintStrategy::Inferred,
    };

    let simple = |tile_matmul, multi_rows| SimpleArgs {
        multi_rows,
        tile_matmul,
    };
    let double = |specialized| DoubleBufferingArgs {
        tile_matmul: Mma,
        specialized,
    };
    vec![
        Strategy::SimpleUnit(Inferred(Default::default())),
        Strategy::SimpleCyclicCmma(Inferred(simple(Cmma, false))),
        Strategy::SimpleTmaMma(Inferred(simple(Mma, false))),
        // The weight gradient's parts of 2,048 rows at the reference's batch
        // (H100): 509-522 µs, against 623 on `specialized_tma_mma`.
        Strategy::SimpleTmaMma(Inferred(simple(Mma, true))),
        Strategy::SpecializedTmaMma(Inferred(().into())),
        // Two shared-memory stages filled by TMA, two 16-row tiles a plane:
        // the dense layers' forward and input-gradient products at 302,000
        // rows (H100, 2026-11-27) in 0.77-0.97x
        // `simple_tma_mma`'s time (e.g. `[128→384]` 499 against 603 µs).
        Strategy::DoubleTmaMma(Inferred(double(false))),
        Strategy::DoubleTmaMma(Inferred(double(true))),
    ]
    .into_iter()
    .map(DenseKernel::Cubek)
    .chain([
        // The same kernel with a 256 × 128 stage (eight planes of 32 × 128)
        // and planes that only issue the TMA loads: at 302,000 rows (H100,
        // 2026-11-27) 0.87-1.01x the time of the best of
        // CubeCL's inferred tilings on the forward and input-gradient
        // products (`[128→512]` view 570 against 653 µs) and 0.91x on one
        // weight gradient's parts; slower on the other's parts and on the
        // leftover rows, where autotune keeps CubeCL's.
        DenseKernel::TmaDouble(TmaTiling {
            planes: Some(16),
            rows_per_plane: Some(2),
            partition_k: Some(4),
            swizzled: false,
            specialized: true,
        }),
    ])
    .collect()
}

/// A kernel for the dense products: one of CubeCL's strategies with the
/// tiling CubeCL infers, or CubeCL's TMA double-buffered kernel with a
/// stage shape chosen here ([`TmaTiling`]).
#[derive(Clone)]
pub enum DenseKernel {
    Cubek(cubek::matmul::launch::Strategy),
    TmaDouble(TmaTiling),
}

impl From<cubek::matmul::launch::Strategy> for DenseKernel {
    fn from(strategy: cubek::matmul::launch::Strategy) -> Self {
        Self::Cubek(strategy)
    }
}

impl std::fmt::Display for DenseKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cubek(strategy) => strategy.fmt(f),
            Self::TmaDouble(tiling) => tiling.fmt(f),
        }
    }
}

/// `lhs·rhs` on the fastest of [`dense_matmul_candidates`] for the problem's
/// autotune bucket (CubeCL's tuner: timed on the first problem of a bucket,
/// kept in CubeCL's on-disk autotune cache).
fn tuned_matmul<R: CubeRuntime>(lhs: CubeTensor<R>, rhs: CubeTensor<R>) -> CubeTensor<R> {
    use cubecl::tune::{local_tuner, LocalTuner, Tunable, TunableSet};
    use cubek::matmul::launch::MatmulAutotuneKey;

    type Operands<R> = (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>);
    static TUNER: LocalTuner<MatmulAutotuneKey, cubecl::CubeTuneId> = local_tuner!("dense-matmul");

    let out = burn_cubecl::kernel::matmul::init_matmul_output(&lhs, &rhs, lhs.dtype);
    let client = lhs.client.clone();
    let id = cubecl::CubeTuneId::new(&lhs.client, &lhs.device);
    let tunables = TUNER.init(|| {
        let key = |(lhs, rhs, out): &Operands<R>| {
            MatmulAutotuneKey::generate(
                &lhs.client,
                lhs.meta.shape(),
                rhs.meta.shape(),
                lhs.meta.strides(),
                rhs.meta.strides(),
                lhs.dtype.into(),
                rhs.dtype.into(),
                out.dtype.into(),
                None,
                None,
            )
        };
        // Timing runs write a copy of the output, not the output itself.
        let inputs = |_: &MatmulAutotuneKey, (lhs, rhs, out): &Operands<R>| {
            (lhs.clone(), rhs.clone(), out.copy())
        };
        let mut set = TunableSet::new(key, inputs);
        for strategy in dense_matmul_candidates() {
            set = set.with(Tunable::new(
                &strategy.to_string(),
                move |(lhs, rhs, out): Operands<R>| {
                    launch_matmul(&strategy, &lhs, &rhs, &out).map_err(|e| format!("{e:?}"))
                },
            ));
        }
        set
    });
    TUNER.execute(&id, &client, tunables, (lhs, rhs, out.clone()));
    out
}

/// `AAM_ROWS_MATMUL=1` sends the dense products [`rows_matmul`] applies to
/// through it; unset or `0`, every product stays on CubeCL's kernels. Off
/// by default: on the H100 at 302,000 rows it ran the forward and input
/// gradient products at 0.9-1.4x the time of CubeCL's `simple_tma_mma`
/// and the weight gradient's parts at ~2x (`docs/performance.md`,
/// 2026-11-27); it is the base for fusing element-wise passes
/// into a product, which CubeCL's kernels cannot take.
fn rows_matmul_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| match std::env::var("AAM_ROWS_MATMUL").as_deref() {
        Ok("1") => true,
        Err(_) | Ok("0") => false,
        Ok(other) => panic!("AAM_ROWS_MATMUL must be 0 or 1, not {other:?}"),
    })
}

/// `lhs·rhs` on [`rows_matmul_tf32`] where it applies, else `None`: f32
/// operands of rank 2, or rank 3 with one batch size, on a runtime with
/// 32-unit planes and TF32 `cmma` (CUDA on Ampere and later), with the
/// inner size a multiple of [`BLOCK_K`] and the output width of 64, each
/// operand contiguous along one of its two axes, and every stride and
/// offset a multiple of four elements. The dense layers' products at AAM's
/// widths (multiples of 128) all qualify, except the weight gradient's
/// leftover rows (an inner size that is rarely a multiple of 32).
///
/// The output is allocated with its rows rounded up to the row block, and
/// the rows asked for returned as a view of it.
pub fn rows_matmul<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
) -> Option<CubeTensor<R>> {
    rows_matmul_tile(lhs, rhs, None)
}

/// [`rows_matmul`] with a given tile: `(row_planes, block_n)`, planes down
/// the rows (32 rows each; 2 or 4) and output columns a cube computes (64
/// or 128, dividing the output width); `None`: the default, to time others.
pub fn rows_matmul_tile<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    tile: Option<(usize, usize)>,
) -> Option<CubeTensor<R>> {
    use crate::rows_matmul::{BLOCK_K, PLANE_ROWS, PLANE_SIZE, VECTOR};

    if lhs.dtype != DType::F32 || rhs.dtype != DType::F32 {
        return None;
    }
    let rank = lhs.meta.shape().num_dims();
    if rhs.meta.shape().num_dims() != rank || !(2..=3).contains(&rank) {
        return None;
    }
    let (ls, rs) = (lhs.meta.shape(), rhs.meta.shape());
    let (lt, rt) = (lhs.meta.strides(), rhs.meta.strides());
    let batch = if rank == 3 { ls[0] } else { 1 };
    if rank == 3 && rs[0] != batch {
        return None;
    }
    let [m, k] = [ls[rank - 2], ls[rank - 1]];
    let n = rs[rank - 1];
    if rs[rank - 2] != k || m == 0 || k == 0 || !k.is_multiple_of(BLOCK_K) || !n.is_multiple_of(64)
    {
        return None;
    }
    // (contiguous along k / along n, the other axis's stride)
    let a_k_contiguous = lt[rank - 1] == 1;
    let a_stride = match (a_k_contiguous, lt[rank - 2] == 1) {
        (true, _) => lt[rank - 2],
        (false, true) => lt[rank - 1],
        (false, false) => return None,
    };
    let b_k_contiguous = rt[rank - 2] == 1 && rt[rank - 1] != 1;
    let b_stride = match (b_k_contiguous, rt[rank - 1] == 1) {
        (true, _) => rt[rank - 1],
        (false, true) => rt[rank - 2],
        (false, false) => return None,
    };
    let a_batch = if rank == 3 && batch > 1 { lt[0] } else { 0 };
    let b_batch = if rank == 3 && batch > 1 { rt[0] } else { 0 };
    let aligned = |t: &CubeTensor<R>| {
        t.handle
            .offset_start
            .is_none_or(|o| o.is_multiple_of((VECTOR * 4) as u64))
    };
    let (row_planes, block_n) = match tile {
        Some((p, b)) if matches!(p, 2 | 4) && matches!(b, 64 | 128) && n.is_multiple_of(b) => {
            (p, b)
        }
        Some(_) => return None,
        None if n.is_multiple_of(128) => (4, 128),
        None => (4, 64),
    };
    let block_m = PLANE_ROWS * row_planes;
    let rows_padded = m.div_ceil(block_m) * block_m;
    if [a_stride, b_stride, a_batch, b_batch]
        .iter()
        .any(|s| !s.is_multiple_of(VECTOR))
        || !aligned(lhs)
        || !aligned(rhs)
        || (!a_k_contiguous && !m.is_multiple_of(VECTOR))
        || rows_padded / block_m > u16::MAX as usize
        || batch > u16::MAX as usize
    {
        return None;
    }
    let client = lhs.client.clone();
    let hardware = &client.properties().hardware;
    if hardware.plane_size_min as usize != PLANE_SIZE
        || hardware.plane_size_max as usize != PLANE_SIZE
    {
        return None;
    }
    let f32_type =
        cubecl::ir::StorageType::Scalar(cubecl::ir::ElemType::Float(cubecl::ir::FloatKind::F32));
    let tf32_type =
        cubecl::ir::StorageType::Scalar(cubecl::ir::ElemType::Float(cubecl::ir::FloatKind::TF32));
    let config = cubecl::features::MmaConfig {
        a_type: tf32_type,
        b_type: tf32_type,
        cd_type: f32_type,
        m: 16,
        n: 16,
        k: 8,
    };
    if !client.features().matmul.cmma.contains(&config) {
        return None;
    }
    let out_shape = if rank == 3 {
        Shape::new([batch, rows_padded, n])
    } else {
        Shape::new([rows_padded, n])
    };
    let out = empty(lhs, out_shape, DType::F32);
    rows_matmul_tf32::launch::<R>(
        &client,
        CubeCount::Static(
            (n / block_n) as u32,
            (rows_padded / block_m) as u32,
            batch as u32,
        ),
        CubeDim::new_2d(PLANE_SIZE as u32, (2 * row_planes) as u32),
        VECTOR,
        lhs.clone().into_tensor_arg(),
        rhs.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        m as u32,
        k as u32,
        rows_padded as u32,
        n as u32,
        a_batch as u32,
        a_stride as u32,
        b_batch as u32,
        b_stride as u32,
        a_k_contiguous,
        b_k_contiguous,
        row_planes,
        block_n,
    );
    if rows_padded == m {
        return Some(out);
    }
    let ranges: Vec<std::ops::Range<usize>> = if rank == 3 {
        vec![0..batch, 0..m, 0..n]
    } else {
        vec![0..m, 0..n]
    };
    Some(burn_cubecl::kernel::slice(out, &ranges))
}

/// `lhs·rhs` on the first of [`dense_matmul_candidates`] that runs, tried
/// from the fastest on an H100 (`AAM_DENSE_MATMUL=validated`).
fn validated_matmul<R: CubeRuntime>(lhs: CubeTensor<R>, rhs: CubeTensor<R>) -> CubeTensor<R> {
    use cubek::matmul::launch::Strategy;
    use cubek::matmul::routines::BlueprintStrategy;

    let mut strategies = dense_matmul_candidates();
    // TMA, CMMA tensor cores, then the unit kernel: the simple kernels,
    // fastest first (`specialized_tma_mma`, the multi-row TMA kernel and the
    // double-buffered ones are on the list for the tuner).
    strategies.retain(|s| match s {
        DenseKernel::Cubek(Strategy::SimpleTmaMma(BlueprintStrategy::Inferred(args))) => {
            !args.multi_rows
        }
        DenseKernel::Cubek(Strategy::SimpleCyclicCmma(_) | Strategy::SimpleUnit(_)) => true,
        _ => false,
    });
    strategies.reverse();
    let out = burn_cubecl::kernel::matmul::init_matmul_output(&lhs, &rhs, lhs.dtype);
    // Errors kept unformatted: a GPU without TMA skips the first kernel on
    // every product of every step.
    let mut errors = Vec::with_capacity(strategies.len());
    for strategy in &strategies {
        match launch_matmul(strategy, &lhs, &rhs, &out) {
            Ok(()) => return out,
            Err(e) => errors.push(e),
        }
    }
    let errors: Vec<String> = strategies
        .iter()
        .zip(errors)
        .map(|(strategy, e)| format!("{strategy}: {e:?}"))
        .collect();
    panic!(
        "no validated matmul kernel runs {:?}·{:?} (strides {:?}, {:?}) here: {errors:?}; \
         AAM_DENSE_MATMUL=autotune uses Burn's autotuned matmul",
        lhs.meta.shape(),
        rhs.meta.shape(),
        lhs.meta.strides(),
        rhs.meta.strides()
    )
}

/// `out = lhs·rhs` on one CubeCL matmul kernel, no autotune: an error where
/// that kernel cannot run on the device or operands (CubeCL's own check,
/// before any launch). Operands of one float type, rank 2 or batched rank 3,
/// in any strides CubeCL's matmul takes (transposed views included).
pub fn launch_matmul<R: CubeRuntime>(
    kernel: &DenseKernel,
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    out: &CubeTensor<R>,
) -> Result<(), cubek::matmul::definition::MatmulSetupError> {
    use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
    use cubek::matmul::routines::BlueprintStrategy;
    use cubek::std::InputBinding;

    let dtype = lhs.dtype;
    let mut elems = MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: dtype.into(),
        rhs: dtype.into(),
        out: out.dtype.into(),
    });
    let client = &lhs.client;
    let lhs = InputBinding::new(lhs.clone().binding(), dtype.into());
    // Both operands read as the left one's type, as Burn's matmul does.
    let rhs = InputBinding::new(rhs.clone().binding(), dtype.into());
    let out = out.clone().binding();
    match kernel {
        DenseKernel::Cubek(strategy) => {
            cubek::matmul::launch::launch_ref(strategy, client, lhs, rhs, out, &mut elems)
        }
        DenseKernel::TmaDouble(tiling) => {
            cubek::matmul::launch::launch_tiling::launch_ref_tma::<R, TunedTmaDoubleBuffering>(
                client,
                lhs,
                rhs,
                out,
                &BlueprintStrategy::Inferred(*tiling),
                &mut elems,
            )
        }
    }
}

/// An element offset as the kernels take it.
fn element_offset(offset: usize) -> u32 {
    u32::try_from(offset).expect("fused attention: an operand offset past 2^32 elements")
}

/// Rows per part of [`column_sums`]: short parts make many units (a real-sized
/// batch's 62,967 ASV-level rows × 128 columns give ~31,000), and
/// [`sum_partials`] splits each column's parts (~250 there, ~1,200 at the
/// reference's 302,000 rows) over lanes.
const COLUMN_ROWS_PER_PART: usize = 256;

/// At most this many parts (cubes) in [`layer_norm_backward_rows_sums`]:
/// each cube then takes a whole number of row groups, `steps` at a time,
/// and the sum over parts stays short (the reference's batch: 302,000 ASV
/// tokens, 8 rows a group, 37 steps, 1,021 parts).
const LAYER_NORM_MAX_PARTS: usize = 1024;

/// Units that share a column's parts in [`sum_partials`] (256 a cube, the
/// most every runtime allows).
const SUM_PARTIAL_LANES: usize = 32;

/// `(Σ_m a[m, c], Σ_m a[m, c]·b[m, c])` (the second only with `b`) over the
/// rows of contiguous `[M, N]` tensors: partial sums over parts of rows,
/// then their sums, in f32 (two launches for both, one op for the host).
fn column_sums<R: CubeRuntime>(
    a: &CubeTensor<R>,
    b: Option<&CubeTensor<R>>,
) -> (CubeTensor<R>, Option<CubeTensor<R>>) {
    let dims = a.meta.shape();
    let [rows, columns] = [dims[0], dims[1]];
    let parts = rows.div_ceil(COLUMN_ROWS_PER_PART);
    let client = a.client.clone();
    let sums = if b.is_some() { 2 } else { 1 };
    let partial = empty(a, Shape::new([sums, parts.max(1), columns]), DType::F32);
    let (cubes, cube_dim) = one_unit_each(&client, (parts * columns).max(1), 256);
    column_partial_sums::launch::<R>(
        &client,
        cubes,
        cube_dim,
        a.clone().into_tensor_arg(),
        b.unwrap_or(a).clone().into_tensor_arg(),
        partial.clone().into_tensor_arg(),
        columns as u32,
        COLUMN_ROWS_PER_PART as u32,
        b.is_some(),
        a.dtype.into(),
    );
    sum_partials_launch(a, partial, parts, columns, b.is_some())
}

/// [`sum_partials`] over `partial` `[1 or 2, parts, columns]` f32: the
/// column sums (of `like`'s type), and the second ones with `with_b`.
fn sum_partials_launch<R: CubeRuntime>(
    like: &CubeTensor<R>,
    partial: CubeTensor<R>,
    parts: usize,
    columns: usize,
    with_b: bool,
) -> (CubeTensor<R>, Option<CubeTensor<R>>) {
    let column = || empty(like, Shape::new([columns]), like.dtype);
    let sum = column();
    let sum_ab = with_b.then(column);
    sum_partials::launch::<R>(
        &like.client,
        CubeCount::Static(columns.div_ceil(SUM_PARTIALS_COLUMNS) as u32, 1, 1),
        CubeDim::new_2d(SUM_PARTIALS_COLUMNS as u32, SUM_PARTIAL_LANES as u32),
        partial.into_tensor_arg(),
        sum.clone().into_tensor_arg(),
        sum_ab.as_ref().unwrap_or(&sum).clone().into_tensor_arg(),
        parts as u32,
        SUM_PARTIAL_LANES,
        with_b,
        like.dtype.into(),
    );
    (sum, sum_ab)
}

/// [`gradient_column_partials`] and [`sum_partials`]: `(dx, Σ_rows dx)`
/// for `dx = dy` through `dropout`'s mask and, with `gelu = Some((x,
/// bias))`, exact GELU's derivative at `x + bias`. `dy` (and `x`) `[..., N]`,
/// viewed as rows of `N`.
fn gradient_column_sums<R: CubeRuntime>(
    gelu: Option<(CubeTensor<R>, Option<CubeTensor<R>>)>,
    dy: CubeTensor<R>,
    dropout: AttentionDropout,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (use_dropout, threshold, scale, seed) = dropout_args(dropout);
    let dy = into_contiguous(dy);
    let shape = dy.meta.shape().clone();
    let columns = shape[shape.num_dims() - 1];
    let rows = dropout_elements_count(&shape) / columns.max(1);
    let (x, bias) = match gelu {
        Some((x, bias)) => {
            let x = into_contiguous(x);
            assert_eq!(
                x.meta.shape(),
                &shape,
                "GELU gradient: x and dy differ in shape"
            );
            let bias = bias.map(|b| row_bias(&x, b, "GELU gradient"));
            (Some(x), bias)
        }
        None => (None, None),
    };
    let client = dy.client.clone();
    let dx = empty(&dy, shape, dy.dtype);
    // Four columns a unit where they divide a row, in parts a quarter as
    // long: as many units as one column a unit over parts of
    // `COLUMN_ROWS_PER_PART` rows, each load 16 bytes.
    let width = if columns.is_multiple_of(4) { 4 } else { 1 };
    let rows_per_part = COLUMN_ROWS_PER_PART / width;
    let parts = rows.div_ceil(rows_per_part).max(1);
    let partial = empty(&dy, Shape::new([1, parts, columns]), DType::F32);
    let vectors = columns / width;
    let (cubes, cube_dim) = one_unit_each(&client, (parts * vectors).max(1), 256);
    let x_arg = x.as_ref().unwrap_or(&dy);
    gradient_column_partials::launch::<R>(
        &client,
        cubes,
        cube_dim,
        width,
        x_arg.clone().into_tensor_arg(),
        bias.as_ref().unwrap_or(x_arg).clone().into_tensor_arg(),
        dy.clone().into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        partial.clone().into_tensor_arg(),
        vectors as u32,
        rows_per_part as u32,
        threshold,
        scale,
        seed,
        x.is_some(),
        use_dropout,
        bias.is_some(),
        dy.dtype.into(),
    );
    (
        dx,
        sum_partials_launch(&dy, partial, parts, columns, false).0,
    )
}

/// One launch of [`adam_steps_elements`] over `items` (see
/// [`AttentionBackend::adam_steps`]): `[param, first, second]` after the
/// step for each, the moments updated in place where the items own them.
fn adam_steps_launch<R, F, I, BT>(
    items: Vec<AdamItem<CubeBackend<R, F, I, BT>>>,
) -> Vec<[CubeTensor<R>; 3]>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let dtype = items[0].param.dtype;
    let client = items[0].param.client.clone();
    let device = items[0].param.device.clone();
    let mut longest = 0;
    let mut coefficients = Vec::with_capacity(9 * items.len());
    let mut tensors = Vec::with_capacity(items.len());
    for item in items {
        let elements = item.param.meta.shape().num_elements();
        for (name, t) in [
            ("grad", &item.grad),
            ("first", &item.first),
            ("second", &item.second),
        ] {
            assert_eq!(
                t.dtype, dtype,
                "adam_steps: {name} is not of the parameters' type"
            );
            assert_eq!(
                t.meta.shape().num_elements(),
                elements,
                "adam_steps: {name}'s length"
            );
        }
        let step = item.step;
        // As `Tensor * f64` does: each coefficient rounded to f32 (and then,
        // in the kernel, to the element type).
        coefficients.extend(
            [
                step.decay,
                step.l2,
                step.beta1,
                1.0 - step.beta1,
                step.beta2,
                1.0 - step.beta2,
                step.bias2_sqrt,
                step.eps,
                step.step_size,
            ]
            .map(|x| x as f32),
        );
        let [param, grad, first, second] =
            [item.param, item.grad, item.first, item.second].map(into_contiguous);
        // Moments in place: in a buffer of their own, else in a copy.
        let [first, second] = [first, second].map(|t| if t.can_mut() { t } else { t.copy() });
        let param_out = empty(&param, param.meta.shape().clone(), dtype);
        longest = longest.max(elements);
        tensors.push([param, grad, first, second, param_out]);
    }
    let coefficients = Tensor::<CubeBackend<R, F, I, BT>, 1>::from_data(
        burn::tensor::TensorData::new(coefficients, [tensors.len() * 9]),
        &device,
    )
    .cast(DType::F32)
    .into_primitive()
    .tensor();
    let sequence = |i: usize| {
        tensors
            .iter()
            .map(|t| t[i].clone().into_tensor_arg())
            .collect()
    };
    const UNITS: u32 = 256;
    let cubes = CubeCount::Static(
        longest.div_ceil(UNITS as usize) as u32,
        tensors.len() as u32,
        1,
    );
    adam_steps_elements::launch::<R>(
        &client,
        cubes,
        CubeDim::new_1d(UNITS),
        sequence(0),
        sequence(1),
        sequence(2),
        sequence(3),
        sequence(4),
        coefficients.into_tensor_arg(),
        dtype.into(),
    );
    tensors
        .into_iter()
        .map(|[_, _, first, second, param_out]| [param_out, first, second])
        .collect()
}

/// Cubes of `cube` units covering `units` units, one unit per element or row
/// (the launch of every element-wise and per-row kernel here).
fn one_unit_each<R: CubeRuntime>(
    client: &cubecl::client::ComputeClient<R>,
    units: usize,
    cube: u32,
) -> (CubeCount, CubeDim) {
    let cube_dim = CubeDim::new_1d(cube);
    (
        cubecl::calculate_cube_count_elemwise(client, units, cube_dim),
        cube_dim,
    )
}

/// The launch of a row kernel with a group of adjacent lanes per row
/// ([`layer_norm_rows`]): `(cubes, cube_dim, lanes)`. Lanes are the
/// device's smallest plane, at most 32 (one per row where planes are
/// unknown), so that a row's shuffles stay in one plane and its loads are
/// adjacent; 256 units a cube.
fn row_groups<R: CubeRuntime>(
    client: &cubecl::client::ComputeClient<R>,
    rows: usize,
) -> (CubeCount, CubeDim, usize) {
    let plane = client.properties().hardware.plane_size_min as usize;
    let lanes = if plane.is_power_of_two() {
        plane.min(32)
    } else {
        1
    };
    let cube_dim = CubeDim::new_1d(256);
    let cubes = rows.div_ceil(256 / lanes).max(1);
    (
        cubecl::calculate_cube_count_elemwise(client, cubes, CubeDim::new_1d(1)),
        cube_dim,
        lanes,
    )
}

/// Planes a cube of attention pooling splits a row's tokens over.
const POOL_PLANES: usize = 8;

/// One cube per row for attention pooling: `(cubes, cube dim, lanes)`, the
/// lanes a plane (a power of two up to 32, as [`row_groups`]).
fn pool_cubes<R: CubeRuntime>(
    client: &cubecl::client::ComputeClient<R>,
    rows: usize,
) -> (CubeCount, CubeDim, usize) {
    let plane = client.properties().hardware.plane_size_min as usize;
    let lanes = if plane.is_power_of_two() {
        plane.min(32)
    } else {
        1
    };
    (
        cubecl::calculate_cube_count_elemwise(client, rows.max(1), CubeDim::new_1d(1)),
        CubeDim::new_2d(lanes as u32, POOL_PLANES as u32),
        lanes,
    )
}

/// `[N, T, D]` of attention pooling's operands, checked against each other.
fn pool_dims<R: CubeRuntime>(
    x: &CubeTensor<R>,
    query: &CubeTensor<R>,
    valid: &CubeTensor<R>,
) -> [usize; 3] {
    let [n, t, d] = x.meta.shape().dims::<3>();
    assert_eq!(
        query.meta.shape().num_elements(),
        d,
        "attention pool: query's width"
    );
    assert_eq!(
        valid.meta.shape().dims::<2>(),
        [n, t],
        "attention pool: valid's shape"
    );
    assert_eq!(valid.dtype, x.dtype, "attention pool: valid's type");
    assert!(t > 0, "attention pool: rows without tokens");
    [n, t, d]
}

/// A new contiguous tensor on `like`'s device.
fn empty<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype::<R>(like.client.clone(), like.device.clone(), shape, dtype)
}
