//! `aam-rs predict`: a `train` checkpoint + a BIOM table → a TSV of
//! predictions in the target's original units (reference §5.3, with its
//! §8 items 1–2 fixed: the architecture, normalisation statistics, class
//! labels and rarefaction depth all come from the checkpoint).

use std::path::PathBuf;
use std::sync::Arc;

use aam_data::write_atomic;
use aam_data::{BatchConfig, BatchLoader, BiomTable, Dataset, Metadata, Transforms};
use aam_models::model::ModelConfig;
use aam_models::sequence_predictor::TargetPrediction;
use aam_models::AttentionBackend;
use aam_train::checkpoint::{read_checkpoint, Checkpoint};
use aam_train::run::{batch_tensors, predict_batch, Slots};
use anyhow::{bail, ensure, Context, Result};
use clap::Args;

use aam_cli::backend::BackendKind;

/// Flags of `aam-rs predict`.
#[derive(Args, Debug)]
pub struct PredictArgs {
    /// A checkpoint written by `aam-rs train` (checkpoints/best.safetensors).
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
}

/// Runs `aam-rs predict`.
pub fn run(args: PredictArgs) -> Result<()> {
    ensure!(args.batch_size > 0, "--batch-size must be ≥ 1");
    let ckpt = read_checkpoint(&args.model)
        .with_context(|| format!("--model {}", args.model.display()))?;
    let ModelConfig::SequencePredictor(config) = &ckpt.meta.model else {
        bail!("--model {}: a `pretrain` checkpoint has no prediction head; train one with `aam-rs train --pretrained-encoder`", args.model.display());
    };
    let classifier = config.is_classifier;
    let table = BiomTable::read(&args.table)
        .with_context(|| format!("reading --table {}", args.table.display()))?;
    let table = match (ckpt.meta.data.rarefy_depth, args.no_rarefy) {
        (Some(depth), false) => {
            let r = table.rarefy(depth as u64, args.seed).with_context(|| {
                format!(
                    "rarefying --table {} to the training depth {depth} (or pass --no-rarefy)",
                    args.table.display()
                )
            })?;
            if !r.dropped.is_empty() {
                tracing::warn!(
                    "{} sample(s) have fewer than {depth} reads (the training depth) and get no prediction: {} (use --no-rarefy to keep them)",
                    r.dropped.len(),
                    aam_data::IdList::new(&r.dropped)
                );
            }
            r.table
        }
        _ => table,
    };
    let transforms = &ckpt.meta.data.transforms;
    let needs_metadata = transforms.categorical.is_some()
        || transforms
            .target
            .as_ref()
            .is_some_and(|t| t.category.is_some());
    let mut builder = Dataset::builder(&table).max_bp(ckpt.meta.data.max_bp);
    match &args.metadata {
        Some(path) => {
            let meta = Metadata::read(path)
                .with_context(|| format!("reading --metadata {}", path.display()))?;
            builder = builder.metadata(Arc::new(meta));
        }
        None if needs_metadata => bail!(
            "--metadata is required: the model uses categorical columns {:?}",
            transforms
                .categorical
                .as_ref()
                .map(|c| c.column_names().to_vec())
                .unwrap_or_default()
        ),
        None => {}
    }
    let dataset = Arc::new(builder.build().context("preparing the table")?);
    // Targets are not read at prediction time: no target transform on batches.
    let batch_transforms = Arc::new(Transforms {
        target: None,
        ..transforms.clone()
    });
    let mut cfg = BatchConfig::validation(args.batch_size, ckpt.meta.run.token_limit, args.seed);
    cfg.require_even = false;
    cfg.asv_sampling = ckpt.meta.run.asv_sampling;
    let loader = BatchLoader::new(
        dataset.clone(),
        (0..dataset.len()).collect(),
        batch_transforms,
        cfg,
    )?;
    let rows = aam_cli::with_backend!(args.backend, |B, device| predict_on::<B>(
        &ckpt, &loader, &dataset, classifier, &device
    ))?;
    let width = rows.first().map_or(1, |r| r.1.len());
    let mut text = String::from("sample_id\t");
    text.push_str(&if width == 1 {
        "prediction".to_string()
    } else {
        (0..width)
            .map(|k| format!("prediction_{k}"))
            .collect::<Vec<_>>()
            .join("\t")
    });
    text.push('\n');
    for (id, values) in &rows {
        text.push_str(&format!("{id}\t{}\n", values.join("\t")));
    }
    write_atomic(&args.output, text.as_bytes())?;
    tracing::info!(
        "wrote {} predictions to {}",
        rows.len(),
        args.output.display()
    );
    Ok(())
}

fn predict_on<B: AttentionBackend>(
    ckpt: &Checkpoint,
    loader: &BatchLoader,
    dataset: &Dataset,
    classifier: bool,
    device: &B::Device,
) -> Result<Vec<(String, Vec<String>)>> {
    let model = ckpt.model::<B>(device)?;
    let info = &ckpt.meta.data;
    let key_columns: Vec<usize> = match (
        info.transforms
            .target
            .as_ref()
            .and_then(|t| t.category.as_ref()),
        dataset.metadata(),
    ) {
        (Some(cat), Some((meta, _))) => cat
            .columns
            .iter()
            .map(|c| meta.column(c))
            .collect::<Result<_, _>>()?,
        _ => Vec::new(),
    };
    let slots = Slots::for_model(&ckpt.meta.model, ckpt.meta.run.all_slots);
    let mut rows = Vec::with_capacity(dataset.len());
    for batch in loader.epoch(0) {
        let batch = batch?;
        let (input, _) = batch_tensors::<B>(&batch, device, classifier, slots);
        let b = batch.batch_size();
        let predictions = predict_batch(&model, input, false);
        let (values, width) = match predictions
            .target
            .context("the model returned no target prediction")?
        {
            TargetPrediction::Point(p) => {
                let w = p.dims()[1];
                (
                    p.into_data().convert::<f32>().to_vec::<f32>().expect("f32"),
                    w,
                )
            }
            TargetPrediction::Quantiles(p) => {
                let [_, out, q] = p.dims();
                (
                    p.reshape([b, out * q])
                        .into_data()
                        .convert::<f32>()
                        .to_vec::<f32>()
                        .expect("f32"),
                    out * q,
                )
            }
        };
        for (i, &pos) in batch.positions.iter().enumerate() {
            let row = &values[i * width..(i + 1) * width];
            let out: Vec<String> = if classifier {
                let c = row
                    .iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map_or(0, |(c, _)| c);
                vec![info
                    .class_labels
                    .as_ref()
                    .and_then(|l| l.get(c).cloned())
                    .unwrap_or_else(|| c.to_string())]
            } else {
                let key = dataset
                    .metadata()
                    .filter(|_| !key_columns.is_empty())
                    .and_then(|(meta, rows)| rows[pos].map(|r| meta.category_key(r, &key_columns)));
                row.iter()
                    .map(|&x| match &info.transforms.target {
                        Some(n) => n.denormalize(x as f64, key.as_deref()),
                        None => x as f64,
                    })
                    .map(|v| format!("{v}"))
                    .collect()
            };
            rows.push((batch.sample_ids[i].clone(), out));
        }
    }
    Ok(rows)
}
