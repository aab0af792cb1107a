//! `aam-rs pretrain` and `aam-rs train`: their flags (reference §5.1, §5.2),
//! turned into `aam-train`'s data and run specifications, the backend chosen,
//! and the hand-off to [`aam_train::run::fit`] with a progress bar.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use aam_data::{CategoryWeights, TargetTransform, Transforms};
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
use aam_train::loss::{LossConfig, TargetLossKind};
use aam_train::optim::OptimizerConfig;
use aam_train::prepare::{Prepared, TargetSpec};
use aam_train::run::{fit, TrainData};
use aam_train::schedule::SchedulerConfig;
use aam_train::world::World;
use anyhow::{bail, ensure, Context, Result};
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::Autodiff;
use clap::Args;

use aam_cli::args::{
    flagged, prepare, serde_value, BatchSizeSearch, DataArgs, ModelArgs, OptimArgs, ReferenceArgs,
    ResumeFrom, RunArgs,
};

use crate::compile_workers::CompileWorkers;
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
    #[command(flatten)]
    reference: ReferenceArgs,
    /// Weight of the UniFrac loss.
    #[arg(long, default_value_t = 1.0)]
    penalty: f64,
    /// Weight of the nucleotide loss.
    #[arg(long, default_value_t = 1.0)]
    nuc_penalty: f64,
    /// Weight of the count loss: pretraining has no count head, so no
    /// effect (as in the reference).
    #[arg(long, default_value_t = 1.0)]
    count_penalty: f64,
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
    #[command(flatten)]
    reference: ReferenceArgs,
    /// Metadata TSV (a `sample_id` or `#SampleID` column).
    #[arg(long, value_name = "TSV")]
    metadata: PathBuf,
    /// The column to predict.
    #[arg(long)]
    metadata_column: String,
    /// Classify the column's (string) labels instead of regressing a number.
    #[arg(long)]
    classifier: bool,
    /// Outputs of the target head: the number of classes of a classifier
    /// (default: the column's distinct labels) or 1 for a regressor.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    out_dim: Option<u64>,
    /// Target transform: none, minmax, zscore, zscore-category, log-minmax,
    /// log-zscore, log-zscore-category. Default: minmax, or what the legacy
    /// flags below say.
    #[arg(long, value_parser = serde_value::<TargetTransform>)]
    target_transform: Option<TargetTransform>,
    /// Columns whose value combination keys zscore-category statistics (comma list).
    #[arg(long, value_delimiter = ',')]
    normalize_by: Vec<String>,
    /// Legacy (reference): min-max normalise the targets (the default).
    #[arg(long, overrides_with = "no_normalize_targets")]
    normalize_targets: bool,
    /// Legacy (reference): raw targets (--target-transform none).
    #[arg(long, overrides_with = "normalize_targets")]
    no_normalize_targets: bool,
    /// Legacy (reference): z-score per category of these columns
    /// (--target-transform zscore-category --normalize-by COLS).
    #[arg(long, value_delimiter = ',', value_name = "COLS")]
    normalize_targets_by: Vec<String>,
    /// Legacy (reference): ln(y + 1) before normalising (log-minmax, or
    /// log-zscore-category with --normalize-targets-by).
    #[arg(long)]
    log_transform_targets: bool,
    /// Per-output regression losses as JSON, keyed by output index or the
    /// target column's name: `{"0": "mse"}`; mse, mae or huber, the others
    /// --loss-type's.
    #[arg(long, value_name = "JSON")]
    loss_config: Option<String>,
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
    /// Build a count head (the default).
    #[arg(long, overrides_with = "no_count_prediction")]
    count_prediction: bool,
    /// Build no count head (and no count loss).
    #[arg(long, overrides_with = "count_prediction")]
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
    /// LayerNorm before the regression head (the default).
    #[arg(long, overrides_with = "no_target_layer_norm")]
    target_layer_norm: bool,
    /// No LayerNorm before the regression head.
    #[arg(long, overrides_with = "target_layer_norm")]
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
    /// Heads of cross-attention and perceiver fusion.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=64))]
    cross_attn_heads: u64,
    /// Latents of perceiver fusion.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1024))]
    perceiver_num_latents: u64,
    /// Self-attention layers of perceiver fusion.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=16))]
    perceiver_num_layers: u64,
    /// Categorical columns (of --categorical-columns) that get a learned
    /// output scale and bias per category (comma list).
    #[arg(long, value_delimiter = ',', value_name = "COLS")]
    conditional_output_scaling: Vec<String>,
    /// Per-category weights of the target loss: `auto` (balanced: each
    /// value of the column weighs N / (K · n_k) over the training samples)
    /// or JSON `{"column=value": weight}` (or `{"value": weight}`); other
    /// values weigh 1.
    #[arg(long, value_name = "auto|JSON")]
    categorical_loss_weights: Option<String>,
    /// The column of --categorical-loss-weights (default: the first of
    /// --categorical-columns).
    #[arg(long, value_name = "COLUMN")]
    categorical_loss_weight_column: Option<String>,
    /// Print a guide to choosing --categorical-fusion and exit.
    #[arg(long)]
    categorical_help: bool,
    /// Average validation predictions (and their metrics) over this many
    /// passes, each with its own random ASV draw (with --asv-sampling random;
    /// otherwise the passes agree and one runs).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100))]
    val_prediction_passes: u64,
    /// Epoch selection: val_loss, r2, mae, accuracy or f1.
    #[arg(long, default_value = "val_loss", value_parser = serde_value::<BestMetric>)]
    best_metric: BestMetric,
}

impl TrainArgs {
    /// `--target-transform`, or the reference's legacy flags read as it
    /// reads them (a warning when both are given; the legacy ones then
    /// lose), and the `--normalize-by` columns.
    fn target_transform(&self) -> (TargetTransform, Vec<String>) {
        let by = if self.normalize_by.is_empty() {
            self.normalize_targets_by.clone()
        } else {
            self.normalize_by.clone()
        };
        let legacy = self.no_normalize_targets
            || !self.normalize_targets_by.is_empty()
            || self.log_transform_targets;
        if let Some(t) = self.target_transform {
            if legacy {
                tracing::warn!(
                    "--target-transform {} is given: --no-normalize-targets, --normalize-targets-by and --log-transform-targets are ignored",
                    t.name()
                );
            }
            return (t, by);
        }
        let log = self.log_transform_targets;
        let t = if !self.normalize_targets_by.is_empty() {
            // The reference turns this pair into a global log-zscore, losing the
            // categories (§8); the per-category transform is what it asks for.
            if log {
                TargetTransform::LogZScoreCategory
            } else {
                TargetTransform::ZScoreCategory
            }
        } else if self.no_normalize_targets {
            if log {
                tracing::warn!("--log-transform-targets with --no-normalize-targets: targets stay raw (--target-transform none)");
            }
            TargetTransform::None
        } else if log {
            TargetTransform::LogMinMax
        } else {
            TargetTransform::MinMax
        };
        if legacy {
            tracing::info!(
                "legacy target flags: --target-transform {}{}",
                t.name(),
                if by.is_empty() {
                    String::new()
                } else {
                    format!(" --normalize-by {}", by.join(","))
                }
            );
        }
        (t, by)
    }

    /// `--loss-config`: one loss per output (keys: output index, or the
    /// target column's name for output 0).
    fn column_losses(&self, outputs: usize) -> Result<Option<Vec<TargetLossKind>>> {
        let Some(json) = &self.loss_config else {
            return Ok(None);
        };
        let map: BTreeMap<String, String> = serde_json::from_str(json).with_context(|| {
            format!("--loss-config {json}: expected a JSON object like {{\"0\": \"mse\"}}")
        })?;
        let mut losses = vec![self.loss_type; outputs];
        for (key, kind) in map {
            let index = if key == self.metadata_column {
                0
            } else {
                key.parse::<usize>().ok().filter(|&i| i < outputs).with_context(|| {
                    format!(
                        "--loss-config: key {key:?} is neither an output index below {outputs} nor the target column {:?}",
                        self.metadata_column
                    )
                })?
            };
            losses[index] = serde_value::<TargetLossKind>(&kind).map_err(|e| {
                anyhow::anyhow!("--loss-config: {key:?}: {kind:?} is not a loss ({e})")
            })?;
        }
        Ok(Some(losses))
    }
}

/// `train --categorical-help`.
pub const CATEGORICAL_HELP: &str = "\
Choosing --categorical-fusion (metadata columns given with --categorical-columns)

  concat           The categorical embeddings are concatenated to each ASV
                   embedding and projected back to the model width. The
                   default; a good first choice for a few low-cardinality
                   columns (site, season, sex).
  add              The embeddings are projected to the model width and added.
                   Fewer parameters than concat; use when the categories
                   shift the whole sample.
  gmu              A gated multimodal unit learns, per sample, how much the
                   metadata contributes. Use when the metadata helps some
                   samples and not others.
  cross-attention  Each ASV attends to a metadata token
                   (--cross-attn-heads). Use when categories change how
                   ASVs should be read, with enough samples per category.
  perceiver        A small set of latents (--perceiver-num-latents, layers
                   --perceiver-num-layers) attends over ASVs and metadata.
                   The most expressive and the most data-hungry.

Related: --categorical-embed-dim (width of each embedding, default 16),
--categorical-lr (a separate learning rate for these modules),
--conditional-output-scaling COLS (a learned output scale and bias per
category of COLS). Start with concat; compare val_loss with gmu or
cross-attention when there are hundreds of samples per category.
";

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
        val_prediction_passes: 1,
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

/// Applies the reference's options that map onto aam-rs's (`--device`,
/// `--target-effective-batch-size`, ...) and logs a note for each that
/// aam-rs answers differently.
fn apply_reference(
    run: &mut RunArgs,
    reference: &ReferenceArgs,
    optim: &mut OptimArgs,
    model: &ModelArgs,
) -> Result<()> {
    aam_cli::keep_log();
    tracing::info!(
        "aam-rs {}: {}",
        env!("CARGO_PKG_VERSION"),
        std::env::args().collect::<Vec<_>>().join(" ")
    );
    let mut notes = run.resolve()?;
    notes.extend(reference.apply(optim));
    run.batch_size_search = reference.batch_size_search();
    notes.extend(model.attn_implementation.resolve().1);
    for note in notes {
        tracing::info!("{note}");
    }
    Ok(())
}

/// `aam-rs pretrain`.
pub fn pretrain(mut args: PretrainArgs) -> Result<()> {
    apply_reference(&mut args.run, &args.reference, &mut args.optim, &args.model)?;
    let resume = resume_checkpoint(&args.run, Task::Pretrain)?;
    if resume.as_ref().is_some_and(already_complete) {
        return Ok(());
    }
    let (model_config, run) = match &resume {
        Some(c) => (c.meta.model.clone(), c.meta.run.clone()),
        None => {
            let (encoder_type, output_dim, base_loss) = args.data.unifrac_metric.base();
            let base = args
                .model
                .encoder_config(args.data.max_bp, args.data.token_limit, encoder_type)?
                .with_base_output_dim(output_dim);
            let loss = LossConfig {
                penalty: args.penalty,
                nuc_penalty: args.nuc_penalty,
                count_penalty: 0.0,
                base: base_loss,
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
pub fn train(mut args: TrainArgs) -> Result<()> {
    if args.categorical_help {
        print!("{CATEGORICAL_HELP}");
        return Ok(());
    }
    apply_reference(&mut args.run, &args.reference, &mut args.optim, &args.model)?;
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
    let (encoder_type, output_dim, base_loss) = args.data.unifrac_metric.base();
    let mut base = args
        .model
        .encoder_config(args.data.max_bp, args.data.token_limit, encoder_type)?
        .with_base_output_dim(output_dim);
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
        let faith = |t: EncoderType| t == EncoderType::FaithPd;
        ensure!(faith(from.encoder_type) == faith(encoder_type),
            "--pretrained-encoder {} was pretrained on {}; pass --unifrac-metric {} (and its --unifrac-matrix or --tree) so that its base head keeps a target",
            path.display(),
            if faith(from.encoder_type) { "Faith's PD" } else { "UniFrac distances" },
            if faith(from.encoder_type) { "faith_pd" } else { "unifrac (or weighted)" });
        base = from;
    }
    let mut transforms = Transforms::default();
    let mut class_labels = None;
    let (target_transform, normalize_by) = args.target_transform();
    if args.classifier {
        class_labels = p.class_labels.clone();
    } else {
        let normalizer = p
            .dataset
            .fit_target_normalizer(target_transform, &normalize_by, &p.train)
            .with_context(|| format!("fitting --target-transform {}", target_transform.name()))?;
        transforms.target = Some(normalizer);
    }
    transforms.counts = Some(p.dataset.fit_count_normalizer(&p.train)?);
    if let Some(spec) = &args.categorical_loss_weights {
        let column = args
            .categorical_loss_weight_column
            .clone()
            .or_else(|| args.categorical_columns.first().cloned())
            .context("--categorical-loss-weights: name the column with --categorical-loss-weight-column (or give --categorical-columns)")?;
        let weights = if spec == "auto" {
            p.dataset
                .fit_loss_weights(&column, &p.train)
                .with_context(|| format!("--categorical-loss-weights auto on column {column}"))?
        } else {
            let given: BTreeMap<String, f64> = serde_json::from_str(spec).with_context(|| {
                format!("--categorical-loss-weights {spec}: expected `auto` or a JSON object like {{\"{column}=value\": 2.0}}")
            })?;
            if let Some((k, w)) = given.iter().find(|(_, w)| !(w.is_finite() && **w >= 0.0)) {
                bail!("--categorical-loss-weights: {k:?} has weight {w}; weights must be finite and ≥ 0");
            }
            CategoryWeights::given(&column, given)
        };
        tracing::info!(
            "target loss weights by {column}: {}",
            weights
                .weights
                .iter()
                .map(|(v, w)| format!("{v} {w:.3}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        transforms.loss_weights = Some(weights);
    } else if args.categorical_loss_weight_column.is_some() {
        tracing::warn!("--categorical-loss-weight-column without --categorical-loss-weights: every sample weighs 1");
    }
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
    if let Some(out_dim) = args.out_dim {
        ensure!(
            out_dim as usize == n_classes,
            "--out-dim {out_dim}: {}",
            if args.classifier {
                format!(
                    "column {} has {n_classes} classes ({:?}); the classifier's outputs are its classes",
                    args.metadata_column, class_labels
                )
            } else {
                format!(
                    "a regressor of one column ({}) has 1 output",
                    args.metadata_column
                )
            }
        );
    }
    for column in &args.conditional_output_scaling {
        ensure!(
            args.categorical_columns.contains(column),
            "--conditional-output-scaling {column}: not one of --categorical-columns {:?}",
            args.categorical_columns
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
                || (target_transform == TargetTransform::LogMinMax && !args.classifier),
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
        .with_count_prediction(!args.no_count_prediction)
        .with_cross_attn_heads(args.cross_attn_heads as usize)
        .with_perceiver_num_latents(args.perceiver_num_latents as usize)
        .with_perceiver_num_layers(args.perceiver_num_layers as usize)
        .with_conditional_scaling_columns(
            (!args.conditional_output_scaling.is_empty())
                .then(|| args.conditional_output_scaling.clone()),
        );
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
        base: base_loss,
        target_loss: if args.classifier {
            TargetLossKind::Huber
        } else {
            args.loss_type
        },
        column_losses: args.column_losses(n_classes)?,
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
    let mut run = run_config(
        Task::Train,
        &args.optim,
        &args.data,
        loss,
        args.categorical_lr,
        args.best_metric,
    );
    run.val_prediction_passes = args.val_prediction_passes as usize;
    if run.val_prediction_passes > 1 && run.asv_sampling != aam_data::AsvSampling::Random {
        tracing::warn!(
            "--val-prediction-passes {}: without --asv-sampling random every pass sees the same ASVs; running one",
            run.val_prediction_passes
        );
        run.val_prediction_passes = 1;
    }
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
    // Across processes only process 0 writes the run's files. SLURM tells a
    // task its rank through its environment: read here, once.
    let world = r.parallel.world(|k| std::env::var(k).ok())?;
    // Started now, so that their device contexts are up when the first
    // forward pass hands them problems.
    let helpers = compile_helpers(&r, &world);
    if world.writes() {
        std::fs::create_dir_all(&r.output_dir)
            .with_context(|| format!("creating --output-dir {}", r.output_dir.display()))?;
        let log = r.output_dir.join("training.log");
        aam_cli::log_to_file(&log).with_context(|| format!("opening {}", log.display()))?;
        let (train_file, val_file) = match run.task {
            Task::Pretrain => ("train_sample_ids.txt", "val_sample_ids.txt"),
            Task::Train => ("train_samples.txt", "val_samples.txt"),
        };
        write_ids(&r.output_dir.join(train_file), &info.train_ids)?;
        write_ids(&r.output_dir.join(val_file), &info.validation_ids)?;
        if let Some(c) = &resume {
            carry_best(c, &r.output_dir)?;
        }
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
            Ok(devices) => fit_on::<B>(
                &devices,
                &world,
                &r,
                model_config,
                run,
                data,
                resume,
                pretrained,
                helpers,
            ),
        }
    })
}

/// `--compile-workers` helpers, where they help: CUDA or ROCm, an empty
/// kernel cache, process 0 of the run (the processes of its node share the
/// cache). A helper that cannot start is a warning: the run compiles its
/// kernels itself.
fn compile_helpers(r: &RunArgs, world: &World) -> Option<CompileWorkers> {
    if r.backend.kernel_cache_is_empty() != Some(true) || world.rank != 0 {
        return None;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let count = r.compile_workers.unwrap_or((cores / 2).min(8));
    if count == 0 {
        return None;
    }
    match CompileWorkers::start(count, r.backend, r.matmul_kernels) {
        Ok(helpers) => {
            tracing::info!(
                "{count} helper processes compile the dense layers' kernels during the first step (--compile-workers)"
            );
            Some(helpers)
        }
        Err(e) => {
            tracing::warn!("no kernel-compiling helpers: {e:#}");
            None
        }
    }
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

#[allow(clippy::too_many_arguments)]
fn fit_on<B: AttentionBackend>(
    devices: &[B::Device],
    world: &World,
    r: &RunArgs,
    model_config: ModelConfig,
    run: RunConfig,
    data: TrainData,
    resume: Option<Checkpoint>,
    pretrained: Option<Pretrained>,
    helpers: Option<CompileWorkers>,
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
            world,
            r,
            model_config,
            run,
            data,
            resume,
            pretrained,
            helpers,
        )
    } else {
        fit_with::<Autodiff<B>>(
            devices,
            world,
            r,
            model_config,
            run,
            data,
            resume,
            pretrained,
            helpers,
        )
    }
}

/// `--auto-batch-size`: replaces `run.batch_size` (and, with
/// `--target-effective-batch-size`, the accumulation steps) by the largest
/// batch under the memory cap of a CUDA or ROCm device; elsewhere a note
/// says that `--batch-size` is kept.
#[allow(clippy::too_many_arguments)]
fn search_batch_size<AB>(
    devices: &[AB::Device],
    world: &World,
    r: &RunArgs,
    search: BatchSizeSearch,
    model: &AamModel<AB>,
    model_config: &ModelConfig,
    run: &mut RunConfig,
    data: &TrainData,
) -> Result<()>
where
    AB: burn::tensor::backend::AutodiffBackend + AttentionBackend,
    AB::InnerBackend: AttentionBackend,
{
    let keep = |why: String| {
        tracing::info!(
            "--auto-batch-size: {why}; training with --batch-size {}",
            run.batch_size
        );
        Ok(())
    };
    if devices.len() > 1 || world.size > 1 {
        return keep(format!(
            "not searched for {} replicas (as the reference, which skips it for data-parallel runs)",
            devices.len() * world.size
        ));
    }
    let index = match r.parallel.list() {
        aam_cli::args::DeviceList::Indices(i) => i.first().copied().unwrap_or(0),
        aam_cli::args::DeviceList::All => 0,
    };
    let Some(total) = r.backend.total_memory(index)? else {
        return keep(format!(
            "the {} backend reports no device memory to fill (the search runs on CUDA and ROCm devices)",
            r.backend.name()
        ));
    };
    let started = std::time::Instant::now();
    let found = aam_train::batch_size::largest_batch::<AB>(
        model,
        model_config,
        run,
        data,
        &devices[0],
        total,
        search.max_memory_fraction,
    )
    .map_err(flagged)?;
    run.batch_size = found.batch_size;
    if let Some(target) = search.target_effective_batch_size {
        run.gradient_accumulation_steps = (target as usize / found.batch_size).max(1);
    }
    tracing::info!(
        "--auto-batch-size: batch size {} ({} per optimiser step), the largest of {} tried under {:.2} GiB ({} of {:.1} GiB), in {:.1} s",
        found.batch_size,
        found.batch_size * run.gradient_accumulation_steps,
        found
            .trials
            .iter()
            .map(|t| format!("{} ({:.2} GiB)", t.batch_size, t.bytes as f64 / (1u64 << 30) as f64))
            .collect::<Vec<_>>()
            .join(", "),
        found.cap as f64 / (1u64 << 30) as f64,
        search.max_memory_fraction,
        total as f64 / (1u64 << 30) as f64,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Trains with autodiff backend `AB` (its checkpointing strategy decides
/// what the backward pass recomputes).
#[allow(clippy::too_many_arguments)]
fn fit_with<AB>(
    devices: &[AB::Device],
    world: &World,
    r: &RunArgs,
    model_config: ModelConfig,
    run: RunConfig,
    data: TrainData,
    resume: Option<Checkpoint>,
    pretrained: Option<Pretrained>,
    helpers: Option<CompileWorkers>,
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
    if let Some(helpers) = &helpers {
        helpers.expect_layers(&model.state_dict_shapes(&model_config));
    }
    let mut run = run;
    if let (Some(search), None) = (r.batch_size_search, &resume) {
        search_batch_size::<AB>(
            devices,
            world,
            r,
            search,
            &model,
            &model_config,
            &mut run,
            &data,
        )?;
    }
    let task = run.task;
    let classifier = matches!(&model_config, ModelConfig::SequencePredictor(c) if c.is_classifier);
    let class_labels = data.info.class_labels.clone();
    let n_params: usize = model
        .state_dict_shapes(&model_config)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    tracing::info!("model: {n_params} parameters; backend {}", r.backend.name());
    let mut progress = Progress::new(run.epochs, stop.clone()).with_helpers(helpers);
    let summary = fit::<AB>(
        devices,
        world,
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
    if !world.writes() {
        return Ok(());
    }
    export_torch(&r.output_dir, task, &summary)?;
    crate::plot::loss_curves(&r.output_dir, &summary.history)?;
    crate::plot::nucleotide_accuracy(&r.output_dir, &summary.history)?;
    let best_epoch = summary.best.as_ref().map_or(0, |b| b.epoch + 1);
    if task == Task::Pretrain {
        // Columns: sample_a, sample_b, unifrac, predicted.
        if let Some(rows) = tsv_rows(&r.output_dir.join(aam_train::run::files::VAL_UNIFRAC)) {
            let pairs: Vec<(f64, f64)> = rows
                .iter()
                .filter_map(|cells| {
                    Some((cells.get(2)?.parse().ok()?, cells.get(3)?.parse().ok()?))
                })
                .collect();
            crate::plot::scatter(
                &r.output_dir,
                "val_unifrac",
                &pairs,
                &format!("validation pairs, best epoch {best_epoch}"),
                ("UniFrac distance", "predicted distance"),
            )?;
        }
    }
    if task == Task::Train && classifier {
        // Columns: sample_id, predicted label, actual label.
        let rows = tsv_rows(&r.output_dir.join(aam_train::run::files::VAL_PREDICTIONS));
        if let (Some(rows), Some(labels)) = (rows, class_labels.as_ref()) {
            let pairs: Vec<(String, String)> = rows
                .iter()
                .filter_map(|cells| Some((cells.last()?.clone(), cells.get(1)?.clone())))
                .collect();
            crate::plot::confusion_matrix(
                &r.output_dir,
                labels,
                &pairs,
                &format!("validation, best epoch {best_epoch}"),
            )?;
        }
    }
    if !classifier {
        // Columns: sample_id, prediction (first output), ..., actual (the
        // target, or Faith's PD in `pretrain`).
        if let Some(rows) = tsv_rows(&r.output_dir.join(aam_train::run::files::VAL_PREDICTIONS)) {
            let pairs: Vec<(f64, f64)> = rows
                .iter()
                .filter_map(|cells| {
                    Some((cells.last()?.parse().ok()?, cells.get(1)?.parse().ok()?))
                })
                .collect();
            crate::plot::predicted_vs_true(
                &r.output_dir,
                &pairs,
                &format!("validation, best epoch {best_epoch}"),
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

/// The cells of a TSV the run wrote, header skipped (None when it wrote none).
fn tsv_rows(path: &Path) -> Option<Vec<Vec<String>>> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(
        text.lines()
            .skip(1)
            .map(|line| line.split('\t').map(str::to_string).collect())
            .collect(),
    )
}

/// The reference's files, in PyTorch's format (`aam_train::torch`):
/// `checkpoints/best_model.pt`, and `pretrained_encoder.pt` (`pretrain`)
/// or `final_model.pt` (`train`), so scripts written for the reference find
/// what they name.
fn export_torch(out_dir: &Path, task: Task, summary: &aam_train::run::FitSummary) -> Result<()> {
    let Ok(best) = read_checkpoint(&summary.best_checkpoint) else {
        return Ok(());
    };
    let checkpoints = out_dir.join("checkpoints");
    aam_train::torch::write_trainer_checkpoint(&checkpoints.join("best_model.pt"), &best)?;
    let also = match task {
        Task::Pretrain => {
            let path = out_dir.join("pretrained_encoder.pt");
            aam_train::torch::write_state_dict(&path, &best.model, "")?;
            path
        }
        Task::Train => {
            let last = read_checkpoint(&summary.last_checkpoint)?;
            let path = out_dir.join("final_model.pt");
            aam_train::torch::write_trainer_checkpoint(&path, &last)?;
            path
        }
    };
    tracing::info!(
        "PyTorch copies for the reference's scripts: {} and {}",
        checkpoints.join("best_model.pt").display(),
        also.display()
    );
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
        let exported = if is_torch_checkpoint(path) {
            aam_train::torch::read_trainer_checkpoint(path)?
        } else {
            None
        };
        let (config, tensors) = if let Some(ckpt) = exported {
            (ckpt.meta.model, ckpt.model)
        } else if path.is_dir() || is_torch_checkpoint(path) {
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
