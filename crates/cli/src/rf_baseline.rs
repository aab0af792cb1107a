//! `aam-rs rf-baseline`: the reference's random-forest baseline (§5.4) on
//! a run's train/validation split, through `aam-baseline`: fits on the
//! training samples' raw counts, predicts the validation samples, prints
//! R², MAE and RMSE, and writes `sample_id, actual, predicted` and a
//! scatter plot beside it.

use std::path::{Path, PathBuf};

use aam_baseline::{Features, Forest, ForestConfig, MaxFeatures, Metrics};
use aam_data::{write_atomic, BiomTable, IdList, Metadata};
use anyhow::{ensure, Context, Result};
use clap::Args;

/// Flags of `aam-rs rf-baseline` (the reference's).
#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct RfBaselineArgs {
    /// BIOM table; its raw (unrarefied) counts are the features.
    #[arg(long, value_name = "BIOM")]
    table: PathBuf,
    /// Metadata TSV (a `sample_id` or `#SampleID` column).
    #[arg(long, value_name = "TSV")]
    metadata: PathBuf,
    /// The numeric column to predict.
    #[arg(long)]
    metadata_column: String,
    /// Training sample IDs, one per line (`train_samples.txt` of a run).
    #[arg(long, value_name = "TXT")]
    train_samples: PathBuf,
    /// Validation sample IDs, one per line (`val_samples.txt` of a run).
    #[arg(long, value_name = "TXT")]
    val_samples: PathBuf,
    /// Output TSV: sample_id, actual, predicted (and a .png of the same stem).
    #[arg(long, value_name = "TSV")]
    output: PathBuf,
    /// Trees.
    #[arg(long, default_value_t = 500)]
    n_estimators: usize,
    /// Features drawn per split: sqrt, log2, all, a count, or a fraction in (0, 1].
    #[arg(long, default_value = "sqrt")]
    max_features: MaxFeatures,
    /// Seed of the bootstrap samples and feature draws.
    #[arg(long, default_value_t = 42)]
    random_seed: u64,
    /// Threads; -1: every core.
    #[arg(long, default_value_t = -1)]
    n_jobs: i64,
}

fn read_ids(path: &Path, flag: &str) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --{flag} {}", path.display()))?;
    let ids = aam_baseline::read_ids(&text)
        .map_err(|e| anyhow::anyhow!("--{flag} {}: {e}", path.display()))?;
    ensure!(
        !ids.is_empty(),
        "--{flag} {}: no sample IDs",
        path.display()
    );
    Ok(ids)
}

/// Runs `aam-rs rf-baseline`.
pub fn run(args: RfBaselineArgs) -> Result<()> {
    ensure!(
        args.n_jobs == -1 || args.n_jobs >= 1,
        "--n-jobs {}: give a number of threads ≥ 1, or -1 for every core",
        args.n_jobs
    );
    let table = BiomTable::read(&args.table)
        .with_context(|| format!("reading --table {}", args.table.display()))?;
    let metadata = Metadata::read(&args.metadata)
        .with_context(|| format!("reading --metadata {}", args.metadata.display()))?;
    let target = metadata.numeric(&args.metadata_column)?;
    let (train_ids, val_ids) = (
        read_ids(&args.train_samples, "train-samples")?,
        read_ids(&args.val_samples, "val-samples")?,
    );
    let (train, validation, missing) = Features::from_table(&table, &train_ids, &val_ids);
    if !missing.is_empty() {
        tracing::warn!(
            "{} listed sample(s) are not in --table and are left out: {}",
            missing.len(),
            IdList::new(&missing)
        );
    }
    // Samples without a value of the column are left out, with a warning.
    let values = |f: &Features| -> (Vec<bool>, Vec<f64>, Vec<String>) {
        let mut keep = Vec::new();
        let mut y = Vec::new();
        let mut without = Vec::new();
        for id in &f.ids {
            match metadata.row(id).and_then(|r| target[r]) {
                Some(v) => {
                    keep.push(true);
                    y.push(v);
                }
                None => {
                    keep.push(false);
                    without.push(id.clone());
                }
            }
        }
        (keep, y, without)
    };
    let (keep_train, y_train, without_train) = values(&train);
    let (keep_val, y_val, without_val) = values(&validation);
    let without: Vec<String> = without_train.into_iter().chain(without_val).collect();
    if !without.is_empty() {
        tracing::warn!(
            "{} sample(s) have no {} value in --metadata and are left out: {}",
            without.len(),
            args.metadata_column,
            IdList::new(&without)
        );
    }
    let (train, validation) = (train.select(&keep_train), validation.select(&keep_val));
    ensure!(
        !train.is_empty(),
        "no training sample of --train-samples is in --table with a {} value",
        args.metadata_column
    );
    ensure!(
        !validation.is_empty(),
        "no validation sample of --val-samples is in --table with a {} value",
        args.metadata_column
    );
    let config = ForestConfig {
        n_estimators: args.n_estimators,
        max_features: args.max_features,
        seed: args.random_seed,
        threads: (args.n_jobs > 0).then_some(args.n_jobs as usize),
    };
    tracing::info!(
        "random forest: {} trees, {} of {} ASVs per split, on {} training samples; predicting {} validation samples",
        config.n_estimators,
        config.max_features.of(train.width()),
        train.width(),
        train.len(),
        validation.len()
    );
    let started = std::time::Instant::now();
    let forest = Forest::fit(&train, &y_train, &config)?;
    let predicted = forest.predict(&validation);
    tracing::info!(
        "fitted and predicted in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let m = Metrics::of(&y_val, &predicted);
    println!("R²: {:.3}", m.r2);
    println!("MAE: {:.3}", m.mae);
    println!("RMSE: {:.3}", m.rmse);
    let mut text = String::from("sample_id\tactual\tpredicted\n");
    for ((id, a), p) in validation.ids.iter().zip(&y_val).zip(&predicted) {
        text.push_str(&format!("{id}\t{a}\t{p}\n"));
    }
    if let Some(dir) = args.output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the folder of --output {}", dir.display()))?;
    }
    write_atomic(&args.output, text.as_bytes())?;
    let png = args.output.with_extension("png");
    let pairs: Vec<(f64, f64)> = y_val.iter().copied().zip(predicted).collect();
    crate::plot::scatter_file(
        &png,
        &pairs,
        &format!(
            "random forest, {}: R² {:.3}, MAE {:.3}",
            args.metadata_column, m.r2, m.mae
        ),
        ("actual", "predicted"),
    )?;
    tracing::info!("wrote {} and {}", args.output.display(), png.display());
    Ok(())
}
