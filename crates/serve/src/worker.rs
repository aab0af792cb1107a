//! The model thread: loads and warms the model, then merges queued
//! requests into device batches by the ASV budget and answers each.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use aam_infer::{Model, ModelKind, Options, Prediction, SampleReads};
use aam_models::AttentionBackend;
use tokio::sync::{mpsc, oneshot};

use crate::Shared;

/// Which answer a request wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    /// `/embed`.
    Embed,
    /// `/predict`.
    Predict,
}

/// A checked request waiting for the model.
pub struct Job {
    pub kind: JobKind,
    pub samples: Vec<SampleReads>,
    /// Its ASVs as the budget counts them (at most `token_limit` per sample).
    pub asvs: usize,
    pub queued_at: Instant,
    pub reply: oneshot::Sender<Result<Answer, String>>,
}

/// A request's results, in the order of its samples.
pub enum Answer {
    /// One embedding per sample.
    Embeddings(Vec<Vec<f32>>),
    /// One prediction per sample.
    Predictions(Vec<Prediction>),
}

/// The model thread's body.
pub fn run<B: AttentionBackend>(
    path: PathBuf,
    device: B::Device,
    shared: Arc<Shared>,
    mut queue: mpsc::UnboundedReceiver<Job>,
    fatal: oneshot::Sender<String>,
) {
    let started = Instant::now();
    let model = match Model::<B>::load(&path, &device) {
        Ok(model) => model,
        Err(e) => {
            let _ = fatal.send(format!("loading {}: {e}", path.display()));
            return;
        }
    };
    let info = model.info().clone();
    if !info.metadata_columns.is_empty() {
        let _ = fatal.send(format!(
            "{}: the model's predictions read the metadata columns {:?}, which `serve` does not take yet; use `aam-rs predict --metadata`",
            path.display(),
            info.metadata_columns
        ));
        return;
    }
    let _ = shared
        .model_config
        .set(serde_json::to_value(model.config()).unwrap_or_default());
    let _ = shared.info.set(info.clone());
    // One batch of each kind compiles the kernels before /health says ready.
    let warm = SampleReads {
        id: "warm-up".into(),
        reads: vec![(
            "ACGT".repeat(info.max_bp.div_ceil(4)),
            info.rarefy_depth.unwrap_or(1) as f64,
        )],
    };
    let options = Options {
        batch_size: 1,
        ..shared.config.options.clone()
    };
    let warmed = model
        .embed(std::slice::from_ref(&warm), &options)
        .and_then(|_| {
            if info.kind == ModelKind::Encoder {
                Ok(())
            } else {
                model
                    .predict(std::slice::from_ref(&warm), &options)
                    .map(|_| ())
            }
        });
    if let Err(e) = warmed {
        let _ = fatal.send(format!("the warm-up batch failed: {e}"));
        return;
    }
    shared.ready.store(true, Ordering::Release);
    tracing::info!(
        "model {} ready in {:.1}s ({} on {})",
        shared.model_name,
        started.elapsed().as_secs_f64(),
        shared.backend,
        shared.device
    );

    let budget = shared.config.max_batch_asvs;
    let mut held: Option<Job> = None;
    loop {
        let first = match held.take() {
            Some(job) => job,
            None => match queue.blocking_recv() {
                Some(job) => job,
                None => break,
            },
        };
        shared.queued.fetch_sub(1, Ordering::AcqRel);
        let kind = first.kind;
        let mut asvs = first.asvs;
        let mut ids: HashSet<String> = first.samples.iter().map(|s| s.id.clone()).collect();
        let mut batch = vec![first];
        while let Ok(job) = queue.try_recv() {
            shared.queued.fetch_sub(1, Ordering::AcqRel);
            let fits = job.kind == kind
                && asvs + job.asvs <= budget
                && job.samples.iter().all(|s| !ids.contains(&s.id));
            if !fits {
                // It leads the next batch; the queue count includes it again.
                shared.queued.fetch_add(1, Ordering::AcqRel);
                held = Some(job);
                break;
            }
            asvs += job.asvs;
            ids.extend(job.samples.iter().map(|s| s.id.clone()));
            batch.push(job);
        }
        answer(&model, &shared, &options, kind, batch);
    }
}

/// Runs one merged device batch and replies to each of its requests.
fn answer<B: AttentionBackend>(
    model: &Model<B>,
    shared: &Shared,
    options: &Options,
    kind: JobKind,
    mut batch: Vec<Job>,
) {
    let start = Instant::now();
    for job in &batch {
        shared
            .metrics
            .queue_seconds(start.duration_since(job.queued_at).as_secs_f64());
    }
    // The samples move into one list; each request keeps its count.
    let counts: Vec<usize> = batch.iter().map(|j| j.samples.len()).collect();
    let samples: Vec<SampleReads> = batch
        .iter_mut()
        .flat_map(|j| std::mem::take(&mut j.samples))
        .collect();
    let options = Options {
        batch_size: samples.len(),
        ..options.clone()
    };
    let result = match kind {
        JobKind::Embed => model
            .embed(&samples, &options)
            .map(|e| Answer::Embeddings(e.values.chunks(e.dim).map(<[f32]>::to_vec).collect())),
        JobKind::Predict => model
            .predict(&samples, &options)
            .map(|p| Answer::Predictions(p.values)),
    };
    shared
        .metrics
        .batch(samples.len(), start.elapsed().as_secs_f64());
    match result {
        // Requests were checked strictly (no sample is left out), so the
        // results are the samples', in order.
        Ok(mut all) => {
            for (job, n) in batch.into_iter().zip(counts).rev() {
                let mine = all.split_off(all.len() - n);
                let _ = job.reply.send(Ok(mine));
            }
        }
        Err(e) => {
            tracing::error!("a batch of {} request(s) failed: {e}", batch.len());
            for job in batch {
                let _ = job.reply.send(Err(e.to_string()));
            }
        }
    }
}

impl Answer {
    fn len(&self) -> usize {
        match self {
            Answer::Embeddings(v) => v.len(),
            Answer::Predictions(v) => v.len(),
        }
    }

    /// The results from `at` on; `self` keeps those before.
    fn split_off(&mut self, at: usize) -> Answer {
        match self {
            Answer::Embeddings(v) => Answer::Embeddings(v.split_off(at)),
            Answer::Predictions(v) => Answer::Predictions(v.split_off(at)),
        }
    }
}
