//! [`DenseOps`] under Burn's fusion backend: the dense layer's forward, its
//! backward and the column sum as one custom op each (matmuls and
//! reductions, which fusion would not merge anyway).

use burn::tensor::ops::FloatTensor;
use burn::tensor::Shape;
use burn_fusion::{Fusion, FusionBackend};

use crate::fusion::float_op;
use crate::{AttentionBackend, DenseOps};

impl<B: FusionBackend + AttentionBackend> DenseOps for Fusion<B> {
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

    fn dense(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        // One custom op on the inner backend, whose product runs on the
        // validated kernels with the weight as a transposed view (Burn's
        // fused matmul autotunes over every kernel, three of them wrong on
        // some layouts; `dense/mod.rs`).
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

    fn column_sum(t: FloatTensor<Self>) -> FloatTensor<Self> {
        let column = (Shape::new([t.shape[1]]), t.dtype);
        float_op::<B>("aam_column_sum", vec![t], vec![column], |inputs| {
            vec![B::column_sum(inputs.into_iter().next().expect("one input"))]
        })
        .pop()
        .expect("column sum")
    }
}
