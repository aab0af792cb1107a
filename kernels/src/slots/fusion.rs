//! [`SlotOps`] under Burn's fusion backend: one custom op each way, which
//! uploads the slot indices when it runs.

use burn::tensor::ops::FloatTensor;
use burn::tensor::Shape;
use burn_fusion::{Fusion, FusionBackend};

use crate::fusion::{float_op, two};
use crate::{AttentionBackend, RowSlots, SlotOps};

impl<B: FusionBackend + AttentionBackend> SlotOps for Fusion<B> {
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
}
