//! Data-pipeline benchmark: load + rarefy + tokenise + batch a real study, the
//! steps every `pretrain` run starts with, timed phase by phase.
//!
//! `benches/data_pipeline.sh` runs this beside `benches/data_pipeline.py` (the
//! same steps with biom-format + numpy, as the reference does) in one call and
//! prints the ratio. Prints one JSON line per repetition.
//!
//! ```text
//! data-bench <table.biom> <unifrac.h5> [--depth 1000] [--batch 8] [--token-limit 1024]
//!            [--max-bp 150] [--workers 1] [--reps 5] [--seed 42]
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;

use aam_data::{
    BatchConfig, BatchLoader, BiomTable, Dataset, DistanceMatrix, MatrixIds, MissingPolicy,
    Transforms,
};

/// Times the data pipeline of a `pretrain` run on one study.
#[derive(Parser)]
struct Args {
    /// BIOM table.
    table: PathBuf,
    /// UniFrac matrix (`ssu` .h5 or any format aam-data reads).
    matrix: PathBuf,
    #[arg(long, default_value_t = 1000)]
    depth: u64,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    #[arg(long, default_value_t = 1024)]
    token_limit: usize,
    #[arg(long, default_value_t = 150)]
    max_bp: usize,
    /// Batch worker threads (1 compares with one Python process).
    #[arg(long, default_value_t = 1)]
    workers: usize,
    #[arg(long, default_value_t = 5)]
    reps: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

fn main() {
    let args = Args::parse();
    for rep in 0..args.reps {
        if let Err(e) = run(&args, rep) {
            eprintln!("data-bench: {e}");
            std::process::exit(1);
        }
    }
}

/// One full pass; every phase timed on its own.
fn run(a: &Args, rep: usize) -> Result<(), Box<dyn std::error::Error>> {
    let total = Instant::now();
    let t = Instant::now();
    let table = BiomTable::read(&a.table)?;
    let load_table = t.elapsed().as_secs_f64();

    let t = Instant::now();
    let matrix = DistanceMatrix::read(&a.matrix, &MatrixIds::Auto)?;
    let load_matrix = t.elapsed().as_secs_f64();

    let t = Instant::now();
    let rarefied = table.rarefy(a.depth, a.seed)?;
    let rarefy = t.elapsed().as_secs_f64();

    // Tokenise every kept ASV once (the reference's sequence cache) and match
    // the table's samples to the matrix rows by ID.
    let t = Instant::now();
    let dataset = Dataset::builder(&rarefied.table)
        .max_bp(a.max_bp)
        .unifrac(Arc::new(matrix), MissingPolicy::Error)
        .build()?;
    let tokenise = t.elapsed().as_secs_f64();

    // One training epoch of batches: shuffled, last partial batch dropped,
    // tokens padded to [B, token_limit, max_bp + 1], counts, UniFrac block.
    let t = Instant::now();
    let dataset = Arc::new(dataset);
    let positions: Vec<usize> = (0..dataset.len()).collect();
    let mut config = BatchConfig::train(a.batch, a.token_limit, a.seed);
    config.workers = a.workers;
    config.prefetch = 2 * a.workers;
    let loader = BatchLoader::new(
        dataset.clone(),
        positions,
        Arc::new(Transforms::default()),
        config,
    )?;
    let (mut batches, mut filled_slots, mut count_sum, mut unifrac_sum) =
        (0usize, 0usize, 0f64, 0f64);
    let mut checks = 0f64;
    for batch in loader.epoch(0) {
        let batch = batch?;
        let t = Instant::now();
        batches += 1;
        // Filled ASV slots: the START token opens every one.
        filled_slots += batch
            .tokens
            .iter()
            .step_by(batch.seq_len)
            .filter(|&&x| x != 0)
            .count();
        count_sum += batch.counts.iter().map(|&c| c as f64).sum::<f64>();
        unifrac_sum += batch
            .unifrac
            .as_ref()
            .map_or(0.0, |u| u.iter().map(|&d| d as f64).sum());
        checks += t.elapsed().as_secs_f64();
    }
    let batch = t.elapsed().as_secs_f64();
    let line = serde_json::json!({
        "impl": "aam-rs",
        "rep": rep,
        "workers": a.workers,
        "samples": dataset.len(),
        "asvs": dataset.asv_ids().len(),
        "dropped_by_rarefaction": rarefied.dropped.len(),
        "batches": batches,
        "filled_slots": filled_slots,
        "count_sum": count_sum,
        "unifrac_sum": unifrac_sum,
        "load_table_s": load_table,
        "load_matrix_s": load_matrix,
        "rarefy_s": rarefy,
        "tokenise_s": tokenise,
        "batch_epoch_s": batch,
        "checksum_s": checks,
        "total_s": total.elapsed().as_secs_f64(),
    });
    println!("{line}");
    Ok(())
}
