//! `aam-dev step`: how fast does this machine train?
//!
//! Times the optimiser step of `aam-rs pretrain` (forward, losses, backward,
//! AdamW) on one fixed synthetic batch, the way `pretrain` runs it, and reports
//! the median step time, samples/s and the backend memory pool's size. The
//! batch is the PyTorch reference benchmark's (`shared/bench/
//! pt_reference_bench.py`): 8 samples with 120, 250, 80, 400, 300, 150, 500 and
//! 200 ASVs of 150 random nucleotides in 1024 slots. So the figure can be put
//! beside the reference's step on identical tensors. Real oral2550 batches are
//! about five times lighter (median 45 ASVs a sample after rarefaction):
//! `--asvs-per-sample` times such a batch, and `benches/pt_step.py` times the
//! reference on the same counts.
//!
//! Model flags are `pretrain`'s, with its defaults, so `--attn-implementation
//! math` or `--gradient-checkpointing` show what a flag costs.

use std::collections::BTreeMap;
use std::time::Instant;

use aam_data::Batch;
use aam_models::model::{AamModel, ModelConfig};
use aam_models::sequence_encoder::EncoderType;
use aam_models::{autocast, set_attention_dropout_seed, AttentionBackend, MixedPrecision};
use aam_train::loss::LossConfig;
use aam_train::loss::Predictions;
use aam_train::optim::{GradientBuffer, Optimizer, OptimizerConfig};
use aam_train::run::{batch_tensors, Slots};
use anyhow::{ensure, Context, Result};
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use clap::Args;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use aam_cli::args::{CheckpointingArgs, ModelArgs, PrecisionArgs};
use aam_cli::backend::BackendKind;

/// `aam-dev step`.
#[derive(Args, Debug)]
pub struct StepArgs {
    /// Backend to time (one compiled into this binary; `aam-rs backends`).
    #[arg(long, value_enum, default_value_t = BackendKind::default())]
    backend: BackendKind,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    checkpointing: CheckpointingArgs,
    #[command(flatten)]
    precision: PrecisionArgs,
    /// ASVs in each sample of the batch (the batch size is their number).
    #[arg(long, value_delimiter = ',', default_values_t = [120, 250, 80, 400, 300, 150, 500, 200])]
    asvs_per_sample: Vec<usize>,
    /// ASV slots per sample (S).
    #[arg(long, default_value_t = 1024)]
    token_limit: usize,
    /// Run the sample level on all `--token-limit` slots, as the reference
    /// (default: on the batch's filled slots rounded up to 32, as `pretrain`).
    #[arg(long)]
    all_slots: bool,
    /// Nucleotides per ASV (L = max_bp + 1 tokens).
    #[arg(long, default_value_t = 150)]
    max_bp: usize,
    /// Learning rate of the AdamW steps.
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// Timed steps (the median is reported).
    #[arg(long, default_value_t = 12)]
    steps: usize,
    /// Untimed steps first (kernel compilation, autotuning, pool growth).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Seed of the weights and the batch.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write the result as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json_out: Option<std::path::PathBuf>,
    /// Sample the host's call stacks during the timed steps and write them
    /// to this file, folded (`thread;outer;…;inner count` per line, for
    /// flamegraph tools). Needs a binary built with the `cpu-profile` feature.
    #[arg(long, value_name = "FILE")]
    cpu_profile: Option<std::path::PathBuf>,
}

/// What `aam-dev step` measured.
#[derive(Debug, Serialize)]
struct StepReport {
    backend: String,
    attn_implementation: String,
    gradient_checkpointing: bool,
    mixed_precision: MixedPrecision,
    batch_size: usize,
    asvs_per_sample: Vec<usize>,
    parameters: usize,
    /// Median ms per optimiser step.
    step_ms: f64,
    samples_per_sec: f64,
    /// Every timed step, ms.
    step_times_ms: Vec<f64>,
    /// Largest size of the backend's memory pool after a step (None where the
    /// backend does not report it).
    peak_reserved_mib: Option<f64>,
    /// Live tensors after the loss, the step's high-water mark (every
    /// activation the backward pass needs is held then); the largest over
    /// the steps. Comparable to PyTorch's `max_memory_allocated`.
    peak_in_use_mib: Option<f64>,
    first_step_s: f64,
    losses: Vec<f64>,
    /// Median ms of each phase of a timed step, in order: the host queueing
    /// the forward pass and loss (`forward_queue`), waiting for the loss
    /// (`loss_read`: the device finishing the forward), queueing the backward
    /// pass and the optimiser, and waiting for the device at the end
    /// (`final_sync`). Where the waits are short, the host bounds the step.
    phase_ms: BTreeMap<&'static str, f64>,
    /// CPU time per timed step of each of the process's threads, by thread
    /// name (Linux; empty elsewhere), busiest first. Burn's fusion backend
    /// and CubeCL run their work on device threads (`DSU-*`: the fusion
    /// stream, `DSD-*`: the CubeCL server) fed by the caller's thread
    /// through a bounded queue: the busiest thread bounds a host-bound step.
    thread_cpu_ms: Vec<(String, f64)>,
}

/// CPU time (user + system) of each thread of this process, by thread id:
/// `(name, seconds)`. Empty where `/proc` is missing.
fn thread_cpu_times() -> BTreeMap<u64, (String, f64)> {
    let mut out = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    // Clock ticks per second: 100 on every Linux this runs on (USER_HZ).
    const TICKS: f64 = 100.0;
    for task in tasks.flatten() {
        let Ok(tid) = task.file_name().to_string_lossy().parse::<u64>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`: comm may hold spaces, so split at the
        // last ')'; utime and stime are fields 14 and 15.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_string();
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
        if let (Some(user), Some(system)) = (ticks(11), ticks(12)) {
            out.insert(tid, (name, (user + system) / TICKS));
        }
    }
    out
}

pub fn run(args: StepArgs) -> Result<()> {
    ensure!(
        args.asvs_per_sample.len() >= 2,
        "--asvs-per-sample needs at least 2 samples (the UniFrac loss compares pairs)"
    );
    ensure!(
        args.asvs_per_sample
            .iter()
            .all(|&n| n >= 1 && n <= args.token_limit),
        "--asvs-per-sample: each count must lie in 1..={} (--token-limit)",
        args.token_limit
    );
    ensure!(args.steps >= 1, "--steps must be at least 1");
    ensure!(
        args.cpu_profile.is_none() || cfg!(feature = "cpu-profile"),
        "--cpu-profile: this binary was built without the `cpu-profile` feature"
    );
    let config = ModelConfig::SequenceEncoder(args.model.encoder_config(
        args.max_bp,
        args.token_limit,
        EncoderType::Unifrac,
    )?);
    let batch = synthetic_batch(&args);
    let report = aam_cli::with_backend!(args.backend, |B, device| {
        args.precision.check::<B>(&device, &args.backend.name())?;
        if args.checkpointing.gradient_checkpointing {
            time_steps::<Autodiff<B, BalancedCheckpointing>>(&args, &config, &batch, &device)
        } else {
            time_steps::<Autodiff<B>>(&args, &config, &batch, &device)
        }
    })?;
    println!(
        "aam-dev step: backend {}, attention {}, gradient checkpointing {}, mixed precision {:?}, batch {} ({} ASVs), {} parameters",
        report.backend,
        report.attn_implementation,
        if report.gradient_checkpointing { "on" } else { "off" },
        report.mixed_precision,
        report.batch_size,
        report.asvs_per_sample.iter().sum::<usize>(),
        report.parameters
    );
    let mib = |m: Option<f64>| m.map_or("not reported".to_string(), |m| format!("{m:.0} MiB"));
    println!(
        "first step {:.1} s; median of {} steps: {:.1} ms/step, {:.1} samples/s, memory pool {}, live peak {}",
        report.first_step_s,
        report.step_times_ms.len(),
        report.step_ms,
        report.samples_per_sec,
        mib(report.peak_reserved_mib),
        mib(report.peak_in_use_mib),
    );
    let phases: Vec<String> = report
        .phase_ms
        .iter()
        .map(|(name, ms)| format!("{} {ms:.1}", &name[2..]))
        .collect();
    println!("phases (median ms): {}", phases.join(", "));
    if !report.thread_cpu_ms.is_empty() {
        let threads: Vec<String> = report
            .thread_cpu_ms
            .iter()
            .take(6)
            .map(|(name, ms)| format!("{name} {ms:.1}"))
            .collect();
        println!("thread CPU (ms per step): {}", threads.join(", "));
    }
    if let Some(path) = &args.json_out {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing --json-out {}", path.display()))?;
    }
    Ok(())
}

/// The reference benchmark's batch: START then random A/C/G/T in the first
/// `n` slots of each sample, counts 1..200, a random symmetric hollow UniFrac
/// block.
fn synthetic_batch(args: &StepArgs) -> Batch {
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let (b, s, l) = (
        args.asvs_per_sample.len(),
        args.token_limit,
        args.max_bp + 1,
    );
    let mut tokens = vec![0u8; b * s * l];
    let mut counts = vec![0f32; b * s];
    for (sample, &n) in args.asvs_per_sample.iter().enumerate() {
        for slot in 0..n {
            let row = &mut tokens[(sample * s + slot) * l..][..l];
            row[0] = 5;
            row[1..]
                .iter_mut()
                .for_each(|t| *t = rng.random_range(1..=4));
            counts[sample * s + slot] = rng.random_range(1..200) as f32;
        }
    }
    let mut unifrac = vec![0f32; b * b];
    for i in 0..b {
        for j in i + 1..b {
            let d: f32 = rng.random();
            unifrac[i * b + j] = d;
            unifrac[j * b + i] = d;
        }
    }
    Batch {
        sample_ids: (0..b).map(|i| format!("synthetic{i}")).collect(),
        positions: (0..b).collect(),
        token_limit: s,
        seq_len: l,
        tokens,
        counts,
        unifrac: Some(unifrac),
        faith_pd: None,
        targets: None,
        categorical_ids: Vec::new(),
        weights: None,
    }
}

/// `pretrain`'s step (see `aam_train::run::fit`) on autodiff backend `AB`, repeated.
fn time_steps<AB>(
    args: &StepArgs,
    config: &ModelConfig,
    batch: &Batch,
    device: &AB::Device,
) -> Result<StepReport>
where
    AB: AutodiffBackend + AttentionBackend,
    AB::InnerBackend: AttentionBackend,
{
    AB::seed(device, args.seed);
    let model: AamModel<AB> = config.init::<AB>(device)?;
    let parameters = model
        .state_dict_shapes(config)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    let AamModel::SequenceEncoder(mut encoder) = model else {
        unreachable!("aam-dev step builds a SequenceEncoder")
    };
    let loss = LossConfig {
        penalty: 1.0,
        nuc_penalty: 1.0,
        count_penalty: 0.0,
        ..Default::default()
    };
    // AdamW, weight decay 0.01: `pretrain`'s defaults.
    let mut optimizer = Optimizer::<AB::InnerBackend>::new(OptimizerConfig::default())
        .with_per_parameter_updates(AB::fuses_elementwise());
    let name = |path: &str| config.torch_key(path);
    let lr = |_: &str| args.lr;
    let slots = Slots::for_model(config, args.all_slots);
    let mut times = Vec::new();
    let mut losses = Vec::new();
    let mut peak: Option<u64> = None;
    let mut peak_in_use: Option<u64> = None;
    let mut first_step_s = 0.0;
    let mut phases: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    let mut cpu_before = BTreeMap::new();
    #[cfg(feature = "cpu-profile")]
    let mut cpu_profile = None;
    for step in 0..args.warmup + args.steps {
        #[cfg(feature = "cpu-profile")]
        if step == args.warmup {
            if let Some(path) = &args.cpu_profile {
                cpu_profile = Some(crate::cpu_profile::CpuProfile::start(path)?);
            }
        }
        if step == args.warmup {
            cpu_before = thread_cpu_times();
        }
        let started = Instant::now();
        let mut last = started;
        let mut phase = |name: &'static str| {
            let now = Instant::now();
            if step >= args.warmup {
                phases
                    .entry(name)
                    .or_default()
                    .push((now - last).as_secs_f64() * 1e3);
            }
            last = now;
        };
        <AB as Backend>::seed(device, args.seed + step as u64);
        set_attention_dropout_seed(args.seed + step as u64);
        let (input, targets) = batch_tensors::<AB>(batch, device, false, slots);
        let predictions: Predictions<AB> = {
            let _autocast = autocast(args.precision.mixed_precision);
            encoder.forward(input.tokens, input.counts, true).into()
        };
        let parts = loss.forward(&predictions, &targets)?;
        phase("1_forward_queue");
        // `fit` reads the loss back every step (to stop on a non-finite one).
        let total: f64 = parts.total.clone().into_scalar().elem();
        phase("2_loss_read");
        ensure!(total.is_finite(), "step {step}: the loss is {total}");
        if let Some(bytes) = <AB::InnerBackend as aam_kernels::RuntimeOps>::memory_in_use(device) {
            peak_in_use = Some(peak_in_use.map_or(bytes, |p| p.max(bytes)));
        }
        let grads = parts.total.backward();
        phase("3_backward_queue");
        encoder = {
            let buffer = GradientBuffer::collect(&encoder, &grads, &name, 1.0);
            optimizer.step::<AB, _>(encoder, buffer, &name, &lr, None)
        };
        phase("4_optimizer_queue");
        <AB::InnerBackend as Backend>::sync(device)
            .map_err(|e| anyhow::anyhow!("synchronising the device: {e:?}"))?;
        phase("5_final_sync");
        let seconds = started.elapsed().as_secs_f64();
        if step == 0 {
            first_step_s = seconds;
            tracing::info!("first step (kernel compilation and autotuning): {seconds:.1} s");
        }
        if step >= args.warmup {
            times.push(seconds * 1e3);
            losses.push(total);
        }
        if let Some(bytes) = <AB::InnerBackend as aam_kernels::RuntimeOps>::memory_reserved(device)
        {
            peak = Some(peak.map_or(bytes, |p| p.max(bytes)));
        }
    }
    let mut thread_cpu_ms: Vec<(String, f64)> = thread_cpu_times()
        .into_iter()
        .map(|(tid, (name, seconds))| {
            let before = cpu_before.get(&tid).map_or(0.0, |(_, s)| *s);
            (name, (seconds - before) * 1e3 / args.steps as f64)
        })
        .filter(|(_, ms)| *ms > 0.0)
        .collect();
    thread_cpu_ms.sort_by(|a, b| b.1.total_cmp(&a.1));
    #[cfg(feature = "cpu-profile")]
    if let Some(profile) = cpu_profile {
        let samples = profile.write()?;
        tracing::info!("--cpu-profile: {samples} samples of the timed steps");
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let step_ms = sorted[sorted.len() / 2];
    Ok(StepReport {
        backend: args.backend.name(),
        attn_implementation: format!("{:?}", args.model.attn_implementation).to_lowercase(),
        gradient_checkpointing: args.checkpointing.gradient_checkpointing,
        mixed_precision: args.precision.mixed_precision,
        batch_size: batch.batch_size(),
        asvs_per_sample: args.asvs_per_sample.clone(),
        parameters,
        step_ms,
        samples_per_sec: batch.batch_size() as f64 / (step_ms / 1e3),
        step_times_ms: times,
        peak_reserved_mib: peak.map(|b| b as f64 / (1u64 << 20) as f64),
        peak_in_use_mib: peak_in_use.map(|b| b as f64 / (1u64 << 20) as f64),
        first_step_s,
        losses,
        phase_ms: phases
            .into_iter()
            .map(|(name, mut ms)| {
                ms.sort_by(f64::total_cmp);
                (name, ms[ms.len() / 2])
            })
            .collect(),
        thread_cpu_ms,
    })
}
