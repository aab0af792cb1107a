//! The training step's gradients on a GPU backend equal the CPU's. This is
//! the whole pretraining loss (UniFrac and nucleotides) of a real batch, on
//! the same weights: 8 demo samples (oral2550) whose ASVs are 100 nt, so
//! every ASV row has 50 padding positions. The sample level runs on the
//! filled slots. The parity suite's fixtures compare model outputs and
//! gradients of weighted outputs; this test goes through `batch_tensors`,
//! the packed ASV rows and the losses, as `pretrain` does. No dropout or
//! masking, whose random draws differ between backends.
//!
//! Runs on wgpu (lavapipe in CI) and, built with the `cuda` feature, on
//! CUDA (the device machine; docs/gpu-benchmarks.md). `AAM_GRADIENTS_MODEL=default`
//! checks the default-size model (D=128, 4 heads, 4 layers per stack)
//! instead of the small one CI runs.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use aam_data::{
    BatchConfig, BatchLoader, BiomTable, Dataset, DistanceMatrix, MatrixIds, MissingPolicy,
};
use aam_models::asv_encoder::AsvEncoderConfig;
use aam_models::model::{ModelConfig, StateTensor};
use aam_models::sample_encoder::SampleSequenceEncoderConfig;
use aam_models::sequence_encoder::SequenceEncoderConfig;
use aam_models::AttentionBackend;
use aam_train::gradcheck::{compare, step_gradients};
use aam_train::loss::LossConfig;
use aam_train::run::Slots;
use burn::backend::NdArray;

/// Losses: f32 on both sides, reductions in other orders.
const LOSS_RTOL: f64 = 1e-5;
/// Gradients, relative to each tensor's largest magnitude (floored at 1e-3):
/// wgpu computes f32 matmuls in f32.
#[cfg(feature = "wgpu")]
const WGPU_GRAD_RTOL: f64 = 1e-3;
/// CUDA's matmuls run in TF32 (10-bit mantissa), as in `backend_parity`.
#[cfg(feature = "cuda")]
const CUDA_GRAD_RTOL: f64 = 1e-2;

/// The first 8 demo samples (rarefied to 500 reads) as one batch.
fn demo_batch() -> aam_data::Batch {
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
    loader.batch(0, 0).unwrap()
}

/// The pretraining model without dropout or masking: small (D=32, 2 heads,
/// one layer per stack), or the default size with `AAM_GRADIENTS_MODEL=default`.
fn model_config() -> ModelConfig {
    let default_size = std::env::var("AAM_GRADIENTS_MODEL").is_ok_and(|v| v == "default");
    let (dim, heads, layers) = if default_size {
        (128, 4, 4)
    } else {
        (32, 2, 1)
    };
    let asv = AsvEncoderConfig::new()
        .with_embedding_dim(dim)
        .with_num_layers(layers)
        .with_num_heads(heads)
        .with_predict_nucleotides(true);
    let sample = SampleSequenceEncoderConfig::new(asv)
        .with_sample_num_layers(layers)
        .with_sample_num_heads(heads);
    ModelConfig::SequenceEncoder(
        SequenceEncoderConfig::new(sample)
            .with_encoder_num_layers(layers)
            .with_encoder_num_heads(heads),
    )
    .without_dropout()
}

/// One step on backend `B` against the CPU's, on the same weights and batch:
/// losses within [`LOSS_RTOL`], every gradient within `grad_rtol`.
fn check<B: AttentionBackend>(backend: &str, device: &B::Device, grad_rtol: f64) {
    let batch = demo_batch();
    let config = model_config();
    let cpu = Default::default();
    let state: HashMap<String, StateTensor> = config
        .init::<NdArray<f32>>(&cpu)
        .unwrap()
        .state_dict(&config)
        .into_iter()
        .collect();
    let loss = LossConfig::default();
    let want = step_gradients::<NdArray<f32>>(&config, &state, &batch, &loss, Slots::Filled, &cpu)
        .unwrap();
    let got = step_gradients::<B>(&config, &state, &batch, &loss, Slots::Filled, device).unwrap();
    let c = compare(&want, &got);
    for (what, w, g) in &c.losses {
        eprintln!("{what} loss: {backend} {g}, CPU {w}");
    }
    eprintln!("gradient norm: {backend} {}, CPU {}", c.norms.1, c.norms.0);
    assert!(
        c.worst_loss() <= LOSS_RTOL,
        "{backend} losses differ from the CPU's: {:?}",
        c.losses
    );
    // A gradient on one side only counts as an infinite error.
    let failures: Vec<String> = c
        .tensors
        .iter()
        .filter(|t| t.rel_err > grad_rtol)
        .map(|t| {
            format!(
                "{}: rel err {:e} (norm {} vs CPU {})",
                t.key, t.rel_err, t.norm_got, t.norm_want
            )
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{backend} gradients differ from the CPU's:\n  {}",
        failures.join("\n  ")
    );
    let worst = c.worst_tensor().unwrap();
    eprintln!(
        "{backend} vs CPU: worst gradient rel err {:e} ({}) over {} tensors",
        worst.rel_err,
        worst.key,
        c.tensors.len()
    );
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_training_gradients_equal_the_cpus_on_a_real_batch() {
    check::<burn::backend::Wgpu>("wgpu", &Default::default(), WGPU_GRAD_RTOL);
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_training_gradients_equal_the_cpus_on_a_real_batch() {
    check::<burn::backend::Cuda>(
        "cuda",
        &burn::backend::cuda::CudaDevice::new(0),
        CUDA_GRAD_RTOL,
    );
}

/// What `--compile-workers` hands its helper processes covers a real
/// pretraining step: every dense backward the step announces is among the
/// problems made from the row counts the model announced before its first
/// layer and the model's weight shapes (`aam_kernels::dense_problems`),
/// forward and backward, except the token embedding's table, used
/// transposed with no input gradient (its own announcement covers it).
#[test]
fn the_announced_row_counts_and_weights_cover_every_dense_layer_of_a_step() {
    use aam_kernels::{covers, dense_layers, dense_problems, Ahead};
    use std::sync::Mutex;

    let batch = demo_batch();
    let config = model_config();
    let cpu = Default::default();
    let model = config.init::<NdArray<f32>>(&cpu).unwrap();
    let layers = dense_layers(&model.state_dict_shapes(&config));
    let state: HashMap<String, StateTensor> = model.state_dict(&config).into_iter().collect();
    // The hook is the process's, and the other tests of this binary run
    // their steps on other threads at the same time: keep this thread's.
    let here = std::thread::current().id();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    aam_kernels::set_compile_ahead_hook(Some(Arc::new(move |a| {
        if std::thread::current().id() == here {
            sink.lock().unwrap().push(a)
        }
    })));
    let loss = LossConfig::default();
    let stepped =
        step_gradients::<NdArray<f32>>(&config, &state, &batch, &loss, Slots::Filled, &cpu);
    aam_kernels::set_compile_ahead_hook(None);
    stepped.unwrap();

    let seen = seen.lock().unwrap().clone();
    let mut made = Vec::new();
    let mut announced = Vec::new();
    for ahead in &seen {
        match ahead {
            Ahead::Rows { rows, dtypes } => made.extend(dense_problems(rows, dtypes, &layers)),
            Ahead::Dense(p) => announced.push(*p),
        }
    }
    assert!(
        !made.is_empty() && announced.len() >= 8,
        "the step announced {} dense layers and {} problems were made",
        announced.len(),
        made.len()
    );
    let mut rows: Vec<usize> = announced.iter().map(|p| p.rows).collect();
    rows.sort();
    rows.dedup();
    eprintln!(
        "{} dense layers announced, at row counts {rows:?}; {} problems made ahead",
        announced.len(),
        made.len()
    );
    let transposed_table = |p: &aam_kernels::DenseProblem| {
        !p.want[0]
            && layers
                .iter()
                .any(|l| (l.outputs, l.inputs) == (p.inputs, p.outputs))
    };
    let uncovered: Vec<_> = announced
        .iter()
        .filter(|p| !made.iter().any(|m| covers(m, p)) && !transposed_table(p))
        .collect();
    assert!(uncovered.is_empty(), "not made ahead: {uncovered:?}");
    // The forwards too: each announced layer's forward is among them.
    for p in &announced {
        let forward = aam_kernels::DenseProblem {
            forward: true,
            want: [false; 3],
            ..*p
        };
        assert!(
            made.iter().any(|m| covers(m, &forward)) || transposed_table(p),
            "forward not made ahead: {forward:?}"
        );
    }
}
