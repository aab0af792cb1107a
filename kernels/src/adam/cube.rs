//! [`AdamOps`] on the CubeCL backends: one kernel launch per 32 parameters
//! (`kernel.rs`), which updates the moments in place.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{CubeCount, CubeDim};

use super::kernel::adam_steps_elements;
use crate::launch::empty;
use crate::{AdamItem, AdamOps, AdamStep};

impl<R, F, I, BT> AdamOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
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
}

/// One launch of [`adam_steps_elements`] over `items` (see
/// [`AdamOps::adam_steps`]): `[param, first, second]` after the
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
