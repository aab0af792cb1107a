//! A batch on its filled ASV slots ([`Slots::Filled`]) gives the same losses
//! and parameter gradients as on all `token_limit` slots, the reference's
//! layout: for the pretraining model and for the fine-tuning model with its
//! count head, target and categorical fusion. Real data: the bundled demo
//! (oral2550 samples). CPU, no dropout (dropout masks are drawn per element,
//! so they differ between layouts).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use aam_data::{
    BatchConfig, BatchLoader, BiomTable, CategoricalEncoder, Dataset, DistanceMatrix, MatrixIds,
    Metadata, MissingPolicy, Transforms,
};
use aam_models::asv_encoder::AsvEncoderConfig;
use aam_models::model::ModelConfig;
use aam_models::sample_encoder::SampleSequenceEncoderConfig;
use aam_models::sequence_encoder::SequenceEncoderConfig;
use aam_models::sequence_predictor::{CategoricalFusion, SequencePredictorConfig};
use aam_train::loss::LossConfig;
use aam_train::run::{batch_tensors, predict_batch, Slots, SLOT_MULTIPLE};
use burn::backend::{Autodiff, NdArray};
use burn::prelude::*;

type AB = Autodiff<NdArray<f32>>;

/// The categorical column of the fine-tuning models.
const COLUMN: &str = "qiita_host_age";

/// More slots than any demo sample fills, so that `Filled` cuts most of them.
const TOKEN_LIMIT: usize = 256;

fn demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/demo")
}

fn dataset() -> Arc<Dataset> {
    let table = BiomTable::read(demo().join("demo.biom"))
        .unwrap()
        .rarefy(500, 7)
        .unwrap()
        .table;
    let matrix =
        DistanceMatrix::read(demo().join("unifrac.unweighted.h5"), &MatrixIds::Auto).unwrap();
    let metadata = Arc::new(Metadata::read(demo().join("demo_map.txt")).unwrap());
    Arc::new(
        Dataset::builder(&table)
            .max_bp(40)
            .unifrac(Arc::new(matrix), MissingPolicy::Error)
            .metadata(metadata)
            .target("age", MissingPolicy::Error)
            .build()
            .unwrap(),
    )
}

fn base() -> SequenceEncoderConfig {
    let asv = AsvEncoderConfig::new()
        .with_embedding_dim(16)
        .with_max_bp(40)
        .with_num_layers(1)
        .with_num_heads(2)
        .with_predict_nucleotides(true);
    let sample = SampleSequenceEncoderConfig::new(asv)
        .with_token_limit(TOKEN_LIMIT)
        .with_sample_num_layers(2)
        .with_sample_num_heads(2);
    SequenceEncoderConfig::new(sample)
        .with_encoder_num_layers(1)
        .with_encoder_num_heads(2)
}

fn predictor(fusion: CategoricalFusion, cardinality: usize) -> ModelConfig {
    ModelConfig::SequencePredictor(
        SequencePredictorConfig::new(base())
            .with_count_num_layers(1)
            .with_count_num_heads(2)
            .with_target_num_layers(1)
            .with_target_num_heads(2)
            .with_categorical_cardinalities(Some(BTreeMap::from([(
                COLUMN.to_string(),
                cardinality,
            )])))
            .with_categorical_fusion(fusion),
    )
}

/// Largest difference relative to the larger magnitude (floored at 1e-3).
fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3);
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Loss components and named gradients of one step of `config` on the
/// loader's first batch with `slots`.
fn step(
    config: &ModelConfig,
    loader: &BatchLoader,
    slots: Slots,
) -> (Vec<(&'static str, f32)>, BTreeMap<String, Vec<f32>>) {
    let _guard = crate::one_run_at_a_time();
    let device = Default::default();
    AB::seed(&device, 3);
    let model = config.init::<AB>(&device).unwrap();
    let batch = loader.batch(0, 0).unwrap();
    let (input, targets) = batch_tensors::<AB>(&batch, &device, false, slots);
    let predictions = predict_batch(&model, input, true);
    let parts = LossConfig::default()
        .forward(&predictions, &targets)
        .unwrap();
    let scalar = |t: &Option<Tensor<AB, 1>>| t.as_ref().map(|t| t.clone().into_scalar());
    let losses = [
        ("total", Some(parts.total.clone().into_scalar())),
        ("unifrac", scalar(&parts.unifrac)),
        ("nuc", scalar(&parts.nuc)),
        ("count", scalar(&parts.count)),
        ("target", scalar(&parts.target)),
    ]
    .into_iter()
    .filter_map(|(name, v)| v.map(|v| (name, v)))
    .collect();
    let grads = parts.total.backward();
    let named = model
        .named_gradients(config, &grads)
        .into_iter()
        .filter_map(|(k, g)| g.map(|g| (k, g.to_vec::<f32>().unwrap())))
        .collect();
    (losses, named)
}

#[test]
fn filled_slots_train_as_all_slots() {
    let dataset = dataset();
    // The study's age column as categories: a real metadata column.
    let (metadata, _) = dataset.metadata().unwrap();
    let categorical =
        CategoricalEncoder::fit(metadata, &[COLUMN], &dataset.sample_ids()[..8]).unwrap();
    let cardinality = categorical.cardinalities()[0];
    let transforms = Arc::new(Transforms {
        categorical: Some(categorical),
        ..Default::default()
    });
    let loader = BatchLoader::new(
        dataset.clone(),
        (0..8).collect(),
        transforms,
        BatchConfig::validation(8, TOKEN_LIMIT, 0),
    )
    .unwrap();
    let batch = loader.batch(0, 0).unwrap();
    let filled = batch.filled_slots();
    let cut = Slots::Filled.apply(&batch).token_limit;
    assert!(
        filled > 1 && cut < TOKEN_LIMIT && cut % SLOT_MULTIPLE == 0 && cut >= filled,
        "the demo batch fills {filled} of {TOKEN_LIMIT} slots; Filled keeps {cut}"
    );

    let configs = [
        ("pretrain", ModelConfig::SequenceEncoder(base())),
        (
            "train, concat",
            predictor(CategoricalFusion::Concat, cardinality),
        ),
        (
            "train, cross-attention",
            predictor(CategoricalFusion::CrossAttention, cardinality),
        ),
    ];
    for (name, config) in configs {
        assert_eq!(Slots::for_model(&config, false), Slots::Filled, "{name}");
        assert_eq!(Slots::for_model(&config, true), Slots::TokenLimit, "{name}");
        let config = config.without_dropout();
        let (all_losses, all_grads) = step(&config, &loader, Slots::TokenLimit);
        let (cut_losses, cut_grads) = step(&config, &loader, Slots::Filled);
        assert!(all_losses.len() >= 3, "{name}: {all_losses:?}");
        assert_eq!(all_losses.len(), cut_losses.len(), "{name}");
        for ((part, want), (_, got)) in all_losses.iter().zip(&cut_losses) {
            assert!(
                (want - got).abs() <= 1e-5 * want.abs().max(1.0),
                "{name}: {part} loss {got} on filled slots, {want} on all"
            );
        }
        assert_eq!(all_grads.len(), cut_grads.len(), "{name}");
        for (key, want) in &all_grads {
            let e = rel(&cut_grads[key], want);
            assert!(e <= 1e-4, "{name}: gradient of {key}: rel err {e:e}");
        }
    }
    // The perceiver attends over padded slots: it keeps them all.
    assert_eq!(
        Slots::for_model(&predictor(CategoricalFusion::Perceiver, cardinality), false),
        Slots::TokenLimit
    );
}
