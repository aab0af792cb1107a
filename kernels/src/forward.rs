//! [`AttentionBackend`] for the CubeCL backends (wgpu, CUDA, ROCm/HIP). The
//! attention calls go to `attention::launch`; the element-wise and row ops
//! (GELU, dropout, LayerNorm, column sums, attention pooling, Adam) make
//! their inputs contiguous, allocate the outputs and launch their kernel; the
//! dense layers' products are tuned over a list of validated matmul kernels
//! instead of all of Burn's autotune candidates (three of those are wrong at
//! shapes their bucket admits; [`dense_matmul_candidates`]).

use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::{DType, Shape, Tensor};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{CubeCount, CubeDim};

use crate::attention;
use crate::kernel::{
    adam_steps_elements, attention_pool_backward_rows, attention_pool_rows, column_partial_sums,
    dropout_elements, gelu_backward_elements, gelu_elements, gradient_column_partials,
    layer_norm_backward_rows, layer_norm_backward_rows_sums, layer_norm_rows, sum_partials,
    SUM_PARTIALS_COLUMNS,
};
use crate::launch::{dropout_args, empty, one_unit_each};
use crate::{AdamItem, AdamStep, AttentionBackend, AttentionDropout, KernelChoice};
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

    #[cfg(feature = "cuda")]
    fn has_collectives() -> bool {
        crate::collective::runtime_has_collectives::<R>()
    }

    #[cfg(feature = "cuda")]
    fn collective_sum(
        tensors: Vec<FloatTensor<Self>>,
        devices: &[Self::Device],
    ) -> Option<Vec<FloatTensor<Self>>> {
        crate::collective::cube_sum::<R, F, I, BT>(tensors, devices)
    }

    fn dense_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::matmul::dense_matmul(a, b)
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
        kernels: KernelChoice,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        attention::launch::forward::<R, F, I, BT>(
            [q, k, v],
            key_padding_mask,
            scale,
            dropout,
            kernels,
        )
    }

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
        kernels: KernelChoice,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        attention::launch::backward::<R, F, I, BT>(
            [q, k, v],
            key_padding_mask,
            [out, lse, dout],
            scale,
            dropout,
            kernels,
        )
    }

    fn packed_attention_forward(
        qkv: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        key_padding_mask: Option<BoolTensor<Self>>,
        heads: usize,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        attention::launch::packed_forward::<R, F, I, BT>(
            qkv,
            bias,
            key_padding_mask,
            heads,
            scale,
            dropout,
            kernels,
        )
    }

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
        kernels: KernelChoice,
    ) -> FloatTensor<Self> {
        attention::launch::packed_backward::<R, F, I, BT>(
            qkv,
            bias,
            key_padding_mask,
            [out, lse, dout],
            heads,
            scale,
            dropout,
            kernels,
        )
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
