//! A transformer layer in training, on a backend with the seeded dropout
//! kernels (wgpu; lavapipe in CI), adds the biases of the attention's output
//! projection and of both feed-forward layers in the element-wise passes
//! after them (dropout plus residual, GELU), not in passes of their own.
//! This checks the layer against the same layer written with each bias in
//! its dense layer, with the same dropout seeds: the same output and the
//! same gradients of the input and of every parameter.
#![cfg(feature = "wgpu")]

use aam_models::nn::{dropout_add, Activation};
use aam_models::set_attention_dropout_seed;
use aam_models::transformer::{TransformerEncoderLayer, TransformerEncoderLayerConfig};
use burn::backend::{Autodiff, Wgpu};
use burn::module::Param;
use burn::nn::DropoutConfig;
use burn::prelude::*;
use burn::tensor::Distribution;

type Gpu = Autodiff<Wgpu>;

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().unwrap()
}

/// Largest difference relative to the largest magnitude of `b` (floored).
fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-2);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// A bias drawn afresh (the layer initialises two of them to zero, where a
/// bias left out would not show).
fn random_bias(bias: &Param<Tensor<Gpu, 1>>) -> Param<Tensor<Gpu, 1>> {
    let b = bias.val();
    Param::from_tensor(Tensor::random(
        b.dims(),
        Distribution::Normal(0.0, 0.5),
        &b.device(),
    ))
}

#[test]
fn folded_biases_give_the_layer_s_outputs_and_gradients() {
    assert!(
        aam_kernels::seeded_dropout_runs::<Gpu>(),
        "the seeded kernels run on wgpu, so the layer folds its biases"
    );
    let device = Default::default();
    <Gpu as Backend>::seed(&device, 3);
    let (n, t, d, f, p) = (3, 19, 32, 128, 0.2);
    let mut layer: TransformerEncoderLayer<Gpu> = TransformerEncoderLayerConfig::new(d, 4, f)
        .with_dropout(p)
        .init(&device);
    layer.self_attn.in_proj_bias = random_bias(&layer.self_attn.in_proj_bias);
    for linear in [
        &mut layer.self_attn.out_proj,
        &mut layer.linear1,
        &mut layer.linear2,
    ] {
        linear.bias = linear.bias.as_ref().map(random_bias);
    }
    let x = Tensor::<Gpu, 3>::random([n, t, d], Distribution::Normal(0.0, 1.0), &device);
    // Sequences of 19, 11 and 4 keys.
    let lengths = [19, 11, 4];
    let mask = Tensor::<Gpu, 2, Int>::from_data(
        TensorData::new(
            (0..n * t)
                .map(|i| (i % t >= lengths[i / t]) as i64)
                .collect::<Vec<_>>(),
            [n, t],
        ),
        &device,
    )
    .equal_elem(1);
    let dy = Tensor::<Gpu, 3>::random([n, t, d], Distribution::Normal(0.0, 1.0), &device);

    let run = |folded: bool| -> Vec<(&'static str, Vec<f32>)> {
        let x = x.clone().require_grad();
        set_attention_dropout_seed(41);
        let y = if folded {
            layer.forward(x.clone(), Some(mask.clone()))
        } else {
            // The layer's steps with each bias in its dense layer, drawing
            // the dropout seeds in the same order.
            let dropout = DropoutConfig::new(p).init();
            let attn = layer.self_attn.self_attention_with(
                layer.norm1.forward(x.clone()),
                Some(mask.clone()),
                true,
            );
            let x1 = dropout_add(&dropout, x.clone(), attn, None);
            let h = layer.linear1.forward(layer.norm2.forward(x1.clone()));
            let ff = layer
                .linear2
                .forward_activated(h, None, Activation::Gelu, &dropout, false);
            dropout_add(&dropout, x1, ff, None)
        };
        let grads = (y.clone() * dy.clone()).sum().backward();
        let grad1 = |p: &Param<Tensor<Gpu, 1>>| values(p.val().grad(&grads).unwrap());
        let grad2 = |p: &Param<Tensor<Gpu, 2>>| values(p.val().grad(&grads).unwrap());
        let bias = |l: &aam_models::nn::Linear<Gpu>| grad1(l.bias.as_ref().unwrap());
        vec![
            ("y", values(y)),
            ("dx", values(x.grad(&grads).unwrap())),
            ("in_proj_weight", grad2(&layer.self_attn.in_proj_weight)),
            ("in_proj_bias", grad1(&layer.self_attn.in_proj_bias)),
            ("out_proj.weight", grad2(&layer.self_attn.out_proj.weight)),
            ("out_proj.bias", bias(&layer.self_attn.out_proj)),
            ("linear1.weight", grad2(&layer.linear1.weight)),
            ("linear1.bias", bias(&layer.linear1)),
            ("linear2.weight", grad2(&layer.linear2.weight)),
            ("linear2.bias", bias(&layer.linear2)),
            ("norm1.weight", grad1(&layer.norm1.weight)),
            ("norm2.bias", grad1(&layer.norm2.bias)),
        ]
    };
    let (folded, ops) = (run(true), run(false));
    for ((name, got), (_, want)) in folded.iter().zip(&ops) {
        // The same f32 arithmetic but for the order of the bias gradients'
        // sums over the rows.
        let tol = if *name == "y" { 1e-5 } else { 1e-4 };
        let err = rel(got, want);
        assert!(err <= tol, "{name}: folded off the ops by {err:e}");
    }
    // Dropout ran: a second seed gives another output.
    set_attention_dropout_seed(42);
    let other = values(layer.forward(x.clone(), Some(mask.clone())));
    assert!(rel(&other, &folded[0].1) > 1e-3, "dropout changed nothing");
}
