//! The attention launches on the CubeCL backends (wgpu, CUDA, ROCm/HIP): make
//! the inputs contiguous, ask `plan.rs` which kernels run, turn the mask into
//! per-key and per-tile validity, allocate the outputs and launch. The row,
//! tiled and `mma` kernels index their operands as `[N, H, T, Dh]` views with
//! any strides: split heads are dense views, and a packed `qkv [N, T, 3D]` or
//! `out [N, T, D]` is viewed in place ([`heads_view`]), so packed
//! self-attention needs no split or merge copies. The `cmma` kernels take
//! contiguous heads (the packed calls split them first).

use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::{DType, Shape, Tensor};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{CubeCount, CubeDim};

use super::args::{HostScalars, OperandsLaunch};
use super::mma::{attention_forward_mma, HalfMma, SplitTf32};
use super::mma_backward::{attention_backward_dkdv_mma_half, attention_backward_dq_mma_half};
use super::plan::{AttentionPlan, AttentionShape, Backward, DeviceInfo, Forward, TensorCorePlan};
use super::rows::{
    attention_backward_dkdv, attention_backward_dq, attention_backward_merged, attention_forward,
    key_validity,
};
use super::tensor_core::{
    attention_backward_dkdv_tc, attention_backward_dq_tc, attention_forward_tc, TC_TILE,
};
use super::tiled::attention_backward_tiled;
use super::{packed, AttentionDropout, KernelChoice};
use crate::launch::{empty, one_unit_each};

type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// The plan for a call of `batch_heads` heads on `like`'s device and type.
fn plan<R: CubeRuntime>(
    like: &CubeTensor<R>,
    [batch_heads, queries, keys, head_dim]: [usize; 4],
    paired: bool,
    kernels: KernelChoice,
) -> AttentionPlan {
    let shape = AttentionShape {
        batch_heads,
        queries,
        keys,
        head_dim,
        dtype: like.dtype,
        paired,
    };
    AttentionPlan::new(&DeviceInfo::of(&like.client), &shape, kernels)
}

/// [`crate::AttentionOps::fused_attention_forward`]: `(out, lse)`.
pub(crate) fn forward<R, F, I, BT>(
    [q, k, v]: [CubeTensor<R>; 3],
    key_padding_mask: Option<BoolTensor<Cube<R, F, I, BT>>>,
    scale: f64,
    dropout: AttentionDropout,
    kernels: KernelChoice,
) -> (CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let [q, k, v] = [q, k, v].map(into_contiguous);
    let [n, h, tq, dh] = dims4(&q);
    let tk = dims4(&k)[2];
    let paired = row_vector_width(&[(&q, 0), (&k, 0), (&v, 0)]) >= 2;
    let plan = plan(&q, [n * h, tq, tk, dh], paired, kernels);
    if let Forward::TensorCore(tc) = plan.forward {
        return tensor_core_forward::<R, F, I, BT>(tc, q, k, v, key_padding_mask, scale, dropout);
    }
    // The kernels write their outputs at the strides they are given.
    // CubeCL's plain `empty` may hand out a pitched layout (rows padded
    // for alignment, as CUDA does for a last dimension like T = 151) that
    // a later reader taking the tensor as dense would misread: the
    // outputs are allocated contiguous.
    let out = empty(&q, Shape::new([n, h, tq, dh]), q.dtype);
    let lse = forward_views::<R, F, I, BT>(
        plan.forward,
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

/// [`crate::AttentionOps::fused_attention_backward`]: `(dq, dk, dv)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<R, F, I, BT>(
    [q, k, v]: [CubeTensor<R>; 3],
    key_padding_mask: Option<BoolTensor<Cube<R, F, I, BT>>>,
    [out, lse, dout]: [CubeTensor<R>; 3],
    scale: f64,
    dropout: AttentionDropout,
    kernels: KernelChoice,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let [q, k, v, dout] = [q, k, v, dout].map(into_contiguous);
    let [n, h, tq, dh] = dims4(&q);
    let tk = dims4(&k)[2];
    let paired = row_vector_width(&[(&q, 0), (&k, 0), (&v, 0), (&dout, 0)]) >= 2;
    let plan = plan(&q, [n * h, tq, tk, dh], paired, kernels);
    if let Backward::TensorCore { queries, keys } = plan.backward {
        return tensor_core_backward::<R, F, I, BT>(
            queries,
            keys,
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
    backward_views::<R, F, I, BT>(
        plan.backward,
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
    let dkv =
        Tensor::<Cube<R, F, I, BT>, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(dkv));
    let [dk, dv] = [0, n].map(|start| dkv.clone().narrow(0, start, n).into_primitive().tensor());
    (dq, dk, dv)
}

/// A packed self-attention call: the projection `qkv` (`[N, T, 3·D]`,
/// contiguous), its `[N, H, T, 3·Dh]` heads view, `D`, `Dh` and the plan.
struct Packed<R: CubeRuntime> {
    qkv: CubeTensor<R>,
    qkv_heads: CubeTensor<R>,
    d: usize,
    dh: usize,
    plan: AttentionPlan,
}

impl<R: CubeRuntime> Packed<R> {
    fn new(qkv: CubeTensor<R>, heads: usize, kernels: KernelChoice) -> Self {
        let qkv = into_contiguous(qkv);
        let [n, t, d3] = dims3(&qkv);
        let (d, dh) = (d3 / 3, d3 / 3 / heads);
        let qkv_heads = heads_view(&qkv, heads, dh);
        let views = [(&qkv_heads, 0), (&qkv_heads, d), (&qkv_heads, 2 * d)];
        let plan = plan(
            &qkv,
            [n * heads, t, t, dh],
            row_vector_width(&views) >= 2,
            kernels,
        );
        Self {
            qkv,
            qkv_heads,
            d,
            dh,
            plan,
        }
    }
}

/// [`crate::AttentionOps::packed_attention_forward`]: `(out, lse)`.
pub(crate) fn packed_forward<R, F, I, BT>(
    qkv: CubeTensor<R>,
    bias: Option<FloatTensor<Cube<R, F, I, BT>>>,
    key_padding_mask: Option<BoolTensor<Cube<R, F, I, BT>>>,
    heads: usize,
    scale: f64,
    dropout: AttentionDropout,
    kernels: KernelChoice,
) -> (CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let Packed {
        qkv,
        qkv_heads,
        d,
        dh,
        plan,
    } = Packed::new(qkv, heads, kernels);
    if let Forward::TensorCore(_) = plan.forward {
        return packed::packed_forward_ops::<Cube<R, F, I, BT>>(
            qkv,
            bias,
            key_padding_mask,
            heads,
            scale,
            dropout,
            kernels,
        );
    }
    let [n, t, _] = dims3(&qkv);
    let out = empty(&qkv, Shape::new([n, t, d]), qkv.dtype);
    let bias = bias.map(|b| packed_bias(b, 3 * d, qkv.dtype));
    let lse = forward_views::<R, F, I, BT>(
        plan.forward,
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

/// [`crate::AttentionOps::packed_attention_backward`]: `dqkv`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn packed_backward<R, F, I, BT>(
    qkv: CubeTensor<R>,
    bias: Option<FloatTensor<Cube<R, F, I, BT>>>,
    key_padding_mask: Option<BoolTensor<Cube<R, F, I, BT>>>,
    [out, lse, dout]: [CubeTensor<R>; 3],
    heads: usize,
    scale: f64,
    dropout: AttentionDropout,
    kernels: KernelChoice,
) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let Packed {
        qkv,
        qkv_heads,
        d,
        dh,
        plan,
    } = Packed::new(qkv, heads, kernels);
    if let Backward::TensorCore { .. } = plan.backward {
        return packed::packed_backward_ops::<Cube<R, F, I, BT>>(
            qkv,
            bias,
            key_padding_mask,
            out,
            lse,
            dout,
            heads,
            scale,
            dropout,
            kernels,
        );
    }
    let [out, dout] = [out, dout].map(into_contiguous);
    let dqkv = empty(&qkv, qkv.meta.shape().clone(), qkv.dtype);
    let dqkv_heads = heads_view(&dqkv, heads, dh);
    let bias = bias.map(|b| packed_bias(b, 3 * d, qkv.dtype));
    backward_views::<R, F, I, BT>(
        plan.backward,
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

/// The forward of `plan` (`mma` or rows) on `[N, H, T, Dh]` views `q, k, v`
/// (any strides, the last 1; `k` and `v` start `kv_offsets` elements into
/// their buffers) into the view `out`; returns the row log-sum-exp
/// `[N, H, Tq]`.
#[allow(clippy::too_many_arguments)]
fn forward_views<R, F, I, BT>(
    plan: Forward,
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
    let client = q.client.clone();
    let validity_tile = match plan {
        Forward::Rows(rows) => rows.tile,
        _ => 16,
    };
    let (key_valid, tile_valid) =
        validity::<R, F, I, BT>(key_padding_mask, n, tk, validity_tile, &q.device);
    let lse = empty(q, Shape::new([n, h, tq]), DType::F32);
    let scalars = HostScalars::new(scale, h, kv_offsets, [0, 0], dropout);
    let use_dropout = scalars.use_dropout;
    // Both `mma` kernels write their rows by pair; the f16/bf16 one reads Q by
    // pair and stages K and V by vectors of `width` (16 bytes where it is
    // 8), the split-TF32 one by vectors of up to four.
    let width = row_vector_width(&[(q, 0), (k, kv_offsets[0]), (v, kv_offsets[1]), (out, 0)]);
    if let Forward::Mma(mma) = plan {
        // The one kernel for both operand families (`M`), each with its
        // staging vectors' width after the cube dim.
        macro_rules! launch_mma {
            ($family:ty, $offset:expr, $count:expr, $width:expr) => {
                attention_forward_mma::launch::<$family, R>(
                    &client,
                    CubeCount::Static($count, mma.groups as u32, 1),
                    CubeDim::new_1d(mma.units as u32),
                    $width,
                    operands([q, k, v], bias, &key_valid),
                    out.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    scalars.launch::<R>($offset),
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
                launch_mma!(HalfMma, offset, count, width);
            } else {
                launch_mma!(SplitTf32, offset, count, width.min(4));
            }
        }
        return lse;
    }
    let Forward::Rows(rows) = plan else {
        unreachable!("the cmma forward runs on contiguous heads (forward_contiguous)")
    };
    let split = rows.rows;
    let rows_per_cube = split.units / (split.lanes * split.parts);
    for (offset, count) in bh_chunks(n * h) {
        attention_forward::launch::<R>(
            &client,
            CubeCount::Static(count, tq.div_ceil(rows_per_cube) as u32, 1),
            CubeDim::new_1d(split.units as u32),
            operands([q, k, v], bias, &key_valid),
            tile_valid.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            scalars.launch::<R>(offset),
            dh,
            rows.tile,
            split.lanes,
            split.parts,
            rows.stride,
            use_dropout,
            bias.is_some(),
            rows.unroll,
            q.dtype.into(),
        );
    }
    lse
}

/// The backward of `plan` (`mma`, tiled, merged or rows) on `[N, H, T, Dh]`
/// views (see [`forward_views`]): dQ into the view `dq`, dK and dV into the
/// one view `dkv` at `dkv_offsets` elements.
#[allow(clippy::too_many_arguments)]
fn backward_views<R, F, I, BT>(
    plan: Backward,
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
    let validity_tile = match plan {
        Backward::Rows(rows) => rows.tile,
        Backward::Merged(merged) => merged.validity_tile,
        _ => 16,
    };
    let (key_valid, tile_valid) =
        validity::<R, F, I, BT>(key_padding_mask, n, tk, validity_tile, &q.device);
    let client = q.client.clone();
    let scalars = HostScalars::new(scale, h, kv_offsets, dkv_offsets, dropout);
    let use_dropout = scalars.use_dropout;
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
    if let Backward::Mma(mma) = plan {
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
                    operands([q, k, v], bias, &key_valid),
                    out.clone().into_tensor_arg(),
                    dout.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    dq.clone().into_tensor_arg(),
                    delta.clone().into_tensor_arg(),
                    scalars.launch::<R>(offset),
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
                    operands([q, k, v], bias, &key_valid),
                    dout.clone().into_tensor_arg(),
                    lse.clone().into_tensor_arg(),
                    delta.clone().into_tensor_arg(),
                    dkv.clone().into_tensor_arg(),
                    scalars.launch::<R>(offset),
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
    if let Backward::Tiled(tiled) = plan {
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
                operands([q, k, v], bias, &key_valid),
                dout.clone().into_tensor_arg(),
                out.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                dkv.clone().into_tensor_arg(),
                dq.clone().into_tensor_arg(),
                scalars.launch::<R>(offset),
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
    if let Backward::Merged(merged) = plan {
        for (offset, count) in bh_chunks(n * h) {
            attention_backward_merged::launch::<R>(
                &client,
                CubeCount::Static(count, 1, 1),
                CubeDim::new_1d(merged.units as u32),
                operands([q, k, v], bias, &key_valid),
                dout.clone().into_tensor_arg(),
                out.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                dkv.clone().into_tensor_arg(),
                dq.clone().into_tensor_arg(),
                scalars.launch::<R>(offset),
                dh,
                merged.tile,
                merged.parts,
                merged.stride,
                use_dropout,
                bias.is_some(),
                tk,
                merged.key_splits,
                merged.loads,
                merged.unroll,
                q.dtype.into(),
            );
        }
        return;
    }
    let Backward::Rows(rows) = plan else {
        unreachable!("the cmma backward runs on contiguous heads (backward_contiguous)")
    };
    let (queries, keys) = (rows.queries, rows.keys);
    // Δ_i = rowsum(dO_i ⊙ O_i) in f32: written by the dQ kernel, read by
    // the dK/dV kernel launched after it.
    let delta = empty(q, Shape::new([n, h, tq]), DType::F32);
    for (offset, count) in bh_chunks(n * h) {
        attention_backward_dq::launch::<R>(
            &client,
            CubeCount::Static(count, queries.cubes as u32, 1),
            CubeDim::new_1d(queries.units as u32),
            operands([q, k, v], bias, &key_valid),
            out.clone().into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            tile_valid.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            scalars.launch::<R>(offset),
            dh,
            rows.tile,
            queries.lanes,
            queries.parts,
            rows.stride,
            use_dropout,
            bias.is_some(),
            rows.unroll,
            q.dtype.into(),
        );
        attention_backward_dkdv::launch::<R>(
            &client,
            CubeCount::Static(count, keys.cubes as u32, 1),
            CubeDim::new_1d(keys.units as u32),
            operands([q, k, v], bias, &key_valid),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            tile_valid.clone().into_tensor_arg(),
            dkv.clone().into_tensor_arg(),
            scalars.launch::<R>(offset),
            dh,
            rows.tile,
            keys.lanes,
            keys.parts,
            rows.stride,
            use_dropout,
            bias.is_some(),
            rows.unroll,
            q.dtype.into(),
        );
    }
}

/// The `cmma` forward of `plan` on contiguous heads; returns `(out, lse)`.
fn tensor_core_forward<R, F, I, BT>(
    plan: TensorCorePlan,
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
    let scalars = HostScalars::new(scale, h, [0, 0], [0, 0], dropout);
    let use_dropout = scalars.use_dropout;
    let rows_per_cube = plan.planes * TC_TILE;
    for (offset, count) in bh_chunks(n * h) {
        attention_forward_tc::launch::<R>(
            &client,
            CubeCount::Static(count, tq.div_ceil(rows_per_cube) as u32, 1),
            CubeDim::new_2d(plan.plane_size as u32, plan.planes as u32),
            operands([&q, &k, &v], None, &key_valid),
            block_valid.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            scalars.launch::<R>(offset),
            plan.head_dim,
            plan.blocks,
            plan.planes,
            plan.plane_size,
            use_dropout,
            q.dtype.into(),
        );
    }
    (out, lse)
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
    let scalars = HostScalars::new(scale, h, [0, 0], [0, 0], dropout);
    let use_dropout = scalars.use_dropout;
    for (offset, count) in bh_chunks(n * h) {
        attention_backward_dq_tc::launch::<R>(
            &client,
            CubeCount::Static(count, tq.div_ceil(plan_q.planes * TC_TILE) as u32, 1),
            CubeDim::new_2d(plan_q.plane_size as u32, plan_q.planes as u32),
            operands([&q, &k, &v], None, &key_valid),
            out.clone().into_tensor_arg(),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            block_valid.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            scalars.launch::<R>(offset),
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
            operands([&q, &k, &v], None, &key_valid),
            dout.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            block_valid.clone().into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
            scalars.launch::<R>(offset),
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

/// The [`Operands`](super::args::Operands) of a launch: `q` stands in for
/// the bias where the call has none (the kernels then read none).
fn operands<Q, K, B, R>(
    [q, k, v]: [&CubeTensor<R>; 3],
    bias: Option<&CubeTensor<R>>,
    key_valid: &CubeTensor<R>,
) -> OperandsLaunch<Q, K, B, R>
where
    Q: cubecl::prelude::CubePrimitive,
    K: cubecl::prelude::CubePrimitive,
    B: cubecl::prelude::CubePrimitive,
    R: CubeRuntime,
{
    OperandsLaunch::new(
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        bias.unwrap_or(q).clone().into_tensor_arg(),
        key_valid.clone().into_tensor_arg(),
    )
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

/// wgpu's (and WebGPU's) limit on cubes per grid dimension.
const MAX_CUBES_PER_DIM: usize = 65_535;

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
