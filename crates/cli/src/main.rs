//! `aam-rs`: the command line of aam-rs.
//!
//! The binary parses flags, picks a backend, calls the libraries and prints;
//! it and `aam-dev` are the only crates that use `anyhow`. One module per
//! subcommand: `pretrain` and `train` (`train.rs`; the loop is
//! `aam_train::run::fit`), `predict` (a trained checkpoint + a table → TSV)
//! and `embed` (a checkpoint + a table → sample embeddings), both over the
//! `aam-infer` library, `serve` (the same over HTTP, `aam-serve`),
//! `convert` (reference PyTorch checkpoint → aam-rs model directory),
//! `forward` (run a model on raw token tensors, write every output to .npz),
//! `backends` (what this binary can run on, here), `inspect` (check a run's
//! inputs), `diagnose attention` (does this platform compute attention
//! correctly?), `diagnose gradients` (does this backend's training step
//! give the CPU's gradients on my data?), `unifrac` (a UniFrac matrix
//! from a table and a tree, `aam-unifrac`) and `rf-baseline` (the
//! reference's random forest, `aam-baseline`). The reference's options that
//! aam-rs answers differently are applied or noted by `train.rs`'s
//! `apply_reference` and `aam_cli::args::ReferenceArgs`. Training's progress bars are
//! `progress.rs`; `stop.rs` turns SIGTERM/SIGUSR1 into a checkpoint at the
//! next step and exit status 75. The flag groups several commands
//! share and the backend choice are the crate's library (`aam_cli::args`,
//! `aam_cli::backend`); every option is listed in `docs/cli.md`.

mod compile_workers;
mod convert;
mod diagnose;
mod embed;
mod forward;
mod gradients;
mod inspect;
mod plot;
mod predict;
mod progress;
mod rf_baseline;
mod serve;
mod stop;
mod train;
mod unifrac;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// AAM (Attention All Microbes) in Rust.
#[derive(Parser, Debug)]
#[command(name = "aam-rs", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Pre-train the base model on UniFrac distances and masked nucleotides.
    // Negative numbers are values (`--lr -1` is refused by the range check
    // naming the flag, not taken for an unknown flag `-1`).
    #[command(allow_negative_numbers = true)]
    Pretrain(train::PretrainArgs),
    /// Train a predictor of a metadata column (optionally from a pre-trained encoder).
    #[command(allow_negative_numbers = true)]
    Train(train::TrainArgs),
    /// Predict a table's samples with a trained checkpoint; writes a TSV.
    Predict(predict::PredictArgs),
    /// Embed a table's samples with a pretrain or train checkpoint; writes a TSV or .npy.
    Embed(embed::EmbedArgs),
    /// Serve a checkpoint over HTTP: POST /embed and /predict, GET /health, /info, /metrics.
    Serve(serve::ServeArgs),
    /// Convert a reference PyTorch checkpoint into an aam-rs model directory.
    Convert(convert::ConvertArgs),
    /// Run a model in eval mode on token tensors and write every output as .npz.
    Forward(forward::ForwardArgs),
    /// List the backends compiled into this binary and the devices each one sees.
    Backends,
    /// Summarise and check a run's inputs (table, UniFrac matrix, metadata) before a long job.
    Inspect(inspect::InspectArgs),
    /// Check that this platform computes attention correctly (exit 1 when it does not).
    Diagnose(diagnose::DiagnoseArgs),
    /// Compute a UniFrac distance matrix (or Faith's PD) from a table and a tree; no ssu needed.
    Unifrac(unifrac::UnifracArgs),
    /// The reference's random-forest baseline on a run's train/validation split.
    RfBaseline(rf_baseline::RfBaselineArgs),
    /// A `--compile-workers` helper of `pretrain`/`train` (started by them).
    #[command(hide = true)]
    CompileKernels(compile_workers::CompileKernelsArgs),
}

fn main() -> ExitCode {
    aam_cli::init();
    // `train --categorical-help` prints its guide without the required flags.
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).is_some_and(|c| c == "train") && argv.iter().any(|a| a == "--categorical-help") {
        print!("{}", train::CATEGORICAL_HELP);
        return ExitCode::SUCCESS;
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Pretrain(args) => train::pretrain(args),
        Command::Train(args) => train::train(args),
        Command::Predict(args) => predict::run(args),
        Command::Embed(args) => embed::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Convert(args) => convert::run(args),
        Command::Forward(args) => forward::run(args),
        Command::Backends => aam_cli::backend::list(),
        Command::Inspect(args) => inspect::run(args),
        Command::Diagnose(args) => diagnose::run(args),
        Command::Unifrac(args) => unifrac::run(args),
        Command::RfBaseline(args) => rf_baseline::run(args),
        Command::CompileKernels(args) => compile_workers::run(args),
    };
    aam_cli::exit_code(result)
}
