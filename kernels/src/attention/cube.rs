//! [`AttentionOps`] on the CubeCL backends: each call goes to the plan and
//! its launches (`launch.rs`).

use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use crate::{AttentionDropout, AttentionOps, KernelChoice};

impl<R, F, I, BT> AttentionOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn has_fused_attention() -> bool {
        true
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
        super::launch::forward::<R, F, I, BT>([q, k, v], key_padding_mask, scale, dropout, kernels)
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
        super::launch::backward::<R, F, I, BT>(
            [q, k, v],
            key_padding_mask,
            [out, lse, dout],
            scale,
            dropout,
            kernels,
        )
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
        super::launch::packed_forward::<R, F, I, BT>(
            qkv,
            bias,
            key_padding_mask,
            heads,
            scale,
            dropout,
            kernels,
        )
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
        super::launch::packed_backward::<R, F, I, BT>(
            qkv,
            bias,
            key_padding_mask,
            [out, lse, dout],
            heads,
            scale,
            dropout,
            kernels,
        )
    }
}
