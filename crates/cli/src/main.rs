//! `aam-rs`: the command line of aam-rs.
//!
//! The only crate that picks a backend, parses arguments and uses `anyhow`.
//! Subcommands: `pretrain` and `train` (training, in `aam-train`),
//! `predict` (a trained checkpoint + a table → TSV), `convert` (reference
//! PyTorch checkpoint → aam-rs model directory), `forward` (run a model on
//! raw token tensors, write every output to .npz), `backends` (what this
//! binary can run on, here), `inspect` (check a run's inputs) and `diagnose
//! attention` (does this platform compute attention correctly?).

mod backend;
mod convert;
#[cfg(feature = "cpu-profile")]
mod cpu_profile;
mod dense_check;
mod diagnose;
mod forward;
mod gradients;
mod inspect;
mod plot;
mod predict;
mod progress;
mod step;
mod train;

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
    Pretrain(train::PretrainArgs),
    /// Train a predictor of a metadata column (optionally from a pre-trained encoder).
    Train(train::TrainArgs),
    /// Predict a table's samples with a trained checkpoint; writes a TSV.
    Predict(predict::PredictArgs),
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
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("AAM_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .init();
    let cli = Cli::parse();
    #[cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]
    aam_models::persist_compiled_kernels();
    let result = match cli.command {
        Command::Pretrain(args) => train::pretrain(args),
        Command::Train(args) => train::train(args),
        Command::Predict(args) => predict::run(args),
        Command::Convert(args) => convert::run(args),
        Command::Forward(args) => forward::run(args),
        Command::Backends => backend::list(),
        Command::Inspect(args) => inspect::run(args),
        Command::Diagnose(args) => diagnose::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // The causes, once each: some error types print their source in
            // their own message as well, which `{:#}` would repeat.
            let mut message = err.to_string();
            for cause in err.chain().skip(1).map(|c| c.to_string()) {
                if !message.ends_with(&cause) {
                    message = format!("{message}: {cause}");
                }
            }
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
