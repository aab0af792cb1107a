//! Reference §4.3–4.4: the epoch loop. One function, [`fit`], for `pretrain`
//! (a [`SequenceEncoder`](aam_models::sequence_encoder::SequenceEncoder)) and
//! `train` (a [`SequencePredictor`](aam_models::sequence_predictor::SequencePredictor)).
//!
//! **Determinism.** Every random draw of a forward pass (dropout, nucleotide
//! masking, attention dropout) comes from a stream seeded by
//! `(seed, micro_step)`, and batch order from `(seed, epoch)`; a checkpoint
//! stores the counters, so a resumed run repeats the uninterrupted one.
//! (Burn's backend RNG is process-global: two fits running at once in one
//! process draw from each other's stream and lose this property.)
//!
//! **Outputs** under the output directory: `checkpoints/last.safetensors`
//! (every epoch), `checkpoints/best.safetensors` (on improvement),
//! `metrics.csv` (one row per epoch), `val_predictions.tsv` (train, best
//! epoch, original units). All are written atomically.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use aam_data::{write_atomic, Batch, BatchConfig, BatchLoader, Dataset};
use aam_models::model::{AamModel, ModelConfig};
use aam_models::output::{AsvTokens, ModelInput};
use aam_models::sequence_predictor::TargetPrediction;
use aam_models::{autocast, set_attention_dropout_seed, AttentionBackend, MixedPrecision};
use burn::module::AutodiffModule;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

use crate::checkpoint::{
    write_checkpoint, Best, Checkpoint, CheckpointMeta, DataInfo, EpochPosition, EpochRecord,
    Progress, FORMAT_VERSION,
};
use crate::config::{PhaseTiming, RunConfig, Task};
use crate::error::{Result, TrainError};
use crate::loss::{
    nucleotide_accuracy, nucleotide_positions, pairwise_tanh_distances, LossParts, LossTargets,
    Predictions, Target,
};
use crate::metrics::{ClassificationMetrics, Means, RegressionMetrics};
use crate::optim::{GradientBuffer, LossScaler, Optimizer};
use crate::parallel::{
    all_reduce, check_shards, gathered_embeddings, nucleotide_share, Offer, Shares, TermScales,
    UnifracPairs,
};
use crate::schedule::Scheduler;

/// The samples of a run.
#[derive(Clone, Debug)]
pub struct TrainData {
    /// All samples.
    pub dataset: Arc<Dataset>,
    /// Training positions.
    pub train: Vec<usize>,
    /// Validation positions (may be empty).
    pub validation: Vec<usize>,
    /// Transforms and provenance, stored in checkpoints.
    pub info: DataInfo,
}

/// Progress of one batch, for a progress bar.
#[derive(Clone, Debug)]
pub struct BatchStatus {
    /// Epoch (0-based) and total.
    pub epoch: usize,
    /// Maximum epochs.
    pub epochs: usize,
    /// Batch (1-based) within the epoch.
    pub batch: usize,
    /// Batches per epoch.
    pub batches: usize,
    /// This batch's total loss.
    pub loss: f64,
    /// Learning rate of the last step.
    pub lr: f64,
    /// Training samples per second in this epoch so far.
    pub samples_per_sec: f64,
}

/// Receives progress; the CLI draws bars and logs from it.
pub trait Observer {
    /// After each training batch.
    fn batch(&mut self, _status: &BatchStatus) {}
    /// When validation starts (with its batch count).
    fn validating(&mut self, _batches: usize) {}
    /// After each epoch.
    fn epoch(&mut self, _record: &EpochRecord, _improved: bool) {}
    /// Checked after each epoch: true stops the run there (as an interruption
    /// would; the checkpoint of that epoch is complete).
    fn should_stop(&mut self) -> bool {
        false
    }
    /// Checked after each optimiser step: true ends the run at that step
    /// with `checkpoints/last.safetensors` written there (at the epoch's
    /// last step, after its validation and checkpoints), and
    /// [`FitSummary::interrupted`] set. The CLI answers SIGTERM and SIGUSR1
    /// (a scheduler's warning before it kills a job) this way.
    fn interrupted(&mut self) -> bool {
        false
    }
}

/// An observer that does nothing.
pub struct Silent;
impl Observer for Silent {}

/// What [`fit`] leaves behind.
#[derive(Clone, Debug)]
pub struct FitSummary {
    /// Every completed epoch.
    pub history: Vec<EpochRecord>,
    /// Best epoch.
    pub best: Option<Best>,
    /// `checkpoints/best.safetensors`.
    pub best_checkpoint: PathBuf,
    /// `checkpoints/last.safetensors`.
    pub last_checkpoint: PathBuf,
    /// Whether early stopping ended the run.
    pub stopped_early: bool,
    /// Whether [`Observer::interrupted`] ended it (`last_checkpoint` holds
    /// the step it stopped at; `--resume-from` continues from there).
    pub interrupted: bool,
    /// Optimiser steps taken in all (a resumed run counts its earlier ones).
    pub steps: u64,
}

/// File names inside the output directory.
pub mod files {
    /// Checkpoint of the last completed epoch, or of a later optimiser step
    /// (`--checkpoint-every-steps`, an interruption).
    pub const LAST: &str = "checkpoints/last.safetensors";
    /// Checkpoint of the best epoch.
    pub const BEST: &str = "checkpoints/best.safetensors";
    /// Per-epoch metrics.
    pub const METRICS: &str = "metrics.csv";
    /// Validation predictions of the best epoch.
    pub const VAL_PREDICTIONS: &str = "val_predictions.tsv";
    /// Device memory per phase of the training step (`--memory-profile`).
    pub const MEMORY_PROFILE: &str = "memory_profile.csv";
}

/// A model run on a batch: the forward pass in training or eval mode
/// (decided by the backend: Autodiff trains).
pub fn predict_batch<B: AttentionBackend>(
    model: &AamModel<B>,
    input: ModelInput<B>,
    return_nucleotides: bool,
) -> Predictions<B> {
    match model {
        AamModel::SequenceEncoder(m) => m
            .forward(input.tokens, input.counts, return_nucleotides)
            .into(),
        AamModel::SequencePredictor(m) => m
            .forward(
                input.tokens,
                input.counts,
                input.categorical_ids.as_ref(),
                return_nucleotides,
            )
            .into(),
    }
}

/// Slot counts of a batch's tensors are rounded up to a multiple of this
/// (at most `token_limit`), so that a run sees a few shapes, not one per
/// batch.
pub const SLOT_MULTIPLE: usize = 32;

/// How many ASV slots per sample a batch's tensors have.
///
/// The reference pads every sample to `token_limit` (1024) slots, and a
/// real-sized sample fills 25-100 of them: its sample-level stacks (8 layers
/// in pretraining, 16 in fine-tuning) then spend ~90% of their work on
/// padding. Where the model masks empty slots
/// ([`ModelConfig::empty_slots_are_masked`]), the slots after the batch's
/// largest sample change nothing it computes for the filled slots and the
/// samples, so they are left out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slots {
    /// `token_limit` slots, as the reference.
    TokenLimit,
    /// The batch's largest sample's filled slots, rounded up to
    /// [`SLOT_MULTIPLE`], at most `token_limit`.
    Filled,
}

impl Slots {
    /// [`Slots::TokenLimit`] where the run asks for all slots
    /// (`--all-slots`) or the model does not mask empty slots, else
    /// [`Slots::Filled`].
    pub fn for_model(config: &ModelConfig, all_slots: bool) -> Self {
        if !all_slots && config.empty_slots_are_masked() {
            Slots::Filled
        } else {
            Slots::TokenLimit
        }
    }

    /// `batch` with these slots (borrowed when it has them already).
    pub fn apply<'a>(&self, batch: &'a Batch) -> std::borrow::Cow<'a, Batch> {
        match self {
            Slots::TokenLimit => std::borrow::Cow::Borrowed(batch),
            Slots::Filled => batch.without_empty_slots(SLOT_MULTIPLE),
        }
    }
}

/// Tensors of a batch, with `slots` ASV slots per sample: the model input and
/// the loss targets.
pub fn batch_tensors<B: Backend>(
    batch: &Batch,
    device: &B::Device,
    classifier: bool,
    slots: Slots,
) -> (ModelInput<B>, LossTargets<B>) {
    let batch = &*slots.apply(batch);
    let b = batch.batch_size();
    // Only the filled slots' rows go to the device (see `AsvTokens::from_host`).
    let tokens = AsvTokens::from_host(&batch.tokens, batch.tokens_shape(), device);
    let counts = Tensor::<B, 3>::from_data(
        TensorData::new(batch.counts.clone(), batch.counts_shape()),
        device,
    );
    let base = batch.unifrac.as_ref().map(|u| {
        Tensor::<B, 2>::from_data(TensorData::new(u.clone(), batch.unifrac_shape()), device)
    });
    let target = batch.targets.as_ref().map(|t| {
        if classifier {
            let classes: Vec<i64> = t.iter().map(|&c| c as i64).collect();
            Target::Classes(Tensor::from_data(TensorData::new(classes, [b]), device))
        } else {
            Target::Regression(Tensor::from_data(
                TensorData::new(t.clone(), batch.targets_shape()),
                device,
            ))
        }
    });
    let categorical_ids = (!batch.categorical_ids.is_empty()).then(|| {
        batch
            .categorical_ids
            .iter()
            .map(|(col, ids)| {
                (
                    col.clone(),
                    Tensor::<B, 1, Int>::from_data(TensorData::new(ids.clone(), [b]), device),
                )
            })
            .collect::<BTreeMap<_, _>>()
    });
    let input = ModelInput {
        tokens: tokens.clone(),
        counts: Some(counts.clone()),
        categorical_ids,
    };
    let targets = LossTargets {
        tokens,
        base,
        counts: Some(counts),
        target,
        sample_weights: None,
    };
    (input, targets)
}

/// A 64-bit mix (splitmix64) so neighbouring counters give unrelated seeds.
fn mix(seed: u64, counter: u64) -> u64 {
    let mut z = seed ^ counter.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Whether a torch key belongs to the categorical parameter group (§4.1).
pub fn is_categorical_param(key: &str) -> bool {
    [
        "categorical_embedder",
        "categorical_projection",
        "gmu",
        "output_scales",
        "cross_attn_fusion",
    ]
    .iter()
    .any(|m| key.starts_with(&format!("{m}.")) || key.contains(&format!(".{m}.")))
}

/// Reads a batch's losses (and nucleotide accuracy counts, and the gradient
/// norm) in one device read and adds them to `means`. Returns the total
/// and the values that are not finite (`name value`; none when all are).
fn record_batch<B: Backend>(
    values: StepValues<B>,
    grad_norm: Option<Tensor<B, 1>>,
    means: &mut Means,
) -> (f64, Vec<String>) {
    let StepValues {
        mut names,
        values,
        accuracy,
    } = values;
    let with_accuracy = accuracy.is_some();
    let mut all = vec![values];
    if let Some(norm) = grad_norm {
        names.push("grad_norm");
        all.push(norm);
    }
    // The accuracy counts (hits, scored) go last.
    all.extend(accuracy);
    let values = Tensor::cat(all, 0);
    let host: Vec<f64> = values
        .into_data()
        .convert::<f64>()
        .to_vec::<f64>()
        .expect("f64");
    for (name, v) in names.iter().zip(&host) {
        means.add(name, *v);
    }
    tracing::debug!(
        "{}",
        names
            .iter()
            .zip(&host)
            .map(|(name, v)| format!("{name} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if with_accuracy {
        let (hits, n) = (host[host.len() - 2], host[host.len() - 1]);
        if n > 0.0 {
            means.add("nuc_accuracy", hits / n);
        }
    }
    let non_finite = names
        .iter()
        .zip(&host)
        .filter(|(_, v)| !v.is_finite())
        .map(|(name, v)| format!("{name} {v}"))
        .collect();
    (host[0], non_finite)
}

/// Where a training step spends its time and device memory.
///
/// - `--time-phases synced`: the mean time of each phase, logged after the
///   first step and every 10 (for finding where the time goes).
/// - `--time-phases host`: the same without synchronising: each phase's time
///   is then what the host spends queueing it, and `read` holds the wait for
///   the device. A step whose `read` is short is bound by the host.
/// - `--memory-profile`: after each phase, the bytes of live tensors on the
///   device; per epoch the largest value of each phase and the memory pool's
///   size are logged and appended to `memory_profile.csv`.
///
/// Both synchronise the device after each phase (`--time-phases synced` and
/// `--memory-profile`), which slows the run.
struct StepProfiler {
    time: bool,
    /// `--time-phases host`: time without synchronising.
    host_only: bool,
    memory: bool,
    last: Instant,
    totals: BTreeMap<&'static str, f64>,
    steps: u64,
    /// Per phase, the most bytes in use after it, this epoch.
    in_use: BTreeMap<&'static str, u64>,
    /// The memory pool's largest size this epoch.
    reserved: u64,
}

impl StepProfiler {
    fn new(memory: bool, timing: PhaseTiming) -> Self {
        Self {
            time: timing != PhaseTiming::Off,
            host_only: timing == PhaseTiming::Host,
            memory,
            last: Instant::now(),
            totals: BTreeMap::new(),
            steps: 0,
            in_use: BTreeMap::new(),
            reserved: 0,
        }
    }

    fn mark<B: AttentionBackend>(&mut self, device: &B::Device, phase: &'static str) {
        if !(self.time || self.memory) {
            return;
        }
        if self.memory || !self.host_only {
            let _ = B::sync(device);
        }
        if self.time {
            let now = Instant::now();
            *self.totals.entry(phase).or_default() += (now - self.last).as_secs_f64();
            self.last = now;
        }
        if self.memory {
            match (B::memory_in_use(device), B::memory_reserved(device)) {
                (Some(in_use), Some(reserved)) => {
                    let max = self.in_use.entry(phase).or_default();
                    *max = (*max).max(in_use);
                    self.reserved = self.reserved.max(reserved);
                }
                _ => {
                    tracing::warn!(
                        "--memory-profile: this backend does not report device memory; no profile"
                    );
                    self.memory = false;
                }
            }
        }
    }

    fn step(&mut self) {
        if !self.time {
            return;
        }
        self.steps += 1;
        if self.steps % 10 == 0 || self.steps == 1 {
            let n = self.steps as f64;
            let parts: Vec<String> = self
                .totals
                .iter()
                .map(|(k, v)| format!("{k} {:.1} ms", 1e3 * v / n))
                .collect();
            let total: f64 = self.totals.values().sum();
            tracing::info!(
                "profile over {} batches: {:.1} ms/batch = {}",
                self.steps,
                1e3 * total / n,
                parts.join(", ")
            );
        }
    }

    /// Logs the epoch's memory profile, appends it to `path` and starts anew.
    fn epoch_end(&mut self, epoch: usize, path: &Path) -> Result<()> {
        if !self.memory || self.in_use.is_empty() {
            return Ok(());
        }
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let peak = self.in_use.values().copied().max().unwrap_or(0);
        let phases: Vec<String> = self
            .in_use
            .iter()
            .map(|(phase, b)| format!("{phase} {:.0}", mib(*b)))
            .collect();
        tracing::info!(
            "memory, epoch {}: peak in use {:.0} MiB, pool {:.0} MiB; in use after each phase (MiB): {}",
            epoch + 1,
            mib(peak),
            mib(self.reserved),
            phases.join(", ")
        );
        let mut text = if path.exists() {
            std::fs::read_to_string(path).map_err(|e| TrainError::io(path, e))?
        } else {
            "epoch,phase,in_use_mib,pool_reserved_mib\n".to_string()
        };
        for (phase, b) in &self.in_use {
            text.push_str(&format!(
                "{},{phase},{:.1},{:.1}\n",
                epoch + 1,
                mib(*b),
                mib(self.reserved)
            ));
        }
        write_atomic(path, text.as_bytes())?;
        self.in_use.clear();
        self.reserved = 0;
        Ok(())
    }
}

/// Trains `model` (fresh, or restored from `resume`) and writes checkpoints
/// and logs under `out_dir`.
///
/// An epoch is [`Trainer::train_epoch`] (each batch one
/// [`Trainer::forward_backward`], and an optimiser step every
/// `gradient_accumulation_steps` batches, [`Trainer::optimizer_step`]), then
/// [`validate`] on the validation samples, then [`Trainer::end_epoch`] (best
/// epoch, early stopping, checkpoints, metrics).
///
/// `model` lives on `devices[0]`. More devices (a device may repeat) train
/// data parallel, one replica each on an equal shard of every batch
/// ([`crate::parallel`]); checkpoints, validation and logs come from the
/// first, and are the same files whatever the number of devices.
#[allow(clippy::too_many_arguments)]
pub fn fit<AB>(
    devices: &[AB::Device],
    model_config: ModelConfig,
    model: AamModel<AB>,
    mut run: RunConfig,
    data: TrainData,
    out_dir: &Path,
    resume: Option<&Checkpoint>,
    observer: &mut dyn Observer,
) -> Result<FitSummary>
where
    AB: AutodiffBackend + AttentionBackend,
    AB::InnerBackend: AttentionBackend,
{
    run.validate()?;
    let device = devices
        .first()
        .ok_or_else(|| TrainError::arg("devices", "names no device"))?;
    if devices.len() > 1 {
        check_shards(run.batch_size, devices.len())?;
    }
    if data.train.len() < run.batch_size {
        return Err(TrainError::arg(
            "batch-size",
            format!(
                "{} is more than the {} training samples (training batches are full; lower it)",
                run.batch_size,
                data.train.len()
            ),
        ));
    }
    let classifier = matches!(&model_config, ModelConfig::SequencePredictor(c) if c.is_classifier);
    let slots = Slots::for_model(&model_config, run.all_slots);
    let (train_loader, val_loader) = loaders(&run, &data)?;
    let batches = train_loader.num_batches();
    run.scheduler.total_steps =
        (batches.div_ceil(run.gradient_accumulation_steps) * run.epochs) as u64;

    let mut optimizers: Vec<_> = devices
        .iter()
        .map(|_| {
            Optimizer::<AB::InnerBackend>::new(run.optimizer.clone())
                .with_per_parameter_updates(AB::fuses_elementwise())
        })
        .collect();
    let (scheduler, mut progress) = match resume {
        Some(ckpt) => {
            if ckpt.meta.data.train_ids != data.info.train_ids
                || ckpt.meta.data.validation_ids != data.info.validation_ids
            {
                return Err(TrainError::Checkpoint {
                    path: ckpt.path.clone(),
                    reason: "its train/validation samples differ from this run's (same table, matrix, seed and --test-size are needed to resume)".into(),
                });
            }
            for (optimizer, device) in optimizers.iter_mut().zip(devices) {
                let mut tensors = ckpt.optimizer.clone();
                optimizer.load_state(&mut tensors, &ckpt.meta.optimizer_steps, device)?;
            }
            (ckpt.meta.scheduler.clone(), ckpt.meta.progress.clone())
        }
        None => (
            Scheduler::new(run.scheduler.clone()),
            Progress {
                epochs_done: 0,
                global_step: 0,
                micro_step: 0,
                best: None,
                bad_epochs: 0,
                history: Vec::new(),
                loss_scaler: None,
                in_epoch: None,
            },
        ),
    };
    // fp16 needs loss scaling; a resumed run keeps its scale.
    match run.mixed_precision {
        MixedPrecision::Fp16 => {
            progress.loss_scaler.get_or_insert_with(LossScaler::default);
        }
        _ => progress.loss_scaler = None,
    }
    let mut trainer = Trainer {
        devices,
        model_config: &model_config,
        run: &run,
        data: &data,
        out_dir,
        optimizers,
        scheduler,
        progress,
        classifier,
        slots,
        return_nucleotides: run.loss.nuc_penalty > 0.0,
        batches,
    };
    // Replica 0 is `model`; the others are its copies on their devices.
    let mut models = vec![model];
    for d in &devices[1..] {
        let replica = models[0].replica(d);
        models.push(replica);
    }
    let (mut stopped_early, mut interrupted) = (false, false);
    for epoch in trainer.progress.epochs_done..run.epochs {
        let (trained, training) = trainer.train_epoch(models, &train_loader, epoch, observer)?;
        models = trained;
        let Some(training) = training else {
            interrupted = true;
            break;
        };
        let asked_to_stop = training.interrupted;
        if cfg!(debug_assertions) {
            check_replicas_agree(&models, &model_config)?;
        }
        // Validation on the first replica (eval mode: the inner backend has no autodiff).
        let (validation, val_rows) = match &val_loader {
            Some(loader) => {
                observer.validating(loader.num_batches());
                let eval_model = valid(&models[0]);
                validate(&eval_model, loader, &run, &data, classifier, slots, device)?
            }
            None => (BTreeMap::new(), Vec::new()),
        };
        let (record, improved) =
            trainer.end_epoch(&models[0], epoch, training, validation, &val_rows)?;
        observer.epoch(&record, improved);
        if trainer.progress.bad_epochs >= run.patience.max(1) {
            tracing::info!(
                "early stopping: no improvement of {} for {} epochs",
                run.best_metric.key(),
                trainer.progress.bad_epochs
            );
            stopped_early = true;
            break;
        }
        if asked_to_stop || observer.interrupted() {
            interrupted = true;
            break;
        }
        if observer.should_stop() {
            break;
        }
    }
    Ok(FitSummary {
        history: trainer.progress.history,
        best: trainer.progress.best,
        best_checkpoint: out_dir.join(files::BEST),
        last_checkpoint: out_dir.join(files::LAST),
        stopped_early,
        interrupted,
        steps: trainer.progress.global_step,
    })
}

/// Data-parallel replicas take the same steps from the same weights, so
/// their weights stay bit-identical; checked after every epoch in debug
/// builds (the tests).
fn check_replicas_agree<B: Backend>(models: &[AamModel<B>], config: &ModelConfig) -> Result<()> {
    let Some((first, rest)) = models.split_first() else {
        return Ok(());
    };
    if rest.is_empty() {
        return Ok(());
    }
    let reference = first.state_dict(config);
    for (rank, model) in rest.iter().enumerate() {
        for ((key, a), (_, b)) in reference.iter().zip(model.state_dict(config)) {
            if a.values != b.values {
                return Err(TrainError::Replica {
                    rank: rank + 1,
                    reason: format!("its {key} differs from replica 0's after the same steps"),
                });
            }
        }
    }
    Ok(())
}

/// The training and (when there are validation samples) validation loaders.
fn loaders(run: &RunConfig, data: &TrainData) -> Result<(BatchLoader, Option<BatchLoader>)> {
    let mut train_cfg = BatchConfig::train(run.batch_size, run.token_limit, run.seed);
    train_cfg.asv_sampling = run.asv_sampling;
    train_cfg.workers = run.workers.max(1);
    train_cfg.prefetch = 2 * train_cfg.workers;
    let transforms = Arc::new(data.info.transforms.clone());
    let train = BatchLoader::new(
        data.dataset.clone(),
        data.train.clone(),
        transforms.clone(),
        train_cfg.clone(),
    )?;
    let validation = if data.validation.is_empty() {
        None
    } else {
        let cfg = BatchConfig {
            shuffle: false,
            drop_last: false,
            require_even: false,
            ..train_cfg
        };
        Some(BatchLoader::new(
            data.dataset.clone(),
            data.validation.clone(),
            transforms,
            cfg,
        )?)
    };
    Ok((train, validation))
}

/// What one epoch's training passes leave for its record.
struct EpochTraining {
    /// Loss (and gradient-norm) means over the epoch's batches.
    means: BTreeMap<String, f64>,
    /// Training samples seen.
    seen: usize,
    /// Seconds of training (without validation).
    seconds: f64,
    /// Learning rate of the epoch's last optimiser step.
    last_lr: f64,
    /// When the epoch started.
    started: Instant,
    /// Whether [`Observer::interrupted`] asked to stop at its last step.
    interrupted: bool,
}

/// A batch's losses (and nucleotide accuracy counts) as one `[k]` tensor
/// on the inner backend, named: what the step reads to the host at its end.
#[derive(Clone)]
struct StepValues<B: Backend> {
    names: Vec<&'static str>,
    values: Tensor<B, 1>,
    /// Nucleotide hits and scored positions `[2]`.
    accuracy: Option<Tensor<B, 1>>,
}

impl<B: Backend> StepValues<B> {
    fn new(parts: &LossParts<B>, accuracy: Option<(Tensor<B, 1>, Tensor<B, 1>)>) -> Self {
        let mut names = vec!["total_loss"];
        let mut values = vec![parts.total.clone()];
        for (name, part) in [
            ("unifrac_loss", &parts.unifrac),
            ("nuc_loss", &parts.nuc),
            ("count_loss", &parts.count),
            ("target_loss", &parts.target),
        ] {
            if let Some(p) = part {
                names.push(name);
                values.push(p.clone());
            }
        }
        Self {
            names,
            values: Tensor::cat(values, 0),
            accuracy: accuracy.map(|(hits, n)| Tensor::cat(vec![hits, n], 0)),
        }
    }

    /// The replicas' values summed on `device` (each replica reports its
    /// share of the global batch's losses).
    fn sum(all: Vec<Self>, device: &B::Device) -> Self {
        let mut all = all.into_iter();
        let first = all.next().expect("one replica at least");
        let start = (
            first.values.to_device(device),
            first.accuracy.map(|a| a.to_device(device)),
        );
        let (values, accuracy) = all.fold(start, |(values, accuracy), v| {
            (
                values + v.values.to_device(device),
                accuracy
                    .zip(v.accuracy)
                    .map(|(a, b)| a + b.to_device(device)),
            )
        });
        Self {
            names: first.names,
            values,
            accuracy,
        }
    }
}

impl<AB: AutodiffBackend> StepValues<AB> {
    /// The values without their autodiff graph.
    fn into_inner(self) -> StepValues<AB::InnerBackend> {
        StepValues {
            names: self.names,
            values: self.values.inner(),
            accuracy: self.accuracy.map(Tensor::inner),
        }
    }
}

/// What every replica's pass of one step reads, besides its own batch.
struct PassContext<'a> {
    run: &'a RunConfig,
    model_config: &'a ModelConfig,
    classifier: bool,
    slots: Slots,
    return_nucleotides: bool,
    loss_scale: f64,
    replicas: usize,
}

/// One replica's part of a step: its shard of the batch and what it shares.
struct Shard<'a> {
    rank: usize,
    batch: &'a Batch,
    shares: Shares,
    /// The global batch's UniFrac block `[B, B]` (`global` pairs).
    global_unifrac: Option<&'a [f32]>,
}

/// A shard's forward pass, waiting for the other replicas' offers.
struct ShardForward<AB: AutodiffBackend> {
    predictions: Predictions<AB>,
    targets: LossTargets<AB>,
    /// What this replica hands the others (several replicas only).
    offer: Option<Offer<AB::InnerBackend>>,
}

/// The forward pass of one replica's shard; with `replicas > 1`, also what
/// it offers the others (its embeddings in `global` mode, its count of
/// scored nucleotide positions).
fn shard_forward<AB>(
    ctx: &PassContext,
    model: &AamModel<AB>,
    device: &AB::Device,
    shard: &Shard,
    mut timer: Option<&mut StepProfiler>,
) -> Result<ShardForward<AB>>
where
    AB: AutodiffBackend + AttentionBackend,
    AB::InnerBackend: AttentionBackend,
{
    let (input, mut targets) = batch_tensors::<AB>(shard.batch, device, ctx.classifier, ctx.slots);
    if let Some(t) = timer.as_deref_mut() {
        t.mark::<AB>(device, "upload");
    }
    if let Some(u) = shard.global_unifrac {
        let b = (u.len() as f64).sqrt() as usize;
        targets.base = Some(Tensor::from_data(
            TensorData::new(u.to_vec(), [b, b]),
            device,
        ));
    }
    let predictions = {
        let _autocast = autocast(ctx.run.mixed_precision);
        predict_batch(model, input, ctx.return_nucleotides)
    };
    if let Some(t) = timer {
        t.mark::<AB>(device, "forward");
    }
    let offer = if ctx.replicas > 1 {
        let nuc_positions = predictions
            .nuc_logits
            .as_ref()
            .map(|_| {
                Ok::<_, TrainError>(
                    nucleotide_positions(
                        predictions.nuc_targets(&targets)?,
                        predictions.mask_indices.clone(),
                    )
                    .float()
                    .sum()
                    .inner(),
                )
            })
            .transpose()?;
        let embeddings = predictions
            .embeddings
            .as_ref()
            .filter(|_| shard.global_unifrac.is_some())
            .map(|e| e.clone().detach().inner());
        Some(Offer {
            embeddings,
            nuc_positions,
        })
    } else {
        None
    };
    Ok(ShardForward {
        predictions,
        targets,
        offer,
    })
}

/// The losses and backward pass of one replica's shard, with every
/// replica's offer (none on one device); its gradients are added to
/// `buffer`, scaled for accumulation and fp16.
#[allow(clippy::too_many_arguments)]
fn shard_backward<AB>(
    ctx: &PassContext,
    model: &AamModel<AB>,
    device: &AB::Device,
    shard: &Shard,
    forward: ShardForward<AB>,
    offers: Option<&[Offer<AB::InnerBackend>]>,
    buffer: &mut GradientBuffer<AB::InnerBackend>,
    mut timer: Option<&mut StepProfiler>,
) -> Result<StepValues<AB::InnerBackend>>
where
    AB: AutodiffBackend + AttentionBackend,
    AB::InnerBackend: AttentionBackend,
{
    let mut mark = |phase| {
        if let Some(t) = timer.as_deref_mut() {
            t.mark::<AB>(device, phase)
        }
    };
    let ShardForward {
        mut predictions,
        targets,
        ..
    } = forward;
    let scales = offers.map(|offers| {
        let offers: Vec<Offer<AB::InnerBackend>> =
            offers.iter().map(|o| o.to_device(device)).collect();
        if shard.global_unifrac.is_some() {
            if let Some(own) = predictions.embeddings.take() {
                predictions.embeddings = Some(gathered_embeddings::<AB>(&offers, shard.rank, own));
            }
        }
        TermScales::of(
            &ctx.run.loss,
            ctx.run.unifrac_pairs,
            ctx.classifier,
            shard.shares,
            ctx.replicas,
            nucleotide_share::<AB>(&offers, shard.rank),
        )
    });
    let parts = ctx.run.loss.forward(&predictions, &targets)?;
    let (objective, parts) = match scales {
        None => (parts.total.clone(), parts),
        Some((objective, report)) => (
            objective.apply(&ctx.run.loss, &parts).total,
            report.apply(&ctx.run.loss, &parts),
        ),
    };
    let accuracy = predictions
        .nuc_logits
        .as_ref()
        .map(|logits| {
            Ok::<_, TrainError>(nucleotide_accuracy(
                logits.clone().detach(),
                predictions.nuc_targets(&targets)?,
                predictions.mask_indices.clone(),
            ))
        })
        .transpose()?;
    mark("loss");
    let grads = if ctx.loss_scale == 1.0 {
        objective.backward()
    } else {
        (objective * ctx.loss_scale).backward()
    };
    mark("backward");
    let name = |path: &str| ctx.model_config.torch_key(path);
    buffer.accumulate(GradientBuffer::collect_model(
        model,
        &grads,
        &name,
        1.0 / (ctx.run.gradient_accumulation_steps as f64 * ctx.loss_scale),
    ));
    mark("collect");
    Ok(StepValues::new(&parts, accuracy).into_inner())
}

/// The state a run carries from batch to batch: optimiser, schedule and
/// progress counters (everything a checkpoint stores besides the weights).
struct Trainer<'a, AB: AutodiffBackend> {
    /// One per replica; the first holds the run's checkpoints and validation.
    devices: &'a [AB::Device],
    model_config: &'a ModelConfig,
    run: &'a RunConfig,
    data: &'a TrainData,
    out_dir: &'a Path,
    /// One per replica (they take the same steps; the first's is saved).
    optimizers: Vec<Optimizer<AB::InnerBackend>>,
    scheduler: Scheduler,
    progress: Progress,
    classifier: bool,
    slots: Slots,
    return_nucleotides: bool,
    /// Training batches per epoch.
    batches: usize,
}

impl<AB> Trainer<'_, AB>
where
    AB: AutodiffBackend + AttentionBackend,
    AB::InnerBackend: AttentionBackend,
{
    /// One epoch over the training batches: a forward and backward pass per
    /// batch, an optimiser step every `gradient_accumulation_steps` batches
    /// (and after the last), one host read per batch. A checkpoint taken
    /// inside this epoch ([`Progress::in_epoch`]) continues from its batch.
    ///
    /// Returns no [`EpochTraining`] when [`Observer::interrupted`] stopped
    /// the epoch before its last batch (its step checkpoint is written).
    fn train_epoch(
        &mut self,
        mut models: Vec<AamModel<AB>>,
        loader: &BatchLoader,
        epoch: usize,
        observer: &mut dyn Observer,
    ) -> Result<(Vec<AamModel<AB>>, Option<EpochTraining>)> {
        let (run, device) = (self.run, &self.devices[0]);
        let accum = run.gradient_accumulation_steps;
        let started = Instant::now();
        let mut buffers: Vec<GradientBuffer<AB::InnerBackend>> =
            self.devices.iter().map(|_| Default::default()).collect();
        let mut pending = 0usize;
        let (first, mut seen, mut last_lr, mut means, mut skipped) =
            match self.progress.in_epoch.take() {
                Some(p) if p.epoch == epoch => {
                    (p.batches_done, p.samples, p.lr, p.means, p.skipped)
                }
                _ => (0, 0, self.scheduler.lr(), Means::default(), 0),
            };
        let mut timer = StepProfiler::new(run.memory_profile, run.time_phases);
        let mut interrupted = false;
        for (k, batch) in (first..).zip(loader.epoch_from(epoch as u64, first)) {
            let batch = batch?;
            let stream = mix(run.seed, self.progress.micro_step);
            for (rank, d) in self.devices.iter().enumerate().rev() {
                AB::seed(
                    d,
                    if rank == 0 {
                        stream
                    } else {
                        mix(stream, rank as u64)
                    },
                );
            }
            set_attention_dropout_seed(stream);
            self.progress.micro_step += 1;
            timer.mark::<AB>(device, "data");
            let values = self.forward_backward(&models, &batch, &mut buffers, &mut timer)?;
            pending += 1;
            let stepped = pending == accum || k + 1 == self.batches;
            // --skip-nonfinite-batches: the batch's values, and before a step
            // the gradient norm, are read before the step; a non-finite one
            // drops the gradients accumulated since the last step.
            let mut read_early = None;
            if run.skip_nonfinite_batches {
                let mut batch_means = Means::default();
                let (total, mut bad) = record_batch(values.clone(), None, &mut batch_means);
                // (fp16's scaled gradients overflow by design: the loss scaler
                // skips those steps and lowers the scale.)
                let scaled = self.progress.loss_scaler.is_some();
                if stepped && bad.is_empty() && !scaled {
                    if let Some(norm) = buffers
                        .iter()
                        .map(|b| b.global_norm())
                        .find(|n| !n.is_finite())
                    {
                        bad.push(format!("gradient norm {norm}"));
                    }
                }
                if !bad.is_empty() {
                    tracing::warn!(
                        "skipping epoch {} batch {} ({}; samples {}){}",
                        epoch + 1,
                        k + 1,
                        bad.join(", "),
                        self.batch_samples(&batch),
                        if pending > 1 {
                            format!(" and the {} batches accumulated before it", pending - 1)
                        } else {
                            String::new()
                        }
                    );
                    skipped += pending;
                    pending = 0;
                    buffers.iter_mut().for_each(GradientBuffer::clear);
                    continue;
                }
                read_early = Some((total, batch_means));
            }
            seen += batch.batch_size();
            // The gradient norm before clipping, still on the device.
            let mut grad_norm = None;
            if stepped {
                last_lr = self.scheduler.lr();
                let (stepped, norm) = self.optimizer_step(models, &mut buffers, &mut means);
                models = stepped;
                grad_norm = norm;
                pending = 0;
                timer.mark::<AB>(device, "optimizer");
            }
            // The step's one host read (losses, accuracy counts, gradient norm),
            // after everything is queued. A non-finite loss stops the run before
            // any checkpoint is written from the weights it produced.
            let (total, non_finite) = match read_early {
                None => record_batch(values, grad_norm, &mut means),
                Some((total, batch_means)) => {
                    means.merge(batch_means);
                    if let Some(norm) = grad_norm {
                        means.add("grad_norm", norm.into_scalar().elem::<f64>());
                    }
                    (total, Vec::new())
                }
            };
            timer.mark::<AB>(device, "read");
            tracing::debug!(
                "epoch {epoch} batch {k}: lr {last_lr:e}, {} samples, {} filled slots",
                batch.batch_size(),
                batch.filled_slots()
            );
            if !non_finite.is_empty() {
                return Err(TrainError::NonFinite {
                    terms: non_finite.join(", "),
                    epoch,
                    batch: k,
                    step: self.progress.global_step - u64::from(stepped),
                    samples: self.batch_samples(&batch),
                    checkpoint: self.out_dir.join(files::LAST),
                });
            }
            timer.step();
            observer.batch(&BatchStatus {
                epoch,
                epochs: run.epochs,
                batch: k + 1,
                batches: self.batches,
                loss: total,
                lr: last_lr,
                samples_per_sec: seen as f64 / started.elapsed().as_secs_f64().max(1e-9),
            });
            if stepped {
                interrupted = observer.interrupted();
                let due = run
                    .checkpoint_every_steps
                    .is_some_and(|n| self.progress.global_step % n.max(1) == 0);
                // The epoch's last step is checkpointed by its end.
                if (interrupted || due) && k + 1 < self.batches {
                    self.progress.in_epoch = Some(EpochPosition {
                        epoch,
                        batches_done: k + 1,
                        samples: seen,
                        lr: last_lr,
                        means: means.clone(),
                        skipped,
                    });
                    let path = self.out_dir.join(files::LAST);
                    self.write_checkpoint(&models[0], &[&path])?;
                    tracing::debug!(
                        "checkpoint at epoch {epoch} batch {} (step {}): {}",
                        k + 1,
                        self.progress.global_step,
                        path.display()
                    );
                    self.progress.in_epoch = None;
                    if interrupted {
                        return Ok((models, None));
                    }
                }
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        timer.epoch_end(epoch, &self.out_dir.join(files::MEMORY_PROFILE))?;
        let mut means = means.finish();
        if run.skip_nonfinite_batches {
            means.insert("skipped_batches".into(), skipped as f64);
        }
        Ok((
            models,
            Some(EpochTraining {
                means,
                seen,
                seconds,
                last_lr,
                started,
                interrupted,
            }),
        ))
    }

    /// A batch's sample IDs, for messages.
    fn batch_samples(&self, batch: &Batch) -> String {
        let ids = self.data.dataset.sample_ids();
        let samples: Vec<&str> = batch.positions.iter().map(|&p| ids[p].as_str()).collect();
        samples.join(", ")
    }

    /// Writes the run's state as it stands (weights of `model`, the first
    /// replica's optimiser, schedule, progress) to each of `paths`.
    fn write_checkpoint(&self, model: &AamModel<AB>, paths: &[&Path]) -> Result<()> {
        let (optim_tensors, optimizer_steps) = self.optimizers[0].state_tensors();
        let meta = CheckpointMeta {
            format: FORMAT_VERSION,
            producer: format!("aam-rs {}", env!("CARGO_PKG_VERSION")),
            model: self.model_config.clone(),
            run: self.run.clone(),
            data: self.data.info.clone(),
            progress: self.progress.clone(),
            scheduler: self.scheduler.clone(),
            optimizer_steps,
        };
        for path in paths {
            write_checkpoint(path, &meta, model, optim_tensors.clone())?;
        }
        Ok(())
    }

    /// The forward and backward passes of one batch: on one device the whole
    /// batch; on several, each replica its shard (see [`crate::parallel`]).
    /// Returns the batch's losses, summed over the replicas on the first
    /// device.
    ///
    /// The replicas run one after another on this thread: every forward
    /// pass, then every backward pass. Launches are asynchronous, so the
    /// devices of several replicas compute at the same time; tensors never
    /// move between threads (Burn's fusion streams are per thread).
    fn forward_backward(
        &self,
        models: &[AamModel<AB>],
        batch: &Batch,
        buffers: &mut [GradientBuffer<AB::InnerBackend>],
        timer: &mut StepProfiler,
    ) -> Result<StepValues<AB::InnerBackend>> {
        let n = self.devices.len();
        let ctx = PassContext {
            run: self.run,
            model_config: self.model_config,
            classifier: self.classifier,
            slots: self.slots,
            return_nucleotides: self.return_nucleotides,
            loss_scale: self.progress.loss_scaler.as_ref().map_or(1.0, |s| s.scale),
            replicas: n,
        };
        let device = &self.devices[0];
        if n == 1 {
            let shard = Shard {
                rank: 0,
                batch,
                shares: Shares::WHOLE,
                global_unifrac: None,
            };
            let forward = shard_forward(&ctx, &models[0], device, &shard, Some(&mut *timer))?;
            return shard_backward(
                &ctx,
                &models[0],
                device,
                &shard,
                forward,
                None,
                &mut buffers[0],
                Some(timer),
            );
        }
        let batches = batch.shards(n);
        let class_weights = self
            .classifier
            .then_some(self.run.loss.class_weights.as_deref())
            .flatten();
        let shares = Shares::of(&batches, class_weights);
        let global_unifrac = match self.run.unifrac_pairs {
            UnifracPairs::Global => batch.unifrac.as_deref(),
            UnifracPairs::Local => None,
        };
        let shards: Vec<Shard> = batches
            .iter()
            .zip(shares)
            .enumerate()
            .map(|(rank, (batch, shares))| Shard {
                rank,
                batch,
                shares,
                global_unifrac,
            })
            .collect();
        let forwards = shards
            .iter()
            .zip(models)
            .zip(self.devices)
            .map(|((shard, model), device)| shard_forward(&ctx, model, device, shard, None))
            .collect::<Result<Vec<_>>>()?;
        timer.mark::<AB>(device, "forward");
        let offers: Vec<Offer<AB::InnerBackend>> = forwards
            .iter()
            .map(|f| f.offer.clone().expect("several replicas offer"))
            .collect();
        let values = shards
            .iter()
            .zip(forwards)
            .zip(models.iter().zip(self.devices))
            .zip(buffers.iter_mut())
            .map(|(((shard, forward), (model, device)), buffer)| {
                shard_backward(
                    &ctx,
                    model,
                    device,
                    shard,
                    forward,
                    Some(&offers),
                    buffer,
                    None,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(StepValues::sum(values, device))
    }

    /// Sums the replicas' accumulated gradients, clips them (fp16: skips the
    /// step when they overflowed) and takes one optimiser step on every
    /// replica. Returns the stepped models and, when clipping ran on the
    /// device, the gradient norm before it.
    fn optimizer_step(
        &mut self,
        models: Vec<AamModel<AB>>,
        buffers: &mut [GradientBuffer<AB::InnerBackend>],
        means: &mut Means,
    ) -> (Vec<AamModel<AB>>, Option<Tensor<AB::InnerBackend, 1>>) {
        let run = self.run;
        all_reduce(buffers, self.devices);
        let mut grad_norm = None;
        if let Some(scaler) = self.progress.loss_scaler.as_mut() {
            // fp16: the norm is read here (one host read serves the overflow
            // check and clipping). A step whose scaled gradients overflowed is
            // skipped (its gradients dropped) and the scale lowered.
            let norm = buffers[0].global_norm();
            if !scaler.update(norm.is_finite()) {
                tracing::debug!(
                    "fp16 gradients overflowed: step skipped, loss scale now {}",
                    scaler.scale
                );
                buffers.iter_mut().for_each(GradientBuffer::clear);
            }
            if let Some(max_norm) = run.max_grad_norm {
                if !buffers[0].is_empty() {
                    for buffer in buffers.iter_mut() {
                        buffer.clip_to_norm(max_norm, norm);
                    }
                    means.add("grad_norm", norm);
                }
            }
        } else if let Some(max_norm) = run.max_grad_norm {
            // On the device: the optimiser is queued behind the backward
            // pass, and the norm is read with the losses. Every replica
            // clips its copy of the same sum by the same norm.
            for (rank, buffer) in buffers.iter_mut().enumerate() {
                let norm = buffer.clip_global_norm(max_norm);
                if rank == 0 {
                    grad_norm = norm;
                }
            }
        }
        let lr = self.scheduler.lr();
        let factor = lr / run.scheduler.lr;
        let group_lr = |key: &str| match run.categorical_lr {
            Some(c) if is_categorical_param(key) => c * factor,
            _ => lr,
        };
        let name = |path: &str| self.model_config.torch_key(path);
        let beta1 = self.scheduler.beta1();
        let stepped = models
            .into_iter()
            .zip(self.optimizers.iter_mut())
            .zip(buffers.iter_mut())
            .map(|((model, optimizer), buffer)| {
                let grads = std::mem::take(buffer);
                step_model(optimizer, model, grads, &name, &group_lr, beta1)
            })
            .collect();
        self.scheduler.step();
        self.progress.global_step += 1;
        (stepped, grad_norm)
    }

    /// Closes an epoch: steps the plateau schedule, decides whether the
    /// monitored metric improved, and writes the checkpoints (`last`, and
    /// `best` with its validation predictions on improvement) and metrics.
    fn end_epoch(
        &mut self,
        model: &AamModel<AB>,
        epoch: usize,
        training: EpochTraining,
        validation: BTreeMap<String, f64>,
        val_rows: &[PredictionRow],
    ) -> Result<(EpochRecord, bool)> {
        let run = self.run;
        let progress = &mut self.progress;
        let monitored = if validation.is_empty() {
            // Without validation the training loss decides (as the reference).
            training
                .means
                .get("total_loss")
                .copied()
                .unwrap_or(f64::NAN)
        } else {
            validation
                .get(run.best_metric.key())
                .copied()
                .unwrap_or(f64::NAN)
        };
        self.scheduler.epoch_end(
            validation
                .get("total_loss")
                .or(training.means.get("total_loss"))
                .copied()
                .unwrap_or(f64::NAN),
        );
        let improved = monitored.is_finite()
            && progress.best.as_ref().is_none_or(|b| {
                if run.best_metric.higher_is_better() {
                    monitored > b.value
                } else {
                    monitored < b.value
                }
            });
        if improved {
            progress.best = Some(Best {
                metric: run.best_metric.key().to_string(),
                value: monitored,
                epoch,
            });
            progress.bad_epochs = 0;
        } else {
            progress.bad_epochs += 1;
        }
        let record = EpochRecord {
            epoch,
            step: progress.global_step,
            lr: training.last_lr,
            train: training.means,
            validation,
            samples_per_sec: training.seen as f64 / training.seconds.max(1e-9),
            seconds: training.started.elapsed().as_secs_f64(),
        };
        progress.history.push(record.clone());
        progress.epochs_done = epoch + 1;

        let out = |rel: &str| self.out_dir.join(rel);
        let (last, best) = (out(files::LAST), out(files::BEST));
        if improved {
            self.write_checkpoint(model, &[&last, &best])?;
            if !val_rows.is_empty() {
                write_predictions(&out(files::VAL_PREDICTIONS), val_rows)?;
            }
        } else {
            self.write_checkpoint(model, &[&last])?;
        }
        write_metrics_csv(&out(files::METRICS), &self.progress.history)?;
        Ok((record, improved))
    }
}

fn step_model<AB>(
    optimizer: &mut Optimizer<AB::InnerBackend>,
    model: AamModel<AB>,
    grads: GradientBuffer<AB::InnerBackend>,
    name: &dyn Fn(&str) -> String,
    lr: &dyn Fn(&str) -> f64,
    beta1: Option<f64>,
) -> AamModel<AB>
where
    AB: AutodiffBackend,
    AB::InnerBackend: AttentionBackend,
{
    match model {
        AamModel::SequenceEncoder(m) => {
            AamModel::SequenceEncoder(optimizer.step::<AB, _>(m, grads, name, lr, beta1))
        }
        AamModel::SequencePredictor(m) => {
            AamModel::SequencePredictor(optimizer.step::<AB, _>(m, grads, name, lr, beta1))
        }
    }
}

impl<B: Backend> GradientBuffer<B> {
    /// [`GradientBuffer::collect`] for either model.
    pub fn collect_model<AB: AutodiffBackend<InnerBackend = B>>(
        model: &AamModel<AB>,
        grads: &AB::Gradients,
        name: &dyn Fn(&str) -> String,
        scale: f64,
    ) -> Self {
        match model {
            AamModel::SequenceEncoder(m) => Self::collect(m, grads, name, scale),
            AamModel::SequencePredictor(m) => Self::collect(m, grads, name, scale),
        }
    }
}

/// The eval-mode copy of a model (no autodiff, so no dropout or masking).
pub fn valid<AB: AutodiffBackend>(model: &AamModel<AB>) -> AamModel<AB::InnerBackend> {
    match model {
        AamModel::SequenceEncoder(m) => AamModel::SequenceEncoder(m.valid()),
        AamModel::SequencePredictor(m) => AamModel::SequencePredictor(m.valid()),
    }
}

/// One validation row: sample, prediction(s) and actual value, in original units.
type PredictionRow = (String, Vec<String>, String);

/// Validation losses and metrics (§3.6), and the predictions for the TSV.
fn validate<B: AttentionBackend>(
    model: &AamModel<B>,
    loader: &BatchLoader,
    run: &RunConfig,
    data: &TrainData,
    classifier: bool,
    slots: Slots,
    device: &B::Device,
) -> Result<(BTreeMap<String, f64>, Vec<PredictionRow>)> {
    let mut means = Means::default();
    let mut pairs = RegressionMetrics::default();
    let mut targets_metrics = RegressionMetrics::default();
    let mut classes = ClassificationMetrics::default();
    let (mut nuc_hits, mut nuc_total) = (0.0, 0.0);
    let mut rows = Vec::new();
    let return_nucleotides = run.loss.nuc_penalty > 0.0;
    for batch in loader.epoch(0) {
        let batch = batch?;
        let (input, targets) = batch_tensors::<B>(&batch, device, classifier, slots);
        let predictions = {
            let _autocast = autocast(run.mixed_precision);
            predict_batch(model, input, return_nucleotides)
        };
        let parts = run.loss.forward(&predictions, &targets)?;
        record_batch(StepValues::new(&parts, None), None, &mut means);
        if let Some(logits) = &predictions.nuc_logits {
            let (hits, n) =
                nucleotide_accuracy(logits.clone(), predictions.nuc_targets(&targets)?, None);
            let counts = Tensor::cat(vec![hits, n], 0)
                .into_data()
                .convert::<f64>()
                .to_vec::<f64>()
                .expect("f64");
            nuc_hits += counts[0];
            nuc_total += counts[1];
        }
        // Pretraining reports metrics of the predicted UniFrac distances.
        if let (Task::Pretrain, Some(e), Some(t)) =
            (run.task, &predictions.embeddings, &targets.base)
        {
            let b = batch.batch_size();
            let p = pairwise_tanh_distances(e.clone())
                .into_data()
                .to_vec::<f32>()
                .expect("f32");
            let t = t.clone().into_data().to_vec::<f32>().expect("f32");
            let (mut pp, mut tt) = (Vec::new(), Vec::new());
            for i in 0..b {
                for j in i + 1..b {
                    pp.push(p[i * b + j] as f64);
                    tt.push(t[i * b + j] as f64);
                }
            }
            pairs.update(&pp, &tt);
        }
        if let Some(pred) = &predictions.target {
            target_rows(
                pred,
                &batch,
                data,
                classifier,
                &mut targets_metrics,
                &mut classes,
                &mut rows,
            );
        }
    }
    let mut out = means.finish();
    if nuc_total > 0.0 {
        out.insert("nuc_accuracy".into(), nuc_hits / nuc_total);
    }
    let regression = if run.task == Task::Pretrain {
        &pairs
    } else {
        &targets_metrics
    };
    if regression.count() > 0 {
        out.insert("mae".into(), regression.mae());
        out.insert("mse".into(), regression.mse());
        out.insert("r2".into(), regression.r2());
    }
    if classifier {
        out.insert("accuracy".into(), classes.accuracy());
        out.insert("f1".into(), classes.f1());
    }
    Ok((out, rows))
}

/// Denormalised predictions of one batch, into the metrics and TSV rows.
fn target_rows<B: Backend>(
    pred: &TargetPrediction<B>,
    batch: &Batch,
    data: &TrainData,
    classifier: bool,
    metrics: &mut RegressionMetrics,
    classes: &mut ClassificationMetrics,
    rows: &mut Vec<PredictionRow>,
) {
    let b = batch.batch_size();
    // Point predictions [B, out]; quantile models report the middle quantile.
    let (values, width) = match pred {
        TargetPrediction::Point(p) => {
            let [_, out] = p.dims();
            (
                p.clone()
                    .into_data()
                    .convert::<f32>()
                    .to_vec::<f32>()
                    .expect("f32"),
                out,
            )
        }
        TargetPrediction::Quantiles(p) => {
            let [_, out, q] = p.dims();
            let mid = p.clone().narrow(2, q / 2, 1).reshape([b, out]);
            (
                mid.into_data()
                    .convert::<f32>()
                    .to_vec::<f32>()
                    .expect("f32"),
                out,
            )
        }
    };
    let raw = data.dataset.targets();
    for (i, &pos) in batch.positions.iter().enumerate() {
        let row = &values[i * width..(i + 1) * width];
        let id = batch.sample_ids[i].clone();
        if classifier {
            let predicted = row
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map_or(0, |(c, _)| c);
            let truth = batch.targets.as_ref().map_or(0, |t| t[i] as usize);
            classes.update(truth, predicted);
            let label = |c: usize| {
                data.info
                    .class_labels
                    .as_ref()
                    .and_then(|l| l.get(c).cloned())
                    .unwrap_or_else(|| c.to_string())
            };
            rows.push((id, vec![label(predicted)], label(truth)));
        } else {
            let key = category_key(data, pos);
            let denorm: Vec<f64> = row
                .iter()
                .map(|&x| match &data.info.transforms.target {
                    Some(n) => n.denormalize(x as f64, key.as_deref()),
                    None => x as f64,
                })
                .collect();
            let actual = raw.map_or(f64::NAN, |r| r[pos]);
            metrics.update(&denorm[..1], &[actual]);
            rows.push((
                id,
                denorm.iter().map(|v| format!("{v}")).collect(),
                format!("{actual}"),
            ));
        }
    }
}

/// The per-category normalisation key of a sample (None without one).
pub fn category_key(data: &TrainData, pos: usize) -> Option<String> {
    let norm = data.info.transforms.target.as_ref()?;
    let cat = norm.category.as_ref()?;
    let (meta, rows) = data.dataset.metadata()?;
    let cols: Vec<usize> = cat
        .columns
        .iter()
        .filter_map(|c| meta.column(c).ok())
        .collect();
    rows[pos].map(|r| meta.category_key(r, &cols))
}

fn write_predictions(path: &Path, rows: &[PredictionRow]) -> Result<()> {
    let width = rows.first().map_or(1, |r| r.1.len());
    let mut text = String::from("sample_id\t");
    if width == 1 {
        text.push_str("prediction");
    } else {
        text.push_str(
            &(0..width)
                .map(|k| format!("prediction_{k}"))
                .collect::<Vec<_>>()
                .join("\t"),
        );
    }
    text.push_str("\tactual\n");
    for (id, pred, actual) in rows {
        text.push_str(&format!("{id}\t{}\t{actual}\n", pred.join("\t")));
    }
    write_atomic(path, text.as_bytes())?;
    Ok(())
}

/// `metrics.csv`: epoch, step, lr, samples/s, seconds, `train_<k>`, `val_<k>`.
fn write_metrics_csv(path: &Path, history: &[EpochRecord]) -> Result<()> {
    let mut train_keys: Vec<&String> = history.iter().flat_map(|r| r.train.keys()).collect();
    train_keys.sort();
    train_keys.dedup();
    let mut val_keys: Vec<&String> = history.iter().flat_map(|r| r.validation.keys()).collect();
    val_keys.sort();
    val_keys.dedup();
    let mut text = String::from("epoch,step,lr,samples_per_sec,seconds");
    for k in &train_keys {
        text.push_str(&format!(",train_{k}"));
    }
    for k in &val_keys {
        text.push_str(&format!(",val_{k}"));
    }
    text.push('\n');
    let cell = |v: Option<&f64>| v.map_or(String::new(), |v| format!("{v}"));
    for r in history {
        text.push_str(&format!(
            "{},{},{},{},{}",
            r.epoch, r.step, r.lr, r.samples_per_sec, r.seconds
        ));
        for k in &train_keys {
            text.push_str(&format!(",{}", cell(r.train.get(*k))));
        }
        for k in &val_keys {
            text.push_str(&format!(",{}", cell(r.validation.get(*k))));
        }
        text.push('\n');
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
    }
    write_atomic(path, text.as_bytes())?;
    Ok(())
}
