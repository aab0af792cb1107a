//! Resuming: a run interrupted after an epoch and resumed from its checkpoint
//! ends with exactly the weights of the uninterrupted run (CPU, bitwise); a
//! checkpoint cut short is reported as such. Real data: the bundled demo
//! (64 oral2550 samples).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use aam_data::{BiomTable, Dataset, DistanceMatrix, MatrixIds, MissingPolicy, Transforms};
use aam_models::asv_encoder::AsvEncoderConfig;
use aam_models::model::ModelConfig;
use aam_models::sample_encoder::SampleSequenceEncoderConfig;
use aam_models::sequence_encoder::SequenceEncoderConfig;
use aam_train::checkpoint::{read_checkpoint, DataInfo};
use aam_train::config::{BestMetric, RunConfig, Task};
use aam_train::loss::LossConfig;
use aam_train::optim::OptimizerConfig;
use aam_train::run::{files, fit, FitSummary, Observer, Silent, TrainData};
use aam_train::schedule::{SchedulerConfig, SchedulerKind};
use aam_train::world::World;
use burn::backend::{Autodiff, NdArray};

pub(crate) type AB = Autodiff<NdArray<f32>>;

fn demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/demo")
}

pub(crate) fn data() -> TrainData {
    let table = BiomTable::read(demo().join("demo.biom"))
        .unwrap()
        .rarefy(500, 7)
        .unwrap()
        .table;
    let matrix =
        DistanceMatrix::read(demo().join("unifrac.unweighted.h5"), &MatrixIds::Auto).unwrap();
    let dataset = Dataset::builder(&table)
        .max_bp(40)
        .unifrac(Arc::new(matrix), MissingPolicy::Error)
        .build()
        .unwrap();
    let split = dataset.split(0.25, 7).unwrap();
    let counts = dataset.fit_count_normalizer(&split.train).unwrap();
    let ids = |p: &[usize]| p.iter().map(|&s| dataset.sample_ids()[s].clone()).collect();
    let info = DataInfo {
        transforms: Transforms {
            counts: Some(counts),
            ..Default::default()
        },
        class_labels: None,
        max_bp: 40,
        target_column: None,
        rarefy_depth: Some(500),
        sources: Default::default(),
        train_ids: ids(&split.train),
        validation_ids: ids(&split.validation),
    };
    TrainData {
        dataset: Arc::new(dataset),
        train: split.train,
        validation: split.validation,
        info,
    }
}

pub(crate) fn model_config() -> ModelConfig {
    let asv = AsvEncoderConfig::new()
        .with_embedding_dim(16)
        .with_max_bp(40)
        .with_num_layers(1)
        .with_num_heads(2)
        .with_predict_nucleotides(true)
        .with_mask_ratio(0.15);
    let sample = SampleSequenceEncoderConfig::new(asv)
        .with_token_limit(16)
        .with_sample_num_layers(1)
        .with_sample_num_heads(2);
    ModelConfig::SequenceEncoder(
        SequenceEncoderConfig::new(sample)
            .with_encoder_num_layers(1)
            .with_encoder_num_heads(2),
    )
}

pub(crate) fn run_config() -> RunConfig {
    RunConfig {
        task: Task::Pretrain,
        epochs: 3,
        batch_size: 8,
        gradient_accumulation_steps: 2,
        max_grad_norm: Some(1.0),
        categorical_lr: None,
        optimizer: OptimizerConfig::default(),
        scheduler: SchedulerConfig::new(SchedulerKind::WarmupCosine, 1e-3, 0, 2),
        loss: LossConfig {
            count_penalty: 0.0,
            ..Default::default()
        },
        patience: 10,
        best_metric: BestMetric::ValLoss,
        seed: 11,
        token_limit: 16,
        asv_sampling: aam_data::AsvSampling::Random,
        all_slots: false,
        workers: 2,
        memory_profile: false,
        time_phases: Default::default(),
        mixed_precision: Default::default(),
        unifrac_pairs: Default::default(),
        checkpoint_every_steps: None,
        skip_nonfinite_batches: false,
        val_prediction_passes: 1,
    }
}

/// Stops after `n` epochs, as an interruption would.
pub(crate) struct StopAfter(pub usize, pub usize);
impl Observer for StopAfter {
    fn epoch(&mut self, _: &aam_train::checkpoint::EpochRecord, _: bool) {
        self.1 += 1;
    }
    fn should_stop(&mut self) -> bool {
        self.1 >= self.0
    }
}

fn train(out: &Path, resume: Option<&Path>, observer: &mut dyn Observer) -> FitSummary {
    train_with(out, resume, observer, None)
}

fn train_with(
    out: &Path,
    resume: Option<&Path>,
    observer: &mut dyn Observer,
    checkpoint_every_steps: Option<u64>,
) -> FitSummary {
    let _guard = crate::one_run_at_a_time();
    let device = Default::default();
    let ckpt = resume.map(|p| read_checkpoint(p).unwrap());
    let config = model_config();
    let model = match &ckpt {
        Some(c) => c.model::<AB>(&device).unwrap(),
        None => {
            <AB as burn::tensor::backend::Backend>::seed(&device, 3);
            config.init::<AB>(&device).unwrap()
        }
    };
    fit::<AB>(
        &[device],
        &World::single(),
        config,
        model,
        RunConfig {
            checkpoint_every_steps,
            ..run_config()
        },
        data(),
        out,
        ckpt.as_ref(),
        observer,
    )
    .unwrap()
}

/// Asks to stop once batch `.1` (1-based) of epoch `.0` is done, as SIGTERM
/// does through the CLI.
struct InterruptAt(usize, usize, (usize, usize));
impl Observer for InterruptAt {
    fn batch(&mut self, s: &aam_train::run::BatchStatus) {
        self.2 = (s.epoch, s.batch);
    }
    fn interrupted(&mut self) -> bool {
        self.2 == (self.0, self.1)
    }
}

/// The weights, optimiser state, counters and training losses of two
/// finished runs are the same, bit for bit.
fn assert_same_run(full: &Path, resumed: &Path) {
    let a = read_checkpoint(&full.join(files::LAST)).unwrap();
    let b = read_checkpoint(&resumed.join(files::LAST)).unwrap();
    assert_eq!(a.meta.progress.epochs_done, 3);
    assert_eq!(a.meta.progress.global_step, b.meta.progress.global_step);
    assert_eq!(a.meta.progress.micro_step, b.meta.progress.micro_step);
    assert_eq!(a.meta.progress.history.len(), b.meta.progress.history.len());
    let mut keys: Vec<&String> = a.model.keys().collect();
    keys.sort();
    assert!(!keys.is_empty());
    for k in keys {
        assert_eq!(
            a.model[k].values, b.model[k].values,
            "weights of {k} differ after resuming"
        );
    }
    assert_eq!(
        a.optimizer, b.optimizer,
        "optimiser state differs after resuming"
    );
    // Same losses in the history (the resumed epochs repeat the same batches).
    for (x, y) in a.meta.progress.history.iter().zip(&b.meta.progress.history) {
        assert_eq!(x.train, y.train, "epoch {} training losses differ", x.epoch);
        assert_eq!(
            x.validation, y.validation,
            "epoch {} validation differs",
            x.epoch
        );
        assert_eq!(x.lr, y.lr, "epoch {} learning rate differs", x.epoch);
    }
}

#[test]
fn resumed_run_matches_the_uninterrupted_one_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let (full, part) = (dir.path().join("full"), dir.path().join("part"));
    train(&full, None, &mut Silent);
    train(&part, None, &mut StopAfter(1, 0));
    let interrupted = read_checkpoint(&part.join(files::LAST)).unwrap();
    assert_eq!(interrupted.meta.progress.epochs_done, 1);
    train(&part, Some(&part.join(files::LAST)), &mut Silent);
    assert_same_run(&full, &part);
    // The first epoch really trained: the weights moved from the initial ones.
    let last = read_checkpoint(&full.join(files::LAST)).unwrap();
    let first = &interrupted.model;
    assert!(first.iter().any(|(k, t)| t.values != last.model[k].values));
}

/// Stopped at optimiser steps inside epochs (6 batches an epoch, a step
/// every 2) and resumed from each step checkpoint, a run ends as the
/// uninterrupted one; so does a run writing a checkpoint every step.
#[test]
fn stopped_inside_epochs_and_resumed_matches_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let (full, part) = (dir.path().join("full"), dir.path().join("part"));
    train(&full, None, &mut Silent);

    // Step 2 of 3 in the first epoch: 4 of its 6 batches done.
    let summary = train(&part, None, &mut InterruptAt(0, 4, (0, 0)));
    assert!(summary.interrupted && summary.history.is_empty());
    let c = read_checkpoint(&part.join(files::LAST)).unwrap();
    let at = c.meta.progress.in_epoch.clone().expect("a step checkpoint");
    assert_eq!(
        (at.epoch, at.batches_done, c.meta.progress.global_step),
        (0, 4, 2)
    );
    // Then step 4 (the second epoch's first); then to the end.
    let resume = part.join(files::LAST);
    let summary = train(&part, Some(&resume), &mut InterruptAt(1, 2, (0, 0)));
    assert!(summary.interrupted);
    let c = read_checkpoint(&part.join(files::LAST)).unwrap();
    let at = c.meta.progress.in_epoch.clone().expect("a step checkpoint");
    assert_eq!(
        (at.epoch, at.batches_done, c.meta.progress.global_step),
        (1, 2, 4)
    );
    let summary = train(&part, Some(&resume), &mut Silent);
    assert!(!summary.interrupted);
    assert_same_run(&full, &part);

    let every = dir.path().join("every");
    train_with(&every, None, &mut Silent, Some(1));
    assert_same_run(&full, &every);
}

#[test]
fn a_checkpoint_cut_short_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    train(&out, None, &mut StopAfter(1, 0));
    let path = out.join(files::LAST);
    let bytes = std::fs::read(&path).unwrap();
    for cut in [bytes.len() / 2, bytes.len() - 1, 100, 4] {
        let short = dir.path().join(format!("short{cut}.safetensors"));
        std::fs::write(&short, &bytes[..cut]).unwrap();
        let err = read_checkpoint(&short).unwrap_err().to_string();
        assert!(err.contains(&short.display().to_string()), "{err}");
        assert!(err.contains("cut short"), "{err}");
    }
}

/// A step whose loss is not finite (here: a NaN put into one weight of the
/// checkpoint resumed from) stops the run with an error naming the epoch,
/// batch, loss terms and samples, and leaves the last checkpoint as it was.
#[test]
fn a_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    train(&out, None, &mut StopAfter(1, 0));
    let path = out.join(files::LAST);
    let before = std::fs::read(&path).unwrap();
    let mut ckpt = read_checkpoint(&path).unwrap();
    let mut keys: Vec<String> = ckpt.model.keys().cloned().collect();
    keys.sort();
    let key = keys
        .iter()
        .find(|k| k.contains("norm") && k.ends_with(".weight"))
        .expect("a LayerNorm weight");
    let values = &mut ckpt.model.get_mut(key).unwrap().values;
    values.iter_mut().for_each(|v| *v = f32::NAN);

    let _guard = crate::one_run_at_a_time();
    let device = Default::default();
    let data = data();
    let first_batch: Vec<String> = {
        let ids = data.dataset.sample_ids();
        let loader = aam_data::BatchLoader::new(
            data.dataset.clone(),
            data.train.clone(),
            Arc::new(data.info.transforms.clone()),
            aam_data::BatchConfig::train(8, 16, 11),
        )
        .unwrap();
        loader.plan(1)[0].iter().map(|&p| ids[p].clone()).collect()
    };
    let err = fit::<AB>(
        &[device],
        &World::single(),
        model_config(),
        ckpt.model::<AB>(&device).unwrap(),
        run_config(),
        data.clone(),
        &out,
        Some(&ckpt),
        &mut Silent,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("not finite at epoch 2 batch 1 (optimiser step 3)"),
        "{err}"
    );
    assert!(err.contains("total_loss NaN"), "{err}");
    assert!(
        err.contains(&first_batch.join(", ")),
        "{err}\n{first_batch:?}"
    );
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "the last checkpoint changed"
    );

    // --skip-nonfinite-batches: every batch (each has the NaN) is skipped and
    // counted, no step is taken, and the run ends.
    let skipping = dir.path().join("skipping");
    let summary = fit::<AB>(
        &[device],
        &World::single(),
        model_config(),
        ckpt.model::<AB>(&device).unwrap(),
        RunConfig {
            skip_nonfinite_batches: true,
            ..run_config()
        },
        data,
        &skipping,
        Some(&ckpt),
        &mut Silent,
    )
    .unwrap();
    assert_eq!(summary.history.len(), 3);
    for epoch in &summary.history[1..] {
        assert_eq!(epoch.train["skipped_batches"], 6.0, "{epoch:?}");
        assert_eq!(epoch.step, 3, "a step was taken");
    }
    let end = read_checkpoint(&skipping.join(files::LAST)).unwrap();
    assert_eq!(end.optimizer, ckpt.optimizer, "the optimiser moved");
    for (k, t) in &ckpt.model {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&end.model[k].values), bits(&t.values), "{k} moved");
    }
}
