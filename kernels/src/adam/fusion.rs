//! [`AdamOps`] under Burn's fusion backend: the step of one parameter, or of
//! all of a step's parameters, as one custom op.

use burn::tensor::ops::FloatTensor;
use burn_fusion::{Fusion, FusionBackend};

use crate::fusion::{float_op, three};
use crate::{AdamItem, AdamOps, AdamStep, AttentionBackend};

impl<B: FusionBackend + AttentionBackend> AdamOps for Fusion<B> {
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
}
