//! [`AttentionBackend`] for Burn's fusion backend (`Fusion<B>`, what
//! `burn::backend::{Cuda, Rocm, Wgpu}` are when Burn's `fusion` feature is on).
//!
//! Fusion records operations lazily and compiles runs of element-wise ops
//! (and their reductions) into single kernels. The attention kernels cannot be
//! fused into anything; they are registered as custom operations, which end
//! the fused run before them and execute on the inner backend `B` with the
//! real tensors. The forward and the backward are one custom op each; seeded
//! dropout is one too (its hash has no element-wise IR op to fuse into), and
//! so is an Adam step of one parameter (a dozen ops that fusion would make
//! one kernel anyway, recorded and fused by the host one by one), and so are
//! LayerNorm's forward and backward and the sum over rows (each a chain of
//! ops that fusion splits at its reductions).

use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::{DType, Shape};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use crate::{AdamStep, AttentionBackend, AttentionDropout};

type Handles<B> =
    HandleContainer<<<B as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

/// The forward kernel: inputs `q, k, v[, mask]`, outputs `out, lse`.
#[derive(Debug)]
struct ForwardOp<B> {
    desc: CustomOpIr,
    scale: f64,
    dropout: AttentionDropout,
    _backend: core::marker::PhantomData<B>,
}

impl<B: FusionBackend + AttentionBackend> Operation<B::FusionRuntime> for ForwardOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let inputs = &self.desc.inputs;
        let [out_ir, lse_ir] = self.desc.outputs.as_slice() else {
            unreachable!("the attention forward has two outputs")
        };
        let q = handles.get_float_tensor::<B>(&inputs[0]);
        let k = handles.get_float_tensor::<B>(&inputs[1]);
        let v = handles.get_float_tensor::<B>(&inputs[2]);
        let mask = inputs.get(3).map(|m| handles.get_bool_tensor::<B>(m));
        let (out, lse) = B::fused_attention_forward(q, k, v, mask, self.scale, self.dropout);
        handles.register_float_tensor::<B>(&out_ir.id, out);
        handles.register_float_tensor::<B>(&lse_ir.id, lse);
    }
}

/// The backward kernels: inputs `q, k, v, out, lse, dout[, mask]`, outputs
/// `dq, dk, dv`.
#[derive(Debug)]
struct BackwardOp<B> {
    desc: CustomOpIr,
    scale: f64,
    dropout: AttentionDropout,
    _backend: core::marker::PhantomData<B>,
}

impl<B: FusionBackend + AttentionBackend> Operation<B::FusionRuntime> for BackwardOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let inputs = &self.desc.inputs;
        let [dq_ir, dk_ir, dv_ir] = self.desc.outputs.as_slice() else {
            unreachable!("the attention backward has three outputs")
        };
        let mut float = |i: usize| handles.get_float_tensor::<B>(&inputs[i]);
        let (q, k, v, out, lse, dout) =
            (float(0), float(1), float(2), float(3), float(4), float(5));
        let mask = inputs.get(6).map(|m| handles.get_bool_tensor::<B>(m));
        let (dq, dk, dv) =
            B::fused_attention_backward(q, k, v, mask, out, lse, dout, self.scale, self.dropout);
        handles.register_float_tensor::<B>(&dq_ir.id, dq);
        handles.register_float_tensor::<B>(&dk_ir.id, dk);
        handles.register_float_tensor::<B>(&dv_ir.id, dv);
    }
}

/// The inner backend's function behind a [`FloatOp`].
type InnerFn<B> = dyn Fn(Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync;

/// A custom op on float tensors only: `run` maps the inputs' inner tensors to
/// the outputs' (dropout, GELU, LayerNorm, the dense backward, the column
/// sum, Adam).
struct FloatOp<B: FusionBackend> {
    desc: CustomOpIr,
    run: Box<InnerFn<B>>,
}

impl<B: FusionBackend> core::fmt::Debug for FloatOp<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("FloatOp").field("desc", &self.desc).finish()
    }
}

impl<B: FusionBackend + AttentionBackend> Operation<B::FusionRuntime> for FloatOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let inputs = self
            .desc
            .inputs
            .iter()
            .map(|t| handles.get_float_tensor::<B>(t))
            .collect();
        let outputs = (self.run)(inputs);
        assert_eq!(outputs.len(), self.desc.outputs.len(), "{}", self.desc.id);
        for (ir, tensor) in self.desc.outputs.iter().zip(outputs) {
            handles.register_float_tensor::<B>(&ir.id, tensor);
        }
    }
}

/// Registers `run` as the custom op `name` on `inputs` (at least one), with
/// outputs of the given shapes and types.
fn float_op<B: FusionBackend + AttentionBackend>(
    name: &'static str,
    inputs: Vec<FloatTensor<Fusion<B>>>,
    outputs: Vec<(Shape, DType)>,
    run: impl Fn(Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync + 'static,
) -> Vec<FloatTensor<Fusion<B>>> {
    let client = inputs[0].client.clone();
    let outputs: Vec<TensorIr> = outputs
        .into_iter()
        .map(|(shape, dtype)| output::<B>(&inputs[0], shape, dtype))
        .collect();
    let mut streams = OperationStreams::default();
    for t in &inputs {
        streams.tensor(t);
    }
    let inputs: Vec<TensorIr> = inputs.into_iter().map(|t| t.into_ir()).collect();
    let desc = CustomOpIr::new(name, &inputs, &outputs);
    let op = FloatOp::<B> {
        desc: desc.clone(),
        run: Box::new(run),
    };
    client.register(streams, OperationIr::Custom(desc), op)
}

/// The three outputs of a [`float_op`] that has three.
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
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let like = (dy.shape.clone(), dy.dtype);
        let column = (gamma.shape.clone(), gamma.dtype);
        let out = float_op::<B>(
            "aam_layer_norm_backward",
            vec![normalised, r, gamma, dy],
            vec![like, column.clone(), column],
            |inputs| {
                let [normalised, r, gamma, dy] = <[_; 4]>::try_from(inputs).expect("four inputs");
                let (dx, dgamma, dbeta) = B::layer_norm_backward(normalised, r, gamma, dy);
                vec![dx, dgamma, dbeta]
            },
        );
        three(out, "layer norm gradient")
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
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let client = q.client.clone();
        let dims = q.shape.clone();
        let out = output::<B>(&q, dims.clone(), q.dtype);
        let lse = output::<B>(&q, Shape::new([dims[0], dims[1], dims[2]]), DType::F32);
        let mut streams = OperationStreams::with_inputs([&q, &k, &v]);
        if let Some(mask) = &key_padding_mask {
            streams.tensor(mask);
        }
        let mut inputs = vec![q.into_ir(), k.into_ir(), v.into_ir()];
        inputs.extend(key_padding_mask.map(|m| m.into_ir()));
        let desc = CustomOpIr::new("aam_fused_attention_forward", &inputs, &[out, lse]);
        let op = ForwardOp::<B> {
            desc: desc.clone(),
            scale,
            dropout,
            _backend: core::marker::PhantomData,
        };
        let mut outputs = client
            .register(streams, OperationIr::Custom(desc), op)
            .into_iter();
        let out = outputs.next().expect("attention output");
        let lse = outputs.next().expect("attention row statistics");
        (out, lse)
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
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let client = q.client.clone();
        let dq = output::<B>(&q, q.shape.clone(), q.dtype);
        let dk = output::<B>(&q, k.shape.clone(), q.dtype);
        let dv = output::<B>(&q, v.shape.clone(), q.dtype);
        let mut streams = OperationStreams::with_inputs([&q, &k, &v, &out, &lse, &dout]);
        if let Some(mask) = &key_padding_mask {
            streams.tensor(mask);
        }
        let mut inputs = vec![
            q.into_ir(),
            k.into_ir(),
            v.into_ir(),
            out.into_ir(),
            lse.into_ir(),
            dout.into_ir(),
        ];
        inputs.extend(key_padding_mask.map(|m| m.into_ir()));
        let desc = CustomOpIr::new("aam_fused_attention_backward", &inputs, &[dq, dk, dv]);
        let op = BackwardOp::<B> {
            desc: desc.clone(),
            scale,
            dropout,
            _backend: core::marker::PhantomData,
        };
        let mut grads = client
            .register(streams, OperationIr::Custom(desc), op)
            .into_iter();
        let mut next = || grads.next().expect("attention gradient");
        (next(), next(), next())
    }
}
