//! `aam-rs diagnose gradients`: does this backend train right on my data?
//!
//! Runs `pretrain`'s step (forward, losses, backward) on real batches of a
//! user's table twice, on the chosen backend and on the CPU (ndarray, f32),
//! from the same weights, and compares the losses and every parameter's
//! gradient ([`aam_train::gradcheck`]). Fresh weights by default, or a
//! checkpoint's (`--checkpoint`: the weights a run reached, with its model).
//! Fresh weights are drawn on the CPU, or on the checked backend as
//! `pretrain` draws them (`--weights-on backend`), which also checks the
//! backend's random initialisation against the CPU's
//! ([`aam_train::gradcheck::compare_draws`]). The gradient norm is checked
//! twice: summed on the host, and as the training loop computes it on the
//! device (what `--max-grad-norm` clips by). Dropout and nucleotide masking
//! are off on both sides: their random draws differ between backends.
//!
//! `diagnose attention` checks the attention kernels on random inputs; this
//! checks the whole step on the batches a run would see, with their real
//! ASV lengths and sample sizes. The reference's ROCm failure (`mem_efficient`
//! attention, wrong only with a padding mask) is the kind of error it exists
//! to catch.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use aam_data::{BatchConfig, BatchLoader, Transforms};
use aam_models::model::{ModelConfig, StateTensor};
use aam_models::sequence_encoder::EncoderType;
use aam_train::checkpoint::read_checkpoint;
use aam_train::gradcheck::{compare, compare_draws, step_gradients, Comparison, StepGradients};
use aam_train::loss::LossConfig;
use aam_train::run::Slots;
use anyhow::{ensure, Context, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;

use aam_cli::args::{prepare, DataArgs, ModelArgs};
use aam_cli::backend::BackendKind;

/// `aam-rs diagnose gradients`.
#[derive(Args, Debug)]
pub struct GradientsArgs {
    /// Backend to check against the CPU (one compiled into this binary).
    #[arg(long, value_enum, default_value_t = BackendKind::default())]
    backend: BackendKind,
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// Check the weights of this training checkpoint, with its model and
    /// loss weights (the model flags are then ignored), instead of fresh ones.
    #[arg(long, value_name = "CHECKPOINT")]
    checkpoint: Option<PathBuf>,
    /// Samples per batch.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Batches to check.
    #[arg(long, default_value_t = 3)]
    batches: usize,
    /// The first batch checked: its index in the first epoch's order
    /// (`pretrain`'s with the same seed; to check where a run went wrong).
    #[arg(long, default_value_t = 0)]
    first_batch: usize,
    /// Times the checked backend runs each batch's step (each compared with
    /// the CPU's): a kernel that reads memory it never wrote, or races,
    /// gives different results in different runs.
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// Where fresh weights are drawn: on the CPU, or on the checked backend
    /// as `pretrain` draws them (then each parameter's draw is also compared
    /// with the CPU's: the same distribution, other random numbers).
    #[arg(long, value_enum, default_value_t = WeightsOn::Cpu, conflicts_with = "checkpoint")]
    weights_on: WeightsOn,
    /// Seed of the rarefaction, the split, the batch order and fresh weights
    /// (`pretrain`'s default; with `--checkpoint`, give the run's `--seed`
    /// and data flags to see its batches).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Largest accepted gradient difference, relative to each parameter's
    /// largest gradient magnitude (losses: relative to max(|loss|, 1)). The
    /// default allows for CUDA's TF32 matmuls (~2e-3); f32 backends agree
    /// to ~1e-5.
    #[arg(long, default_value_t = 1e-2)]
    tolerance: f64,
    /// Also write the result as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json_out: Option<PathBuf>,
    /// Self-test: scale the checked backend's gradient of one parameter
    /// (the one with the largest entry) by 1.05, which the check must report.
    #[arg(long, hide = true)]
    inject_fault: bool,
}

/// Where `diagnose gradients` draws fresh weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum WeightsOn {
    Cpu,
    Backend,
}

/// One parameter's fresh draw on the backend against the CPU's.
#[derive(Debug, Serialize)]
struct DrawReport {
    key: String,
    /// `(mean, std)`.
    cpu: (f64, f64),
    backend: (f64, f64),
    repeated: f64,
    problem: Option<String>,
}

/// One batch's comparison, as reported.
#[derive(Debug, Serialize)]
struct BatchReport {
    batch: usize,
    samples: usize,
    asvs: usize,
    /// `(name, cpu, backend)`.
    losses: Vec<(&'static str, f64, f64)>,
    grad_norm_cpu: f64,
    grad_norm_backend: f64,
    /// The backend's norm as the training loop computes it, on the device.
    grad_norm_backend_device: f64,
    worst_rel_err: f64,
    worst_parameter: String,
    /// Losses and parameters over the tolerance: `(what, rel err, CPU,
    /// backend)`, the last two a loss's values or a parameter's gradient norms.
    failures: Vec<(String, f64, f64, f64)>,
}

#[derive(Debug, Serialize)]
struct Report {
    backend: String,
    tolerance: f64,
    parameters: usize,
    /// With `--weights-on backend`: every parameter's draw, worst first.
    weights: Vec<DrawReport>,
    batches: Vec<BatchReport>,
    passed: bool,
}

pub fn run(args: GradientsArgs) -> Result<()> {
    ensure!(
        args.batch_size >= 2 && args.batch_size % 2 == 0,
        "--batch-size must be even and at least 2 (the UniFrac loss compares pairs), got {}",
        args.batch_size
    );
    ensure!(args.batches >= 1, "--batches must be at least 1");
    let checkpoint = args
        .checkpoint
        .as_ref()
        .map(|p| read_checkpoint(p).with_context(|| format!("--checkpoint {}", p.display())))
        .transpose()?;
    let (config, loss) = match &checkpoint {
        Some(c) => (c.meta.model.clone(), c.meta.run.loss.clone()),
        None => (
            ModelConfig::SequenceEncoder(args.model.encoder_config(
                args.data.max_bp,
                args.data.token_limit,
                EncoderType::Unifrac,
            )?),
            LossConfig {
                count_penalty: 0.0,
                ..Default::default()
            },
        ),
    };
    ensure!(
        matches!(config, ModelConfig::SequenceEncoder(_)),
        "--checkpoint: diagnose gradients checks pretraining checkpoints (a `train` checkpoint needs its metadata targets)"
    );
    let config = config.without_dropout();
    let prepared = prepare(&args.data, args.seed, None, None)?;
    let transforms = match &checkpoint {
        Some(c) => c.meta.data.transforms.clone(),
        None => Transforms {
            counts: Some(prepared.dataset.fit_count_normalizer(&prepared.train)?),
            ..Default::default()
        },
    };
    let mut batch_config = BatchConfig::train(args.batch_size, args.data.token_limit, args.seed);
    batch_config.asv_sampling = args.data.asv_sampling;
    let loader = BatchLoader::new(
        prepared.dataset.clone(),
        prepared.train.clone(),
        Arc::new(transforms),
        batch_config,
    )?;
    let available = loader.num_batches();
    ensure!(
        args.first_batch < available,
        "--first-batch {}: the first epoch has {available} batches of --batch-size {}",
        args.first_batch,
        args.batch_size
    );
    let cpu = burn::backend::ndarray::NdArrayDevice::Cpu;
    let cpu_draw = || -> Result<HashMap<String, StateTensor>> {
        <burn::backend::NdArray<f32> as burn::prelude::Backend>::seed(&cpu, args.seed);
        Ok(config
            .init::<burn::backend::NdArray<f32>>(&cpu)?
            .state_dict(&config)
            .into_iter()
            .collect())
    };
    let mut weights = Vec::new();
    let state: HashMap<String, StateTensor> = match (&checkpoint, args.weights_on) {
        (Some(c), _) => c.model.clone(),
        (None, WeightsOn::Cpu) => cpu_draw()?,
        (None, WeightsOn::Backend) => {
            let drawn: HashMap<String, StateTensor> =
                aam_cli::with_backend!(args.backend, |B, device| {
                    <B as burn::prelude::Backend>::seed(&device, args.seed);
                    Ok::<_, anyhow::Error>(
                        config
                            .init::<B>(&device)?
                            .state_dict(&config)
                            .into_iter()
                            .collect(),
                    )
                })?;
            weights = compare_draws(&cpu_draw()?, &drawn)
                .into_iter()
                .map(|d| DrawReport {
                    key: d.key,
                    cpu: d.want,
                    backend: d.got,
                    repeated: d.repeated,
                    problem: d.problem,
                })
                .collect();
            print_draws(&weights, &args.backend.name());
            drawn
        }
    };
    let parameters = state.values().map(|t| t.values.len()).sum();
    let slots = Slots::for_model(&config, args.data.all_slots);
    let backend = args.backend.name();
    println!(
        "aam-rs diagnose gradients: {backend} against the CPU, {} weights ({parameters} parameters), batches {}..{} of {available}",
        if checkpoint.is_some() { "checkpoint" } else { "fresh" },
        args.first_batch,
        (args.first_batch + args.batches).min(available)
    );
    let mut reports = Vec::new();
    for k in args.first_batch..(args.first_batch + args.batches).min(available) {
        let batch = loader.batch(0, k)?;
        let asvs = batch.counts.iter().filter(|&&c| c > 0.0).count();
        let want = step_gradients::<burn::backend::NdArray<f32>>(
            &config, &state, &batch, &loss, slots, &cpu,
        )?;
        for _ in 0..args.repeats.max(1) {
            let mut got: StepGradients = aam_cli::with_backend!(args.backend, |B, device| {
                Ok::<_, anyhow::Error>(step_gradients::<B>(
                    &config, &state, &batch, &loss, slots, &device,
                )?)
            })?;
            if args.inject_fault {
                let largest = |g: &Vec<f32>| g.iter().fold(0f32, |m, x| m.max(x.abs()));
                if let Some(g) = got
                    .gradients
                    .values_mut()
                    .max_by(|a, b| largest(a).total_cmp(&largest(b)))
                {
                    g.iter_mut().for_each(|x| *x *= 1.05);
                }
                // As a fault in the backward pass would: the device's norm
                // sums the faulty gradient.
                got.device_norm = got.norm();
            }
            let report = batch_report(k, batch.batch_size(), asvs, &compare(&want, &got), &args);
            print_batch(&report, &backend);
            reports.push(report);
        }
    }
    let passed = reports.iter().all(|r| r.failures.is_empty())
        && weights.iter().all(|w| w.problem.is_none());
    let report = Report {
        backend: backend.clone(),
        tolerance: args.tolerance,
        parameters,
        weights,
        batches: reports,
        passed,
    };
    if let Some(path) = &args.json_out {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing --json-out {}", path.display()))?;
    }
    ensure!(
        report.weights.iter().all(|w| w.problem.is_none()),
        "{backend}'s fresh weights are not drawn as the CPU's are (above)"
    );
    ensure!(
        passed,
        "{backend}'s training step differs from the CPU's by more than --tolerance {} (above)",
        args.tolerance
    );
    println!(
        "{backend}'s losses and gradients equal the CPU's within {}",
        args.tolerance
    );
    Ok(())
}

fn batch_report(
    batch: usize,
    samples: usize,
    asvs: usize,
    c: &Comparison,
    args: &GradientsArgs,
) -> BatchReport {
    let worst = c.worst_tensor();
    let failures: Vec<(String, f64, f64, f64)> = c
        .loss_errors()
        .map(|(name, want, got, err)| (format!("{name} loss"), err, want, got))
        .chain(
            c.tensors
                .iter()
                .map(|t| (t.key.clone(), t.rel_err, t.norm_want, t.norm_got)),
        )
        .chain(std::iter::once((
            "gradient norm on the device (against the host's sum)".to_string(),
            c.device_norm_error(),
            c.norms.1,
            c.device_norms.1,
        )))
        .filter(|(_, err, ..)| *err > args.tolerance)
        .collect();
    BatchReport {
        batch,
        samples,
        asvs,
        losses: c.losses.clone(),
        grad_norm_cpu: c.norms.0,
        grad_norm_backend: c.norms.1,
        grad_norm_backend_device: c.device_norms.1,
        worst_rel_err: worst.map_or(0.0, |t| t.rel_err),
        worst_parameter: worst.map_or(String::new(), |t| t.key.clone()),
        failures,
    }
}

fn print_draws(rows: &[DrawReport], backend: &str) {
    let bad = rows.iter().filter(|r| r.problem.is_some()).count();
    println!(
        "fresh weights drawn on {backend}: {bad} of {} parameters look unlike the CPU's draw",
        rows.len()
    );
    // Worst first: the problems, then the largest spread ratios.
    for r in rows.iter().take(bad.max(3)) {
        println!(
            "  {}: mean {:.3e} std {:.3e} on {backend}, mean {:.3e} std {:.3e} on the CPU, {:.2}% repeated{}",
            r.key,
            r.backend.0,
            r.backend.1,
            r.cpu.0,
            r.cpu.1,
            100.0 * r.repeated,
            r.problem
                .as_ref()
                .map_or(String::new(), |p| format!(": {p}"))
        );
    }
}

fn print_batch(r: &BatchReport, backend: &str) {
    let losses: Vec<String> = r
        .losses
        .iter()
        .map(|(name, cpu, got)| format!("{name} {got:.6} (CPU {cpu:.6})"))
        .collect();
    println!(
        "batch {} ({} samples, {} ASVs): {}; gradient norm {:.4} (on the device {:.4}; CPU {:.4}); worst parameter rel err {:.1e} ({})",
        r.batch,
        r.samples,
        r.asvs,
        losses.join(", "),
        r.grad_norm_backend,
        r.grad_norm_backend_device,
        r.grad_norm_cpu,
        r.worst_rel_err,
        r.worst_parameter
    );
    for (key, err, cpu, got) in r.failures.iter().take(12) {
        println!("  over tolerance: {key}: rel err {err:.2e}, {got:.4e} on {backend}, {cpu:.4e} on the CPU");
    }
    if r.failures.len() > 12 {
        println!("  ... and {} more", r.failures.len() - 12);
    }
}
