//! [`GeluOps`] under Burn's fusion backend: one custom op each way.

use burn::tensor::ops::FloatTensor;
use burn::tensor::Shape;
use burn_fusion::{Fusion, FusionBackend};

use crate::fusion::{float_op, two};
use crate::{AttentionBackend, AttentionDropout, GeluOps};

impl<B: FusionBackend + AttentionBackend> GeluOps for Fusion<B> {
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
}
