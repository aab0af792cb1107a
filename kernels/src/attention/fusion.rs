//! [`AttentionOps`] under Burn's fusion backend: the forward and the backward
//! one custom op each, on split heads or on the packed projection
//! (`packed.rs`): they end the fused run before them and execute on the
//! inner backend.

use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::{DType, Shape};
use burn_fusion::{Fusion, FusionBackend};

use crate::fusion::{masked_op, three, two};
use crate::{AttentionBackend, AttentionDropout, AttentionOps, KernelChoice};

impl<B: FusionBackend + AttentionBackend> AttentionOps for Fusion<B> {
    fn has_fused_attention() -> bool {
        B::has_fused_attention()
    }

    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let dims = q.shape.clone();
        let out = (dims.clone(), q.dtype);
        let lse = (Shape::new([dims[0], dims[1], dims[2]]), DType::F32);
        let outputs = masked_op::<B>(
            "aam_fused_attention_forward",
            vec![q, k, v],
            key_padding_mask,
            vec![out, lse],
            move |inputs, mask| {
                let [q, k, v] = <[_; 3]>::try_from(inputs).expect("q, k, v");
                let (out, lse) = B::fused_attention_forward(q, k, v, mask, scale, dropout, kernels);
                vec![out, lse]
            },
        );
        two(outputs, "attention output and row statistics")
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
        kernels: KernelChoice,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let shapes = [&q, &k, &v].map(|t| (t.shape.clone(), q.dtype));
        let grads = masked_op::<B>(
            "aam_fused_attention_backward",
            vec![q, k, v, out, lse, dout],
            key_padding_mask,
            shapes.to_vec(),
            move |inputs, mask| {
                let [q, k, v, out, lse, dout] =
                    <[_; 6]>::try_from(inputs).expect("q, k, v, out, lse, dout");
                let (dq, dk, dv) = B::fused_attention_backward(
                    q, k, v, mask, out, lse, dout, scale, dropout, kernels,
                );
                vec![dq, dk, dv]
            },
        );
        three(grads, "attention gradient")
    }

    fn packed_attention_forward(
        qkv: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        key_padding_mask: Option<BoolTensor<Self>>,
        heads: usize,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let [n, t, d3] = qkv.shape.dims();
        let out = (Shape::new([n, t, d3 / 3]), qkv.dtype);
        let lse = (Shape::new([n, heads, t]), DType::F32);
        let mut inputs = vec![qkv];
        inputs.extend(bias);
        let outputs = masked_op::<B>(
            "aam_packed_attention_forward",
            inputs,
            key_padding_mask,
            vec![out, lse],
            move |inputs, mask| {
                let mut inputs = inputs.into_iter();
                let qkv = inputs.next().expect("qkv");
                let (out, lse) = B::packed_attention_forward(
                    qkv,
                    inputs.next(),
                    mask,
                    heads,
                    scale,
                    dropout,
                    kernels,
                );
                vec![out, lse]
            },
        );
        two(outputs, "packed attention output and row statistics")
    }

    fn packed_attention_backward(
        qkv: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        key_padding_mask: Option<BoolTensor<Self>>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> FloatTensor<Self> {
        let like = (qkv.shape.clone(), qkv.dtype);
        let mut inputs = vec![qkv, out, lse, dout];
        inputs.extend(bias);
        masked_op::<B>(
            "aam_packed_attention_backward",
            inputs,
            key_padding_mask,
            vec![like],
            move |inputs, mask| {
                let mut inputs = inputs.into_iter();
                let mut next = || inputs.next().expect("qkv, out, lse, dout");
                let (qkv, out, lse, dout) = (next(), next(), next(), next());
                vec![B::packed_attention_backward(
                    qkv,
                    inputs.next(),
                    mask,
                    out,
                    lse,
                    dout,
                    heads,
                    scale,
                    dropout,
                    kernels,
                )]
            },
        )
        .pop()
        .expect("packed attention gradient")
    }
}
