//! `aam-cli` as a library: the two pieces of the `aam-rs` command line that
//! the development harness `aam-dev` (in `benches/`) shares with it, so that
//! both take the same flags and run on the same backends.
//!
//! - [`args`]: the flag groups several commands take (data, model,
//!   optimisation, run, precision) and their translation into `aam-train`'s
//!   specifications;
//! - [`backend`]: the backends compiled in ([`backend::BackendKind`], one per
//!   cargo feature), the [`with_backend!`] macro that turns the choice into a
//!   type, and `aam-rs backends`.
//!
//! Everything else of the command line (one module per subcommand) lives in
//! the binary. Models in services use the libraries (`aam-models`,
//! `aam-train`, `aam-data`) directly, not this crate.

pub mod args;
pub mod backend;

use std::process::ExitCode;

/// What both binaries do first: logs to stderr, filtered by `AAM_LOG`
/// (`tracing`'s filter syntax, default `info` without CubeCL's autotune
/// lines and burn-collective's per-sum lines), and CubeCL's compiled
/// kernels kept on disk between runs (GPU builds).
/// From [`keep_log`] on, the same lines also go to the file that
/// [`log_to_file`] names, with their time.
pub fn init() {
    use tracing_subscriber::prelude::*;
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_env("AAM_LOG")
            // CubeCL logs each autotuned problem at info ("Tuning ..."),
            // burn-collective and its transport each sum across processes.
            .unwrap_or_else(|_| {
                "info,cubecl_runtime::tune=warn,burn_collective=warn,burn_communication=warn".into()
            })
    };
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .without_time()
                .with_filter(filter()),
        )
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(|| LogFile)
                .with_ansi(false)
                .with_filter(filter()),
        )
        .init();
    #[cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]
    aam_models::persist_compiled_kernels();
}

/// Where the log lines' copy goes: held in memory from [`keep_log`] until
/// [`log_to_file`] names the file.
struct LogSink {
    file: Option<std::fs::File>,
    pending: Option<Vec<u8>>,
}

static LOG_SINK: std::sync::Mutex<LogSink> = std::sync::Mutex::new(LogSink {
    file: None,
    pending: None,
});

fn log_sink() -> std::sync::MutexGuard<'static, LogSink> {
    LOG_SINK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The log lines' writer into [`LOG_SINK`] (nothing before [`keep_log`]).
struct LogFile;

impl std::io::Write for LogFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut sink = log_sink();
        if let Some(file) = sink.file.as_mut() {
            file.write_all(buf)?;
        } else if let Some(pending) = sink.pending.as_mut() {
            pending.extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Keeps the log lines from now on, for the file [`log_to_file`] will name
/// (a run's output folder is made only once its options are checked).
pub fn keep_log() {
    let mut sink = log_sink();
    if sink.file.is_none() && sink.pending.is_none() {
        sink.pending = Some(Vec::new());
    }
}

/// Writes the log to `path` from now on, starting with the lines kept since
/// [`keep_log`] (appended: a resumed run continues its run's log), as the
/// reference's `training.log`.
pub fn log_to_file(path: &std::path::Path) -> std::io::Result<()> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let mut sink = log_sink();
    if let Some(pending) = sink.pending.take() {
        file.write_all(&pending)?;
    }
    sink.file = Some(file);
    Ok(())
}

/// Prints a command's error with its causes (`error: ...`) and turns the
/// result into the process's exit status.
pub fn exit_code(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) if err.is::<Interrupted>() => {
            eprintln!("{err}");
            ExitCode::from(Interrupted::EXIT_STATUS)
        }
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

#[doc(hidden)]
pub use anyhow::anyhow as __anyhow;
#[doc(hidden)]
pub use burn as __burn;

/// A training run stopped by a signal at an optimiser step, its checkpoint
/// written: `aam-rs` exits with [`Interrupted::EXIT_STATUS`] so that a job
/// script can tell it from a failure and requeue it.
#[derive(Debug)]
pub struct Interrupted {
    /// The signal's name (`SIGTERM`, `SIGUSR1`).
    pub signal: &'static str,
    /// The checkpoint of the step it stopped at.
    pub checkpoint: std::path::PathBuf,
    /// Optimiser steps taken.
    pub step: u64,
}

impl Interrupted {
    /// 75, `EX_TEMPFAIL` of sysexits.h: a temporary failure, to be retried
    /// (with `--resume-from auto`).
    pub const EXIT_STATUS: u8 = 75;
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stopped by {} at step {}; checkpoint {} (continue with the same command and --resume-from auto)",
            self.signal,
            self.step,
            self.checkpoint.display()
        )
    }
}

impl std::error::Error for Interrupted {}
