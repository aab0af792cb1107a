//! Model level: a whole SequenceEncoder (the pretrain family, with empty ASV
//! slots, a START-only ASV, an interior 0 and a one-ASV sample) gives the same
//! outputs and parameter gradients with the fused kernel and the math path.
//! Runs on wgpu (lavapipe in CI, where the attention plan leaves loops rolled
//! to keep shader compilation short).
#![cfg(feature = "wgpu")]

use std::collections::HashMap;

use aam_models::import::{infer_config, ImportHints, TorchCheckpoint};
use aam_models::model::{AamModel, ModelConfig};
use aam_models::output::ModelInput;
use aam_models::AttnImplementation;
use burn::backend::{Autodiff, Wgpu};
use burn::prelude::*;

type Gpu = Autodiff<Wgpu>;

/// Outputs, relative to each output's largest magnitude: both paths are f32;
/// the kernel's online softmax sums in another order than the math path.
const OUTPUT_RTOL: f32 = 1e-5;
/// Gradients, relative to each tensor's largest magnitude (floored at 1e-2).
const GRAD_RTOL: f32 = 1e-4;

fn fixture(name: &str) -> std::path::PathBuf {
    aam_tests::fixtures_dir().join(name)
}

fn model(
    config: &ModelConfig,
    ckpt: &TorchCheckpoint,
    attn: AttnImplementation,
    device: &burn::backend::wgpu::WgpuDevice,
) -> AamModel<Gpu> {
    let mut config = config.clone();
    if let ModelConfig::SequenceEncoder(c) = &mut config {
        c.sample.asv.attn_implementation = attn;
    }
    let mut loaded = config.init::<Gpu>(device).unwrap();
    loaded
        .load_state_dict(&config, ckpt.tensors.clone(), &ckpt.path)
        .unwrap();
    config
        .without_dropout()
        .init::<Gpu>(device)
        .unwrap()
        .with_weights_of(loaded)
}

fn tokens(device: &burn::backend::wgpu::WgpuDevice) -> Tensor<Gpu, 3, Int> {
    let npz = fixture("encoder_unifrac").join("inputs.npz");
    let mut reader = ndarray_npy::NpzReader::new(std::fs::File::open(npz).unwrap()).unwrap();
    let t: ndarray::ArrayD<i64> = reader
        .by_name("tokens.npy")
        .or_else(|_| reader.by_name("tokens"))
        .unwrap();
    Tensor::from_data(
        TensorData::new(t.iter().copied().collect::<Vec<_>>(), t.shape().to_vec()),
        device,
    )
}

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-2);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn sequence_encoder_fused_equals_math() {
    let device = Default::default();
    let ckpt = TorchCheckpoint::read(&fixture("encoder_unifrac").join("state_dict.pt")).unwrap();
    let config = infer_config(&ckpt.shapes(), &ImportHints::default(), &ckpt.path).unwrap();
    let mut results = Vec::new();
    for attn in [AttnImplementation::Math, AttnImplementation::Fused] {
        let m = model(&config, &ckpt, attn, &device);
        let input = ModelInput {
            tokens: tokens(&device).into(),
            counts: None,
            categorical_ids: None,
        };
        let outputs = m.forward_named(input, true);
        let values: HashMap<&str, Vec<f32>> = outputs
            .iter()
            .map(|(n, t)| (*n, t.to_data().convert::<f32>().to_vec::<f32>().unwrap()))
            .collect();
        let f = outputs
            .iter()
            .filter_map(|(_, t)| {
                let len = t.shape().iter().product::<usize>();
                let w: Vec<f32> = (0..len)
                    .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
                    .collect();
                t.weighted_sum(&w)
            })
            .reduce(|a, b| a + b)
            .unwrap();
        let grads = f.backward();
        let named: HashMap<String, Vec<f32>> = m
            .named_gradients(&config, &grads)
            .into_iter()
            .filter_map(|(k, g)| g.map(|g| (k, g.convert::<f32>().to_vec::<f32>().unwrap())))
            .collect();
        results.push((values, named));
    }
    let (math_out, math_grads) = &results[0];
    let (fused_out, fused_grads) = &results[1];
    for (name, want) in math_out {
        let e = rel(&fused_out[name], want);
        assert!(e <= OUTPUT_RTOL, "{name}: fused vs math rel err {e:e}");
    }
    assert_eq!(
        math_grads.len(),
        fused_grads.len(),
        "same parameters receive gradients"
    );
    let mut worst = 0f32;
    for (name, want) in math_grads {
        let e = rel(&fused_grads[name], want);
        worst = worst.max(e);
        assert!(e <= GRAD_RTOL, "grad {name}: fused vs math rel err {e:e}");
    }
    eprintln!(
        "fused vs math: worst gradient rel err {worst:e} over {} tensors",
        math_grads.len()
    );
}
