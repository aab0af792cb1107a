//! Helpers of `benches/unifrac.sh`, which times `aam-rs unifrac` beside `ssu`:
//!
//! - `unifrac-bench synth --table oral_2550.biom --samples 20000 --output
//!   synth.biom`: a synthetic BIOM table of any size from a real one, for
//!   timing UniFrac at scale on a real tree: each new sample is the sum of two
//!   real samples drawn at random (seeded), so it keeps the real ASVs, clades
//!   and sparsity.
//! - `unifrac-bench compare a.h5 b.h5`: the largest absolute difference of
//!   two distance matrices in `ssu`'s HDF5 layout (in double precision),
//!   matched by sample ID.
//! - `unifrac-bench shear --table T --tree N --output O`: the tree sheared to
//!   the table's observations (how `crates/data/demo/tree.nwk` was made).

use std::path::PathBuf;

use aam_data::BiomTable;
use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a synthetic table.
    Synth(Args),
    /// Print max |a - b| over the samples of `a`.
    Compare { a: PathBuf, b: PathBuf },
    /// Write `tree` sheared to the observations of `table` (the demo's tree.nwk).
    Shear {
        #[arg(long)]
        table: PathBuf,
        #[arg(long)]
        tree: PathBuf,
        #[arg(long)]
        output: PathBuf,
    },
}

#[derive(clap::Args)]
struct Args {
    /// The real table to draw from.
    #[arg(long)]
    table: PathBuf,
    /// Samples of the synthetic table.
    #[arg(long)]
    samples: usize,
    /// Output BIOM 2.1 (HDF5).
    #[arg(long)]
    output: PathBuf,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

/// SplitMix64: a small, seeded generator (quality is not the point here).
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    match Cli::parse().command {
        Command::Synth(args) => synth(args),
        Command::Shear {
            table,
            tree,
            output,
        } => shear(&table, &tree, &output),
        Command::Compare { a, b } => {
            let (a, b) = (read_h5(&a)?, read_h5(&b)?);
            let position: std::collections::HashMap<&str, usize> =
                b.0.iter()
                    .enumerate()
                    .map(|(i, id)| (id.as_str(), i))
                    .collect();
            let at: Vec<usize> =
                a.0.iter()
                    .map(|id| {
                        position
                            .get(id.as_str())
                            .copied()
                            .ok_or(format!("{id} is missing from the second matrix"))
                    })
                    .collect::<Result<_, _>>()?;
            let (n, m) = (a.0.len(), b.0.len());
            let mut worst = 0.0f64;
            for i in 0..n {
                for j in 0..n {
                    worst = worst.max((a.1[i * n + j] - b.1[at[i] * m + at[j]]).abs());
                }
            }
            println!("{worst:e}");
            Ok(())
        }
    }
}

/// IDs and values (widened to f64) of a matrix in `ssu`'s HDF5 layout.
fn read_h5(path: &std::path::Path) -> Result<(Vec<String>, Vec<f64>), Box<dyn std::error::Error>> {
    let file = hdf5_pure::File::from_bytes(std::fs::read(path)?)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let ids = file
        .dataset("order")
        .and_then(|d| d.read_string())
        .map_err(|e| format!("{}: order: {e}", path.display()))?;
    let values = file
        .dataset("matrix")
        .and_then(|d| d.read_f64())
        .map_err(|e| format!("{}: matrix: {e}", path.display()))?;
    Ok((ids, values))
}

fn shear(
    table: &PathBuf,
    tree: &PathBuf,
    output: &PathBuf,
) -> Result<(), Box<dyn std::error::Error>> {
    let table = BiomTable::read(table)?;
    let ids: std::collections::HashSet<&str> =
        table.observation_ids().iter().map(String::as_str).collect();
    let tree = aam_unifrac::Tree::read(tree)?;
    let sheared = tree
        .sheared(|name| ids.contains(name))
        .ok_or("no observation of the table is a tip of the tree")?;
    aam_data::write_atomic(output, format!("{}\n", sheared.to_newick(false)).as_bytes())?;
    eprintln!("{}: {} tips", output.display(), sheared.n_tips());
    Ok(())
}

fn synth(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let real = BiomTable::read(&args.table)?;
    let n = real.n_samples() as u64;
    let mut state = args.seed;
    let (mut obs, mut samples, mut counts) = (Vec::new(), Vec::new(), Vec::new());
    for s in 0..args.samples {
        for _ in 0..2 {
            let from = real.sample((next(&mut state) % n) as usize);
            obs.extend_from_slice(from.observations);
            counts.extend_from_slice(from.counts);
            samples.extend(std::iter::repeat_n(s as u32, from.len()));
        }
    }
    let ids = (0..args.samples).map(|s| format!("synth.{s}")).collect();
    let table = BiomTable::from_triplets(
        &args.output,
        ids,
        real.observation_ids().to_vec(),
        &obs,
        &samples,
        &counts,
    )?;
    table.write_hdf5(&args.output)?;
    eprintln!(
        "{}: {} samples x {} observations, {} counts",
        args.output.display(),
        table.n_samples(),
        table.n_observations(),
        table.nnz()
    );
    Ok(())
}
