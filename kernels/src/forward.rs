//! [`AttentionBackend`] for the CubeCL backends (wgpu, CUDA, ROCm/HIP): make
//! the inputs contiguous, turn the mask into per-key and per-tile validity,
//! allocate the outputs and launch.

use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{CubeCount, CubeDim};

use crate::kernel::{attention_backward_dkdv, attention_backward_dq, attention_forward};
use crate::{AttentionBackend, AttentionDropout};

/// Shared memory per cube for the two tiles (K and V, or Q and dO): 16 KiB,
/// the WebGPU default limit, so the kernels run on every wgpu adapter.
const TILE_BYTES: usize = 16 * 1024;

/// Rows per shared-memory tile: 32 up to Dh = 64, fewer for wider heads.
fn tile_rows(head_dim: usize) -> usize {
    (TILE_BYTES / (2 * 4 * head_dim.max(1))).clamp(1, 32)
}

/// Whether the kernels unroll their loops over the head dimension. On by
/// default (the rows then live in registers); `AAM_KERNEL_UNROLL=0` turns it
/// off, which only changes code generation: CPU Vulkan drivers (Mesa
/// lavapipe, used in CI) take minutes to compile the unrolled kernels.
fn unroll_loops() -> bool {
    static UNROLL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *UNROLL.get_or_init(|| {
        std::env::var("AAM_KERNEL_UNROLL")
            .map(|v| v != "0")
            .unwrap_or(true)
    })
}
/// The largest head dimension the kernels take (registers per unit).
pub const MAX_HEAD_DIM: usize = 128;
/// wgpu's (and WebGPU's) limit on cubes per grid dimension.
const MAX_CUBES_PER_DIM: usize = 65_535;

/// Units (rows) per cube: fewer for wide heads, whose rows use more registers.
fn rows_per_cube(head_dim: usize) -> u32 {
    if head_dim > 64 {
        32
    } else {
        64
    }
}

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
    type B<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    let valid: Tensor<B<R, F, I, BT>, 2> = match mask {
        Some(m) => Tensor::<B<R, F, I, BT>, 2, burn::tensor::Bool>::from_primitive(m)
            .bool_not()
            .float(),
        None => Tensor::ones([n, tk], device),
    }
    .cast(DType::F32);
    let tiles = tk.div_ceil(tile_keys);
    let padded = if tiles * tile_keys > tk {
        let pad = Tensor::<B<R, F, I, BT>, 2>::zeros([n, tiles * tile_keys - tk], device)
            .cast(DType::F32);
        Tensor::cat(vec![valid.clone(), pad], 1)
    } else {
        valid.clone()
    };
    let per_tile = padded
        .reshape([n, tiles, tile_keys])
        .sum_dim(2)
        .reshape([n, tiles]);
    (
        into_contiguous(valid.into_primitive().tensor()),
        into_contiguous(per_tile.into_primitive().tensor()),
    )
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
        let tk = dims4(&k)[2];
        assert!(
            dh <= MAX_HEAD_DIM,
            "fused attention: head dim {dh} > {MAX_HEAD_DIM}"
        );
        let (key_valid, tile_valid) =
            validity::<R, F, I, BT>(key_padding_mask, n, tk, tile_rows(dh), &q.device);
        let client = q.client.clone();
        // The kernels index their outputs as dense row-major arrays. CubeCL's
        // plain `empty` may hand out a pitched layout (rows padded for
        // alignment, as CUDA does for a last dimension like T = 151), which
        // the backward's `into_contiguous(lse)` then read as garbage: the
        // outputs must be allocated contiguous.
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
        let rows = rows_per_cube(dh);
        for (offset, count) in bh_chunks(n * h) {
            attention_forward::launch::<R>(
                &client,
                CubeCount::Static(count, tq.div_ceil(rows as usize) as u32, 1),
                CubeDim::new_1d(rows),
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                key_valid.clone().into_tensor_arg(),
                tile_valid.clone().into_tensor_arg(),
                out.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                scale as f32,
                h as u32,
                offset,
                threshold,
                drop_scale,
                seed,
                dh,
                tile_rows(dh),
                use_dropout,
                unroll_loops(),
                q.dtype.into(),
            );
        }
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
        let (key_valid, tile_valid) =
            validity::<R, F, I, BT>(key_padding_mask, n, tk, tile_rows(dh), &q.device);
        // Δ_i = rowsum(dO_i ⊙ O_i), in f32.
        let delta: Tensor<Self, 4> =
            (Tensor::<Self, 4>::from_primitive(TensorPrimitive::Float(dout.clone()))
                * Tensor::from_primitive(TensorPrimitive::Float(out)))
            .cast(DType::F32)
            .sum_dim(3);
        let delta = into_contiguous(delta.reshape([n, h, tq]).into_primitive().tensor());
        let lse = into_contiguous(lse);
        let client = q.client.clone();
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
        let rows = rows_per_cube(dh);
        for (offset, count) in bh_chunks(n * h) {
            attention_backward_dq::launch::<R>(
                &client,
                CubeCount::Static(count, tq.div_ceil(rows as usize) as u32, 1),
                CubeDim::new_1d(rows),
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                dout.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                key_valid.clone().into_tensor_arg(),
                tile_valid.clone().into_tensor_arg(),
                dq.clone().into_tensor_arg(),
                scale as f32,
                h as u32,
                offset,
                threshold,
                drop_scale,
                seed,
                dh,
                tile_rows(dh),
                use_dropout,
                unroll_loops(),
                q.dtype.into(),
            );
            attention_backward_dkdv::launch::<R>(
                &client,
                CubeCount::Static(count, tk.div_ceil(rows as usize) as u32, 1),
                CubeDim::new_1d(rows),
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                dout.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                key_valid.clone().into_tensor_arg(),
                dk.clone().into_tensor_arg(),
                dv.clone().into_tensor_arg(),
                scale as f32,
                h as u32,
                offset,
                threshold,
                drop_scale,
                seed,
                dh,
                tile_rows(dh),
                use_dropout,
                unroll_loops(),
                q.dtype.into(),
            );
        }
        (dq, dk, dv)
    }
}
