//! `aam-rs pretrain` and `aam-rs train`: their flags (reference §5.1, §5.2),
//! turned into `aam-train`'s data and run specifications, the backend chosen,
//! and the hand-off to [`aam_train::run::fit`] with a progress bar.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use aam_data::{TargetTransform, Transforms};
use aam_models::categorical::CategoricalEmbedDim;
use aam_models::import::{is_torch_checkpoint, read_model_weights, ImportHints};
use aam_models::model::{AamModel, ModelConfig, StateTensor};
use aam_models::sequence_encoder::EncoderType;
use aam_models::sequence_predictor::{
    CategoricalFusion, OutputActivation, SequencePredictorConfig,
};
use aam_models::AttentionBackend;
use aam_train::checkpoint::{read_checkpoint, Checkpoint, DataInfo};
use aam_train::config::{BestMetric, RunConfig, Task};
use aam_train::loss::{BaseLoss, LossConfig, TargetLossKind};
use aam_train::optim::OptimizerConfig;
use aam_train::prepare::{Prepared, TargetSpec};
use aam_train::run::{fit, TrainData};
use aam_train::schedule::SchedulerConfig;
use anyhow::{bail, ensure, Context, Result};
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::Autodiff;
use clap::Args;

use aam_cli::args::{
    flagged, prepare, serde_value, DataArgs, ModelArgs, OptimArgs, ResumeFrom, RunArgs,
};

use crate::progress::Progress;
use crate::stop::StopSignal;

/// `aam-rs pretrain`: self-supervised pre-training of the base model on
/// UniFrac distances and masked nucleotides.
#[derive(Args, Debug)]
pub struct PretrainArgs {
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    optim: OptimArgs,
    #[command(flatten)]
    run: RunArgs,
    /// Weight of the UniFrac loss.
    #[arg(long, default_value_t = 1.0)]
    penalty: f64,
    /// Weight of the nucleotide loss.
    #[arg(long, default_value_t = 1.0)]
    nuc_penalty: f64,
}

/// `aam-rs train`: supervised training on a metadata column, optionally
/// from a pre-trained encoder.
#[derive(Args, Debug)]
pub struct TrainArgs {
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    optim: OptimArgs,
    #[command(flatten)]
    run: RunArgs,
    /// Metadata TSV (a `sample_id` or `#SampleID` column).
    #[arg(long, value_name = "TSV")]
    metadata: PathBuf,
    /// The column to predict.
    #[arg(long)]
    metadata_column: String,
    /// Classify the column's (string) labels instead of regressing a number.
    #[arg(long)]
    classifier: bool,
    /// Target transform: none, minmax, zscore, zscore-category, log-minmax, log-zscore.
    #[arg(long, default_value = "minmax", value_parser = serde_value::<TargetTransform>)]
    target_transform: TargetTransform,
    /// Columns whose value combination keys zscore-category statistics (comma list).
    #[arg(long, value_delimiter = ',')]
    normalize_by: Vec<String>,
    /// Regression loss: mse, mae, huber, quantile or asymmetric.
    #[arg(long, default_value = "huber", value_parser = serde_value::<TargetLossKind>)]
    loss_type: TargetLossKind,
    /// Quantile levels for the quantile loss (comma list; default 0.1,0.5,0.9).
    #[arg(long, value_delimiter = ',')]
    quantiles: Vec<f64>,
    /// Asymmetric loss: weight of over-prediction.
    #[arg(long, default_value_t = 1.0)]
    over_penalty: f64,
    /// Asymmetric loss: weight of under-prediction.
    #[arg(long, default_value_t = 1.0)]
    under_penalty: f64,
    /// Class weights for the classifier's NLL (comma list, one per label in sorted order).
    #[arg(long, value_delimiter = ',')]
    class_weights: Vec<f64>,
    /// Weight of the target loss.
    #[arg(long, default_value_t = 1.0)]
    target_penalty: f64,
    /// Weight of the UniFrac loss.
    #[arg(long, default_value_t = 1.0)]
    penalty: f64,
    /// Weight of the nucleotide loss (forced to 0 with --freeze-base).
    #[arg(long, default_value_t = 1.0)]
    nuc_penalty: f64,
    /// Weight of the count loss.
    #[arg(long, default_value_t = 1.0)]
    count_penalty: f64,
    /// Build no count head (and no count loss).
    #[arg(long)]
    no_count_prediction: bool,
    /// Initialise the base model from a `pretrain` checkpoint, a reference
    /// `.pt` (its `pretrained_encoder.pt` or `best_model.pt`) or a `convert`
    /// folder; its architecture wins over the flags.
    #[arg(long, value_name = "CHECKPOINT")]
    pretrained_encoder: Option<PathBuf>,
    /// Train only the heads: the base model's weights stay fixed.
    #[arg(long)]
    freeze_base: bool,
    /// Metadata columns embedded as categorical inputs (comma list).
    #[arg(long, value_delimiter = ',')]
    categorical_columns: Vec<String>,
    /// Width of each categorical embedding.
    #[arg(long, default_value_t = 16)]
    categorical_embed_dim: usize,
    /// concat, add, gmu, cross-attention or perceiver.
    #[arg(long, default_value = "concat", value_parser = serde_value::<CategoricalFusion>)]
    categorical_fusion: CategoricalFusion,
    /// Learning rate of the categorical modules (default: --lr).
    #[arg(long)]
    categorical_lr: Option<f64>,
    /// none, relu, softplus or exp.
    #[arg(long, default_value = "none", value_parser = serde_value::<OutputActivation>)]
    output_activation: OutputActivation,
    /// Sigmoid output (targets in [0, 1]; on by default with log-minmax).
    #[arg(long)]
    bounded_targets: bool,
    /// Trainable output scale and bias.
    #[arg(long)]
    learnable_output_scale: bool,
    /// No LayerNorm before the regression head.
    #[arg(long)]
    no_target_layer_norm: bool,
    /// Hidden widths of an MLP head (comma list, e.g. 64,32).
    #[arg(long, value_delimiter = ',')]
    regressor_hidden_dims: Vec<usize>,
    /// Dropout of the MLP head.
    #[arg(long, default_value_t = 0.0)]
    regressor_dropout: f64,
    /// Add a linear skip to the MLP head.
    #[arg(long)]
    residual_regression_head: bool,
    /// Epoch selection: val_loss, r2, mae, accuracy or f1.
    #[arg(long, default_value = "val_loss", value_parser = serde_value::<BestMetric>)]
    best_metric: BestMetric,
}

fn run_config(
    task: Task,
    o: &OptimArgs,
    d: &DataArgs,
    loss: LossConfig,
    categorical_lr: Option<f64>,
    best_metric: BestMetric,
) -> RunConfig {
    RunConfig {
        task,
        epochs: o.epochs,
        batch_size: o.batch_size,
        gradient_accumulation_steps: o.gradient_accumulation_steps,
        max_grad_norm: o.max_grad_norm,
        categorical_lr,
        optimizer: OptimizerConfig {
            kind: o.optimizer,
            weight_decay: o.weight_decay,
            ..Default::default()
        },
        scheduler: SchedulerConfig {
            kind: o.scheduler,
            lr: o.lr,
            total_steps: 0,
            warmup_steps: o.warmup_steps,
            t0: o.scheduler_t0,
            t_mult: o.scheduler_t_mult,
            eta_min: o.scheduler_eta_min,
            patience: o.scheduler_patience,
            factor: o.scheduler_factor,
            min_lr: o.scheduler_min_lr,
        },
        loss,
        patience: o.patience,
        best_metric,
        seed: o.seed,
        token_limit: d.token_limit,
        asv_sampling: d.asv_sampling,
        all_slots: d.all_slots,
        workers: o.num_workers.max(1),
        memory_profile: false,
        time_phases: Default::default(),
        mixed_precision: Default::default(),
        unifrac_pairs: Default::default(),
        checkpoint_every_steps: None,
        skip_nonfinite_batches: false,
    }
}

fn write_ids(path: &Path, ids: &[String]) -> Result<()> {
    let mut text = ids.join("\n");
    text.push('\n');
    aam_data::write_atomic(path, text.as_bytes())?;
    Ok(())
}

/// Reads the checkpoint given with `--resume-from`, if any.
fn resume_checkpoint(r: &RunArgs, task: Task) -> Result<Option<Checkpoint>> {
    let ckpt = match &r.resume_from {
        None => return Ok(None),
        Some(ResumeFrom::Path(path)) => {
            read_checkpoint(path).with_context(|| format!("--resume-from {}", path.display()))?
        }
        Some(ResumeFrom::Auto) => match newest_checkpoint(&r.output_dir) {
            Some(c) => c,
            None => {
                tracing::info!(
                    "--resume-from auto: no checkpoint in {} yet; starting the run",
                    r.output_dir.display()
                );
                return Ok(None);
            }
        },
    };
    let path = &ckpt.path;
    ensure!(
        ckpt.meta.run.task == task,
        "--resume-from {}: a {:?} checkpoint cannot resume a {:?} run",
        path.display(),
        ckpt.meta.run.task,
        task
    );
    let p = &ckpt.meta.progress;
    let at = match &p.in_epoch {
        Some(e) => format!("at batch {} of epoch {}", e.batches_done, e.epoch + 1),
        None => format!("after epoch {}", p.epochs_done),
    };
    tracing::info!(
        "resuming from {} {at} (step {}); the checkpoint's configuration is used",
        path.display(),
        p.global_step
    );
    Ok(Some(ckpt))
}

/// `--resume-from auto`: the checkpoint of `out_dir` furthest into the run
/// (`last`, or `best` when `last` cannot be read), skipping unreadable ones
/// with a warning; the temporary files of writes cut short by a kill are
/// removed.
fn newest_checkpoint(out_dir: &Path) -> Option<Checkpoint> {
    let last = out_dir.join(aam_train::run::files::LAST);
    if let Some(dir) = last.parent() {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name();
            if name.to_string_lossy().contains(".safetensors.tmp") {
                tracing::info!("removing {} (a write cut short)", entry.path().display());
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    let mut newest: Option<Checkpoint> = None;
    for path in [last, out_dir.join(aam_train::run::files::BEST)] {
        if !path.exists() {
            continue;
        }
        match read_checkpoint(&path) {
            Ok(c) => {
                let key =
                    |c: &Checkpoint| (c.meta.progress.global_step, c.meta.progress.micro_step);
                if newest.as_ref().is_none_or(|n| key(&c) > key(n)) {
                    newest = Some(c);
                }
            }
            Err(e) => tracing::warn!("--resume-from auto: skipping {}: {e}", path.display()),
        }
    }
    newest
}

/// Checks a run configuration; an error names the flag at fault (`invalid --batch-size: ...`).
fn check_run(run: &RunConfig) -> Result<()> {
    run.validate().map_err(flagged)
}

/// Whether a `--resume-from` checkpoint ends a finished run (all epochs, or
/// stopped early): `fit` would run no epoch, or after early stopping one
/// more, so the caller says so and writes nothing.
fn already_complete(c: &Checkpoint) -> bool {
    let (p, run) = (&c.meta.progress, &c.meta.run);
    let stopped = p.bad_epochs >= run.patience.max(1);
    let complete = p.epochs_done >= run.epochs || stopped;
    if complete {
        tracing::info!(
            "--resume-from {}: the run is already complete ({} of {} epochs{}); nothing to do",
            c.path.display(),
            p.epochs_done,
            run.epochs,
            if stopped { ", stopped early" } else { "" }
        );
    }
    complete
}

/// `aam-rs pretrain`.
pub fn pretrain(args: PretrainArgs) -> Result<()> {
    let resume = resume_checkpoint(&args.run, Task::Pretrain)?;
    if resume.as_ref().is_some_and(already_complete) {
        return Ok(());
    }
    let (model_config, run) = match &resume {
        Some(c) => (c.meta.model.clone(), c.meta.run.clone()),
        None => {
            let base = args.model.encoder_config(
                args.data.max_bp,
                args.data.token_limit,
                EncoderType::Unifrac,
            )?;
            let loss = LossConfig {
                penalty: args.penalty,
                nuc_penalty: args.nuc_penalty,
                count_penalty: 0.0,
                ..Default::default()
            };
            (
                ModelConfig::SequenceEncoder(base),
                run_config(
                    Task::Pretrain,
                    &args.optim,
                    &args.data,
                    loss,
                    None,
                    BestMetric::ValLoss,
                ),
            )
        }
    };
    check_run(&run)?;
    let prepared = prepare(&args.data, run.seed, None, Some(&args.run.output_dir))?;
    let counts = prepared.dataset.fit_count_normalizer(&prepared.train)?;
    let transforms = Transforms {
        counts: Some(counts),
        ..Default::default()
    };
    let info = match &resume {
        Some(c) => c.meta.data.clone(),
        None => prepared.data_info(&args.data.spec(run.seed, None), transforms, None, None),
    };
    start(
        args.run.clone(),
        model_config,
        run,
        prepared,
        info,
        resume,
        None,
    )
}

/// `aam-rs train`.
pub fn train(args: TrainArgs) -> Result<()> {
    let resume = resume_checkpoint(&args.run, Task::Train)?;
    if resume.as_ref().is_some_and(already_complete) {
        return Ok(());
    }
    if resume.is_none() {
        // The optimisation flags, before the data is read (the loss flags are checked in `start`).
        check_run(&run_config(
            Task::Train,
            &args.optim,
            &args.data,
            LossConfig::default(),
            args.categorical_lr,
            args.best_metric,
        ))?;
    }
    let seed = resume.as_ref().map_or(args.optim.seed, |c| c.meta.run.seed);
    // A resumed run keeps its checkpoint's task and label order.
    let labels = resume
        .as_ref()
        .and_then(|c| c.meta.data.class_labels.as_deref());
    let classifier = resume
        .as_ref()
        .map_or(args.classifier, |c| c.meta.data.class_labels.is_some());
    let target = TargetSpec {
        path: &args.metadata,
        column: &args.metadata_column,
        classifier,
        labels,
    };
    let prepared = prepare(&args.data, seed, Some(target), Some(&args.run.output_dir))?;
    let pretrained = match (&resume, &args.pretrained_encoder) {
        (None, Some(path)) => Some(
            Pretrained::read(path, &args.model)
                .with_context(|| format!("--pretrained-encoder {}", path.display()))?,
        ),
        _ => None,
    };
    let (model_config, run, info) = match &resume {
        Some(c) => (
            c.meta.model.clone(),
            c.meta.run.clone(),
            c.meta.data.clone(),
        ),
        None => train_setup(&args, &prepared, pretrained.as_ref())?,
    };
    start(
        args.run.clone(),
        model_config,
        run,
        prepared,
        info,
        resume,
        pretrained,
    )
}

/// Model, run and data configuration of a fresh `train` run.
fn train_setup(
    args: &TrainArgs,
    p: &Prepared,
    pretrained: Option<&Pretrained>,
) -> Result<(ModelConfig, RunConfig, DataInfo)> {
    let mut base = args.model.encoder_config(
        args.data.max_bp,
        args.data.token_limit,
        EncoderType::Unifrac,
    )?;
    if let Some(pretrained) = pretrained {
        let path = &pretrained.path;
        // The base architecture is the checkpoint's; masking/attention settings stay the flags'.
        let mut from = pretrained.encoder.clone();
        from.sample.asv.mask_ratio = base.sample.asv.mask_ratio;
        from.sample.asv.mask_strategy = base.sample.asv.mask_strategy;
        from.sample.asv.attn_implementation = base.sample.asv.attn_implementation;
        from.sample.asv.asv_chunk_size = base.sample.asv.asv_chunk_size;
        ensure!(from.sample.asv.max_bp == args.data.max_bp && from.sample.token_limit == args.data.token_limit,
            "--pretrained-encoder {} was trained with --max-bp {} --token-limit {}; pass the same values",
            path.display(), from.sample.asv.max_bp, from.sample.token_limit);
        base = from;
    }
    let mut transforms = Transforms::default();
    let mut class_labels = None;
    if args.classifier {
        class_labels = p.class_labels.clone();
    } else {
        let normalizer = p
            .dataset
            .fit_target_normalizer(args.target_transform, &args.normalize_by, &p.train)
            .with_context(|| {
                format!(
                    "fitting --target-transform {}",
                    args.target_transform.name()
                )
            })?;
        transforms.target = Some(normalizer);
    }
    transforms.counts = Some(p.dataset.fit_count_normalizer(&p.train)?);
    if !args.categorical_columns.is_empty() {
        transforms.categorical = Some(
            p.dataset
                .fit_categorical(&args.categorical_columns, &p.train)?,
        );
    }
    let n_classes = class_labels.as_ref().map_or(1, |l| l.len());
    if args.classifier {
        ensure!(
            n_classes >= 2,
            "--classifier: column {} has {} distinct label(s); at least 2 are needed",
            args.metadata_column,
            n_classes
        );
    }
    let quantiles = (args.loss_type == TargetLossKind::Quantile).then(|| {
        if args.quantiles.is_empty() {
            vec![0.1, 0.5, 0.9]
        } else {
            args.quantiles.clone()
        }
    });
    ensure!(
        args.quantiles.is_empty() || quantiles.is_some(),
        "--quantiles is only used with --loss-type quantile"
    );
    let mut predictor = SequencePredictorConfig::new(base)
        .with_count_num_layers(args.model.attention_layers)
        .with_count_num_heads(args.model.attention_heads)
        .with_count_dropout(args.model.dropout)
        .with_target_num_layers(args.model.attention_layers)
        .with_target_num_heads(args.model.attention_heads)
        .with_target_dropout(args.model.dropout)
        .with_out_dim(n_classes)
        .with_is_classifier(args.classifier)
        .with_freeze_base(args.freeze_base)
        .with_target_layer_norm(!args.no_target_layer_norm)
        .with_bounded_targets(
            args.bounded_targets
                || (args.target_transform == TargetTransform::LogMinMax && !args.classifier),
        )
        .with_learnable_output_scale(args.learnable_output_scale)
        .with_output_activation(args.output_activation)
        .with_categorical_embed_dim(CategoricalEmbedDim::Uniform(args.categorical_embed_dim))
        .with_categorical_fusion(args.categorical_fusion)
        .with_regressor_hidden_dims(
            (!args.regressor_hidden_dims.is_empty()).then(|| args.regressor_hidden_dims.clone()),
        )
        .with_regressor_dropout(args.regressor_dropout)
        .with_residual_regression_head(args.residual_regression_head)
        .with_num_quantiles(quantiles.as_ref().map(Vec::len))
        .with_count_prediction(!args.no_count_prediction);
    if let Some(enc) = &transforms.categorical {
        let cards = enc
            .column_names()
            .iter()
            .cloned()
            .zip(enc.cardinalities())
            .collect();
        predictor = predictor.with_categorical_cardinalities(Some(cards));
    }
    predictor.validate()?;
    let loss = LossConfig {
        penalty: args.penalty,
        nuc_penalty: if args.freeze_base {
            0.0
        } else {
            args.nuc_penalty
        },
        target_penalty: args.target_penalty,
        count_penalty: if args.no_count_prediction {
            0.0
        } else {
            args.count_penalty
        },
        base: BaseLoss::Unifrac,
        target_loss: if args.classifier {
            TargetLossKind::Huber
        } else {
            args.loss_type
        },
        column_losses: None,
        quantiles,
        over_penalty: args.over_penalty,
        under_penalty: args.under_penalty,
        class_weights: (!args.class_weights.is_empty()).then(|| args.class_weights.clone()),
    };
    if let Some(w) = &loss.class_weights {
        ensure!(
            w.len() == n_classes,
            "--class-weights has {} values for {} classes ({:?})",
            w.len(),
            n_classes,
            class_labels
        );
    }
    let run = run_config(
        Task::Train,
        &args.optim,
        &args.data,
        loss,
        args.categorical_lr,
        args.best_metric,
    );
    let info = p.data_info(
        &args.data.spec(args.optim.seed, None),
        transforms,
        class_labels,
        Some(args.metadata_column.clone()),
    );
    Ok((ModelConfig::SequencePredictor(predictor), run, info))
}

fn start(
    r: RunArgs,
    model_config: ModelConfig,
    mut run: RunConfig,
    prepared: Prepared,
    info: DataInfo,
    resume: Option<Checkpoint>,
    pretrained: Option<Pretrained>,
) -> Result<()> {
    check_run(&run)?;
    // An observation of this invocation, resumed or not.
    run.memory_profile = r.memory_profile;
    run.time_phases = r.time_phases;
    run.checkpoint_every_steps = r.checkpoint_every_steps;
    run.skip_nonfinite_batches = r.skip_nonfinite_batches;
    r.matmul_kernels.apply();
    // Before the first kernel runs (the model's initialisation compiles some).
    if let Some(note) = r.backend.kernel_cache_note() {
        tracing::info!("{note}");
    }
    run.mixed_precision = r.precision.mixed_precision;
    run.unifrac_pairs = r.parallel.unifrac_pairs;
    std::fs::create_dir_all(&r.output_dir)
        .with_context(|| format!("creating --output-dir {}", r.output_dir.display()))?;
    let (train_file, val_file) = match run.task {
        Task::Pretrain => ("train_sample_ids.txt", "val_sample_ids.txt"),
        Task::Train => ("train_samples.txt", "val_samples.txt"),
    };
    write_ids(&r.output_dir.join(train_file), &info.train_ids)?;
    write_ids(&r.output_dir.join(val_file), &info.validation_ids)?;
    if let Some(c) = &resume {
        carry_best(c, &r.output_dir)?;
    }
    let data = TrainData {
        dataset: prepared.dataset,
        train: prepared.train,
        validation: prepared.validation,
        info,
    };
    aam_cli::with_backend!(r.backend, |B, device| {
        match r.backend.devices_like(&device, &r.parallel.list()) {
            Err(err) => Err(err),
            Ok(devices) => fit_on::<B>(&devices, &r, model_config, run, data, resume, pretrained),
        }
    })
}

/// A run resumed into an --output-dir without `checkpoints/best.safetensors`
/// starts it with the run's best checkpoint (the reference saves the loaded
/// state there first), so the best model is there even if no later epoch
/// improves: the resumed checkpoint when it is of the best epoch, else the
/// `best.safetensors` beside it when that is the same run's best.
fn carry_best(resume: &Checkpoint, out_dir: &Path) -> Result<()> {
    let target = out_dir.join(aam_train::run::files::BEST);
    let Some(best) = &resume.meta.progress.best else {
        return Ok(());
    };
    if target.exists() {
        return Ok(());
    }
    let at_epoch_end = resume.meta.progress.in_epoch.is_none();
    let source = if at_epoch_end && best.epoch + 1 == resume.meta.progress.epochs_done {
        Some(resume.path.clone())
    } else {
        let beside = resume.path.with_file_name("best.safetensors");
        read_checkpoint(&beside)
            .ok()
            .filter(|c| {
                c.meta.progress.best.as_ref() == Some(best)
                    && c.meta.progress.epochs_done == best.epoch + 1
            })
            .map(|_| beside)
    };
    let Some(source) = source else {
        tracing::warn!(
            "the best checkpoint (epoch {}) of the run resumed from {} is not beside it; {} appears when an epoch improves",
            best.epoch + 1,
            resume.path.display(),
            target.display()
        );
        return Ok(());
    };
    let bytes = std::fs::read(&source).with_context(|| format!("reading {}", source.display()))?;
    if let Some(dir) = target.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    aam_data::write_atomic(&target, &bytes)?;
    tracing::info!(
        "copied the best checkpoint so far (epoch {}) to {}",
        best.epoch + 1,
        target.display()
    );
    Ok(())
}

fn fit_on<B: AttentionBackend>(
    devices: &[B::Device],
    r: &RunArgs,
    model_config: ModelConfig,
    run: RunConfig,
    data: TrainData,
    resume: Option<Checkpoint>,
    pretrained: Option<Pretrained>,
) -> Result<()> {
    r.precision.check::<B>(&devices[0], &r.backend.name())?;
    if devices.len() > 1 {
        tracing::info!(
            "data parallel: {} replicas on {:?}, one thread each, {} samples each per batch; \
             UniFrac pairs {}; sums {}",
            devices.len(),
            devices,
            run.batch_size / devices.len(),
            serde_json::to_value(run.unifrac_pairs)?
                .as_str()
                .unwrap_or_default(),
            if aam_train::parallel::sums_on_devices::<B>(&devices) {
                "on the GPUs (NCCL all-reduce)"
            } else {
                "through the host"
            }
        );
    }
    if r.checkpointing.gradient_checkpointing {
        tracing::info!(
            "gradient checkpointing: memory-bound operations are recomputed in the backward pass"
        );
        fit_with::<Autodiff<B, BalancedCheckpointing>>(
            devices,
            r,
            model_config,
            run,
            data,
            resume,
            pretrained,
        )
    } else {
        fit_with::<Autodiff<B>>(devices, r, model_config, run, data, resume, pretrained)
    }
}

/// Trains with autodiff backend `AB` (its checkpointing strategy decides
/// what the backward pass recomputes).
fn fit_with<AB>(
    devices: &[AB::Device],
    r: &RunArgs,
    model_config: ModelConfig,
    run: RunConfig,
    data: TrainData,
    resume: Option<Checkpoint>,
    pretrained: Option<Pretrained>,
) -> Result<()>
where
    AB: burn::tensor::backend::AutodiffBackend + AttentionBackend,
    AB::InnerBackend: AttentionBackend,
{
    // From here on SIGTERM/SIGUSR1 stop the run at a step with a checkpoint.
    let stop = StopSignal::install()?;
    let device = &devices[0];
    let model: AamModel<AB> = match &resume {
        Some(c) => c.model::<AB>(device)?,
        None => {
            // Initial weights from --seed too, so that a run repeats exactly.
            <AB as burn::tensor::backend::Backend>::seed(device, run.seed);
            let mut model = model_config.init::<AB>(device)?;
            if let Some(p) = &pretrained {
                load_encoder(&mut model, &model_config, p)?;
            }
            model
        }
    };
    let task = run.task;
    let classifier = matches!(&model_config, ModelConfig::SequencePredictor(c) if c.is_classifier);
    let n_params: usize = model
        .state_dict_shapes(&model_config)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    tracing::info!("model: {n_params} parameters; backend {}", r.backend.name());
    let mut progress = Progress::new(run.epochs, stop.clone());
    let summary = fit::<AB>(
        devices,
        model_config,
        model,
        run,
        data,
        &r.output_dir,
        resume.as_ref(),
        &mut progress,
    )
    .map_err(flagged)?;
    progress.finish();
    if summary.interrupted {
        return Err(aam_cli::Interrupted {
            signal: stop.received().unwrap_or("a signal"),
            checkpoint: summary.last_checkpoint,
            step: summary.steps,
        }
        .into());
    }
    crate::plot::loss_curves(&r.output_dir, &summary.history)?;
    if task == Task::Train && !classifier {
        let tsv = r.output_dir.join(aam_train::run::files::VAL_PREDICTIONS);
        if let Ok(text) = std::fs::read_to_string(&tsv) {
            // Columns: sample_id, prediction (first output), ..., actual.
            let pairs: Vec<(f64, f64)> = text
                .lines()
                .skip(1)
                .filter_map(|line| {
                    let cells: Vec<&str> = line.split('\t').collect();
                    Some((cells.last()?.parse().ok()?, cells.get(1)?.parse().ok()?))
                })
                .collect();
            let best = summary.best.as_ref().map_or(0, |b| b.epoch + 1);
            crate::plot::predicted_vs_true(
                &r.output_dir,
                &pairs,
                &format!("validation, best epoch {best}"),
            )?;
        }
    }
    match &summary.best {
        Some(b) => tracing::info!(
            "best {} {:.6} at epoch {}: {}",
            b.metric,
            b.value,
            b.epoch + 1,
            summary.best_checkpoint.display()
        ),
        None => tracing::warn!("no epoch produced a finite {}", "metric"),
    }
    Ok(())
}

/// The base model that `--pretrained-encoder` names: a `pretrain`
/// checkpoint, the base of a `train` checkpoint, a reference `.pt` (its
/// `pretrained_encoder.pt`, or the `base_model` of a predictor's
/// `best_model.pt`), or an `aam-rs convert` folder.
struct Pretrained {
    /// The file or folder.
    path: PathBuf,
    /// Its architecture.
    encoder: aam_models::sequence_encoder::SequenceEncoderConfig,
    /// Its weights, by the encoder's torch keys.
    tensors: HashMap<String, StateTensor>,
}

impl Pretrained {
    /// Reads `path`; a reference checkpoint's heads and activations are
    /// those of `model`'s flags (the reference builds both models from the
    /// same flags).
    fn read(path: &Path, model: &ModelArgs) -> Result<Self> {
        let (config, tensors) = if path.is_dir() || is_torch_checkpoint(path) {
            let hints = ImportHints {
                attention_heads: model.attention_heads,
                ..ImportHints::default()
            };
            read_model_weights(path, &hints)?
        } else {
            let ckpt = read_checkpoint(path)?;
            (ckpt.meta.model, ckpt.model)
        };
        let (encoder, tensors) = match config {
            ModelConfig::SequenceEncoder(encoder) => (encoder, tensors),
            ModelConfig::SequencePredictor(predictor) => {
                tracing::info!(
                    "--pretrained-encoder {}: a fine-tuned model; its base model is used",
                    path.display()
                );
                let base = tensors
                    .into_iter()
                    .filter_map(|(k, t)| Some((k.strip_prefix("base_model.")?.to_string(), t)))
                    .collect();
                (predictor.base, base)
            }
        };
        Ok(Self {
            path: path.to_path_buf(),
            encoder,
            tensors,
        })
    }
}

/// Copies a pre-trained encoder's weights into a predictor's `base_model`.
fn load_encoder<B: burn::tensor::backend::Backend>(
    model: &mut AamModel<B>,
    config: &ModelConfig,
    encoder: &Pretrained,
) -> Result<()> {
    let mut state: HashMap<String, StateTensor> = model.state_dict(config).into_iter().collect();
    let mut loaded = 0;
    for (key, tensor) in &encoder.tensors {
        let target = format!("base_model.{key}");
        match state.get(&target) {
            Some(t) if t.shape == tensor.shape => {
                state.insert(target, tensor.clone());
                loaded += 1;
            }
            Some(t) => bail!(
                "--pretrained-encoder {}: {key} has shape {:?}, the model's base_model.{key} {:?}",
                encoder.path.display(),
                tensor.shape,
                t.shape
            ),
            None => bail!(
                "--pretrained-encoder {}: {key} has no place in this model's base_model",
                encoder.path.display()
            ),
        }
    }
    ensure!(
        loaded > 0,
        "--pretrained-encoder {}: no weights matched",
        encoder.path.display()
    );
    model.load_state_dict(config, state, &encoder.path)?;
    tracing::info!(
        "loaded {loaded} tensors of the pre-trained encoder {}",
        encoder.path.display()
    );
    Ok(())
}
