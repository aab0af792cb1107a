//! [`LayerNormOps`] under Burn's fusion backend: forward and backward one
//! custom op each (chains that fusion would split at their reductions).

use burn::tensor::ops::FloatTensor;
use burn::tensor::Shape;
use burn_fusion::{Fusion, FusionBackend};

use crate::fusion::{float_op, three};
use crate::{AttentionBackend, LayerNormOps};

impl<B: FusionBackend + AttentionBackend> LayerNormOps for Fusion<B> {
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
}
