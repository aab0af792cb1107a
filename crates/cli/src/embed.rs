//! `aam-rs embed`: a checkpoint (`pretrain` or `train`) + a BIOM table →
//! one embedding per sample, for search, clustering or ordination. The
//! work is `aam_infer::Model::embed`'s, as in a service; the samples go
//! through it in chunks so that a progress bar can follow (a sample's
//! embedding does not depend on its chunk).

use std::path::{Path, PathBuf};

use aam_data::write_atomic;
use aam_infer::{Embeddings, Model, Options, SampleReads};
use aam_models::AttentionBackend;
use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use aam_cli::backend::BackendKind;

use crate::predict::{read_metadata, warn_dropped};

/// Flags of `aam-rs embed`.
#[derive(Args, Debug)]
pub struct EmbedArgs {
    /// A checkpoint of `aam-rs pretrain` or `train`, or a model folder of
    /// `aam-rs convert`.
    #[arg(long, value_name = "CHECKPOINT")]
    model: PathBuf,
    /// BIOM table of the samples to embed.
    #[arg(long, value_name = "BIOM")]
    table: PathBuf,
    /// Output: `.tsv` (sample_id, then one column per dimension) or `.npy`
    /// (an `[n, D]` float32 array; the sample IDs go to `<output>.ids.txt`,
    /// one per line, in row order).
    #[arg(long, value_name = "TSV|NPY")]
    output: PathBuf,
    /// Also write each sample's ASV embeddings to this TSV (sample_id,
    /// sequence, then one column per dimension).
    #[arg(long, value_name = "TSV")]
    asv_output: Option<PathBuf>,
    /// Metadata TSV (needed when the model uses categorical columns).
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

#[derive(Clone, Copy)]
enum Format {
    Tsv,
    Npy,
}

/// Runs `aam-rs embed`.
pub fn run(args: EmbedArgs) -> Result<()> {
    ensure!(args.batch_size > 0, "--batch-size must be ≥ 1");
    let format = match args.output.extension().and_then(|e| e.to_str()) {
        Some("tsv") | Some("txt") => Format::Tsv,
        Some("npy") => Format::Npy,
        _ => bail!(
            "--output {}: the format comes from the extension: .tsv or .npy",
            args.output.display()
        ),
    };
    let samples = aam_infer::read_table(&args.table)
        .with_context(|| format!("reading --table {}", args.table.display()))?;
    let options = Options {
        batch_size: args.batch_size,
        rarefy: !args.no_rarefy,
        seed: args.seed,
        metadata: read_metadata(args.metadata.as_deref())?,
        asv_embeddings: args.asv_output.is_some(),
        ..Options::default()
    };
    let embeddings = aam_cli::with_backend!(args.backend, |B, device| embed_on::<B>(
        &args.model,
        &samples,
        &options,
        &device
    ))?;
    warn_dropped(&embeddings.dropped, "embedding");
    match format {
        Format::Tsv => write_atomic(&args.output, sample_tsv(&embeddings).as_bytes())?,
        Format::Npy => {
            let array = ndarray::Array2::from_shape_vec(
                (embeddings.ids.len(), embeddings.dim),
                embeddings.values.clone(),
            )
            .expect("n x D values");
            let mut bytes = Vec::new();
            ndarray_npy::WriteNpyExt::write_npy(&array, &mut bytes)
                .context("encoding the .npy array")?;
            let mut ids = embeddings.ids.join("\n");
            ids.push('\n');
            write_atomic(&ids_path(&args.output), ids.as_bytes())?;
            write_atomic(&args.output, &bytes)?;
        }
    }
    if let (Some(path), Some(asvs)) = (&args.asv_output, &embeddings.asvs) {
        let mut text = String::from("sample_id\tsequence");
        header(&mut text, embeddings.dim);
        for (id, asvs) in embeddings.ids.iter().zip(asvs) {
            for asv in asvs {
                text.push_str(&format!("{id}\t{}", asv.sequence));
                row(&mut text, &asv.values);
            }
        }
        write_atomic(path, text.as_bytes())?;
    }
    tracing::info!(
        "wrote {} sample embeddings ({} dimensions) to {}",
        embeddings.ids.len(),
        embeddings.dim,
        args.output.display()
    );
    Ok(())
}

/// Where `.npy` output keeps its sample IDs: `<output>.ids.txt`.
fn ids_path(output: &Path) -> PathBuf {
    let mut name = output.as_os_str().to_owned();
    name.push(".ids.txt");
    PathBuf::from(name)
}

fn header(text: &mut String, dim: usize) {
    for k in 0..dim {
        text.push_str(&format!("\tdim_{k}"));
    }
    text.push('\n');
}

fn row(text: &mut String, values: &[f32]) {
    for v in values {
        text.push_str(&format!("\t{v}"));
    }
    text.push('\n');
}

fn sample_tsv(embeddings: &Embeddings) -> String {
    let mut text = String::from("sample_id");
    header(&mut text, embeddings.dim);
    for (i, id) in embeddings.ids.iter().enumerate() {
        text.push_str(id);
        row(&mut text, embeddings.row(i));
    }
    text
}

/// Embeds `samples` in chunks, with a progress bar on a terminal.
fn embed_on<B: AttentionBackend>(
    model: &Path,
    samples: &[SampleReads],
    options: &Options,
    device: &B::Device,
) -> Result<Embeddings> {
    let model =
        Model::<B>::load(model, device).with_context(|| format!("--model {}", model.display()))?;
    let bar =
        ProgressBar::with_draw_target(Some(samples.len() as u64), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("embedding [{bar:30}] {pos}/{len} samples ({elapsed}<{eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut all = Embeddings {
        ids: Vec::new(),
        dim: model.info().embedding_dim,
        values: Vec::new(),
        asvs: options.asv_embeddings.then(Vec::new),
        dropped: Vec::new(),
    };
    for chunk in samples.chunks(options.batch_size * 16) {
        let part = match model.embed(chunk, options) {
            Err(aam_infer::InferError::AllTooShallow { .. }) => {
                all.dropped.extend(chunk.iter().map(|s| s.id.clone()));
                bar.inc(chunk.len() as u64);
                continue;
            }
            other => other?,
        };
        all.ids.extend(part.ids);
        all.values.extend(part.values);
        all.dropped.extend(part.dropped);
        if let (Some(all), Some(part)) = (all.asvs.as_mut(), part.asvs) {
            all.extend(part);
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    if all.ids.is_empty() {
        bail!(
            "no sample of the table reaches the training rarefaction depth of {} reads (use --no-rarefy to embed them as they are)",
            model.info().rarefy_depth.unwrap_or(0)
        );
    }
    Ok(all)
}
