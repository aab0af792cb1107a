//! Reference §4.3–4.4: the epoch loop. One function, [`fit`], for `pretrain`
//! (a [`SequenceEncoder`](aam_models::sequence_encoder::SequenceEncoder)) and
//! `train` (a [`SequencePredictor`](aam_models::sequence_predictor::SequencePredictor)).
//!
//! **Determinism.** Every random draw of a forward pass (dropout, nucleotide
//! masking, attention dropout) comes from a stream seeded by
//! `(seed, micro_step)`, and batch order from `(seed, epoch)`; a checkpoint
//! stores the counters, so a resumed run repeats the uninterrupted one.
//! On the CubeCL backends the masks come from counter-based kernels seeded
//! per thread, so data-parallel replicas (one thread each) repeat too. On
//! the backends without them (ndarray, candle, libtorch) dropout and random
//! masking draw from Burn's process-global generator: replicas on threads,
//! or two fits at once in one process, draw from each other's stream there.
//!
//! **Outputs** under the output directory: `checkpoints/last.safetensors`
//! (every epoch), `checkpoints/best.safetensors` (on improvement),
//! `metrics.csv` (one row per epoch), `val_predictions.tsv` (train, best
//! epoch, original units). All are written atomically.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use aam_data::{write_atomic, Batch, BatchConfig, BatchLoader, Dataset};
use aam_models::model::{AamModel, ModelConfig};
use aam_models::output::{AsvTokens, ModelInput};
use aam_models::sequence_predictor::TargetPrediction;
use aam_models::{autocast, AttentionBackend, MixedPrecision};
use burn::module::AutodiffModule;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

use crate::checkpoint::{
    write_checkpoint, Best, Checkpoint, CheckpointMeta, DataInfo, EpochPosition, EpochRecord,
    Progress, FORMAT_VERSION,
};
use crate::collective::{self, ProcessSum};
use crate::config::{PhaseTiming, RunConfig, Task};
use crate::error::{Result, TrainError};
use crate::loss::{
    nucleotide_accuracy, pairwise_tanh_distances, BaseLoss, LossTargets, Predictions, Target,
};
use crate::metrics::{ClassificationMetrics, Means, RegressionMetrics};
use crate::optim::{LossScaler, Optimizer};
use crate::parallel::{check_shards, Group, HostExchange, Shares, UnifracPairs};
use crate::replica::{
    Clip, Done, Job, Ranks, Replica, Setup, Shard, StepPlan, StepValues, Workers,
};
use crate::schedule::Scheduler;
use crate::tensorboard::{self, EventWriter};
use crate::world::{fingerprint, rendezvous, Links, World};

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
    /// Optimiser steps of the run so far (this batch's included).
    pub step: u64,
    /// Whether this batch ended an optimiser step (the last of
    /// `--gradient-accumulation-steps`).
    pub stepped: bool,
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

/// The caller's observer, with the run's scalars also written to
/// TensorBoard event files (`<out>/tensorboard/`). A write that fails is
/// logged once and ends the event file, not the run.
struct Logged<'a> {
    inner: &'a mut dyn Observer,
    events: Option<EventWriter>,
}

impl<'a> Logged<'a> {
    fn new(out_dir: &Path, inner: &'a mut dyn Observer) -> Self {
        let events = EventWriter::create(&out_dir.join(tensorboard::DIR))
            .map_err(|e| tracing::warn!("no TensorBoard events: {e}"))
            .ok();
        Logged { inner, events }
    }

    fn write(&mut self, f: impl FnOnce(&mut EventWriter) -> Result<()>) {
        if let Some(events) = &mut self.events {
            if let Err(e) = f(events) {
                tracing::warn!("TensorBoard events stop here: {e}");
                self.events = None;
            }
        }
    }
}

impl Observer for Logged<'_> {
    fn batch(&mut self, status: &BatchStatus) {
        if status.stepped {
            self.write(|w| {
                w.scalars(
                    status.step,
                    [
                        ("step/total_loss", status.loss),
                        ("step/learning_rate", status.lr),
                    ],
                )
            });
        }
        self.inner.batch(status);
    }
    fn validating(&mut self, batches: usize) {
        self.inner.validating(batches);
    }
    fn epoch(&mut self, record: &EpochRecord, improved: bool) {
        self.write(|w| w.epoch(record, improved));
        self.inner.epoch(record, improved);
    }
    fn should_stop(&mut self) -> bool {
        self.inner.should_stop()
    }
    fn interrupted(&mut self) -> bool {
        self.inner.interrupted()
    }
}

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
    /// Pretraining: the UniFrac distance and the embeddings' predicted
    /// distance of each pair of samples within a validation batch, best epoch.
    pub const VAL_UNIFRAC: &str = "val_unifrac.tsv";
    /// Validation predictions of the best epoch (the target; in Faith's PD
    /// pretraining, the predicted PD of each validation sample).
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
    let base = match (&batch.unifrac, &batch.faith_pd) {
        (Some(u), _) => Some(Tensor::<B, 2>::from_data(
            TensorData::new(u.clone(), batch.unifrac_shape()),
            device,
        )),
        (None, Some(pd)) => Some(Tensor::<B, 2>::from_data(
            TensorData::new(pd.clone(), [b, 1]),
            device,
        )),
        (None, None) => None,
    };
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
        sample_weights: batch
            .weights
            .as_ref()
            .map(|w| Tensor::<B, 1>::from_data(TensorData::new(w.clone(), [b]), device)),
    };
    (input, targets)
}

/// A 64-bit mix (splitmix64) so neighbouring counters give unrelated seeds.
pub(crate) fn mix(seed: u64, counter: u64) -> u64 {
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
/// norm) in one device read, adds the other replicas' shares (`others`,
/// [`crate::replica::host_values`]), and adds them to `means`.
fn record_batch<B: Backend>(
    values: StepValues<B>,
    grad_norm: Option<Tensor<B, 1>>,
    means: &mut Means,
    others: &[Vec<f64>],
) -> BatchRecord {
    let StepValues {
        mut names,
        values,
        accuracy,
        stop,
    } = values;
    let with_accuracy = accuracy.is_some();
    let with_stop = stop.is_some();
    let mut all = vec![values];
    if let Some(norm) = grad_norm {
        names.push("grad_norm");
        all.push(norm);
    }
    // The accuracy counts (hits, scored) go last, then the stop requests.
    all.extend(accuracy);
    all.extend(stop);
    let values = Tensor::cat(all, 0);
    let mut host: Vec<f64> = values
        .into_data()
        .convert::<f64>()
        .to_vec::<f64>()
        .expect("f64");
    let stop = with_stop && host.pop().is_some_and(|s| s > 0.0);
    // Another replica's share: its losses, then its accuracy counts (no
    // gradient norm: that is the summed gradients', the same everywhere).
    for other in others {
        let accuracy = if with_accuracy { 2 } else { 0 };
        let own_losses = other.len() - accuracy;
        for (h, o) in host.iter_mut().zip(&other[..own_losses]) {
            *h += o;
        }
        let end = host.len();
        for (h, o) in host[end - accuracy..].iter_mut().zip(&other[own_losses..]) {
            *h += o;
        }
    }
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
    BatchRecord {
        total: host[0],
        non_finite,
        stop,
    }
}

/// What [`record_batch`] read.
struct BatchRecord {
    /// The batch's total loss.
    total: f64,
    /// The values that are not finite (`name value`).
    non_finite: Vec<String>,
    /// Across processes: whether a process asked every process to stop.
    stop: bool,
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
pub(crate) struct StepProfiler {
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

    pub(crate) fn mark<B: AttentionBackend>(&mut self, device: &B::Device, phase: &'static str) {
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
/// first, and are the same files whatever the number of devices. `world`
/// places this process among the run's processes ([`crate::world`]; one:
/// [`World::single`]): their replicas form one group, and only process 0
/// writes files.
#[allow(clippy::too_many_arguments)]
pub fn fit<AB>(
    devices: &[AB::Device],
    world: &World,
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
    world.check()?;
    let writes = world.writes();
    let mut logged;
    let observer: &mut dyn Observer = if writes {
        logged = Logged::new(out_dir, observer);
        &mut logged
    } else {
        observer
    };
    let device = devices
        .first()
        .ok_or_else(|| TrainError::arg("devices", "names no device"))?;
    // Every replica of the run, in every process; this process's come from
    // global rank `first`.
    let replicas = world.size * devices.len();
    let first = world.rank * devices.len();
    if replicas > 1 {
        check_shards(run.batch_size, replicas)?;
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

    let mut optimizer = Optimizer::<AB::InnerBackend>::new(run.optimizer.clone())
        .with_per_parameter_updates(AB::fuses_elementwise());
    // The optimiser state a resumed run's worker replicas load too.
    let mut resumed_optimizer = None;
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
            let mut tensors = ckpt.optimizer.clone();
            optimizer.load_state(&mut tensors, &ckpt.meta.optimizer_steps, device)?;
            if devices.len() > 1 {
                resumed_optimizer = Some(Arc::new((
                    ckpt.optimizer.clone(),
                    ckpt.meta.optimizer_steps.clone(),
                )));
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
    let setup = Setup {
        run: &run,
        model_config: &model_config,
        classifier,
        slots,
        return_nucleotides: run.loss.nuc_penalty > 0.0,
        parameters: model.state_dict_shapes(&model_config),
    };
    let processes = world.size > 1;
    let mut links = None;
    let mut across = None;
    if processes {
        // Every process starts from the same weights (the same seed, or the
        // same checkpoint): the fingerprint checks it.
        let mut print = serde_json::to_vec(&run).unwrap_or_default();
        print.extend(data.info.train_ids.join("\n").as_bytes());
        for (key, t) in model.state_dict(&model_config) {
            print.extend(key.as_bytes());
            print.extend(t.values.iter().flat_map(|v| v.to_le_bytes()));
        }
        let (joined, how) = join_processes::<AB::InnerBackend>(
            world,
            devices,
            first,
            replicas,
            fingerprint(&print),
        )?;
        if let Joined::Host(sum) = how {
            across = Some(sum);
        }
        // A process lost mid-run would leave the others waiting in a sum
        // forever (neither an NCCL collective nor burn-collective has a
        // timeout): stop instead.
        let rank = world.rank;
        joined.watch(move |lost| {
            tracing::error!(
                "process {lost} of the run stopped (its log says why); process {rank} cannot \
                 go on without it and exits"
            );
            // Not `std::process::exit`: its exit handlers (the CUDA
            // runtime's) wait for the collective that waits for the lost
            // process, and never return (2x H200, 2026-11-30).
            // SAFETY: `_exit` ends the process at once; nothing of it is used after.
            unsafe { libc::_exit(1) }
        })?;
        links = Some(joined);
    }
    let ranks = Ranks {
        first,
        replicas,
        processes,
    };
    let shared_devices = Arc::new(devices.to_vec());
    let host = Arc::new(match across {
        Some(across) => HostExchange::across_processes(devices.len(), across),
        None => HostExchange::new(devices.len()),
    });
    // The worker replicas start from replica 0's weights, read once.
    let weights = (devices.len() > 1).then(|| {
        Arc::new(
            model
                .state_dict(&model_config)
                .into_iter()
                .collect::<HashMap<_, _>>(),
        )
    });
    let lead = Replica::new(
        model,
        optimizer,
        Group {
            rank: first,
            local: 0,
            replicas,
            devices: shared_devices.clone(),
            host: host.clone(),
            processes,
            disagreements: None,
        },
    );
    std::thread::scope(|scope| {
        let workers = weights
            .as_ref()
            .map(|weights| {
                Workers::spawn::<AB>(
                    scope,
                    &setup,
                    &shared_devices,
                    &host,
                    ranks,
                    weights,
                    resumed_optimizer.as_ref(),
                )
            })
            .transpose()?;
        let mut trainer = Trainer {
            devices,
            ranks,
            writes,
            setup: &setup,
            data: &data,
            out_dir,
            lead,
            workers,
            others: Vec::new(),
            scheduler,
            progress,
            batches,
        };
        let (mut stopped_early, mut interrupted) = (false, false);
        for epoch in trainer.progress.epochs_done..run.epochs {
            let Some(training) = trainer.train_epoch(&train_loader, epoch, observer)? else {
                interrupted = true;
                break;
            };
            let asked_to_stop = training.interrupted;
            if cfg!(debug_assertions) {
                trainer.check_replicas_agree()?;
            }
            trainer.lead.group.check_agreement()?;
            // Validation on the first replica (eval mode: the inner backend has no autodiff).
            let (validation, val_rows) = match &val_loader {
                Some(loader) => {
                    observer.validating(loader.num_batches());
                    let eval_model = valid(trainer.lead.model());
                    validate(&eval_model, loader, &run, &data, classifier, slots, device)?
                }
                None => (BTreeMap::new(), ValRows::default()),
            };
            let (record, improved) = trainer.end_epoch(epoch, training, validation, &val_rows)?;
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
            // Across processes only a step's sums decide (a signal during
            // validation is acted on at the next step, by every process).
            if asked_to_stop || (!processes && observer.interrupted()) {
                interrupted = true;
                break;
            }
            if observer.should_stop() {
                break;
            }
        }
        // The run's last sum is done: the other processes may end now.
        if let Some(links) = links.as_mut() {
            links.finish();
        }
        host.finish();
        Ok(FitSummary {
            history: trainer.progress.history,
            best: trainer.progress.best,
            best_checkpoint: out_dir.join(files::BEST),
            last_checkpoint: out_dir.join(files::LAST),
            stopped_early,
            interrupted,
            steps: trainer.progress.global_step,
        })
    })
}

/// How this process's replicas sum with the other processes' ones.
enum Joined {
    /// Over the runtime's process group (NCCL): every replica is a rank.
    ProcessGroup,
    /// Through the host, and across processes with `burn-collective`.
    Host(ProcessSum),
}

/// Meets the run's other processes ([`crate::world`]) and makes this
/// process's replicas (on `devices`, global ranks from `first`) ranks of the
/// process group of all `replicas` where the backend has one (NCCL on
/// CUDA); on the other backends, joins the processes' `burn-collective`
/// ([`crate::collective`]), which process 0's coordinator introduces.
fn join_processes<B: AttentionBackend>(
    world: &World,
    devices: &[B::Device],
    first: usize,
    replicas: usize,
    print: u64,
) -> Result<(Links, Joined)> {
    use burn::tensor::backend::DeviceOps;
    if !B::has_collectives() {
        let (id, links) = rendezvous(world, devices.len(), print, || {
            collective::start_coordinator(world).map(collective::coordinator_id)
        })?;
        let port = collective::coordinator_port(&id).ok_or_else(|| {
            TrainError::arg(
                "world-size",
                "process 0 sums with NCCL and this process cannot (every process needs the \
                 same --backend)",
            )
        })?;
        let (own, process0) = links.addresses().ok_or_else(|| {
            TrainError::arg(
                "rendezvous",
                "no link to another process to learn addresses from",
            )
        })?;
        let across = ProcessSum::join(world, (process0, port), own)?;
        tracing::info!(
            "process {} of {}: replicas {}..{} of {} (burn-collective, coordinator {process0}:{port})",
            world.rank,
            world.size,
            first,
            first + devices.len(),
            replicas
        );
        return Ok((links, Joined::Host(across)));
    }
    let mut ids: Vec<_> = devices.iter().map(DeviceOps::id).collect();
    ids.sort();
    ids.dedup();
    if ids.len() != devices.len() {
        return Err(TrainError::arg(
            "devices",
            "repeats a device: across processes each device holds one replica (NCCL has one rank per GPU)",
        ));
    }
    let no_nccl = || {
        TrainError::arg(
            "world-size",
            "this backend's runtime has no NCCL across processes",
        )
    };
    let (id, links) = rendezvous(world, devices.len(), print, || {
        B::process_group_id()
            .ok_or_else(no_nccl)?
            .map_err(|e| TrainError::arg("world-size", format!("NCCL: {e}")))
    })?;
    if collective::coordinator_port(&id).is_some() {
        return Err(TrainError::arg(
            "world-size",
            "process 0 sums with burn-collective and this process with NCCL (every process \
             needs the same --backend)",
        ));
    }
    for (k, device) in devices.iter().enumerate() {
        if !B::join_process_group(device, id, first + k, replicas) {
            return Err(no_nccl());
        }
    }
    tracing::info!(
        "process {} of {}: replicas {}..{} of {} (NCCL)",
        world.rank,
        world.size,
        first,
        first + devices.len(),
        replicas
    );
    Ok((links, Joined::ProcessGroup))
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

/// The state a run carries from batch to batch: optimiser, schedule and
/// progress counters (everything a checkpoint stores besides the weights).
struct Trainer<'a, AB: AutodiffBackend> {
    /// One per replica of this process; the first holds the run's
    /// checkpoints and validation.
    devices: &'a [AB::Device],
    /// Where this process's replicas stand among the run's.
    ranks: Ranks,
    /// Whether this process writes the run's files (process 0).
    writes: bool,
    setup: &'a Setup<'a>,
    data: &'a TrainData,
    out_dir: &'a Path,
    /// Replica 0, on this thread: its weights and optimiser are saved.
    lead: Replica<AB>,
    /// The other replicas, each on its own thread (none on one device).
    workers: Option<Workers>,
    /// The other replicas' shares of the current batch's values, read on
    /// their threads ([`crate::replica::host_values`]).
    others: Vec<Vec<f64>>,
    scheduler: Scheduler,
    progress: Progress,
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
        loader: &BatchLoader,
        epoch: usize,
        observer: &mut dyn Observer,
    ) -> Result<Option<EpochTraining>> {
        let (run, device) = (self.setup.run, &self.devices[0].clone());
        let accum = run.gradient_accumulation_steps;
        let started = Instant::now();
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
        // Across processes: a process asked every process to stop (read from
        // a step's sums, so that all stop at the same step).
        let mut stop_asked = false;
        for (k, batch) in (first..).zip(loader.epoch_from(epoch as u64, first)) {
            let batch = batch?;
            let stream = mix(run.seed, self.progress.micro_step);
            self.progress.micro_step += 1;
            timer.mark::<AB>(device, "data");
            pending += 1;
            let stepped = pending == accum || k + 1 == self.batches;
            // The workers read their values now where the batch's are read
            // before a step, else after theirs.
            let read_now = !stepped || run.skip_nonfinite_batches;
            self.others.clear();
            let asks = self.ranks.processes && observer.interrupted();
            let values = self.forward_backward(&batch, stream, read_now, asks, &mut timer)?;
            // The replicas' gradients are summed before anything reads them.
            if stepped {
                let setup = self.setup;
                self.on_every_replica(|_| Job::Reduce, |lead| lead.reduce(setup))?;
                timer.mark::<AB>(device, "reduce");
            }
            // --skip-nonfinite-batches: the batch's values, and before a step
            // the gradient norm, are read before the step; a non-finite one
            // drops the gradients accumulated since the last step.
            let mut read_early = None;
            if run.skip_nonfinite_batches {
                let mut batch_means = Means::default();
                let record = record_batch(values.clone(), None, &mut batch_means, &self.others);
                stop_asked |= record.stop;
                let (total, mut bad) = (record.total, record.non_finite);
                // (fp16's scaled gradients overflow by design: the loss scaler
                // skips those steps and lowers the scale.)
                let scaled = self.progress.loss_scaler.is_some();
                if stepped && bad.is_empty() && !scaled {
                    let norm = self.lead.buffer.global_norm();
                    if !norm.is_finite() {
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
                    self.clear_gradients()?;
                    continue;
                }
                read_early = Some((total, batch_means));
            }
            seen += batch.batch_size();
            // The gradient norm before clipping, still on the device.
            let mut grad_norm = None;
            if stepped {
                last_lr = self.scheduler.lr();
                grad_norm = self.optimizer_step(&mut means)?;
                pending = 0;
                timer.mark::<AB>(device, "optimizer");
            }
            // The step's one host read (losses, accuracy counts, gradient norm),
            // after everything is queued. A non-finite loss stops the run before
            // any checkpoint is written from the weights it produced.
            let (total, non_finite) = match read_early {
                None => {
                    let record = record_batch(values, grad_norm, &mut means, &self.others);
                    stop_asked |= record.stop;
                    (record.total, record.non_finite)
                }
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
                step: self.progress.global_step,
                stepped,
            });
            if stepped {
                interrupted = if self.ranks.processes {
                    stop_asked
                } else {
                    observer.interrupted()
                };
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
                    self.write_checkpoint(&[&path])?;
                    tracing::debug!(
                        "checkpoint at epoch {epoch} batch {} (step {}): {}",
                        k + 1,
                        self.progress.global_step,
                        path.display()
                    );
                    self.progress.in_epoch = None;
                    if interrupted {
                        return Ok(None);
                    }
                }
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        if self.writes {
            timer.epoch_end(epoch, &self.out_dir.join(files::MEMORY_PROFILE))?;
        }
        let mut means = means.finish();
        if run.skip_nonfinite_batches {
            means.insert("skipped_batches".into(), skipped as f64);
        }
        Ok(Some(EpochTraining {
            means,
            seen,
            seconds,
            last_lr,
            started,
            interrupted,
        }))
    }

    /// A batch's sample IDs, for messages.
    fn batch_samples(&self, batch: &Batch) -> String {
        let ids = self.data.dataset.sample_ids();
        let samples: Vec<&str> = batch.positions.iter().map(|&p| ids[p].as_str()).collect();
        samples.join(", ")
    }

    /// Writes the run's state as it stands (replica 0's weights and
    /// optimiser, schedule, progress) to each of `paths`.
    fn write_checkpoint(&self, paths: &[&Path]) -> Result<()> {
        if !self.writes {
            return Ok(());
        }
        let (optim_tensors, optimizer_steps) = self.lead.optimizer.state_tensors();
        let meta = CheckpointMeta {
            format: FORMAT_VERSION,
            producer: format!("aam-rs {}", env!("CARGO_PKG_VERSION")),
            model: self.setup.model_config.clone(),
            run: self.setup.run.clone(),
            data: self.data.info.clone(),
            progress: self.progress.clone(),
            scheduler: self.scheduler.clone(),
            optimizer_steps,
        };
        for path in paths {
            write_checkpoint(path, &meta, self.lead.model(), optim_tensors.clone())?;
        }
        Ok(())
    }

    /// Sends every worker replica `job(rank)`, runs `lead` on replica 0
    /// meanwhile, and waits for the workers' answers.
    fn on_every_replica<R>(
        &mut self,
        job: impl FnMut(usize) -> Job,
        lead: impl FnOnce(&mut Replica<AB>) -> Result<R>,
    ) -> Result<(R, Vec<Done>)> {
        let Some(workers) = &self.workers else {
            return Ok((lead(&mut self.lead)?, Vec::new()));
        };
        workers.send(job);
        let mine = lead(&mut self.lead);
        if mine.is_err() {
            // Workers waiting for replica 0 in a sum give up.
            workers.abort();
        }
        let theirs = workers.wait();
        Ok((mine?, theirs?))
    }

    /// Keeps the workers' shares of the batch's values among their answers.
    fn keep_values(&mut self, done: Vec<Done>) {
        if self.ranks.processes {
            // Replica 0's values are the run's already (summed across processes).
            return;
        }
        self.others.extend(done.into_iter().filter_map(|d| match d {
            Done::Values(v) => Some(v),
            _ => None,
        }));
    }

    /// Drops every replica's accumulated gradients.
    fn clear_gradients(&mut self) -> Result<()> {
        self.on_every_replica(
            |_| Job::Clear,
            |lead| {
                lead.buffer.clear();
                Ok(())
            },
        )?;
        Ok(())
    }

    /// The forward and backward passes of one batch (random draws seeded
    /// from `stream`): on one device the whole batch; on several, each
    /// replica its shard, at once on their threads (see [`crate::replica`]).
    /// Returns the batch's losses, summed over the replicas, on the first
    /// device. `stop`: across processes, whether this process asks every
    /// process to stop (summed with the losses).
    fn forward_backward(
        &mut self,
        batch: &Batch,
        stream: u64,
        read_now: bool,
        stop: bool,
        timer: &mut StepProfiler,
    ) -> Result<StepValues<AB::InnerBackend>> {
        let n = self.ranks.replicas;
        let first = self.ranks.first;
        let setup = self.setup;
        let loss_scale = self.progress.loss_scaler.as_ref().map_or(1.0, |s| s.scale);
        let mut ctx = setup.context(loss_scale, n);
        ctx.stop = stop;
        if n == 1 {
            let shard = Shard {
                rank: 0,
                batch,
                shares: Shares::WHOLE,
                global_unifrac: None,
            };
            return self.lead.pass(&ctx, &shard, stream, Some(timer));
        }
        let mut shards = batch.shards(n);
        let class_weights = setup
            .classifier
            .then_some(setup.run.loss.class_weights.as_deref())
            .flatten();
        let shares = Shares::of(&shards, class_weights);
        let global_unifrac = match setup.run.unifrac_pairs {
            UnifracPairs::Global => batch.unifrac.as_deref(),
            UnifracPairs::Local => None,
        };
        let shared_unifrac = global_unifrac.map(|u| Arc::new(u.to_vec()));
        // This process's shards: global ranks first..first+L.
        let mut shards = shards.split_off(first);
        shards.truncate(self.devices.len());
        let mut theirs = shards.split_off(1).into_iter();
        let lead_shard = Shard {
            rank: first,
            batch: &shards[0],
            shares: shares[first],
            global_unifrac,
        };
        let (values, done) = self.on_every_replica(
            |local| Job::Pass {
                batch: theirs.next().expect("one shard per worker"),
                shares: shares[first + local],
                global_unifrac: shared_unifrac.clone(),
                stream,
                loss_scale,
                read: read_now,
            },
            |lead| lead.pass(&ctx, &lead_shard, stream, None),
        )?;
        self.keep_values(done);
        timer.mark::<AB>(&self.devices[0], "replicas");
        Ok(values)
    }

    /// Clips the (summed) gradients (fp16: skips the step when they
    /// overflowed) and takes one optimiser step on every replica. Returns,
    /// when clipping ran on the device, the gradient norm before it.
    fn optimizer_step(&mut self, means: &mut Means) -> Result<Option<Tensor<AB::InnerBackend, 1>>> {
        let run = self.setup.run;
        let mut clip = match run.max_grad_norm {
            Some(max_norm) => Clip::OnDevice(max_norm),
            None => Clip::None,
        };
        if let Some(scaler) = self.progress.loss_scaler.as_mut() {
            // fp16: the norm is read here (one host read serves the overflow
            // check and clipping). A step whose scaled gradients overflowed is
            // skipped (its gradients dropped) and the scale lowered.
            let norm = self.lead.buffer.global_norm();
            let finite = scaler.update(norm.is_finite());
            if !finite {
                tracing::debug!(
                    "fp16 gradients overflowed: step skipped, loss scale now {}",
                    scaler.scale
                );
                self.clear_gradients()?;
            }
            clip = match run.max_grad_norm {
                Some(max_norm) if !self.lead.buffer.is_empty() => {
                    means.add("grad_norm", norm);
                    Clip::ToNorm { max_norm, norm }
                }
                _ => Clip::None,
            };
        }
        let lr = self.scheduler.lr();
        let plan = StepPlan {
            clip,
            lr,
            factor: lr / run.scheduler.lr,
            beta1: self.scheduler.beta1(),
        };
        let setup = self.setup;
        let (grad_norm, done) =
            self.on_every_replica(|_| Job::Step(plan), |lead| Ok(lead.step(setup, &plan)))?;
        self.keep_values(done);
        self.scheduler.step();
        self.progress.global_step += 1;
        Ok(grad_norm)
    }

    /// Data-parallel replicas take the same steps from the same weights, so
    /// their weights stay bit-identical; checked after every epoch in debug
    /// builds (the tests).
    fn check_replicas_agree(&mut self) -> Result<()> {
        if self.workers.is_none() {
            return Ok(());
        }
        let config = self.setup.model_config;
        let (reference, theirs) =
            self.on_every_replica(|_| Job::Weights, |lead| Ok(lead.model().state_dict(config)))?;
        for (rank, done) in theirs.into_iter().enumerate() {
            let Done::Weights(weights) = done else {
                continue;
            };
            for ((key, a), (_, b)) in reference.iter().zip(weights) {
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

    /// Closes an epoch: steps the plateau schedule, decides whether the
    /// monitored metric improved, and writes the checkpoints (`last`, and
    /// `best` with its validation predictions on improvement) and metrics.
    fn end_epoch(
        &mut self,
        epoch: usize,
        training: EpochTraining,
        validation: BTreeMap<String, f64>,
        val_rows: &ValRows,
    ) -> Result<(EpochRecord, bool)> {
        let run = self.setup.run;
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
        if !self.writes {
            return Ok((record, improved));
        }
        if improved {
            self.write_checkpoint(&[&last, &best])?;
            if !val_rows.targets.is_empty() {
                write_predictions(&out(files::VAL_PREDICTIONS), &val_rows.targets)?;
            }
            if !val_rows.pairs.is_empty() {
                write_pairs(&out(files::VAL_UNIFRAC), &val_rows.pairs)?;
            }
        } else {
            self.write_checkpoint(&[&last])?;
        }
        write_metrics_csv(&out(files::METRICS), &self.progress.history)?;
        Ok((record, improved))
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

/// What validation predicted, for the best epoch's files.
#[derive(Default)]
struct ValRows {
    /// Target predictions (`train`).
    targets: Vec<PredictionRow>,
    /// Pairs of samples of a batch: their UniFrac distance and the
    /// distance of their embeddings (`pretrain`).
    pairs: Vec<(String, String, f64, f64)>,
}

/// Validation losses and metrics (§3.6), and the predictions for the TSV.
fn validate<B: AttentionBackend>(
    model: &AamModel<B>,
    loader: &BatchLoader,
    run: &RunConfig,
    data: &TrainData,
    classifier: bool,
    slots: Slots,
    device: &B::Device,
) -> Result<(BTreeMap<String, f64>, ValRows)> {
    let mut means = Means::default();
    let mut pairs = RegressionMetrics::default();
    let mut targets_metrics = RegressionMetrics::default();
    let mut classes = ClassificationMetrics::default();
    let (mut nuc_hits, mut nuc_total) = (0.0, 0.0);
    let mut rows = Vec::new();
    let mut pair_rows = Vec::new();
    let return_nucleotides = run.loss.nuc_penalty > 0.0;
    // --val-prediction-passes N: this pass is the first of the N.
    let averaging =
        run.val_prediction_passes > 1 && run.asv_sampling == aam_data::AsvSampling::Random;
    let mut passes = PassSums::default();
    for batch in loader.epoch(0) {
        let batch = batch?;
        let (input, targets) = batch_tensors::<B>(&batch, device, classifier, slots);
        let predictions = {
            let _autocast = autocast(run.mixed_precision);
            predict_batch(model, input, return_nucleotides)
        };
        if let (true, Some(pred)) = (averaging, &predictions.target) {
            passes.add(pred, &batch, classifier);
        }
        let parts = run.loss.forward(&predictions, &targets)?;
        record_batch(StepValues::new(&parts, None), None, &mut means, &[]);
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
                    pair_rows.push((
                        batch.sample_ids[i].clone(),
                        batch.sample_ids[j].clone(),
                        t[i * b + j] as f64,
                        p[i * b + j] as f64,
                    ));
                }
            }
            pairs.update(&pp, &tt);
        }
        // Faith's PD pretraining reports metrics of the predicted PD.
        if let (Task::Pretrain, BaseLoss::Mse, Some(p), Some(t)) = (
            run.task,
            run.loss.base,
            &predictions.base_prediction,
            &targets.base,
        ) {
            let host = |x: &Tensor<B, 2>| -> Vec<f64> {
                x.clone()
                    .into_data()
                    .convert::<f64>()
                    .to_vec()
                    .expect("f64")
            };
            let (p, t) = (host(p), host(t));
            pairs.update(&p, &t);
            for (i, id) in batch.sample_ids.iter().enumerate() {
                rows.push((id.clone(), vec![p[i].to_string()], t[i].to_string()));
            }
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
    if averaging && !rows.is_empty() {
        rows = averaged_predictions(
            passes, model, loader, run, data, classifier, slots, device, &mut out,
        )?;
    }
    Ok((
        out,
        ValRows {
            targets: rows,
            pairs: pair_rows,
        },
    ))
}

/// Per dataset position, a sample's target outputs summed over validation
/// passes (a classifier's class probabilities), and the order in which the
/// samples were first seen (the TSV's) with their classes.
#[derive(Default)]
struct PassSums {
    sums: BTreeMap<usize, Vec<f64>>,
    order: Vec<(usize, String, Option<usize>)>,
}

impl PassSums {
    /// Adds one batch's outputs.
    fn add<B: Backend>(&mut self, pred: &TargetPrediction<B>, batch: &Batch, classifier: bool) {
        let (values, width) = point_predictions(pred, batch.batch_size());
        for (i, &pos) in batch.positions.iter().enumerate() {
            let row = &values[i * width..(i + 1) * width];
            let row: Vec<f64> = if classifier {
                row.iter().map(|&x| (x as f64).exp()).collect()
            } else {
                row.iter().map(|&x| x as f64).collect()
            };
            match self.sums.get_mut(&pos) {
                Some(sum) => sum.iter_mut().zip(&row).for_each(|(s, x)| *s += x),
                None => {
                    let truth = batch.targets.as_ref().map(|t| t[i] as usize);
                    self.order.push((pos, batch.sample_ids[i].clone(), truth));
                    self.sums.insert(pos, row);
                }
            }
        }
    }
}

/// Target predictions averaged over `run.val_prediction_passes` passes of
/// the validation samples, each with the random ASV draws of its own
/// epoch stream: `first` holds pass 0 (validation's own), passes 1.. run
/// here. Returns the rows for the TSV, and recomputes the metrics of `out`
/// (`mae`, `mse`, `r2`, or `accuracy`, `f1`) from them. A regressor's
/// outputs are averaged in the model's (normalised) units and then
/// denormalised; a classifier's class probabilities are averaged.
#[allow(clippy::too_many_arguments)]
fn averaged_predictions<B: AttentionBackend>(
    first: PassSums,
    model: &AamModel<B>,
    loader: &BatchLoader,
    run: &RunConfig,
    data: &TrainData,
    classifier: bool,
    slots: Slots,
    device: &B::Device,
    out: &mut BTreeMap<String, f64>,
) -> Result<Vec<PredictionRow>> {
    let passes = run.val_prediction_passes;
    let mut all = first;
    for pass in 1..passes as u64 {
        for batch in loader.epoch(pass) {
            let batch = batch?;
            let (input, _) = batch_tensors::<B>(&batch, device, classifier, slots);
            let predictions = {
                let _autocast = autocast(run.mixed_precision);
                predict_batch(model, input, false)
            };
            if let Some(pred) = predictions.target {
                all.add(&pred, &batch, classifier);
            }
        }
    }
    let PassSums { sums, order } = all;
    let mut metrics = RegressionMetrics::default();
    let mut classes = ClassificationMetrics::default();
    let mut rows = Vec::with_capacity(order.len());
    for (pos, id, truth) in order {
        let mean: Vec<f64> = sums[&pos].iter().map(|s| s / passes as f64).collect();
        if classifier {
            let predicted = mean
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map_or(0, |(c, _)| c);
            let truth = truth.unwrap_or(0);
            classes.update(truth, predicted);
            rows.push((
                id,
                vec![class_label(data, predicted)],
                class_label(data, truth),
            ));
        } else {
            regression_row(data, pos, id, mean.into_iter(), &mut metrics, &mut rows);
        }
    }
    if classifier {
        out.insert("accuracy".into(), classes.accuracy());
        out.insert("f1".into(), classes.f1());
    } else if metrics.count() > 0 {
        out.insert("mae".into(), metrics.mae());
        out.insert("mse".into(), metrics.mse());
        out.insert("r2".into(), metrics.r2());
    }
    Ok(rows)
}

/// A batch's point predictions `[B, width]` as f32: a quantile model's
/// middle quantile.
fn point_predictions<B: Backend>(pred: &TargetPrediction<B>, b: usize) -> (Vec<f32>, usize) {
    match pred {
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
    }
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
    // Point predictions [B, out]; quantile models report the middle quantile.
    let (values, width) = point_predictions(pred, batch.batch_size());
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
            rows.push((
                id,
                vec![class_label(data, predicted)],
                class_label(data, truth),
            ));
        } else {
            regression_row(data, pos, id, row.iter().map(|&x| x as f64), metrics, rows);
        }
    }
}

/// The label of class `c` (its index when the run has no labels).
fn class_label(data: &TrainData, c: usize) -> String {
    data.info
        .class_labels
        .as_ref()
        .and_then(|l| l.get(c).cloned())
        .unwrap_or_else(|| c.to_string())
}

/// A regressor's outputs for the sample at `pos`, in original units, into
/// the metrics (first output) and the TSV rows.
fn regression_row(
    data: &TrainData,
    pos: usize,
    id: String,
    outputs: impl Iterator<Item = f64>,
    metrics: &mut RegressionMetrics,
    rows: &mut Vec<PredictionRow>,
) {
    let key = category_key(data, pos);
    let denorm: Vec<f64> = outputs
        .map(|x| match &data.info.transforms.target {
            Some(n) => n.denormalize(x, key.as_deref()),
            None => x,
        })
        .collect();
    let actual = data.dataset.targets().map_or(f64::NAN, |r| r[pos]);
    metrics.update(&denorm[..1], &[actual]);
    rows.push((
        id,
        denorm.iter().map(|v| format!("{v}")).collect(),
        format!("{actual}"),
    ));
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

fn write_pairs(path: &Path, pairs: &[(String, String, f64, f64)]) -> Result<()> {
    let mut text = String::from("sample_a\tsample_b\tunifrac\tpredicted\n");
    for (a, b, actual, predicted) in pairs {
        text.push_str(&format!("{a}\t{b}\t{actual}\t{predicted}\n"));
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
