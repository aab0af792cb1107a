//! `aam-rs inspect`: summarise and check a run's inputs before a long job.
//!
//! Reads the table (and the matrix and metadata when given), prints what a
//! `pretrain`/`train` run with the same flags would see (a report, or one
//! JSON object with `--json`), and fails, listing the reasons, when such a
//! run would stop before its first epoch. The statistics and checks are
//! `aam_data::summarize`; this file reads the files and prints.

use std::fmt::Write as _;
use std::path::PathBuf;

use aam_data::summary::{CheckedSamples, Coverage, Stats, Summary, TargetKind};
use aam_data::{summarize, BiomTable, DistanceMatrix, MatrixIds, Metadata, SummaryOptions};
use anyhow::{bail, Context, Result};
use clap::Args;

/// Flags of `aam-rs inspect`; the shared ones mean what they mean for
/// `pretrain` and `train`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// BIOM table (HDF5 2.x or JSON 1.0); observation IDs are the ASV sequences.
    #[arg(long, value_name = "BIOM")]
    table: PathBuf,
    /// UniFrac distances (.h5 from ssu, .npy/.npz with a sample-ID sidecar, .csv/.tsv).
    #[arg(long, value_name = "FILE")]
    unifrac_matrix: Option<PathBuf>,
    /// Metadata TSV (sample IDs in the first column).
    #[arg(long, value_name = "TSV")]
    metadata: Option<PathBuf>,
    /// The column `train` would predict.
    #[arg(long, requires = "metadata")]
    metadata_column: Option<String>,
    /// The column holds class labels (`train --classifier`), not numbers.
    #[arg(long, requires = "metadata_column")]
    classifier: bool,
    /// Reads per sample after rarefaction.
    #[arg(long, default_value_t = 5000)]
    rarefy_depth: u64,
    /// Seed of the rarefaction (the runs' --seed).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Bases kept per ASV.
    #[arg(long, default_value_t = 150)]
    max_bp: usize,
    /// Check as a run with --drop-missing would: samples missing from the
    /// matrix or metadata are dropped instead of stopping the run.
    #[arg(long)]
    drop_missing: bool,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    json: bool,
}

/// Runs `aam-rs inspect`.
pub fn run(args: InspectArgs) -> Result<()> {
    let table = BiomTable::read(&args.table)
        .with_context(|| format!("reading --table {}", args.table.display()))?;
    let mut unreadable = Vec::new();
    let matrix = match &args.unifrac_matrix {
        None => None,
        Some(path) => match DistanceMatrix::read(path, &MatrixIds::Auto) {
            Ok(m) => Some(m),
            Err(e) => {
                unreadable.push(format!("reading --unifrac-matrix {}: {e}", path.display()));
                None
            }
        },
    };
    let metadata = match &args.metadata {
        None => None,
        Some(path) => match Metadata::read(path) {
            Ok(m) => Some(m),
            Err(e) => {
                unreadable.push(format!("reading --metadata {}: {e}", path.display()));
                None
            }
        },
    };
    let options = SummaryOptions {
        rarefy_depth: args.rarefy_depth,
        seed: args.seed,
        max_bp: args.max_bp,
        target_column: args.metadata_column.clone(),
        classifier: args.classifier,
        drop_missing: args.drop_missing,
    };
    let mut summary = summarize(&table, matrix.as_ref(), metadata.as_ref(), &options);
    for problem in unreadable {
        summary.add_problem(problem);
    }
    if args.unifrac_matrix.is_none() {
        summary.add_warning("no --unifrac-matrix: `pretrain` and `train` need one, so its coverage of the samples is not checked");
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&summary).context("writing the summary as JSON")?
        );
    } else {
        print!("{}", report(&summary));
    }
    if !summary.ok {
        let mut reasons = format!(
            "a pretrain/train run on these inputs would not start ({} problem(s)):",
            summary.problems.len()
        );
        for p in &summary.problems {
            reasons.push_str("\n  - ");
            reasons.push_str(p);
        }
        bail!(reasons);
    }
    Ok(())
}

/// A number as short as it reads: integers without decimals, others to 4 significant places after the point.
fn num(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{x:.0}")
    } else {
        let s = format!("{x:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn stats(s: &Option<Stats>) -> String {
    match s {
        Some(s) => format!(
            "min {}, median {}, max {}",
            num(s.min),
            num(s.median),
            num(s.max)
        ),
        None => "-".into(),
    }
}

fn coverage(c: &Coverage, checked: usize, of_what: &str) -> String {
    let mut line = format!(
        "{} ({} samples): has {} of the {checked} {of_what}",
        c.path, c.samples, c.covered
    );
    if c.missing > 0 {
        let _ = write!(
            line,
            "; missing {}: {}",
            c.missing,
            c.missing_first.join(", ")
        );
        if c.missing > c.missing_first.len() {
            let _ = write!(line, " (and {} more)", c.missing - c.missing_first.len());
        }
    }
    line
}

/// The readable report.
fn report(s: &Summary) -> String {
    let mut out = String::new();
    let t = &s.table;
    let _ = writeln!(out, "table        {}", t.path);
    let _ = writeln!(
        out,
        "             {} samples, {} ASVs, {} non-zero counts{}",
        t.samples,
        t.asvs,
        t.nonzero,
        if t.integer_counts {
            ""
        } else {
            " (some counts are not whole numbers)"
        }
    );
    let _ = writeln!(
        out,
        "reads/sample {}; {} below --rarefy-depth {}",
        stats(&t.depth),
        t.below_depth,
        s.rarefaction.depth
    );
    let _ = writeln!(out, "ASVs/sample  {}", stats(&t.asvs_per_sample));
    let q = &s.sequences;
    let _ = writeln!(
        out,
        "ASV length   {} nt; {} longer than --max-bp {}",
        stats(&q.length),
        q.longer_than_max_bp,
        q.max_bp
    );
    let _ = writeln!(
        out,
        "non-ACGT     {} ASVs contain some, {} characters in all",
        q.asvs_with_non_acgt, q.non_acgt_bases
    );
    let r = &s.rarefaction;
    if r.done {
        let _ = writeln!(
            out,
            "rarefied     to {} reads (seed {}): {} samples, {} ASVs; ASVs/sample {}",
            r.depth,
            r.seed,
            r.samples,
            r.asvs,
            stats(&r.asvs_per_sample)
        );
    } else {
        let _ = writeln!(
            out,
            "rarefied     to {} reads: failed (see the problems)",
            r.depth
        );
    }
    let of_what = match s.checked_samples {
        CheckedSamples::Rarefied => "samples kept by rarefaction",
        CheckedSamples::Table => "table samples",
    };
    if let Some(m) = &s.matrix {
        let _ = writeln!(out, "matrix       {}", coverage(m, s.checked, of_what));
    }
    if let Some(m) = &s.metadata {
        let _ = writeln!(out, "metadata     {}", coverage(m, s.checked, of_what));
    }
    if let Some(target) = &s.target {
        let kind = match target.kind {
            TargetKind::Numeric => "numeric",
            TargetKind::Categorical => "categorical",
        };
        let _ = writeln!(
            out,
            "target       {:?} ({kind}): {} with a value, {} without",
            target.column, target.with_value, target.missing
        );
        if let Some(range) = &target.range {
            let _ = writeln!(
                out,
                "             min {}, max {}, mean {}",
                num(range.min),
                num(range.max),
                num(range.mean)
            );
        }
        if let Some(distinct) = target.distinct {
            let listed: Vec<String> = target
                .categories
                .iter()
                .map(|c| format!("{} ({})", c.value, c.count))
                .collect();
            let more = distinct - target.categories.len();
            let _ = writeln!(
                out,
                "             {distinct} distinct: {}{}",
                listed.join(", "),
                if more > 0 {
                    format!(" (and {more} more)")
                } else {
                    String::new()
                }
            );
        }
    }
    let _ = writeln!(out, "usable       {} samples", s.usable_samples);
    for w in &s.warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    for p in &s.problems {
        let _ = writeln!(out, "problem: {p}");
    }
    if s.ok {
        let _ = writeln!(out, "OK: a pretrain/train run on these inputs would start");
    } else {
        let _ = writeln!(
            out,
            "NOT OK: {} problem(s); a pretrain/train run on these inputs would stop",
            s.problems.len()
        );
    }
    out
}
