//! The training step's gradients on a GPU backend equal the CPU's. This is
//! the whole pretraining loss (UniFrac and nucleotides) of a real batch, on
//! the same weights: 8 demo samples (oral2550) whose ASVs are 100 nt, so
//! every ASV row has 50 padding positions. The sample level runs on the
//! filled slots. The parity suite's fixtures compare model outputs and
//! gradients of weighted outputs; this test goes through `batch_tensors`,
//! the packed ASV rows and the losses, as `pretrain` does. No dropout or
//! masking, whose random draws differ between backends.
//!
//! Runs on wgpu (lavapipe in CI).
#![cfg(feature = "wgpu")]

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use aam_data::{
    BatchConfig, BatchLoader, BiomTable, Dataset, DistanceMatrix, MatrixIds, MissingPolicy,
};
use aam_models::asv_encoder::AsvEncoderConfig;
use aam_models::import::{AamModel, ModelConfig, StateTensor};
use aam_models::sample_encoder::SampleSequenceEncoderConfig;
use aam_models::sequence_encoder::SequenceEncoderConfig;
use aam_models::AttentionBackend;
use aam_train::loss::LossConfig;
use aam_train::run::{batch_tensors, predict_batch, Slots};
use burn::backend::{Autodiff, NdArray, Wgpu};
use burn::prelude::*;

/// Losses: f32 on both sides, reductions in other orders.
const LOSS_RTOL: f32 = 1e-5;
/// Gradients, relative to each tensor's largest magnitude (floored at 1e-3).
const GRAD_RTOL: f32 = 1e-3;

/// `(unifrac loss, nucleotide loss, gradients by torch key)` of one step.
type Step = (f32, f32, HashMap<String, Vec<f32>>);

fn step<B: AttentionBackend>(
    config: &ModelConfig,
    state: &HashMap<String, StateTensor>,
    batch: &aam_data::Batch,
    device: &B::Device,
) -> Step {
    let mut model: AamModel<Autodiff<B>> = config.init(device).unwrap();
    model
        .load_state_dict(config, state.clone(), Path::new("the CPU model"))
        .unwrap();
    let (input, targets) = batch_tensors::<Autodiff<B>>(batch, device, false, Slots::Filled);
    let predictions = predict_batch(&model, input, true);
    let parts = LossConfig::default()
        .forward(&predictions, &targets)
        .unwrap();
    let scalar = |t: Option<Tensor<Autodiff<B>, 1>>| -> f32 { t.unwrap().into_scalar().elem() };
    let (unifrac, nuc) = (scalar(parts.unifrac.clone()), scalar(parts.nuc.clone()));
    let grads = parts.total.backward();
    let named = model
        .named_gradients(config, &grads)
        .into_iter()
        .filter_map(|(k, g)| g.map(|g| (k, g.convert::<f32>().to_vec::<f32>().unwrap())))
        .collect();
    (unifrac, nuc, named)
}

#[test]
fn wgpu_training_gradients_equal_the_cpus_on_a_real_batch() {
    // Unrolling only changes code generation; lavapipe compiles faster without.
    std::env::set_var("AAM_KERNEL_UNROLL", "0");
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates/data/demo");
    let table = BiomTable::read(demo.join("demo.biom"))
        .unwrap()
        .rarefy(500, 7)
        .unwrap()
        .table;
    let matrix =
        DistanceMatrix::read(demo.join("unifrac.unweighted.h5"), &MatrixIds::Auto).unwrap();
    let dataset = Dataset::builder(&table)
        .max_bp(150)
        .unifrac(Arc::new(matrix), MissingPolicy::Error)
        .build()
        .unwrap();
    let loader = BatchLoader::new(
        Arc::new(dataset),
        (0..8).collect(),
        Arc::default(),
        BatchConfig::validation(8, 1024, 0),
    )
    .unwrap();
    let batch = loader.batch(0, 0).unwrap();
    let asv = AsvEncoderConfig::new()
        .with_embedding_dim(32)
        .with_num_layers(1)
        .with_num_heads(2)
        .with_predict_nucleotides(true);
    let sample = SampleSequenceEncoderConfig::new(asv)
        .with_sample_num_layers(1)
        .with_sample_num_heads(2);
    let config = ModelConfig::SequenceEncoder(
        SequenceEncoderConfig::new(sample)
            .with_encoder_num_layers(1)
            .with_encoder_num_heads(2),
    )
    .without_dropout();
    let cpu = Default::default();
    let state: HashMap<_, _> = config
        .init::<NdArray<f32>>(&cpu)
        .unwrap()
        .state_dict(&config)
        .into_iter()
        .collect();
    let (u_cpu, n_cpu, g_cpu) = step::<NdArray<f32>>(&config, &state, &batch, &cpu);
    let (u_gpu, n_gpu, g_gpu) = step::<Wgpu>(&config, &state, &batch, &Default::default());
    for (what, want, got) in [("unifrac", u_cpu, u_gpu), ("nucleotide", n_cpu, n_gpu)] {
        assert!(
            (want - got).abs() <= LOSS_RTOL * want.abs().max(1.0),
            "{what} loss: wgpu {got}, CPU {want}"
        );
    }
    assert_eq!(
        g_cpu.len(),
        g_gpu.len(),
        "the same parameters have gradients"
    );
    let mut worst = (0f32, String::new());
    for (key, want) in &g_cpu {
        let got = &g_gpu[key];
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3);
        let err = want
            .iter()
            .zip(got)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
            / scale;
        assert!(err <= GRAD_RTOL, "gradient of {key}: rel err {err:e}");
        if err > worst.0 {
            worst = (err, key.clone());
        }
    }
    eprintln!(
        "wgpu vs CPU: worst gradient rel err {:e} ({}) over {} tensors",
        worst.0,
        worst.1,
        g_cpu.len()
    );
}
