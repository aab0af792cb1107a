//! [`PoolOps`] under Burn's fusion backend: one custom op each way.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_fusion::{Fusion, FusionBackend};

use crate::fusion::{float_op, two};
use crate::{AttentionBackend, PoolOps};

impl<B: FusionBackend + AttentionBackend> PoolOps for Fusion<B> {
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
}
