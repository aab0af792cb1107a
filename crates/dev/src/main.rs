//! `aam-dev`: the harness used to develop aam-rs's kernels and training
//! step. Not for users (they have `aam-rs diagnose attention` and `diagnose
//! gradients`); not published.
//!
//! - `aam-dev step`: times `pretrain`'s optimiser step on a fixed batch (the
//!   reference benchmark's, by default), with per-phase memory and an
//!   optional sampling profile of the host threads (`--cpu-profile`, cargo
//!   feature `cpu-profile`). The GPU figures in `docs/performance.md` come
//!   from it (`benches/step_device.sh`).
//! - `aam-dev dense`: takes a dense layer's split weight gradient apart on
//!   random inputs and checks each part against a float64 product.
//!
//! It takes `aam-rs`'s model and backend flags (`aam_cli::args`,
//! `aam_cli::backend`), so a figure here is what `aam-rs pretrain` runs.

#[cfg(feature = "cpu-profile")]
mod cpu_profile;
mod dense;
mod step;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Development harness of aam-rs: step timing and kernel checks.
#[derive(Parser, Debug)]
#[command(name = "aam-dev", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How the dense layers' products pick their kernel on the GPU backends
    /// (as `aam-rs pretrain --matmul-kernels`).
    #[arg(long, global = true, value_enum, default_value_t)]
    matmul_kernels: aam_cli::args::MatmulKernels,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Time pretrain's optimiser step on the reference benchmark's batch.
    Step(step::StepArgs),
    /// Check a dense layer's split weight gradient on random inputs against
    /// a float64 product, part by part.
    Dense(dense::DenseArgs),
}

fn main() -> ExitCode {
    aam_cli::init();
    let cli = Cli::parse();
    cli.matmul_kernels.apply();
    aam_cli::exit_code(match cli.command {
        Command::Step(args) => step::run(args),
        Command::Dense(args) => dense::run(args),
    })
}
