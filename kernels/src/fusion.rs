//! [`AttentionBackend`] for Burn's fusion backend (`Fusion<B>`, what
//! `burn::backend::{Cuda, Rocm, Wgpu}` are when Burn's `fusion` feature is on).
//!
//! Fusion records operations lazily and compiles runs of element-wise ops
//! (and their reductions) into single kernels. The attention kernels cannot be
//! fused into anything; they are registered as custom operations, which end
//! the fused run before them and execute on the inner backend `B` with the
//! real tensors. The forward and the backward are one custom op each (on
//! split heads, or on the packed projection `qkv` from which the inner
//! backend splits them, see `packed.rs`); seeded
//! dropout is one too (its hash has no element-wise IR op to fuse into), and
//! so is an Adam step of one parameter (a dozen ops that fusion would make
//! one kernel anyway, recorded and fused by the host one by one), and so are
//! LayerNorm's forward and backward and the sum over rows (each a chain of
//! ops that fusion splits at its reductions), unpacking rows to their
//! slots (which uploads its indices when it runs), and, on CUDA, a
//! data-parallel step's sum of tensors across GPUs (NCCL all-reduces queued
//! without draining the stream).

use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::{DType, Shape};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use crate::{AdamItem, AdamStep, AttentionBackend, AttentionDropout, KernelChoice, RowSlots};

type Handles<B> =
    HandleContainer<<<B as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

/// The inner backend's function behind a [`CustomOp`]: the float inputs and
/// the key padding mask, if the op has one, to the outputs.
type InnerFn<B> =
    dyn Fn(Vec<FloatTensor<B>>, Option<BoolTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync;

/// A custom op on float tensors and an optional key padding mask (the last
/// input when `masked`): `run` maps the inputs' inner tensors to the
/// outputs' (the attention kernels, dropout, GELU, LayerNorm, the dense
/// backward, the column sum, Adam).
struct CustomOp<B: FusionBackend> {
    desc: CustomOpIr,
    masked: bool,
    run: Box<InnerFn<B>>,
}

impl<B: FusionBackend> core::fmt::Debug for CustomOp<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CustomOp")
            .field("desc", &self.desc)
            .finish()
    }
}

impl<B: FusionBackend + AttentionBackend> Operation<B::FusionRuntime> for CustomOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let (floats, mask) = match self.desc.inputs.split_last() {
            Some((mask, floats)) if self.masked => (floats, Some(mask)),
            _ => (self.desc.inputs.as_slice(), None),
        };
        let inputs = floats
            .iter()
            .map(|t| handles.get_float_tensor::<B>(t))
            .collect();
        let mask = mask.map(|m| handles.get_bool_tensor::<B>(m));
        let outputs = (self.run)(inputs, mask);
        assert_eq!(outputs.len(), self.desc.outputs.len(), "{}", self.desc.id);
        for (ir, tensor) in self.desc.outputs.iter().zip(outputs) {
            handles.register_float_tensor::<B>(&ir.id, tensor);
        }
    }
}

/// Registers `run` as the custom op `name` on `inputs` (at least one) and
/// the key padding mask, with outputs of the given shapes and types.
fn masked_op<B: FusionBackend + AttentionBackend>(
    name: &'static str,
    inputs: Vec<FloatTensor<Fusion<B>>>,
    mask: Option<BoolTensor<Fusion<B>>>,
    outputs: Vec<(Shape, DType)>,
    run: impl Fn(Vec<FloatTensor<B>>, Option<BoolTensor<B>>) -> Vec<FloatTensor<B>>
        + Send
        + Sync
        + 'static,
) -> Vec<FloatTensor<Fusion<B>>> {
    let client = inputs[0].client.clone();
    let outputs: Vec<TensorIr> = outputs
        .into_iter()
        .map(|(shape, dtype)| output::<B>(&inputs[0], shape, dtype))
        .collect();
    let mut streams = OperationStreams::default();
    for t in inputs.iter().chain(&mask) {
        streams.tensor(t);
    }
    let masked = mask.is_some();
    let inputs: Vec<TensorIr> = inputs
        .into_iter()
        .chain(mask)
        .map(|t| t.into_ir())
        .collect();
    let desc = CustomOpIr::new(name, &inputs, &outputs);
    let op = CustomOp::<B> {
        desc: desc.clone(),
        masked,
        run: Box::new(run),
    };
    client.register(streams, OperationIr::Custom(desc), op)
}

/// Registers `run` as the custom op `name` on float `inputs` (at least
/// one), with outputs of the given shapes and types.
fn float_op<B: FusionBackend + AttentionBackend>(
    name: &'static str,
    inputs: Vec<FloatTensor<Fusion<B>>>,
    outputs: Vec<(Shape, DType)>,
    run: impl Fn(Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync + 'static,
) -> Vec<FloatTensor<Fusion<B>>> {
    masked_op::<B>(name, inputs, None, outputs, move |inputs, _| run(inputs))
}

/// The two outputs of a custom op that has two.
fn two<T>(outputs: Vec<T>, what: &str) -> (T, T) {
    let [a, b] = <[T; 2]>::try_from(outputs).unwrap_or_else(|_| panic!("{what}: two outputs"));
    (a, b)
}

/// The three outputs of a custom op that has three.
fn three<T>(outputs: Vec<T>, what: &str) -> (T, T, T) {
    let [a, b, c] = <[T; 3]>::try_from(outputs).unwrap_or_else(|_| panic!("{what}: three outputs"));
    (a, b, c)
}

/// An output of a custom op: a fresh tensor id with its shape and type.
fn output<B: FusionBackend>(like: &FloatTensor<Fusion<B>>, shape: Shape, dtype: DType) -> TensorIr {
    TensorIr::uninit(like.client.create_empty_handle(), shape, dtype)
}

impl<B: FusionBackend + AttentionBackend> AttentionBackend for Fusion<B> {
    fn has_fused_attention() -> bool {
        B::has_fused_attention()
    }

    fn fuses_elementwise() -> bool {
        true
    }

    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        B::memory_reserved(device)
    }

    fn memory_in_use(device: &Self::Device) -> Option<u64> {
        B::memory_in_use(device)
    }

    fn has_seeded_dropout() -> bool {
        B::has_seeded_dropout()
    }

    fn has_collectives() -> bool {
        B::has_collectives()
    }

    #[cfg(feature = "cuda")]
    fn collective_sum(
        tensors: Vec<FloatTensor<Self>>,
        devices: &[Self::Device],
    ) -> Option<Vec<FloatTensor<Self>>> {
        if !B::has_collectives() || tensors.is_empty() {
            return None;
        }
        crate::collective::distinct_ids(devices)?;
        // One custom op for the whole sum, run in stream order on the
        // device's thread: there the inner backend queues one all-reduce per
        // tensor (in place: the inputs are consumed) and the wait of later
        // compute for them, while this thread goes on recording. Burn's
        // fusion all-reduce records an op per tensor and `sync_collective`
        // then drains the stream: two H200s trained at 397-410 samples/s
        // that way, 432-454 this way (f32, 8 samples per GPU, 2026-11-29).
        // (Laying the tensors end to end in one buffer and summing that
        // inside this op gave wrong sums: the two-GPU run's weights left
        // the one-GPU run's.)
        let like = tensors.iter().map(|t| (t.shape.clone(), t.dtype)).collect();
        let devices = devices.to_vec();
        Some(float_op::<B>(
            "aam_all_reduce_sum",
            tensors,
            like,
            move |inputs| {
                B::collective_sum(inputs, &devices)
                    .expect("the inner backend has collectives on distinct devices")
            },
        ))
    }

    fn seeded_dropout(x: FloatTensor<Self>, dropout: AttentionDropout) -> FloatTensor<Self> {
        // The input, or in the backward pass the gradient, through the mask.
        let like = (x.shape.clone(), x.dtype);
        float_op::<B>("aam_seeded_dropout", vec![x], vec![like], move |inputs| {
            vec![B::seeded_dropout(
                inputs.into_iter().next().expect("x"),
                dropout,
            )]
        })
        .pop()
        .expect("dropout output")
    }

    fn seeded_dropout_add(
        residual: FloatTensor<Self>,
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        let like = (x.shape.clone(), x.dtype);
        let mut inputs = vec![residual, x];
        inputs.extend(bias);
        float_op::<B>(
            "aam_seeded_dropout_add",
            inputs,
            vec![like],
            move |inputs| {
                let mut inputs = inputs.into_iter();
                let (residual, x) = (inputs.next().expect("residual"), inputs.next().expect("x"));
                vec![B::seeded_dropout_add(residual, x, inputs.next(), dropout)]
            },
        )
        .pop()
        .expect("dropout_add output")
    }

    fn adam_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        first: FloatTensor<Self>,
        second: FloatTensor<Self>,
        step: AdamStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let like = (param.shape.clone(), param.dtype);
        let out = float_op::<B>(
            "aam_adam_step",
            vec![param, grad, first, second],
            vec![like.clone(), like.clone(), like],
            move |inputs| {
                let [p, g, m, v] = <[_; 4]>::try_from(inputs).expect("four inputs");
                let (p, m, v) = B::adam_step(p, g, m, v, step);
                vec![p, m, v]
            },
        );
        three(out, "adam step output")
    }

    fn adam_steps(items: Vec<AdamItem<Self>>) -> Vec<[FloatTensor<Self>; 3]> {
        if items.is_empty() {
            return Vec::new();
        }
        let mut inputs = Vec::with_capacity(4 * items.len());
        let mut outputs = Vec::with_capacity(3 * items.len());
        let mut steps = Vec::with_capacity(items.len());
        for item in items {
            for t in [&item.param, &item.first, &item.second] {
                outputs.push((t.shape.clone(), t.dtype));
            }
            inputs.extend([item.param, item.grad, item.first, item.second]);
            steps.push(item.step);
        }
        let steps_len = steps.len();
        let out = float_op::<B>("aam_adam_steps", inputs, outputs, move |inputs| {
            let mut inputs = inputs.into_iter();
            let mut next = || inputs.next().expect("four inputs per parameter");
            let items = steps
                .iter()
                .map(|&step| AdamItem {
                    param: next(),
                    grad: next(),
                    first: next(),
                    second: next(),
                    step,
                })
                .collect();
            B::adam_steps(items).into_iter().flatten().collect()
        });
        let mut out = out.into_iter();
        let mut next = || out.next().expect("three outputs per parameter");
        (0..steps_len).map(|_| [next(), next(), next()]).collect()
    }

    fn dense_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        want: [bool; 3],
    ) -> (
        Option<FloatTensor<Self>>,
        Option<FloatTensor<Self>>,
        Option<FloatTensor<Self>>,
    ) {
        let shapes = [
            (x.shape.clone(), x.dtype),
            (weight.shape.clone(), weight.dtype),
            (Shape::new([weight.shape[0]]), weight.dtype),
        ];
        let outputs = shapes
            .into_iter()
            .zip(want)
            .filter_map(|(shape, wanted)| wanted.then_some(shape))
            .collect();
        let mut out = float_op::<B>(
            "aam_dense_backward",
            vec![x, weight, dy],
            outputs,
            move |inputs| {
                let [x, weight, dy] = <[_; 3]>::try_from(inputs).expect("three inputs");
                let (dx, dw, db) = B::dense_backward(x, weight, dy, want);
                [dx, dw, db].into_iter().flatten().collect()
            },
        )
        .into_iter();
        let mut next = |wanted: bool| wanted.then(|| out.next().expect("dense gradient"));
        (next(want[0]), next(want[1]), next(want[2]))
    }

    fn gelu_exact(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let like = (x.shape.clone(), x.dtype);
        float_op::<B>("aam_gelu", vec![x], vec![like], |inputs| {
            vec![B::gelu_exact(inputs.into_iter().next().expect("x"))]
        })
        .pop()
        .expect("gelu output")
    }

    fn gelu_exact_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        let like = (dy.shape.clone(), dy.dtype);
        float_op::<B>("aam_gelu_backward", vec![x, dy], vec![like], |inputs| {
            let [x, dy] = <[_; 2]>::try_from(inputs).expect("two inputs");
            vec![B::gelu_exact_backward(x, dy)]
        })
        .pop()
        .expect("gelu gradient")
    }

    fn gelu_exact_dropout(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        let like = (x.shape.clone(), x.dtype);
        let mut inputs = vec![x];
        inputs.extend(bias);
        float_op::<B>("aam_gelu_dropout", inputs, vec![like], move |inputs| {
            let mut inputs = inputs.into_iter();
            let x = inputs.next().expect("x");
            vec![B::gelu_exact_dropout(x, inputs.next(), dropout)]
        })
        .pop()
        .expect("gelu dropout output")
    }

    fn gelu_exact_dropout_backward(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        let like = (dy.shape.clone(), dy.dtype);
        let mut inputs = vec![x, dy];
        inputs.extend(bias);
        float_op::<B>(
            "aam_gelu_dropout_backward",
            inputs,
            vec![like],
            move |inputs| {
                let mut inputs = inputs.into_iter();
                let (x, dy) = (inputs.next().expect("x"), inputs.next().expect("dy"));
                vec![B::gelu_exact_dropout_backward(
                    x,
                    inputs.next(),
                    dy,
                    dropout,
                )]
            },
        )
        .pop()
        .expect("gelu dropout gradient")
    }

    fn attention_pool_with_stats(
        x: FloatTensor<Self>,
        query: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [n, d] = [x.shape[0], x.shape[2]];
        let pooled = (Shape::new([n, d]), x.dtype);
        let lse = (Shape::new([n]), DType::F32);
        let out = float_op::<B>(
            "aam_attention_pool",
            vec![x, query, valid],
            vec![pooled, lse],
            move |inputs| {
                let [x, query, valid] = <[_; 3]>::try_from(inputs).expect("three inputs");
                let (pooled, lse) = B::attention_pool_with_stats(x, query, valid, scale);
                vec![pooled, lse]
            },
        );
        two(out, "attention pool output")
    }

    fn attention_pool_backward(
        x: FloatTensor<Self>,
        query: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let dx = (x.shape.clone(), x.dtype);
        let dquery = (query.shape.clone(), query.dtype);
        let out = float_op::<B>(
            "aam_attention_pool_backward",
            vec![x, query, valid, lse, dy],
            vec![dx, dquery],
            move |inputs| {
                let [x, query, valid, lse, dy] = <[_; 5]>::try_from(inputs).expect("five inputs");
                let (dx, dquery) = B::attention_pool_backward(x, query, valid, lse, dy, scale);
                vec![dx, dquery]
            },
        );
        two(out, "attention pool gradients")
    }

    fn layer_norm_with_stats(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let rows = x.shape[0];
        let like = (x.shape.clone(), x.dtype);
        let stats = (Shape::new([rows, 1]), x.dtype);
        let mut inputs = vec![x, gamma];
        inputs.extend(beta);
        let out = float_op::<B>(
            "aam_layer_norm",
            inputs,
            vec![like.clone(), like, stats],
            move |inputs| {
                let mut inputs = inputs.into_iter();
                let (x, gamma) = (inputs.next().expect("x"), inputs.next().expect("γ"));
                let (y, normalised, r) = B::layer_norm_with_stats(x, gamma, inputs.next(), eps);
                vec![y, normalised, r]
            },
        );
        three(out, "layer norm output")
    }

    fn layer_norm_backward(
        normalised: FloatTensor<Self>,
        r: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        dx_add: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let like = (dy.shape.clone(), dy.dtype);
        let column = (gamma.shape.clone(), gamma.dtype);
        let mut inputs = vec![normalised, r, gamma, dy];
        inputs.extend(dx_add);
        let out = float_op::<B>(
            "aam_layer_norm_backward",
            inputs,
            vec![like, column.clone(), column],
            |inputs| {
                let mut inputs = inputs.into_iter();
                let mut next = || inputs.next().expect("four inputs");
                let (normalised, r, gamma, dy) = (next(), next(), next(), next());
                let (dx, dgamma, dbeta) =
                    B::layer_norm_backward(normalised, r, gamma, dy, inputs.next());
                vec![dx, dgamma, dbeta]
            },
        );
        three(out, "layer norm gradient")
    }

    fn unpack_rows(
        packed: FloatTensor<Self>,
        fill: FloatTensor<Self>,
        slots: &RowSlots,
    ) -> FloatTensor<Self> {
        let out = (Shape::new([slots.slots(), packed.shape[1]]), packed.dtype);
        let slots = slots.clone();
        float_op::<B>(
            "aam_unpack_rows",
            vec![packed, fill],
            vec![out],
            move |inputs| {
                let [packed, fill] = <[_; 2]>::try_from(inputs).expect("packed and fill");
                vec![B::unpack_rows(packed, fill, &slots)]
            },
        )
        .pop()
        .expect("unpacked rows")
    }

    fn unpack_rows_backward(
        dout: FloatTensor<Self>,
        slots: &RowSlots,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let width = dout.shape[1];
        let outputs = vec![
            (Shape::new([slots.rows(), width]), dout.dtype),
            (Shape::new([1, width]), dout.dtype),
        ];
        let slots = slots.clone();
        let outputs = float_op::<B>(
            "aam_unpack_rows_backward",
            vec![dout],
            outputs,
            move |inputs| {
                let dout = inputs.into_iter().next().expect("dout");
                let (dpacked, dfill) = B::unpack_rows_backward(dout, &slots);
                vec![dpacked, dfill]
            },
        );
        two(outputs, "unpack rows backward")
    }

    fn dense(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        // One custom op on the inner backend, whose product runs on the
        // validated kernels with the weight as a transposed view (Burn's
        // fused matmul autotunes over every kernel, three of them wrong on
        // some layouts; `dense.rs`).
        let out = (Shape::new([x.shape[0], weight.shape[0]]), x.dtype);
        let mut inputs = vec![x, weight];
        inputs.extend(bias);
        float_op::<B>("aam_dense", inputs, vec![out], |inputs| {
            let mut inputs = inputs.into_iter();
            let (x, w) = (inputs.next().expect("x"), inputs.next().expect("weight"));
            vec![B::dense(x, w, inputs.next())]
        })
        .pop()
        .expect("dense output")
    }

    fn seeded_dropout_column_sum(
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let like = (dy.shape.clone(), dy.dtype);
        let column = (Shape::new([dy.shape[dy.shape.num_dims() - 1]]), dy.dtype);
        let out = float_op::<B>(
            "aam_seeded_dropout_column_sum",
            vec![dy],
            vec![like, column],
            move |inputs| {
                let dy = inputs.into_iter().next().expect("dy");
                let (dx, sum) = B::seeded_dropout_column_sum(dy, dropout);
                vec![dx, sum]
            },
        );
        two(out, "dropout gradient and its column sum")
    }

    fn gelu_exact_dropout_backward_column_sum(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let like = (dy.shape.clone(), dy.dtype);
        let column = (Shape::new([dy.shape[dy.shape.num_dims() - 1]]), dy.dtype);
        let mut inputs = vec![x, dy];
        inputs.extend(bias);
        let out = float_op::<B>(
            "aam_gelu_dropout_backward_column_sum",
            inputs,
            vec![like, column],
            move |inputs| {
                let mut inputs = inputs.into_iter();
                let (x, dy) = (inputs.next().expect("x"), inputs.next().expect("dy"));
                let (dx, sum) =
                    B::gelu_exact_dropout_backward_column_sum(x, inputs.next(), dy, dropout);
                vec![dx, sum]
            },
        );
        two(out, "GELU gradient and its column sum")
    }

    fn column_sum(t: FloatTensor<Self>) -> FloatTensor<Self> {
        let column = (Shape::new([t.shape[1]]), t.dtype);
        float_op::<B>("aam_column_sum", vec![t], vec![column], |inputs| {
            vec![B::column_sum(inputs.into_iter().next().expect("one input"))]
        })
        .pop()
        .expect("column sum")
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
        let dims = q.shape.clone();
        let out = (dims.clone(), q.dtype);
        let lse = (Shape::new([dims[0], dims[1], dims[2]]), DType::F32);
        let outputs = masked_op::<B>(
            "aam_fused_attention_forward",
            vec![q, k, v],
            key_padding_mask,
            vec![out, lse],
            move |inputs, mask| {
                let [q, k, v] = <[_; 3]>::try_from(inputs).expect("q, k, v");
                let (out, lse) = B::fused_attention_forward(q, k, v, mask, scale, dropout, kernels);
                vec![out, lse]
            },
        );
        two(outputs, "attention output and row statistics")
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
        let shapes = [&q, &k, &v].map(|t| (t.shape.clone(), q.dtype));
        let grads = masked_op::<B>(
            "aam_fused_attention_backward",
            vec![q, k, v, out, lse, dout],
            key_padding_mask,
            shapes.to_vec(),
            move |inputs, mask| {
                let [q, k, v, out, lse, dout] =
                    <[_; 6]>::try_from(inputs).expect("q, k, v, out, lse, dout");
                let (dq, dk, dv) = B::fused_attention_backward(
                    q, k, v, mask, out, lse, dout, scale, dropout, kernels,
                );
                vec![dq, dk, dv]
            },
        );
        three(grads, "attention gradient")
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
        let [n, t, d3] = qkv.shape.dims();
        let out = (Shape::new([n, t, d3 / 3]), qkv.dtype);
        let lse = (Shape::new([n, heads, t]), DType::F32);
        let mut inputs = vec![qkv];
        inputs.extend(bias);
        let outputs = masked_op::<B>(
            "aam_packed_attention_forward",
            inputs,
            key_padding_mask,
            vec![out, lse],
            move |inputs, mask| {
                let mut inputs = inputs.into_iter();
                let qkv = inputs.next().expect("qkv");
                let (out, lse) = B::packed_attention_forward(
                    qkv,
                    inputs.next(),
                    mask,
                    heads,
                    scale,
                    dropout,
                    kernels,
                );
                vec![out, lse]
            },
        );
        two(outputs, "packed attention output and row statistics")
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
        let like = (qkv.shape.clone(), qkv.dtype);
        let mut inputs = vec![qkv, out, lse, dout];
        inputs.extend(bias);
        masked_op::<B>(
            "aam_packed_attention_backward",
            inputs,
            key_padding_mask,
            vec![like],
            move |inputs, mask| {
                let mut inputs = inputs.into_iter();
                let mut next = || inputs.next().expect("qkv, out, lse, dout");
                let (qkv, out, lse, dout) = (next(), next(), next(), next());
                vec![B::packed_attention_backward(
                    qkv,
                    inputs.next(),
                    mask,
                    out,
                    lse,
                    dout,
                    heads,
                    scale,
                    dropout,
                    kernels,
                )]
            },
        )
        .pop()
        .expect("packed attention gradient")
    }
}
