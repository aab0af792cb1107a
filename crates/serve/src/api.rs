//! The HTTP routes: request parsing and checks, answers, status codes.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use aam_infer::{ModelKind, Prediction};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::worker::{Answer, Job, JobKind};
use crate::Shared;

/// The service's routes.
pub fn router(shared: Arc<Shared>) -> Router {
    let limit = shared.config.max_body_bytes;
    Router::new()
        .route("/embed", post(embed))
        .route("/predict", post(predict))
        .route("/health", get(health))
        .route("/info", get(info))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(shared)
}

/// An answer other than 200: its status and message.
struct Refusal(StatusCode, String);

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Refusal(status, message.into())
    }
}

async fn embed(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    respond(&shared, JobKind::Embed, body).await
}

async fn predict(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    respond(&shared, JobKind::Predict, body).await
}

async fn respond(shared: &Shared, kind: JobKind, body: Bytes) -> Response {
    let start = Instant::now();
    let route = match kind {
        JobKind::Embed => "/embed",
        JobKind::Predict => "/predict",
    };
    let (status, value) = match run(shared, kind, body, start).await {
        Ok(value) => (StatusCode::OK, value),
        Err(Refusal(status, message)) => (
            status,
            json!({"error": message, "error_type": error_type(status)}),
        ),
    };
    shared
        .metrics
        .request(route, status.as_u16(), start.elapsed().as_secs_f64());
    (status, Json(value)).into_response()
}

fn error_type(status: StatusCode) -> &'static str {
    match status {
        StatusCode::PAYLOAD_TOO_LARGE => "too_large",
        StatusCode::UNPROCESSABLE_ENTITY => "validation",
        StatusCode::TOO_MANY_REQUESTS => "overloaded",
        StatusCode::SERVICE_UNAVAILABLE => "unhealthy",
        _ => "backend",
    }
}

async fn run(
    shared: &Shared,
    kind: JobKind,
    body: Bytes,
    start: Instant,
) -> Result<Value, Refusal> {
    let info = match shared.info.get() {
        Some(info) if shared.ready.load(Ordering::Acquire) => info,
        _ => {
            return Err(Refusal::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the model is loading; GET /health answers 200 when it is ready",
            ))
        }
    };
    if kind == JobKind::Predict && info.kind == ModelKind::Encoder {
        return Err(Refusal::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "this is a `pretrain` model: it has no prediction head (POST /embed)",
        ));
    }
    let _permit = shared.permits.clone().try_acquire_owned().map_err(|_| {
        Refusal::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "the server is busy: {} requests in flight (--max-concurrent-requests); retry later",
                shared.config.max_concurrent_requests
            ),
        )
    })?;
    let document = aam_data::parse_samples_json(&body).map_err(|e| {
        Refusal::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("invalid request body: {e}"),
        )
    })?;
    let samples = document.samples;
    // Embeddings read no metadata; predictions of a model with categorical
    // inputs need it.
    let metadata = document
        .metadata
        .filter(|_| kind == JobKind::Predict)
        .map(Arc::new);
    let config = &shared.config;
    if samples.is_empty() {
        return Err(Refusal::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "samples: the list is empty",
        ));
    }
    if samples.len() > config.max_request_samples {
        return Err(Refusal::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "samples: {} samples, more than the limit of {} per request (--max-request-samples)",
                samples.len(),
                config.max_request_samples
            ),
        ));
    }
    let asvs: usize = samples
        .iter()
        .map(|s| s.reads.len().min(info.token_limit))
        .sum();
    if asvs > config.max_batch_asvs {
        return Err(Refusal::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "samples: {asvs} ASVs, more than a device batch holds ({} ASVs, --max-batch-asvs); split the request",
                config.max_batch_asvs
            ),
        ));
    }
    let options = aam_infer::Options {
        metadata: metadata.clone(),
        ..config.options.clone()
    };
    info.check(&samples, &options, kind == JobKind::Predict)
        .map_err(|e| Refusal::new(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))?;
    let ids: Vec<String> = samples.iter().map(|s| s.id.clone()).collect();
    let (reply, answer) = tokio::sync::oneshot::channel();
    shared.queued.fetch_add(1, Ordering::AcqRel);
    let job = Job {
        kind,
        samples,
        metadata,
        asvs,
        queued_at: start,
        reply,
    };
    let sent = match shared
        .jobs
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
    {
        Some(jobs) => jobs.send(job).is_ok(),
        None => false,
    };
    if !sent {
        shared.queued.fetch_sub(1, Ordering::AcqRel);
        return Err(Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        ));
    }
    let answer = answer
        .await
        .map_err(|_| {
            Refusal::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the model thread has stopped",
            )
        })?
        .map_err(|e| Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, e))?;
    Ok(match answer {
        Answer::Embeddings(rows) => json!({
            "model": shared.model_name,
            "dim": info.embedding_dim,
            "embeddings": ids.iter().zip(rows).map(|(id, e)| json!({"id": id, "embedding": e})).collect::<Vec<_>>(),
        }),
        Answer::Predictions(values) => json!({
            "model": shared.model_name,
            "predictions": ids.iter().zip(values).map(|(id, p)| prediction_json(id, p, info)).collect::<Vec<_>>(),
        }),
    })
}

/// `{"id", "prediction"}` (a number, or a list for several outputs),
/// `{"id", "label", "probabilities": {label: p}}` or `{"id", "quantiles"}`.
fn prediction_json(id: &str, prediction: Prediction, info: &aam_infer::ModelInfo) -> Value {
    match prediction {
        Prediction::Values(v) if v.len() == 1 => json!({"id": id, "prediction": v[0]}),
        Prediction::Values(v) => json!({"id": id, "prediction": v}),
        Prediction::Quantiles(q) if q.len() == 1 => json!({"id": id, "quantiles": q[0]}),
        Prediction::Quantiles(q) => json!({"id": id, "quantiles": q}),
        Prediction::Class {
            label,
            probabilities,
        } => {
            let names: Vec<String> = match &info.class_labels {
                Some(labels) => labels.clone(),
                None => (0..probabilities.len()).map(|c| c.to_string()).collect(),
            };
            let by_label: serde_json::Map<String, Value> = names
                .into_iter()
                .zip(probabilities)
                .map(|(l, p)| (l, json!(p)))
                .collect();
            json!({"id": id, "label": label, "probabilities": by_label})
        }
    }
}

async fn health(State(shared): State<Arc<Shared>>) -> Response {
    if shared.ready.load(Ordering::Acquire) {
        (StatusCode::OK, Json(json!({"status": "ok"}))).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading", "error": "the model is loading and compiling its kernels"})),
        )
            .into_response()
    }
}

async fn info(State(shared): State<Arc<Shared>>) -> Response {
    let c = &shared.config;
    let body = json!({
        "model": shared.model_name,
        "version": env!("CARGO_PKG_VERSION"),
        "sha256": shared.sha256,
        "backend": shared.backend,
        "device": shared.device,
        "ready": shared.ready.load(Ordering::Acquire),
        "info": shared.info.get(),
        "config": shared.model_config.get(),
        "limits": {
            "max_batch_asvs": c.max_batch_asvs,
            "max_concurrent_requests": c.max_concurrent_requests,
            "max_request_samples": c.max_request_samples,
            "max_body_bytes": c.max_body_bytes,
            "max_sequence_length": c.options.max_sequence_length,
        },
        "rarefy": c.options.rarefy,
        "seed": c.options.seed,
    });
    (StatusCode::OK, Json(body)).into_response()
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    let in_flight = shared.config.max_concurrent_requests - shared.permits.available_permits();
    let text = shared
        .metrics
        .render(shared.queued.load(Ordering::Acquire), in_flight);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}
