//! [`DropoutOps`] under Burn's fusion backend: one custom op each (the hash
//! has no element-wise IR op to fuse into).

use burn::tensor::ops::FloatTensor;
use burn::tensor::Shape;
use burn_fusion::{Fusion, FusionBackend};

use crate::fusion::{float_op, two};
use crate::{AttentionBackend, AttentionDropout, DropoutOps};

impl<B: FusionBackend + AttentionBackend> DropoutOps for Fusion<B> {
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
}
