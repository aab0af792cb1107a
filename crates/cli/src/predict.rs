//! `aam-rs predict`: a `train` checkpoint + a BIOM table → a TSV of
//! predictions in the target's original units (reference §5.3, with its
//! §8 items 1–2 fixed: the architecture, normalisation statistics, class
//! labels and rarefaction depth all come from the checkpoint), and its
//! multi-pass mode (`--prediction-passes`, `--output-variance`). The work is
//! `aam_infer::Model::predict`'s, as in a service.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use aam_data::{write_atomic, AsvSampling, IdList, Metadata, SampleReads};
use aam_infer::{Model, Options, Prediction, Predictions};
use aam_models::AttentionBackend;
use anyhow::{ensure, Context, Result};
use clap::Args;

use aam_cli::args::{serde_value, DeviceKind};
use aam_cli::backend::BackendKind;

/// Flags of `aam-rs predict`.
#[derive(Args, Debug)]
pub struct PredictArgs {
    /// A checkpoint written by `aam-rs train` (checkpoints/best.safetensors),
    /// a reference checkpoint (`.pt`) or a model folder of `aam-rs convert`
    /// (predictions of these two in the model's normalised units).
    #[arg(long, value_name = "CHECKPOINT")]
    model: PathBuf,
    /// BIOM table of the samples to predict.
    #[arg(long, value_name = "BIOM")]
    table: PathBuf,
    /// Output TSV: sample_id, prediction (or prediction_0..k).
    #[arg(long, value_name = "TSV")]
    output: PathBuf,
    /// Metadata TSV (needed when the model uses categorical columns or
    /// per-category normalisation).
    #[arg(long, value_name = "TSV")]
    metadata: Option<PathBuf>,
    /// Use the table's counts as they are instead of rarefying to the
    /// training depth.
    #[arg(long)]
    no_rarefy: bool,
    /// Seed of the rarefaction.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Samples per batch.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Compute backend.
    #[arg(long, value_enum, default_value_t = BackendKind::default())]
    backend: BackendKind,
    /// The reference's device choice: `cpu` is --backend ndarray, `cuda` the
    /// GPU backend built in.
    #[arg(long, value_enum, conflicts_with = "backend")]
    device: Option<DeviceKind>,
    /// Which ASVs fill the slots of a sample with more than the model's
    /// slots: first, abundance or random (default: the training rule, with
    /// random read as abundance).
    #[arg(long, value_parser = serde_value::<AsvSampling>)]
    asv_sampling: Option<AsvSampling>,
    /// Average each sample's prediction over this many passes, each with its
    /// own random choice of ASVs (with --asv-sampling random; otherwise the
    /// passes would agree, and one is run).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    prediction_passes: u64,
    /// Add the population standard deviation over the passes
    /// (`prediction_std`, one per prediction column).
    #[arg(long)]
    output_variance: bool,
    /// Reference: turn off its token cache. Each ASV is tokenised once when
    /// the table is read; nothing changes.
    #[arg(long)]
    no_sequence_cache: bool,
}

/// Runs `aam-rs predict`.
pub fn run(mut args: PredictArgs) -> Result<()> {
    ensure!(args.batch_size > 0, "--batch-size must be ≥ 1");
    if let Some(device) = args.device {
        args.backend = device.backend()?;
    }
    if args.no_sequence_cache {
        tracing::info!("--no-sequence-cache: each ASV is tokenised once when the table is read; there is no cache to turn off");
    }
    let mut passes = args.prediction_passes as usize;
    if passes > 1 && args.asv_sampling != Some(AsvSampling::Random) {
        tracing::warn!(
            "--prediction-passes {passes}: without --asv-sampling random every pass sees the same ASVs; running one"
        );
        passes = 1;
    }
    let samples = aam_infer::read_table(&args.table)
        .with_context(|| format!("reading --table {}", args.table.display()))?;
    let options = Options {
        batch_size: args.batch_size,
        rarefy: !args.no_rarefy,
        seed: args.seed,
        metadata: read_metadata(args.metadata.as_deref())?,
        asv_sampling: args.asv_sampling,
        passes,
        ..Options::default()
    };
    let predictions = aam_cli::with_backend!(args.backend, |B, device| predict_on::<B>(
        &args.model,
        &samples,
        &options,
        &device
    ))?;
    warn_dropped(&predictions.dropped, "prediction");
    let width = match predictions.values.first() {
        Some(Prediction::Values(v)) => v.len(),
        Some(Prediction::Quantiles(q)) => q.iter().map(Vec::len).sum(),
        _ => 1,
    };
    let mut text = String::from("sample_id\t");
    text.push_str(&if width == 1 {
        "prediction".to_string()
    } else {
        (0..width)
            .map(|k| format!("prediction_{k}"))
            .collect::<Vec<_>>()
            .join("\t")
    });
    if args.output_variance {
        text.push('\t');
        text.push_str(&if width == 1 {
            "prediction_std".to_string()
        } else {
            (0..width)
                .map(|k| format!("prediction_std_{k}"))
                .collect::<Vec<_>>()
                .join("\t")
        });
    }
    text.push('\n');
    for (i, (id, prediction)) in predictions.ids.iter().zip(&predictions.values).enumerate() {
        let mut cells: Vec<String> = match prediction {
            Prediction::Values(v) => v.iter().map(|x| x.to_string()).collect(),
            Prediction::Quantiles(q) => q.iter().flatten().map(|x| x.to_string()).collect(),
            Prediction::Class { label, .. } => vec![label.clone()],
        };
        if args.output_variance {
            let std = predictions.std.as_ref().map(|s| &s[i]);
            let spread: Vec<f64> = match prediction {
                // A class's spread: that of the chosen class's probability.
                Prediction::Class { probabilities, .. } => {
                    let class = probabilities
                        .iter()
                        .enumerate()
                        .max_by(|a, b| a.1.total_cmp(b.1))
                        .map_or(0, |(c, _)| c);
                    vec![std.map_or(0.0, |s| s[class])]
                }
                _ => std.cloned().unwrap_or_else(|| vec![0.0; width]),
            };
            cells.extend(spread.iter().map(|x| x.to_string()));
        }
        text.push_str(&format!("{id}\t{}\n", cells.join("\t")));
    }
    write_atomic(&args.output, text.as_bytes())?;
    tracing::info!(
        "wrote {} predictions to {}",
        predictions.ids.len(),
        args.output.display()
    );
    Ok(())
}

/// `--metadata`, read.
pub fn read_metadata(path: Option<&Path>) -> Result<Option<Arc<Metadata>>> {
    path.map(|p| {
        Metadata::read(p)
            .map(Arc::new)
            .with_context(|| format!("reading --metadata {}", p.display()))
    })
    .transpose()
}

/// Logs the samples left out for having fewer reads than the training depth.
pub fn warn_dropped(dropped: &[String], what: &str) {
    if !dropped.is_empty() {
        tracing::warn!(
            "{} sample(s) have fewer reads than the training depth and get no {what}: {} (use --no-rarefy to keep them)",
            dropped.len(),
            IdList::new(dropped)
        );
    }
}

fn predict_on<B: AttentionBackend>(
    model: &Path,
    samples: &[SampleReads],
    options: &Options,
    device: &B::Device,
) -> Result<Predictions> {
    let model =
        Model::<B>::load(model, device).with_context(|| format!("--model {}", model.display()))?;
    model.predict(samples, options).map_err(|e| match e {
        aam_infer::InferError::MetadataRequired { columns } => {
            anyhow::anyhow!(
                "--metadata is required: the model uses categorical columns {columns:?}"
            )
        }
        e => e.into(),
    })
}
