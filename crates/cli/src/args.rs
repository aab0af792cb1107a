//! The flags that several commands share (data, model, optimisation, run,
//! precision), each group a clap `Args` struct, and their translation into
//! `aam-train`'s specifications. An invalid value is reported by its flag
//! ([`flagged`]).

use std::path::{Path, PathBuf};

use aam_data::AsvSampling;
use aam_models::asv_encoder::MaskStrategy;
use aam_models::sample_encoder::CountEmbeddingMethod;
use aam_models::sequence_encoder::{EncoderType, SequenceEncoderConfig};
use aam_models::{AttnImplementation, MixedPrecision};
use aam_train::config::{ModelSpec, PhaseTiming};
use aam_train::loss::BaseLoss;
use aam_train::optim::OptimizerKind;
use aam_train::parallel::UnifracPairs;
use aam_train::prepare::{DataSpec, Prepared, TargetSpec, UnifracSource};
use aam_train::schedule::SchedulerKind;
use aam_train::TrainError;
use anyhow::Result;
use burn::prelude::Backend;
use clap::{Args, ValueEnum};
use serde::de::DeserializeOwned;

use crate::backend::BackendKind;

/// Parses a value by its serde (snake/kebab-case) spelling.
pub fn serde_value<T: DeserializeOwned>(s: &str) -> Result<T, String> {
    serde_json::from_value(serde_json::Value::String(s.to_string())).map_err(|e| e.to_string())
}

/// `--matmul-kernels`: how the dense layers' products pick their kernel on
/// the GPU backends (CUDA, ROCm, wgpu); the CPU backends have one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MatmulKernels {
    /// A rule over kernels validated at AAM's shapes: a GPU's first step
    /// compiles one kernel per product, nothing is timed.
    #[default]
    Plan,
    /// CubeCL's tuner times every validated kernel once per problem bucket
    /// and caches the winners: minutes on a GPU's first run.
    Autotune,
}

impl MatmulKernels {
    /// Applies the choice to the whole process (before the first step).
    pub fn apply(self) {
        #[cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]
        aam_kernels::set_matmul_tuning(match self {
            Self::Plan => aam_kernels::MatmulTuning::Plan,
            Self::Autotune => aam_kernels::MatmulTuning::Autotune,
        });
    }
}

/// Inputs and their preparation (both commands).
#[derive(Args, Debug, Clone)]
pub struct DataArgs {
    /// BIOM table (HDF5 2.x or JSON 1.0); observation IDs are the ASV sequences.
    #[arg(long, value_name = "BIOM")]
    pub table: PathBuf,
    /// UniFrac distances (.h5 from ssu or `aam-rs unifrac`, .npy/.npz with a
    /// sample-ID sidecar, .csv/.tsv); with --unifrac-metric faith_pd, one
    /// Faith's PD value per sample (faithpd's .tsv, .csv, .npy/.npz/.h5 with
    /// sample IDs). Or give --tree.
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present = "tree",
        conflicts_with = "tree"
    )]
    pub unifrac_matrix: Option<PathBuf>,
    /// Newick tree: compute the UniFrac distances of the rarefied table's
    /// samples instead of reading --unifrac-matrix (kept in --output-dir as
    /// `unifrac-<metric>-<key>.h5` and reused by runs on the same inputs).
    #[arg(long, value_name = "NEWICK")]
    pub tree: Option<PathBuf>,
    /// Compute the --tree distances on this GPU backend, as `aam-rs unifrac
    /// --gpu` (cuda and rocm in double precision: the CPU's distances; wgpu
    /// in single precision, cached apart), instead of the CPU's threads.
    #[arg(long, value_enum, value_name = "BACKEND", requires = "tree")]
    pub unifrac_gpu: Option<crate::backend::GpuArg>,
    /// The base target: a UniFrac variant (`unifrac` and `weighted` are the
    /// reference's names; with --unifrac-matrix the file decides which), or
    /// `faith_pd`: a Faith's PD value per sample, predicted by a one-output
    /// head with an MSE loss (read from --unifrac-matrix, or computed from
    /// --tree).
    #[arg(long, value_enum, default_value_t = UnifracMetric::Unweighted)]
    pub unifrac_metric: UnifracMetric,
    /// Reads per sample after rarefaction (samples with fewer are dropped, with a warning).
    #[arg(long, default_value_t = 5000)]
    pub rarefy_depth: u64,
    /// Fraction of samples held out for validation.
    #[arg(long, default_value_t = 0.2)]
    pub test_size: f64,
    /// Bases kept per ASV.
    #[arg(long, default_value_t = 150)]
    pub max_bp: usize,
    /// ASV slots per sample.
    #[arg(long, default_value_t = 1024)]
    pub token_limit: usize,
    /// Which ASVs fill the slots of a sample with more: first, abundance or random.
    #[arg(long, default_value = "first", value_parser = serde_value::<AsvSampling>)]
    pub asv_sampling: AsvSampling,
    /// Drop (with a warning listing them) table samples absent from the matrix
    /// or metadata, instead of stopping.
    #[arg(long)]
    pub drop_missing: bool,
    /// Run the sample level on all --token-limit slots, as the reference
    /// (default: on each batch's filled slots, rounded up to 32, where the
    /// model masks empty slots; the losses and gradients are the same).
    #[arg(long)]
    pub all_slots: bool,
}

/// Architecture flags shared by both commands.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model width D.
    #[arg(long, default_value_t = 128)]
    pub embedding_dim: usize,
    /// Attention heads of every transformer stack.
    #[arg(long, default_value_t = 4)]
    pub attention_heads: usize,
    /// Layers of every transformer stack.
    #[arg(long, default_value_t = 4)]
    pub attention_layers: usize,
    /// Dropout of every transformer stack.
    #[arg(long, default_value_t = 0.1)]
    pub dropout: f64,
    /// Feed per-ASV read counts into the sample encoder.
    #[arg(long, overrides_with = "no_count_embedding")]
    pub count_embedding: bool,
    /// How counts enter: add, concat or film.
    #[arg(long, default_value = "add", value_parser = serde_value::<CountEmbeddingMethod>)]
    pub count_embedding_method: CountEmbeddingMethod,
    /// Fraction of nucleotides masked for the nucleotide loss (0 disables).
    #[arg(long, default_value_t = 0.15)]
    pub nuc_mask_ratio: f64,
    /// Masking strategy: random or span.
    #[arg(long, default_value = "random", value_parser = serde_value::<MaskStrategy>)]
    pub nuc_mask_strategy: MaskStrategy,
    /// ASVs per chunk through the ASV encoder at inference (validation; 0: all at once);
    /// bounds activation memory there. Training runs all at once: every chunk's
    /// activations are kept for the backward pass, so chunks would save nothing.
    #[arg(long, default_value_t = 256)]
    pub asv_chunk_size: usize,
    /// Attention implementation: auto, fused (the CubeCL kernel) or math.
    /// The reference's sdpa, flash and mem_efficient (PyTorch's SDPA
    /// kernels) are taken as auto.
    #[arg(long, value_enum, default_value_t = AttnArg::Auto)]
    pub attn_implementation: AttnArg,
    /// No count embedding (the default; the reference's negation of --count-embedding).
    #[arg(long, overrides_with = "count_embedding", hide_short_help = true)]
    pub no_count_embedding: bool,
}

/// `--attn-implementation`: aam-rs's choices and the reference's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum AttnArg {
    /// The fused kernel where the backend has one, the math path elsewhere.
    Auto,
    /// The fused kernel (an error on a backend without one).
    Fused,
    /// Masked softmax attention from tensor ops, on every backend.
    Math,
    /// The reference's PyTorch SDPA dispatch: here auto.
    Sdpa,
    /// The reference's FlashAttention switch: here auto.
    Flash,
    /// The reference's default, memory-efficient SDPA: here auto.
    MemEfficient,
}

impl AttnArg {
    /// The implementation aam-rs runs, and a note when the name was the reference's.
    pub fn resolve(self) -> (AttnImplementation, Option<String>) {
        match self {
            Self::Auto => (AttnImplementation::Auto, None),
            Self::Fused => (AttnImplementation::Fused, None),
            Self::Math => (AttnImplementation::Math, None),
            Self::Sdpa | Self::Flash | Self::MemEfficient => (
                AttnImplementation::Auto,
                Some(format!(
                    "--attn-implementation {}: PyTorch's SDPA kernels are not used here; \
                     aam-rs runs its fused CubeCL kernel where the backend has one and the math path elsewhere (auto)",
                    self.to_possible_value().expect("not skipped").get_name()
                )),
            ),
        }
    }
}

/// Optimisation flags shared by both commands.
#[derive(Args, Debug, Clone)]
pub struct OptimArgs {
    /// Maximum epochs.
    #[arg(long, default_value_t = 100)]
    pub epochs: usize,
    /// Samples per batch (even: the UniFrac loss compares pairs).
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Batches per optimiser step.
    #[arg(long, default_value_t = 1)]
    pub gradient_accumulation_steps: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-4)]
    pub lr: f64,
    /// Weight decay.
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f64,
    /// adamw, adam or sgd.
    #[arg(long, default_value = "adamw", value_parser = serde_value::<OptimizerKind>)]
    pub optimizer: OptimizerKind,
    /// warmup_cosine, cosine, cosine_restarts, plateau, onecycle or none.
    #[arg(long, default_value = "warmup_cosine", value_parser = serde_value::<SchedulerKind>)]
    pub scheduler: SchedulerKind,
    /// Warm-up steps of warmup_cosine (clamped, with a warning, when ≥ the run).
    #[arg(long, default_value_t = 10000)]
    pub warmup_steps: u64,
    /// cosine_restarts: first period in steps (default: a quarter of the run).
    #[arg(long)]
    pub scheduler_t0: Option<u64>,
    /// cosine_restarts: period multiplier (default 2).
    #[arg(long)]
    pub scheduler_t_mult: Option<u64>,
    /// cosine schedules: floor (default 0).
    #[arg(long)]
    pub scheduler_eta_min: Option<f64>,
    /// plateau: epochs without improvement before a reduction (default 5).
    #[arg(long)]
    pub scheduler_patience: Option<u64>,
    /// plateau: reduction factor (default 0.3).
    #[arg(long)]
    pub scheduler_factor: Option<f64>,
    /// plateau: floor (default 0).
    #[arg(long)]
    pub scheduler_min_lr: Option<f64>,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    pub max_grad_norm: Option<f64>,
    /// Early stopping: epochs without improvement.
    #[arg(long, default_value_t = 10)]
    pub patience: usize,
    /// Seed of rarefaction, split, batch order, dropout and masking.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Batch-building threads.
    #[arg(long, default_value_t = 4)]
    pub num_workers: usize,
}

/// Where to run and write.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Output directory (checkpoints/, metrics.csv, plots, sample lists).
    #[arg(long, value_name = "DIR")]
    pub output_dir: PathBuf,
    /// The batch-size search `--auto-batch-size` asked for.
    #[arg(skip)]
    pub batch_size_search: Option<BatchSizeSearch>,
    /// Continue the run of this checkpoint (its configuration is used; data
    /// must be the same). `auto`: the newest readable checkpoint in
    /// --output-dir, or a fresh start when there is none (one command for a
    /// job's first run and its requeues).
    #[arg(long, value_name = "CHECKPOINT|auto")]
    pub resume_from: Option<ResumeFrom>,
    /// Also write checkpoints/last.safetensors every N optimiser steps, not
    /// only at each epoch's end: a killed job loses at most N steps.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub checkpoint_every_steps: Option<u64>,
    /// Skip a batch whose losses or gradient norm are not finite (and the
    /// batches accumulated with it), logged and counted as
    /// train_skipped_batches, instead of stopping the run. Costs one more
    /// device read per batch.
    #[arg(long)]
    pub skip_nonfinite_batches: bool,
    /// Compute backend (`aam-rs backends` lists those compiled in).
    #[arg(long, value_enum, default_value_t = BackendKind::default())]
    pub backend: BackendKind,
    /// The reference's device choice: `cpu` is --backend ndarray, `cuda` the
    /// GPU backend built in (CUDA, else ROCm, as PyTorch's ROCm builds name
    /// it). --backend chooses among more.
    #[arg(long, value_enum, conflicts_with = "backend")]
    pub device: Option<DeviceKind>,
    #[command(flatten)]
    pub checkpointing: CheckpointingArgs,
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// Log device memory per phase of the training step (data, upload,
    /// forward, loss, backward, optimizer) each epoch and write
    /// memory_profile.csv (CubeCL backends; slows the run a little).
    #[arg(long)]
    pub memory_profile: bool,
    /// Log the mean time of each phase of the training step after the first
    /// step and every 10: `synced` (the device synchronised after each phase;
    /// slower) or `host` (the time the host spends queueing each phase; `read`
    /// then holds the wait for the device).
    #[arg(long, default_value = "off", value_parser = serde_value::<PhaseTiming>)]
    pub time_phases: PhaseTiming,
    /// How the dense layers' matrix products pick their kernel on the GPU
    /// backends: `plan` (a rule over validated kernels; a GPU's first steps
    /// only compile) or `autotune` (CubeCL times every validated kernel once
    /// per problem size and caches the winners; minutes on a GPU's first run).
    #[arg(long, value_enum, default_value_t)]
    pub matmul_kernels: MatmulKernels,
    /// On CUDA and ROCm, when this machine's kernel cache is empty: helper
    /// processes that compile the dense layers' kernels during the first
    /// step, before the training reaches them (0: none; default: half this
    /// machine's cores, at most 8).
    #[arg(long, value_name = "N")]
    pub compile_workers: Option<usize>,
    #[command(flatten)]
    pub parallel: ParallelArgs,
}

/// `--resume-from`: a checkpoint file, or `auto`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResumeFrom {
    /// The newest readable checkpoint of --output-dir, if any.
    Auto,
    /// This checkpoint.
    Path(PathBuf),
}

impl std::str::FromStr for ResumeFrom {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Ok(match s {
            "auto" => Self::Auto,
            _ => Self::Path(PathBuf::from(s)),
        })
    }
}

/// `--devices`: the backend's devices by index, or all it sees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceList {
    /// Every device the backend sees, one replica each.
    All,
    /// These indices, one replica per entry.
    Indices(Vec<usize>),
}

impl std::str::FromStr for DeviceList {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim() == "all" {
            return Ok(DeviceList::All);
        }
        let indices = s
            .split(',')
            .map(|d| {
                d.trim().parse::<usize>().map_err(|_| {
                    format!("`{d}` is not a device index (give indices like 0,1 or `all`)")
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DeviceList::Indices(indices))
    }
}

/// Data-parallel training: `--devices`, `--unifrac-pairs`, and the
/// reference's `--data-parallel` / `--distributed`.
#[derive(Args, Debug, Clone)]
pub struct ParallelArgs {
    /// Devices to train on, one model replica each: the backend's device
    /// indices (`0,1,2,3`) or `all`. A device listed twice holds two replicas
    /// (`0,0`: data parallel on one device, as the CPU backends run it).
    /// `--batch-size` stays the global batch, split evenly over the replicas,
    /// so results do not depend on the number of devices.
    #[arg(long, value_name = "LIST", default_value = "0")]
    pub devices: DeviceList,
    /// Which pairs the UniFrac loss of a data-parallel step compares: `global`
    /// (every pair of the global batch: the single-device loss and the
    /// reference's --data-parallel) or `local` (pairs within each replica's
    /// shard: the reference's --distributed, DDP).
    #[arg(long, default_value = "global", value_parser = serde_value::<UnifracPairs>)]
    pub unifrac_pairs: UnifracPairs,
    /// The reference's DataParallel switch: here the same as `--devices all`.
    #[arg(long, conflicts_with_all = ["devices", "distributed"])]
    pub data_parallel: bool,
    /// The reference's DDP switch: here the same as `--devices all` (one
    /// process drives every GPU of the node); add `--unifrac-pairs local` for
    /// the reference's DDP loss.
    #[arg(long, conflicts_with = "devices")]
    pub distributed: bool,
    /// The reference's FSDP switch (parameters sharded over GPUs): here
    /// `--devices all`, each device holding the whole model (AAM's models
    /// fit one device many times over).
    #[arg(long, conflicts_with_all = ["devices", "data_parallel"])]
    pub fsdp: bool,
    /// The reference's per-rank FSDP checkpoint shards (needs --fsdp): here
    /// every checkpoint is one file.
    #[arg(long, requires = "fsdp")]
    pub fsdp_sharded_checkpoint: bool,
    /// The reference's SyncBatchNorm switch: the model has no BatchNorm (in
    /// the reference neither), so nothing changes.
    #[arg(long)]
    pub sync_batchnorm: bool,
    /// Processes of a run across processes or nodes (one per node with
    /// --devices all, or one per GPU), each training its replicas on its
    /// --devices and summing with the others through NCCL (CUDA), or through
    /// the host and Burn's burn-collective (the other backends). Under
    /// SLURM with more than one task: SLURM_NTASKS (`--world-size 1` opts out).
    #[arg(long, value_name = "N")]
    pub world_size: Option<usize>,
    /// This process's rank, 0..N (under SLURM: SLURM_PROCID).
    #[arg(long, value_name = "R")]
    pub rank: Option<usize>,
    /// `host:port` where process 0 listens for the others (under SLURM: the
    /// first host of the job's node list, port 20000 + job ID mod 20000).
    #[arg(long, value_name = "HOST:PORT")]
    pub rendezvous: Option<String>,
    /// Seconds a process waits for the others at the rendezvous.
    #[arg(long, value_name = "SECONDS", default_value_t = 600)]
    pub rendezvous_timeout: u64,
}

/// The first host of a SLURM node list (`gpu[01-04,07],cpu1` gives `gpu01`).
pub fn first_slurm_host(list: &str) -> Option<String> {
    let mut depth = 0;
    let first: String = list
        .chars()
        .take_while(|&c| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                ',' if depth == 0 => return false,
                _ => {}
            }
            true
        })
        .collect();
    match first.split_once('[') {
        None => (!first.is_empty()).then_some(first),
        Some((prefix, ranges)) => {
            let start: String = ranges.chars().take_while(|c| c.is_ascii_digit()).collect();
            (!start.is_empty()).then(|| format!("{prefix}{start}"))
        }
    }
}

impl ParallelArgs {
    /// Notes on the reference's switches that aam-rs answers differently.
    pub fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        if self.fsdp {
            notes.push("--fsdp: each device holds the whole model (data parallel over --devices all); AAM's models fit one device".into());
        }
        if self.fsdp_sharded_checkpoint {
            notes.push("--fsdp-sharded-checkpoint: checkpoints are one file, whatever the number of devices".into());
        }
        if self.sync_batchnorm {
            notes.push(
                "--sync-batchnorm: the model has no BatchNorm layer; nothing to synchronise".into(),
            );
        }
        notes
    }

    /// Where this process stands among a run's processes: the flags, else
    /// SLURM's variables (`env` reads one) where the job has several tasks.
    pub fn world(&self, env: impl Fn(&str) -> Option<String>) -> Result<aam_train::world::World> {
        let timeout = std::time::Duration::from_secs(self.rendezvous_timeout);
        let slurm = |name: &str| -> Result<Option<usize>> {
            env(name)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|_| anyhow::anyhow!("SLURM's {name}={v} is not a number"))
                })
                .transpose()
        };
        let size = match self.world_size {
            Some(n) => n,
            None => slurm("SLURM_NTASKS")?.unwrap_or(1),
        };
        if size <= 1 {
            return Ok(aam_train::world::World::single());
        }
        let rank = match self
            .rank
            .map(Ok)
            .or_else(|| slurm("SLURM_PROCID").transpose())
        {
            Some(r) => r?,
            None => anyhow::bail!("--world-size {size} needs --rank (or SLURM_PROCID)"),
        };
        let rendezvous = match &self.rendezvous {
            Some(r) => r.clone(),
            None => {
                let host = env("SLURM_JOB_NODELIST")
                    .or_else(|| env("SLURM_NODELIST"))
                    .and_then(|l| first_slurm_host(&l));
                let port = 20000 + slurm("SLURM_JOB_ID")?.unwrap_or(9400) % 20000;
                match host {
                    Some(host) => format!("{host}:{port}"),
                    None => anyhow::bail!(
                        "--world-size {size} needs --rendezvous HOST:PORT (or SLURM_JOB_NODELIST)"
                    ),
                }
            }
        };
        let world = aam_train::world::World {
            rank,
            size,
            rendezvous,
            timeout,
        };
        world.check()?;
        Ok(world)
    }

    /// The device list, with the reference's switches read as `all`.
    pub fn list(&self) -> DeviceList {
        if self.data_parallel || self.distributed || self.fsdp {
            DeviceList::All
        } else {
            self.devices.clone()
        }
    }
}

/// `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    /// The GPU backend built in: CUDA, else ROCm.
    Cuda,
    /// The CPU (ndarray).
    Cpu,
}

impl DeviceKind {
    /// The backend this device choice runs on; an error names the cargo
    /// feature when no GPU backend is built in.
    pub fn backend(self) -> Result<BackendKind> {
        let found = BackendKind::compiled().into_iter().find(|b| {
            let name = b.name();
            match self {
                Self::Cpu => name == "ndarray",
                Self::Cuda => name == "cuda" || name == "rocm",
            }
        });
        found.ok_or_else(|| {
            let feature = match self {
                Self::Cpu => "ndarray",
                Self::Cuda => "cuda (or rocm)",
            };
            anyhow::anyhow!(
                "--device {}: this aam-rs was built without that backend (cargo feature {feature}; `aam-rs backends` lists those built in)",
                self.to_possible_value().expect("not skipped").get_name()
            )
        })
    }
}

/// `--auto-batch-size`: search the largest batch under a memory cap.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchSizeSearch {
    /// `--max-memory-fraction` (default 0.8, the reference's).
    pub max_memory_fraction: f64,
    /// `--target-effective-batch-size`: samples per optimiser step after
    /// the search.
    pub target_effective_batch_size: Option<u64>,
}

/// Options of the reference's `pretrain` and `train` that aam-rs takes with
/// its own answer: each given one is applied or logged with a note saying
/// what aam-rs does instead (`docs/migrating-from-aam.md`).
#[derive(Args, Debug, Clone)]
pub struct ReferenceArgs {
    /// On a CUDA or ROCm device: train with the largest even batch in
    /// [2, 256] whose step needs at most --max-memory-fraction of the
    /// device's memory, measured before training (replaces --batch-size).
    /// Elsewhere a note says --batch-size is kept. Off by default (the
    /// reference's default was on).
    #[arg(long, overrides_with = "no_auto_batch_size")]
    pub auto_batch_size: bool,
    /// Train with --batch-size as given (the default).
    #[arg(long, overrides_with = "auto_batch_size")]
    pub no_auto_batch_size: bool,
    /// The memory cap of --auto-batch-size, a fraction of the device's
    /// memory. Default 0.8.
    #[arg(long, value_name = "FRACTION")]
    pub max_memory_fraction: Option<f64>,
    /// Samples per optimiser step: sets --gradient-accumulation-steps to
    /// this over --batch-size (rounded down, at least 1).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub target_effective_batch_size: Option<u64>,
    /// Reference: torch.compile. aam-rs is compiled; nothing to do.
    #[arg(long)]
    pub compile_model: bool,
    /// Reference: TF32 matmuls on Ampere+. aam-rs's f32 matrix products on
    /// CUDA use TF32 tensor cores already; nothing changes.
    #[arg(long)]
    pub tf32: bool,
    /// Reference: PyTorch's CUDA allocator setting. CubeCL's memory pools
    /// manage device memory here; nothing changes.
    #[arg(long)]
    pub use_expandable_segments: bool,
    /// Reference: turn off its token cache. aam-rs tokenises each ASV once
    /// when the table is read; nothing changes.
    #[arg(long)]
    pub no_sequence_cache: bool,
}

impl ReferenceArgs {
    /// The batch-size search asked for, if any.
    pub fn batch_size_search(&self) -> Option<BatchSizeSearch> {
        self.auto_batch_size.then(|| BatchSizeSearch {
            max_memory_fraction: self.max_memory_fraction.unwrap_or(0.8),
            target_effective_batch_size: self.target_effective_batch_size,
        })
    }

    /// Applies what maps onto aam-rs's options (`--target-effective-batch-size`)
    /// and returns a note for each option answered differently.
    pub fn apply(&self, optim: &mut OptimArgs) -> Vec<String> {
        let mut notes = Vec::new();
        if !self.auto_batch_size && self.max_memory_fraction.is_some() {
            notes.push(format!(
                "--max-memory-fraction caps --auto-batch-size, which is off: training with --batch-size {}",
                optim.batch_size
            ));
        }
        if let Some(target) = self.target_effective_batch_size {
            let steps = (target as usize / optim.batch_size.max(1)).max(1);
            notes.push(format!(
                "--target-effective-batch-size {target}: {steps} batch(es) of {} per optimiser step (--gradient-accumulation-steps {steps})",
                optim.batch_size
            ));
            optim.gradient_accumulation_steps = steps;
        }
        for (given, note) in [
            (self.compile_model, "--compile-model: aam-rs is compiled Rust and CubeCL kernels; there is nothing to compile"),
            (self.tf32, "--tf32: f32 matrix products on CUDA use TF32 tensor cores already (the CPU and the other backends compute in f32); nothing changes"),
            (self.use_expandable_segments, "--use-expandable-segments: CubeCL's memory pools manage device memory; there is no PyTorch allocator to set"),
            (self.no_sequence_cache, "--no-sequence-cache: each ASV is tokenised once when the table is read; there is no cache to turn off"),
        ] {
            if given {
                notes.push(note.into());
            }
        }
        notes
    }
}

impl RunArgs {
    /// Applies `--device` (onto --backend) and returns the notes of the
    /// reference's switches that aam-rs answers differently.
    pub fn resolve(&mut self) -> Result<Vec<String>> {
        if let Some(device) = self.device {
            self.backend = device.backend()?;
        }
        Ok(self.parallel.notes())
    }
}

/// `--mixed-precision`.
#[derive(Args, Debug, Clone, Copy)]
pub struct PrecisionArgs {
    /// Mixed precision: run the transformer layers' matmuls, attention and
    /// feed-forward in bf16 or fp16 (fp16 with dynamic loss scaling), keeping
    /// weights, norms and losses in f32. GPU backends only. Default: none.
    #[arg(long, default_value = "none", value_parser = serde_value::<MixedPrecision>)]
    pub mixed_precision: MixedPrecision,
}

impl PrecisionArgs {
    /// Fails, naming the flag, when backend `B` cannot compute in the type.
    pub fn check<B: Backend>(&self, device: &B::Device, backend: &str) -> Result<()> {
        if let Some(dtype) = self.mixed_precision.dtype() {
            anyhow::ensure!(
                B::supports_dtype(device, dtype),
                "--mixed-precision {}: the {backend} backend has no {dtype:?} arithmetic on this device (use none, or a GPU backend)",
                serde_json::to_value(self.mixed_precision)?
                    .as_str()
                    .unwrap_or_default()
            );
        }
        Ok(())
    }
}

/// `--gradient-checkpointing` / `--no-gradient-checkpointing`.
#[derive(Args, Debug, Clone, Copy)]
pub struct CheckpointingArgs {
    /// Gradient checkpointing: recompute memory-bound operations (activations,
    /// norms, dropout) in the backward pass instead of keeping their outputs.
    /// Less memory, more time; works with every attention path. Default: off.
    #[arg(long, overrides_with = "no_gradient_checkpointing")]
    pub gradient_checkpointing: bool,
    /// Keep every intermediate for the backward pass (the default).
    #[arg(long, overrides_with = "gradient_checkpointing")]
    pub no_gradient_checkpointing: bool,
}

/// `--unifrac-metric`: the UniFrac variant `--tree` computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum UnifracMetric {
    /// Presence/absence UniFrac.
    #[default]
    #[value(alias = "unifrac")]
    Unweighted,
    /// Abundance-weighted, normalised UniFrac.
    #[value(alias = "weighted")]
    WeightedNormalized,
    /// Abundance-weighted UniFrac, not normalised.
    WeightedUnnormalized,
    /// Faith's phylogenetic diversity of each sample.
    FaithPd,
}

impl UnifracMetric {
    /// The UniFrac variant; `None` for Faith's PD.
    fn method(self) -> Option<aam_unifrac::Method> {
        match self {
            Self::Unweighted => Some(aam_unifrac::Method::Unweighted),
            Self::WeightedNormalized => Some(aam_unifrac::Method::WeightedNormalized),
            Self::WeightedUnnormalized => Some(aam_unifrac::Method::WeightedUnnormalized),
            Self::FaithPd => None,
        }
    }

    /// The base model and base loss this target trains: Faith's PD, a
    /// one-output head (the reference's pretrain width; its `train` builds a
    /// width-D head that cannot match the `[B, 1]` target, §8 item 13) with
    /// MSE; else the UniFrac embedding distance.
    pub fn base(self) -> (EncoderType, Option<usize>, BaseLoss) {
        match self {
            Self::FaithPd => (EncoderType::FaithPd, Some(1), BaseLoss::Mse),
            _ => (EncoderType::Unifrac, None, BaseLoss::Unifrac),
        }
    }
}

impl DataArgs {
    /// The inputs of a run, prepared with `seed`; a matrix computed from
    /// `--tree` is kept in `cache_dir` (a run's output folder).
    pub fn spec(&self, seed: u64, cache_dir: Option<&Path>) -> DataSpec {
        // clap requires one of the two.
        let file = || self.unifrac_matrix.clone().unwrap_or_default();
        let unifrac = match (&self.tree, self.unifrac_metric.method()) {
            (Some(tree), Some(method)) => UnifracSource::Tree {
                tree: tree.clone(),
                method,
                cache_dir: cache_dir.map(Path::to_path_buf),
                // `prepare` sees the GPU's device.
                gpu: None,
            },
            (Some(tree), None) => UnifracSource::FaithPdTree(tree.clone()),
            (None, Some(_)) => UnifracSource::Matrix(file()),
            (None, None) => UnifracSource::FaithPd(file()),
        };
        DataSpec {
            table: self.table.clone(),
            unifrac,
            rarefy_depth: self.rarefy_depth,
            test_size: self.test_size,
            max_bp: self.max_bp,
            drop_missing: self.drop_missing,
            seed,
        }
    }
}

impl ModelArgs {
    /// The base model these flags describe, for inputs of `max_bp` bases and
    /// `token_limit` slots.
    pub fn encoder_config(
        &self,
        max_bp: usize,
        token_limit: usize,
        encoder_type: EncoderType,
    ) -> Result<SequenceEncoderConfig> {
        ModelSpec {
            embedding_dim: self.embedding_dim,
            attention_heads: self.attention_heads,
            attention_layers: self.attention_layers,
            dropout: self.dropout,
            count_embedding: self.count_embedding,
            count_embedding_method: self.count_embedding_method,
            nuc_mask_ratio: self.nuc_mask_ratio,
            nuc_mask_strategy: self.nuc_mask_strategy,
            asv_chunk_size: self.asv_chunk_size,
            attn_implementation: self.attn_implementation.resolve().0,
            max_bp,
            token_limit,
        }
        .encoder_config(encoder_type)
        .map_err(flagged)
    }
}

/// A library error, with an invalid option named by its flag (`invalid --batch-size: ...`).
pub fn flagged(e: TrainError) -> anyhow::Error {
    match e {
        TrainError::InvalidArgument { field, reason } => {
            anyhow::anyhow!("invalid --{}: {reason}", field.replace('_', "-"))
        }
        e => e.into(),
    }
}

/// Reads, rarefies, joins and splits the inputs (`aam_train::prepare`); a
/// matrix computed from `--tree` is kept in `cache_dir`.
pub fn prepare(
    d: &DataArgs,
    seed: u64,
    target: Option<TargetSpec>,
    cache_dir: Option<&Path>,
) -> Result<Prepared> {
    let mut spec = d.spec(seed, cache_dir);
    if let Some(arg) = d.unifrac_gpu {
        let UnifracSource::Tree { gpu, .. } = &mut spec.unifrac else {
            anyhow::bail!("--unifrac-gpu does not apply to --unifrac-metric faith_pd (a sum per sample, on the CPU)");
        };
        *gpu = Some(arg.runtime("--unifrac-gpu")?);
    }
    aam_train::prepare::prepare(&spec, target).map_err(flagged)
}
