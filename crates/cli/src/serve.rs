//! `aam-rs serve`: a checkpoint as an HTTP service (`aam_serve`).

use std::path::PathBuf;

use aam_infer::Options;
use aam_models::AttentionBackend;
use aam_serve::{ServeConfig, WarmUp};
use anyhow::{ensure, Result};
use clap::Args;

use aam_cli::backend::BackendKind;

/// Flags of `aam-rs serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A checkpoint of `aam-rs pretrain` (embeddings) or `train` (embeddings
    /// and predictions), or a model folder of `aam-rs convert`.
    #[arg(long, value_name = "CHECKPOINT")]
    model: PathBuf,
    /// Address to listen on; 0.0.0.0 serves other machines too.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port; 0 picks a free one (the log says which).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// The model's name in answers (default: from the checkpoint's path,
    /// `<run>/<best|last>`).
    #[arg(long, value_name = "NAME")]
    served_model_name: Option<String>,
    /// ASVs per device batch: queued requests are merged up to it; a
    /// request with more gets 413.
    #[arg(long, default_value_t = 16_384)]
    max_batch_asvs: usize,
    /// Milliseconds a batch may wait, once the device is free, for requests
    /// it expects: fewer queued than the last batch answered plus those
    /// that waited for it. Clients that send again when answered then share
    /// one batch instead of taking turns; one client alone never waits.
    /// 0: a batch is what is queued.
    #[arg(long, default_value_t = 5.0, value_name = "MS")]
    batch_wait_ms: f64,
    /// Requests in flight (queued or running) before answering 429.
    #[arg(long, default_value_t = 512)]
    max_concurrent_requests: usize,
    /// Threads that parse and check requests (the model's thread comes on
    /// top). Default: the machine's cores, at least 2 and at most 8.
    #[arg(long, value_name = "N")]
    http_threads: Option<usize>,
    /// Samples per request before answering 413.
    #[arg(long, default_value_t = 64)]
    max_request_samples: usize,
    /// Bytes per request body before answering 413.
    #[arg(long, default_value_t = 16 << 20)]
    max_body_bytes: usize,
    /// Refuse sequences longer than this (422) instead of cutting them to
    /// the model's --max-bp as training did.
    #[arg(long, value_name = "BP")]
    max_sequence_length: Option<usize>,
    /// Use the samples' counts as they are instead of rarefying to the
    /// training depth (a sample with fewer reads gets 422 otherwise).
    #[arg(long)]
    no_rarefy: bool,
    /// Seed of the rarefaction.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Compute backend.
    #[arg(long, value_enum, default_value_t = BackendKind::default())]
    backend: BackendKind,
    /// What runs before GET /health says ready: `shapes` (every ASV slot
    /// count a batch can take, at sample counts of powers of two: on a GPU
    /// backend the kernels of each shape are compiled before the first
    /// request, not while requests wait) or `one-batch` (a single sample).
    /// Default: `shapes` on cuda, rocm and wgpu, `one-batch` on the CPU
    /// backends, which compile nothing.
    #[arg(long, value_enum, value_name = "WHAT")]
    warm_up: Option<WarmUpArg>,
}

/// `--warm-up`.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum WarmUpArg {
    Shapes,
    OneBatch,
}

/// Runs `aam-rs serve` until SIGTERM or Ctrl-C.
pub fn run(args: ServeArgs) -> Result<()> {
    for (flag, value) in [
        ("--max-batch-asvs", args.max_batch_asvs),
        ("--max-concurrent-requests", args.max_concurrent_requests),
        ("--max-request-samples", args.max_request_samples),
        ("--max-body-bytes", args.max_body_bytes),
        ("--http-threads", args.http_threads.unwrap_or(1)),
    ] {
        ensure!(value > 0, "{flag} must be ≥ 1");
    }
    ensure!(
        args.batch_wait_ms.is_finite() && (0.0..=10_000.0).contains(&args.batch_wait_ms),
        "--batch-wait-ms must be between 0 and 10000, not {}",
        args.batch_wait_ms
    );
    let config = ServeConfig {
        host: args.host.clone(),
        port: args.port,
        model_name: args.served_model_name.clone(),
        max_batch_asvs: args.max_batch_asvs,
        batch_wait: std::time::Duration::from_secs_f64(args.batch_wait_ms / 1e3),
        max_concurrent_requests: args.max_concurrent_requests,
        http_threads: args
            .http_threads
            .unwrap_or_else(aam_serve::default_http_threads),
        max_request_samples: args.max_request_samples,
        max_body_bytes: args.max_body_bytes,
        options: Options {
            rarefy: !args.no_rarefy,
            seed: args.seed,
            max_sequence_length: args.max_sequence_length,
            ..Options::default()
        },
        warm_up: match args.warm_up {
            Some(WarmUpArg::Shapes) => WarmUp::Shapes,
            Some(WarmUpArg::OneBatch) => WarmUp::OneBatch,
            None if args.backend.compiles_kernels() => WarmUp::Shapes,
            None => WarmUp::OneBatch,
        },
    };
    let backend = args.backend.name();
    aam_cli::with_backend!(args.backend, |B, device| serve_on::<B>(
        &args, device, &backend, config
    ))
}

fn serve_on<B: AttentionBackend>(
    args: &ServeArgs,
    device: B::Device,
    backend: &str,
    config: ServeConfig,
) -> Result<()> {
    Ok(aam_serve::serve::<B>(&args.model, device, backend, config)?)
}
