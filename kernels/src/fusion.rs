//! The plumbing every op's `fusion.rs` shares: Burn's fusion backend
//! (`Fusion<B>`, what `burn::backend::{Cuda, Rocm, Wgpu}` are when Burn's
//! `fusion` feature is on) records operations lazily and compiles runs of
//! element-wise ops (and their reductions) into single kernels. The ops
//! here cannot be fused into anything, or gain nothing from it: each is
//! registered as one custom operation ([`CustomOp`]), which ends the fused
//! run before it and executes on the inner backend `B` with the real
//! tensors, so that the host records one op where the tensor ops were a
//! dozen or more.

use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::{DType, Shape};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use crate::AttentionBackend;

pub(crate) type Handles<B> =
    HandleContainer<<<B as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

/// The inner backend's function behind a [`CustomOp`]: the float inputs and
/// the key padding mask, if the op has one, to the outputs.
pub(crate) type InnerFn<B> =
    dyn Fn(Vec<FloatTensor<B>>, Option<BoolTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync;

/// A custom op on float tensors and an optional key padding mask (the last
/// input when `masked`): `run` maps the inputs' inner tensors to the
/// outputs' (the attention kernels, dropout, GELU, LayerNorm, the dense
/// backward, the column sum, Adam).
pub(crate) struct CustomOp<B: FusionBackend> {
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
pub(crate) fn masked_op<B: FusionBackend + AttentionBackend>(
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
pub(crate) fn float_op<B: FusionBackend + AttentionBackend>(
    name: &'static str,
    inputs: Vec<FloatTensor<Fusion<B>>>,
    outputs: Vec<(Shape, DType)>,
    run: impl Fn(Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> + Send + Sync + 'static,
) -> Vec<FloatTensor<Fusion<B>>> {
    masked_op::<B>(name, inputs, None, outputs, move |inputs, _| run(inputs))
}

/// The two outputs of a custom op that has two.
pub(crate) fn two<T>(outputs: Vec<T>, what: &str) -> (T, T) {
    let [a, b] = <[T; 2]>::try_from(outputs).unwrap_or_else(|_| panic!("{what}: two outputs"));
    (a, b)
}

/// The three outputs of a custom op that has three.
pub(crate) fn three<T>(outputs: Vec<T>, what: &str) -> (T, T, T) {
    let [a, b, c] = <[T; 3]>::try_from(outputs).unwrap_or_else(|_| panic!("{what}: three outputs"));
    (a, b, c)
}

/// An output of a custom op: a fresh tensor id with its shape and type.
pub(crate) fn output<B: FusionBackend>(
    like: &FloatTensor<Fusion<B>>,
    shape: Shape,
    dtype: DType,
) -> TensorIr {
    TensorIr::uninit(like.client.create_empty_handle(), shape, dtype)
}
