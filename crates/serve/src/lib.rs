//! `aam-serve`: a trained aam-rs model as an HTTP service (`aam-rs serve`).
//!
//! **Job.** Answer `POST /embed` (sample embeddings) and `POST /predict`
//! (predictions in the target's units) for samples sent as
//! `{"samples": [{"id": "S1", "counts": {"TACG...": 12, ...}}]}` (and, for
//! models with categorical inputs, `"metadata": {"column": "value"}` per
//! sample), with
//! `GET /health`, `GET /info` and `GET /metrics` (Prometheus) beside them.
//! The numbers are [`aam_infer`]'s, so they equal `aam-rs embed` and
//! `aam-rs predict` on the same samples.
//!
//! **Design** (after Hugging Face's text-embeddings-inference):
//! - *One thread owns the model and the device* (a GPU backend's device
//!   belongs to the thread that drives it). HTTP handlers run on a small
//!   tokio runtime; they parse and check a request completely
//!   ([`aam_infer::ModelInfo::check`]) and only then queue it, so a bad
//!   request never reaches the device and never fails anyone else's batch.
//! - *Requests are merged into device batches by an ASV budget*: the model
//!   thread takes the oldest request and adds the queued ones behind it
//!   while their ASVs fit in `max_batch_asvs` (sample IDs must not collide
//!   within a batch; a request that does waits for the next one). Under
//!   load a device batch is many requests; alone, a request runs at once.
//!   Where fewer requests are queued than the last batch answered plus
//!   those that waited for it, the batch waits up to `batch_wait` for the
//!   rest: clients that send again when answered would otherwise split into
//!   groups taking turns on the device, each paying a batch's fixed cost.
//! - *A semaphore bounds the work in the server*: beyond
//!   `max_concurrent_requests` requests in flight the answer is 429 at
//!   once, not a growing queue.
//! - *Status codes say whose fault it is*: 413 for a request over a limit
//!   (body size, samples, ASVs), 422 for malformed JSON or bad samples (the
//!   message names the sample and the field), 429 when busy, 503 until the
//!   model is loaded and its kernels compiled (`/health` too).
//! - *Kernels compile before the first request*: on a JIT backend each new
//!   batch shape compiles kernels the first time it runs, seconds that a
//!   request would wait for. [`WarmUp::Shapes`] runs every ASV slot count a
//!   batch can take, at sample counts of powers of two, before `/health`
//!   says ready ([`ServeConfig::warm_up`]).
//! - *Shutdown is graceful*: SIGTERM or Ctrl-C stops accepting connections,
//!   the requests in flight are answered, then the process exits.

#![deny(missing_docs)]

mod api;
mod metrics;
mod worker;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, OnceLock};

use aam_infer::{ModelInfo, Options};
use aam_models::AttentionBackend;
use tokio::sync::Semaphore;

use crate::metrics::Metrics;
use crate::worker::Job;

/// The service's options (`aam-rs serve` flags).
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Address to listen on (127.0.0.1: this machine only).
    pub host: String,
    /// Port (0: any free port; the log says which).
    pub port: u16,
    /// The name answered as `"model"` (default: from the checkpoint's path).
    pub model_name: Option<String>,
    /// ASVs per device batch: requests are merged up to it, and a request
    /// with more is refused (413).
    pub max_batch_asvs: usize,
    /// How long a batch may wait, from when the device is free, for the
    /// requests it expects back (see the module doc); zero: what is queued.
    pub batch_wait: std::time::Duration,
    /// Requests in flight (queued or running) before answering 429.
    pub max_concurrent_requests: usize,
    /// Threads that parse and check requests (the model thread comes on
    /// top); by default the machine's cores, at least 2 and at most 8
    /// ([`default_http_threads`]).
    pub http_threads: usize,
    /// Samples per request before answering 413.
    pub max_request_samples: usize,
    /// Bytes per request body before answering 413.
    pub max_body_bytes: usize,
    /// Rarefaction (to the training depth, with this seed) and the sequence
    /// length limit; `batch_size` is ignored (the ASV budget forms batches).
    pub options: Options,
    /// What runs before `/health` says ready.
    pub warm_up: WarmUp,
}

/// The batches a service runs before it says it is ready.
///
/// On the JIT backends (CUDA, ROCm, wgpu) a kernel is compiled the first
/// time a batch of its shape runs: on a fresh machine, hundreds of
/// milliseconds to seconds each, which the requests of a new shape would
/// wait for. Compiled kernels are kept on disk, so a restart finds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WarmUp {
    /// One batch of one sample (per answer kind): the model is loaded and
    /// runs. Enough where nothing is compiled per shape (the CPU backends).
    #[default]
    OneBatch,
    /// Every ASV slot count a batch can take, at sample counts of powers of
    /// two, and the ASV level's row counts up to `max_batch_asvs`: a few
    /// hundred small batches (seconds with the kernels on disk; on a fresh
    /// GPU, the time to compile them).
    Shapes,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            model_name: None,
            max_batch_asvs: 16_384,
            batch_wait: std::time::Duration::from_millis(5),
            max_concurrent_requests: 512,
            http_threads: default_http_threads(),
            max_request_samples: 64,
            max_body_bytes: 16 << 20,
            options: Options::default(),
            warm_up: WarmUp::default(),
        }
    }
}

/// The machine's cores, at least 2 and at most 8: enough threads to parse
/// and check the requests of a batch's clients (each request's JSON is
/// parsed and its samples checked on them) while they come back, so that
/// they gather into one batch (`batch_wait`).
pub fn default_http_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8))
}

/// Why the service could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Binding the address, reading the model file, the runtime.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The model could not be loaded or run.
    #[error("{0}")]
    Model(String),
}

/// What the HTTP handlers share.
pub(crate) struct Shared {
    pub config: ServeConfig,
    pub model_name: String,
    pub backend: String,
    pub device: String,
    pub sha256: String,
    /// Set by the model thread once the model is loaded.
    pub info: OnceLock<ModelInfo>,
    /// The model's architecture, as JSON (for `/info`).
    pub model_config: OnceLock<serde_json::Value>,
    /// True once the warm-up batches ran ([`WarmUp`]).
    pub ready: AtomicBool,
    /// Requests queued, not yet taken by the model thread.
    pub queued: AtomicUsize,
    pub permits: Arc<Semaphore>,
    /// The queue to the model thread; taken (closed) at shutdown.
    pub jobs: std::sync::Mutex<Option<std::sync::mpsc::Sender<Job>>>,
    pub metrics: Metrics,
}

/// Serves the model at `model` (a checkpoint file or `convert` folder) on
/// `device` until SIGTERM or Ctrl-C. `backend` and the device's `Debug`
/// text are reported by `/info`. Returns when the server has stopped; an
/// error if it could not start or the model failed to load.
pub fn serve<B: AttentionBackend>(
    model: &Path,
    device: B::Device,
    backend: &str,
    config: ServeConfig,
) -> Result<(), ServeError> {
    let sha256 = file_sha256(model)?;
    let model_name = config
        .model_name
        .clone()
        .unwrap_or_else(|| default_name(model));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.http_threads.max(1))
        .enable_all()
        .build()
        .map_err(|source| ServeError::Io {
            what: "starting the HTTP runtime".into(),
            source,
        })?;
    let (jobs, queue) = std::sync::mpsc::channel();
    let shared = Arc::new(Shared {
        permits: Arc::new(Semaphore::new(config.max_concurrent_requests)),
        model_name,
        backend: backend.to_string(),
        device: format!("{device:?}"),
        sha256,
        info: OnceLock::new(),
        model_config: OnceLock::new(),
        ready: AtomicBool::new(false),
        queued: AtomicUsize::new(0),
        jobs: std::sync::Mutex::new(Some(jobs)),
        metrics: Metrics::default(),
        config,
    });
    let (fatal_tx, fatal_rx) = tokio::sync::oneshot::channel::<String>();
    let model_thread = {
        let shared = shared.clone();
        let path = model.to_path_buf();
        std::thread::Builder::new()
            .name("aam-model".into())
            .spawn(move || worker::run::<B>(path, device, shared, queue, fatal_tx))
            .map_err(|source| ServeError::Io {
                what: "starting the model thread".into(),
                source,
            })?
    };
    let result = runtime.block_on(listen(shared.clone(), fatal_rx));
    // The requests in flight are answered: closing the queue ends the model thread.
    shared.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
    let _ = model_thread.join();
    result
}

async fn listen(
    shared: Arc<Shared>,
    fatal: tokio::sync::oneshot::Receiver<String>,
) -> Result<(), ServeError> {
    let address = format!("{}:{}", shared.config.host, shared.config.port);
    let listener = tokio::net::TcpListener::bind(&address)
        .await
        .map_err(|source| ServeError::Io {
            what: format!("listening on {address} (--host, --port)"),
            source,
        })?;
    let bound: SocketAddr = listener.local_addr().map_err(|source| ServeError::Io {
        what: "reading the bound address".into(),
        source,
    })?;
    tracing::info!("listening on http://{bound} (the model loads in the background; GET /health says when it is ready)");
    let failure: Arc<std::sync::Mutex<Option<String>>> = Default::default();
    let stop = {
        let failure = failure.clone();
        async move {
            tokio::select! {
                _ = terminate() => tracing::info!("shutting down: answering the requests in flight"),
                message = async {
                    match fatal.await {
                        Ok(message) => message,
                        // The model thread ended without a failure: only at shutdown.
                        Err(_) => std::future::pending().await,
                    }
                } => {
                    *failure.lock().expect("not poisoned") = Some(message);
                }
            }
        }
    };
    axum::serve(listener, api::router(shared))
        .with_graceful_shutdown(stop)
        .await
        .map_err(|source| ServeError::Io {
            what: "serving HTTP".into(),
            source,
        })?;
    let failed = failure.lock().expect("not poisoned").take();
    match failed {
        Some(message) => Err(ServeError::Model(message)),
        None => Ok(()),
    }
}

/// SIGTERM (what SLURM, systemd and Kubernetes send) or Ctrl-C.
async fn terminate() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// `runs/x/checkpoints/best.safetensors` → `x/best`; a folder → its name.
fn default_name(model: &Path) -> String {
    let stem = model
        .file_stem()
        .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    let parent = model.parent();
    match (
        parent.and_then(Path::file_name),
        parent.and_then(Path::parent).and_then(Path::file_name),
    ) {
        (Some(dir), Some(run)) if dir == "checkpoints" => {
            format!("{}/{stem}", run.to_string_lossy())
        }
        _ => stem,
    }
}

/// SHA-256 of the checkpoint file (of a folder's weights), hex.
fn file_sha256(model: &Path) -> Result<String, ServeError> {
    use sha2::Digest;
    let file: PathBuf = if model.is_dir() {
        model.join(aam_models::import::WEIGHTS_FILE)
    } else {
        model.to_path_buf()
    };
    let bytes = std::fs::read(&file).map_err(|source| ServeError::Io {
        what: format!("reading {}", file.display()),
        source,
    })?;
    Ok(sha2::Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
