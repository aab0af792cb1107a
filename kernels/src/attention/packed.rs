//! Self-attention on the packed projection `qkv` (torch's `in_proj` output),
//! as one op from `qkv` to the merged-heads context, and one back to `dqkv`.
//!
//! Why: split into heads by tensor ops (three narrows, reshapes and axis
//! swaps, and the merge after), a self-attention layer cost a GPU training
//! step ~26 host ops, each recorded by autodiff and by Burn's fusion stream
//! and launched by CubeCL: the backward of each narrow alone allocates a
//! zero `[N, T, 3D]` gradient, writes its third into it, and the three are
//! added. As one autodiff node (and, under fusion, one custom op each way)
//! the same work is queued once; inside it, on the inner backend, the split
//! is the copy the kernels needed anyway and `dqkv` is written by one
//! concatenation.
//!
//! The functions here are the tensor-op compositions behind the trait's
//! defaults: any backend with [`AttentionOps::fused_attention_forward`]
//! and its backward gets the packed ops from them.

use burn::prelude::*;
use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::TensorPrimitive;

use crate::{AttentionDropout, AttentionOps, KernelChoice};

/// `[N, T, D] → [N, H, T, D/H]` (a view).
fn split_heads<B: Backend>(x: Tensor<B, 3>, heads: usize) -> Tensor<B, 4> {
    let [n, t, d] = x.dims();
    x.reshape([n, t, heads, d / heads]).swap_dims(1, 2)
}

/// `[N, H, T, Dh] → [N, T, H·Dh]`.
fn merge_heads<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 3> {
    let [n, h, t, dh] = x.dims();
    x.swap_dims(1, 2).reshape([n, t, h * dh])
}

/// The query, key and value heads of `qkv [N, T, 3D]`, each `[N, H, T, Dh]`
/// and contiguous, from one copy: `qkv` seen as `[N, T, 3, H, Dh]`, laid out
/// as `[3, N, H, T, Dh]` by one reshape, then cut in three (views where the
/// cut is aligned). Narrowing first would copy each third twice (a reshape
/// of the narrowed view, then the kernels' contiguous copy of the swap).
fn split_packed<B: Backend>(qkv: FloatTensor<B>, heads: usize) -> [FloatTensor<B>; 3] {
    let qkv = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(qkv));
    let [n, t, d3] = qkv.dims();
    let dh = d3 / 3 / heads;
    let rows = n * heads;
    let heads_first = qkv
        .reshape([n, t, 3, heads, dh])
        .permute([2, 0, 3, 1, 4])
        .reshape([3 * rows, t, dh]);
    core::array::from_fn(|i| {
        heads_first
            .clone()
            .narrow(0, i * rows, rows)
            .reshape([n, heads, t, dh])
            .into_primitive()
            .tensor()
    })
}

fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// `qkv + bias` (a tensor op: the kernels behind these defaults take no bias).
fn with_bias<B: Backend>(qkv: FloatTensor<B>, bias: Option<FloatTensor<B>>) -> FloatTensor<B> {
    crate::with_row_bias(float::<B, 3>(qkv), bias.map(float::<B, 1>))
        .into_primitive()
        .tensor()
}

/// [`AttentionOps::packed_attention_forward`] from the split-heads
/// kernels: `(out [N, T, D], lse [N, H, T])`.
pub(crate) fn packed_forward_ops<B: AttentionOps>(
    qkv: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    key_padding_mask: Option<BoolTensor<B>>,
    heads: usize,
    scale: f64,
    dropout: AttentionDropout,
    kernels: KernelChoice,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let [q, k, v] = split_packed::<B>(with_bias::<B>(qkv, bias), heads);
    let (out, lse) = B::fused_attention_forward(q, k, v, key_padding_mask, scale, dropout, kernels);
    (
        merge_heads(float::<B, 4>(out)).into_primitive().tensor(),
        lse,
    )
}

/// [`AttentionOps::packed_attention_backward`] from the split-heads
/// kernels: `dqkv [N, T, 3D]`, written by one concatenation.
#[allow(clippy::too_many_arguments)]
pub(crate) fn packed_backward_ops<B: AttentionOps>(
    qkv: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    key_padding_mask: Option<BoolTensor<B>>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    dout: FloatTensor<B>,
    heads: usize,
    scale: f64,
    dropout: AttentionDropout,
    kernels: KernelChoice,
) -> FloatTensor<B> {
    let [n, t, d3] = float::<B, 3>(qkv.clone()).dims();
    let [q, k, v] = split_packed::<B>(with_bias::<B>(qkv, bias), heads);
    let as_heads = |x| {
        split_heads(float::<B, 3>(x), heads)
            .into_primitive()
            .tensor()
    };
    let (dq, dk, dv) = B::fused_attention_backward(
        q,
        k,
        v,
        key_padding_mask,
        as_heads(out),
        lse,
        as_heads(dout),
        scale,
        dropout,
        kernels,
    );
    // [N, H, T, Dh] each → [N, T, 3, H, Dh] → [N, T, 3D]: the layout of qkv.
    let per_row = [dq, dk, dv].map(|g| float::<B, 4>(g).swap_dims(1, 2));
    Tensor::stack::<5>(per_row.to_vec(), 2)
        .reshape([n, t, d3])
        .into_primitive()
        .tensor()
}
