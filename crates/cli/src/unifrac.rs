//! `aam-rs unifrac`: a UniFrac distance matrix (or Faith's PD) from a BIOM
//! table and a Newick tree, with the `aam-unifrac` library; no `ssu` needed.

use std::path::PathBuf;
use std::time::Instant;

use aam_cli::backend::GpuArg;
use aam_data::{BiomTable, IdList};
use aam_unifrac::{Method, Options, Report, Tree};
use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// What to compute (`ssu -m` names, plus Faith's PD).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum MethodArg {
    /// Presence/absence: unshared branch length over total branch length.
    Unweighted,
    /// Abundance-weighted, normalised to [0, 1].
    WeightedNormalized,
    /// Abundance-weighted, not normalised.
    WeightedUnnormalized,
    /// Generalized UniFrac with `--alpha`.
    Generalized,
    /// Faith's phylogenetic diversity of each sample (a vector, `.tsv` only).
    FaithPd,
}

/// Flags of `aam-rs unifrac`.
#[derive(Args, Debug)]
pub struct UnifracArgs {
    /// BIOM table (2.1 HDF5 or 1.0 JSON); its observation IDs are the tree's tip labels.
    #[arg(long, value_name = "BIOM")]
    table: PathBuf,
    /// Rooted Newick tree whose tips include every observation of the table.
    #[arg(long, value_name = "NEWICK")]
    tree: PathBuf,
    /// The distance (or faith_pd).
    #[arg(long, value_enum, default_value_t = MethodArg::Unweighted)]
    method: MethodArg,
    /// Generalized UniFrac's alpha, in [0, 1] (only with --method generalized; default 1).
    #[arg(long)]
    alpha: Option<f64>,
    /// Variance-adjusted UniFrac (Chang et al. 2011), as `ssu --vaw`.
    #[arg(long)]
    variance_adjusted: bool,
    /// Output: `.h5`/`.hdf5` (ssu's layout: `matrix`, `order`; read by aam-rs,
    /// the reference and QIIME 2) or `.tsv` (lsmat); faith_pd writes a `.tsv`.
    #[arg(long, value_name = "H5|TSV")]
    output: PathBuf,
    /// Write the matrix in single precision (it is computed in double).
    #[arg(long)]
    fp32: bool,
    /// Worker threads (0: every core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Compute on this GPU backend instead of the CPU's threads (a binary
    /// built with its feature; `aam-rs backends` lists them).
    #[arg(long, value_enum, value_name = "BACKEND")]
    gpu: Option<GpuArg>,
    /// Leave out observations that are not tips of the tree instead of stopping.
    #[arg(long)]
    drop_missing: bool,
    /// Leave out samples without counts instead of stopping.
    #[arg(long)]
    drop_empty: bool,
}

pub fn run(args: UnifracArgs) -> Result<()> {
    let method = match (args.method, args.alpha) {
        (MethodArg::Generalized, alpha) => Method::Generalized {
            alpha: alpha.unwrap_or(1.0),
        },
        (_, Some(_)) => bail!("--alpha applies only to --method generalized"),
        (MethodArg::Unweighted, None) => Method::Unweighted,
        (MethodArg::WeightedNormalized, None) => Method::WeightedNormalized,
        (MethodArg::WeightedUnnormalized, None) => Method::WeightedUnnormalized,
        (MethodArg::FaithPd, None) => Method::Unweighted,
    };
    if args.method == MethodArg::FaithPd && (args.variance_adjusted || args.fp32) {
        bail!("--variance-adjusted and --fp32 do not apply to --method faith_pd");
    }
    if args.gpu.is_some() && args.method == MethodArg::FaithPd {
        bail!("--gpu does not apply to --method faith_pd (a sum per sample, on the CPU)");
    }
    let gpu = args.gpu.map(|g| g.runtime("--gpu")).transpose()?;
    let options = Options {
        method,
        variance_adjusted: args.variance_adjusted,
        threads: args.threads,
        drop_missing: args.drop_missing,
        drop_empty: args.drop_empty,
    };
    let start = Instant::now();
    let table = BiomTable::read(&args.table)?;
    let tree = Tree::read(&args.tree)?;
    tracing::info!(
        "{}: {} samples x {} observations; {}: {} tips, {} nodes ({:.1} s)",
        args.table.display(),
        table.n_samples(),
        table.n_observations(),
        args.tree.display(),
        tree.n_tips(),
        tree.len(),
        start.elapsed().as_secs_f64()
    );
    if args.method == MethodArg::FaithPd {
        let (pd, report) = aam_unifrac::faith_pd(&table, &tree, &options)?;
        warn(&report);
        pd.write(&args.output)?;
        tracing::info!(
            "wrote Faith's PD of {} samples to {} ({:.1} s)",
            pd.ids.len(),
            args.output.display(),
            start.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("unifrac [{bar:30}] {pos}/{len} branches ({elapsed}<{eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut progress = |done: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    let (matrix, report) = match gpu {
        None => aam_unifrac::unifrac(&table, &tree, &options, &mut progress)?,
        Some(gpu) => aam_unifrac::unifrac_on_gpu(&table, &tree, &options, gpu, &mut progress)?,
    };
    bar.finish_and_clear();
    tracing::info!(
        "computed the distances of {} samples ({:.1} s)",
        matrix.len(),
        start.elapsed().as_secs_f64()
    );
    warn(&report);
    matrix.write(&args.output, args.fp32)?;
    tracing::info!(
        "wrote the {n} x {n} {}{} matrix ({} branches) to {} in {:.1} s",
        method.name(),
        if args.variance_adjusted {
            " (variance adjusted)"
        } else {
            ""
        },
        report.branches,
        args.output.display(),
        start.elapsed().as_secs_f64(),
        n = matrix.len(),
    );
    Ok(())
}

fn warn(report: &Report) {
    if !report.dropped_observations.is_empty() {
        tracing::warn!(
            "{} observation(s) are not tips of the tree and were left out (--drop-missing): {}",
            report.dropped_observations.len(),
            IdList::new(&report.dropped_observations)
        );
    }
    if !report.dropped_samples.is_empty() {
        tracing::warn!(
            "{} sample(s) without counts were left out (--drop-empty): {}",
            report.dropped_samples.len(),
            IdList::new(&report.dropped_samples)
        );
    }
}
