//! `aam-rs`: the command line of aam-rs.
//!
//! The only crate that picks a backend, parses arguments and uses `anyhow`.
//! Subcommands: `convert` (reference PyTorch checkpoint → aam-rs model
//! directory), `forward` (run a model on raw token tensors, write every
//! output to .npz) and `backends` (what this binary can run on, here).

mod backend;
mod convert;
mod forward;

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
    /// Convert a reference PyTorch checkpoint into an aam-rs model directory.
    Convert(convert::ConvertArgs),
    /// Run a model in eval mode on token tensors and write every output as .npz.
    Forward(forward::ForwardArgs),
    /// List the backends compiled into this binary and the devices each one sees.
    Backends,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("AAM_LOG").unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .without_time()
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Convert(args) => convert::run(args),
        Command::Forward(args) => forward::run(args),
        Command::Backends => backend::list(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
