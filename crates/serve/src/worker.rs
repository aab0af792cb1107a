//! The model thread: loads and warms the model, then merges queued
//! requests into device batches by the ASV budget and answers each.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aam_data::Metadata;
use aam_infer::{Model, ModelKind, Options, Prediction, SampleReads};
use aam_models::AttentionBackend;
use tokio::sync::oneshot;

use crate::{Shared, WarmUp};

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
    /// Its samples' metadata (`/predict` of a model with categorical
    /// inputs), one row per sample.
    pub metadata: Option<Arc<Metadata>>,
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
    queue: Receiver<Job>,
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
    let _ = shared
        .model_config
        .set(serde_json::to_value(model.config()).unwrap_or_default());
    let _ = shared.info.set(info.clone());
    // The kernels compile (on a JIT backend) before /health says ready.
    let batches = match warm_up(&model, &shared.config) {
        Ok(batches) => batches,
        Err(e) => {
            let _ = fatal.send(format!("the warm-up batch failed: {e}"));
            return;
        }
    };
    shared.ready.store(true, Ordering::Release);
    tracing::info!(
        "model {} ready in {:.1}s ({} on {}; {batches} warm-up batch{})",
        shared.model_name,
        started.elapsed().as_secs_f64(),
        shared.backend,
        shared.device,
        if batches == 1 { "" } else { "es" }
    );
    let options = Options {
        batch_size: 1,
        ..shared.config.options.clone()
    };

    let budget = shared.config.max_batch_asvs;
    let wait = shared.config.batch_wait;
    let mut held: Option<Job> = None;
    // The requests the last batch answered plus those waiting when it was
    // answered: the clients to expect back (see `next_batch`).
    let mut expect = 0;
    while let Some(batch) = next_batch(&queue, &mut held, budget, &shared.queued, expect, wait) {
        let kind = batch[0].kind;
        let jobs = batch.len();
        let waiting = answer(&model, &shared, &options, kind, batch);
        expect = jobs + waiting;
    }
}

/// The next device batch: the held job, or the first queued one (waiting
/// for it where none is), then every queued job of the same kind while the
/// ASVs fit in `budget` and no sample ID repeats; a job that does not fit is
/// held for the next batch. `None` once the queue is closed and empty.
///
/// **Gathering.** Where the batch holds fewer than `expect` requests (those
/// the previous batch answered plus those that were waiting then), it waits
/// for more until `wait` after this call began, and goes as soon as it has
/// `expect`, the budget is full or the deadline passes. Clients that send
/// their next request when answered (a pipeline, a load test) otherwise
/// split into groups that take turns on the device, each paying a batch's
/// fixed cost (on an H200 about 7.6 ms, whatever its size); gathered, they
/// share one batch. A request that finds the service idle longer than
/// `wait` runs at once, and one client alone never waits (it expects 1).
pub(crate) fn next_batch(
    queue: &Receiver<Job>,
    held: &mut Option<Job>,
    budget: usize,
    queued: &AtomicUsize,
    expect: usize,
    wait: Duration,
) -> Option<Vec<Job>> {
    let deadline = Instant::now() + wait;
    let first = match held.take() {
        Some(job) => job,
        None => queue.recv().ok()?,
    };
    queued.fetch_sub(1, Ordering::AcqRel);
    let kind = first.kind;
    let mut asvs = first.asvs;
    let mut ids: HashSet<String> = first.samples.iter().map(|s| s.id.clone()).collect();
    let mut batch = vec![first];
    loop {
        let job = match queue.try_recv() {
            Ok(job) => job,
            Err(TryRecvError::Disconnected) => break,
            Err(TryRecvError::Empty) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if batch.len() >= expect || left.is_zero() {
                    break;
                }
                match queue.recv_timeout(left) {
                    Ok(job) => job,
                    Err(_) => break,
                }
            }
        };
        queued.fetch_sub(1, Ordering::AcqRel);
        let fits = job.kind == kind
            && asvs + job.asvs <= budget
            && job.samples.iter().all(|s| !ids.contains(&s.id));
        if !fits {
            // It leads the next batch; the queue count includes it again.
            queued.fetch_add(1, Ordering::AcqRel);
            *held = Some(job);
            break;
        }
        asvs += job.asvs;
        ids.extend(job.samples.iter().map(|s| s.id.clone()));
        batch.push(job);
    }
    Some(batch)
}

/// Runs the warm-up batches `config.warm_up` asks for, of each kind the
/// model answers; returns how many ran.
fn warm_up<B: AttentionBackend>(
    model: &Model<B>,
    config: &crate::ServeConfig,
) -> aam_infer::Result<usize> {
    let info = model.info();
    let slots = model.slot_counts();
    let shapes = match config.warm_up {
        WarmUp::OneBatch => vec![WarmUpBatch {
            largest: 1,
            samples: 1,
            others: 1,
        }],
        WarmUp::Shapes => warm_up_shapes(&slots, config.max_batch_asvs),
    };
    if config.warm_up == WarmUp::Shapes {
        tracing::info!(
            "warming up on {} batch shapes (ASV slots {}..={}, up to {} ASVs a batch): on a fresh machine this compiles the kernels, once",
            shapes.len(),
            slots.first().copied().unwrap_or(0),
            info.token_limit,
            config.max_batch_asvs
        );
    }
    // Counts as they are: rarefaction would drop the warm-up's ASVs.
    let options = Options {
        rarefy: false,
        ..config.options.clone()
    };
    // A model with categorical inputs predicts from metadata: all missing.
    let most = shapes.iter().map(|s| s.samples).max().unwrap_or(1);
    let metadata = (!info.metadata_columns.is_empty())
        .then(|| {
            Metadata::from_rows(
                "the warm-up batches".into(),
                "sample_id".into(),
                info.metadata_columns.clone(),
                (0..most)
                    .map(|s| (WarmUpBatch::id(s), Vec::new()))
                    .collect(),
            )
        })
        .transpose()?
        .map(Arc::new);
    // Sequences of the model's length, or of the longest a request may send.
    let length = options
        .max_sequence_length
        .map_or(info.max_bp, |most| most.min(info.max_bp));
    for shape in &shapes {
        let samples = shape.samples(length);
        let options = Options {
            batch_size: samples.len(),
            ..options.clone()
        };
        model.embed(&samples, &options)?;
        if info.kind != ModelKind::Encoder {
            let options = Options {
                metadata: metadata.clone(),
                ..options
            };
            model.predict(&samples, &options)?;
        }
    }
    Ok(shapes.len())
}

/// One warm-up batch: a sample of `largest` ASVs (which sets the batch's
/// ASV slots) and `samples - 1` more of `others` ASVs each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WarmUpBatch {
    pub largest: usize,
    pub samples: usize,
    pub others: usize,
}

impl WarmUpBatch {
    /// The ID of a batch's `s`-th sample.
    fn id(s: usize) -> String {
        format!("warm-up-{s}")
    }

    /// The batch's samples: distinct made-up sequences of `length`
    /// nucleotides, one read each.
    fn samples(&self, length: usize) -> Vec<SampleReads> {
        let sequence = |i: usize| -> String {
            // A different sequence per ASV of a sample (an LCG's bits).
            let mut x = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            (0..length)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    b"ACGT"[(x >> 62) as usize] as char
                })
                .collect()
        };
        (0..self.samples)
            .map(|s| SampleReads {
                id: Self::id(s),
                reads: (0..if s == 0 { self.largest } else { self.others })
                    .map(|i| (sequence(i), 1.0))
                    .collect(),
            })
            .collect()
    }
}

/// The batch shapes [`WarmUp::Shapes`] runs, within `budget` ASVs a batch:
/// - for each slot count a batch can take (`slots`), batches of 1, 2, 4, ...
///   samples, one of them filling the slots and the others one ASV each:
///   the sample level's shapes (samples × slots) at little cost;
/// - batches of 2, 4, 8, ... samples of the smallest slot count, full:
///   the ASV level's row counts (all the batch's nucleotides) up to the
///   budget.
///
/// The kernels keyed by a shape (the sample-level attention by its slots,
/// the reductions' tuning by size buckets of powers of two) are then
/// compiled before the first request, and requests of other sizes reuse
/// them.
pub(crate) fn warm_up_shapes(slots: &[usize], budget: usize) -> Vec<WarmUpBatch> {
    let mut shapes = Vec::new();
    for &largest in slots {
        let mut samples = 1;
        while samples * largest <= budget.max(largest) {
            shapes.push(WarmUpBatch {
                largest,
                samples,
                others: 1,
            });
            samples *= 2;
        }
    }
    if let Some(&full) = slots.first() {
        let mut samples = 2;
        while samples * full <= budget {
            shapes.push(WarmUpBatch {
                largest: full,
                samples,
                others: full,
            });
            samples *= 2;
        }
    }
    shapes
}

/// Runs one merged device batch and replies to each of its requests;
/// returns how many requests were waiting when it had run (before its own
/// clients could send again).
fn answer<B: AttentionBackend>(
    model: &Model<B>,
    shared: &Shared,
    options: &Options,
    kind: JobKind,
    mut batch: Vec<Job>,
) -> usize {
    let start = Instant::now();
    for job in &batch {
        shared
            .metrics
            .queue_seconds(start.duration_since(job.queued_at).as_secs_f64());
    }
    // The samples (and their metadata) move into one list; each request
    // keeps its count.
    let counts: Vec<usize> = batch.iter().map(|j| j.samples.len()).collect();
    let tables: Vec<&Arc<Metadata>> = batch.iter().filter_map(|j| j.metadata.as_ref()).collect();
    let metadata = match tables.as_slice() {
        [] => None,
        [one] => Some(Arc::clone(one)),
        all => match Metadata::concat(&all.iter().map(|t| &***t).collect::<Vec<_>>()) {
            Ok(merged) => Some(Arc::new(merged)),
            Err(e) => {
                for job in batch {
                    let _ = job.reply.send(Err(e.to_string()));
                }
                return shared.queued.load(Ordering::Acquire);
            }
        },
    };
    let samples: Vec<SampleReads> = batch
        .iter_mut()
        .flat_map(|j| std::mem::take(&mut j.samples))
        .collect();
    let options = Options {
        batch_size: samples.len(),
        metadata,
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
    let waiting = shared.queued.load(Ordering::Acquire);
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
    waiting
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

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: &str, asvs: usize) -> Job {
        Job {
            kind: JobKind::Embed,
            samples: vec![SampleReads {
                id: id.into(),
                reads: Vec::new(),
            }],
            metadata: None,
            asvs,
            queued_at: Instant::now(),
            reply: oneshot::channel().0,
        }
    }

    fn ids(batch: &[Job]) -> Vec<&str> {
        batch.iter().map(|j| j.samples[0].id.as_str()).collect()
    }

    /// A batch takes what is queued while the ASVs fit; the job that does
    /// not fit (over the budget, another kind, a sample ID already in the
    /// batch) leads the next one; the queue count follows.
    #[test]
    fn batches_take_the_queued_jobs_that_fit() {
        let queued = AtomicUsize::new(0);
        let (send, queue) = std::sync::mpsc::channel();
        let mut held = None;
        let mut predict = job("p", 1);
        predict.kind = JobKind::Predict;
        for j in [
            job("a", 10),
            job("b", 20),
            job("c", 80),
            job("d", 1),
            job("d", 1),
            predict,
        ] {
            send.send(j).unwrap();
            queued.fetch_add(1, Ordering::AcqRel);
        }
        let mut next = || {
            let batch = next_batch(&queue, &mut held, 100, &queued, 0, Duration::ZERO)?;
            Some(ids(&batch).join(" "))
        };
        assert_eq!(next().as_deref(), Some("a b"), "c is over the budget");
        assert_eq!(queued.load(Ordering::Acquire), 4);
        assert_eq!(next().as_deref(), Some("c d"), "d is in the batch already");
        assert_eq!(next().as_deref(), Some("d"), "p is another kind");
        assert_eq!(next().as_deref(), Some("p"));
        assert_eq!(queued.load(Ordering::Acquire), 0);
        drop(send);
        assert_eq!(next(), None);
    }

    /// A batch with fewer requests than it expects waits for more until its
    /// deadline, and goes as soon as it has them; one that expects no more
    /// than are queued, or whose wait is zero, goes at once.
    #[test]
    fn batches_gather_the_requests_they_expect_until_the_deadline() {
        let queued = AtomicUsize::new(0);
        let (send, queue) = std::sync::mpsc::channel();
        let mut held = None;
        let push = |send: &std::sync::mpsc::Sender<Job>, id: &str| {
            queued.fetch_add(1, Ordering::AcqRel);
            send.send(job(id, 1)).unwrap();
        };
        // Expects 3; the third arrives 50 ms in, within the 10 s wait.
        push(&send, "a");
        push(&send, "b");
        let late = send.clone();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            late.send(job("c", 1)).unwrap();
        });
        queued.fetch_add(1, Ordering::AcqRel);
        let start = Instant::now();
        let batch =
            next_batch(&queue, &mut held, 100, &queued, 3, Duration::from_secs(10)).unwrap();
        sender.join().unwrap();
        assert_eq!(ids(&batch), ["a", "b", "c"]);
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "it went when it had 3"
        );
        assert_eq!(queued.load(Ordering::Acquire), 0);
        // Expects 3, only 1 comes: it goes at the deadline.
        push(&send, "d");
        let start = Instant::now();
        let batch = next_batch(
            &queue,
            &mut held,
            100,
            &queued,
            3,
            Duration::from_millis(80),
        )
        .unwrap();
        assert_eq!(ids(&batch), ["d"]);
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(80) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
        // Expects 1, or no wait: at once.
        for (expect, wait) in [(1, Duration::from_secs(10)), (3, Duration::ZERO)] {
            push(&send, "e");
            let start = Instant::now();
            let batch = next_batch(&queue, &mut held, 100, &queued, expect, wait).unwrap();
            assert_eq!(ids(&batch), ["e"]);
            assert!(start.elapsed() < Duration::from_secs(5));
        }
        // A job over the budget ends the wait (it leads the next batch).
        push(&send, "f");
        let start = Instant::now();
        let sender = {
            let late = send.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                late.send(job("g", 100)).unwrap();
            })
        };
        queued.fetch_add(1, Ordering::AcqRel);
        let batch =
            next_batch(&queue, &mut held, 100, &queued, 5, Duration::from_secs(10)).unwrap();
        sender.join().unwrap();
        assert_eq!(ids(&batch), ["f"]);
        assert!(start.elapsed() < Duration::from_secs(5));
        assert_eq!(held.as_ref().map(|j| j.samples[0].id.as_str()), Some("g"));
    }

    /// Every slot count at sample counts of powers of two within the budget,
    /// then full batches of the smallest slot count up to the budget.
    #[test]
    fn warm_up_shapes_cover_every_slot_count_within_the_budget() {
        let shapes = warm_up_shapes(&[32, 64, 96], 256);
        let of = |largest, others| -> Vec<usize> {
            shapes
                .iter()
                .filter(|b| b.largest == largest && b.others == others)
                .map(|b| b.samples)
                .collect()
        };
        assert_eq!(of(32, 1), [1, 2, 4, 8]);
        assert_eq!(of(64, 1), [1, 2, 4]);
        assert_eq!(of(96, 1), [1, 2]);
        assert_eq!(of(32, 32), [2, 4, 8]);
        assert_eq!(shapes.len(), 12);
        for b in &shapes {
            assert!(b.largest + (b.samples - 1) * b.others <= 256, "{b:?}");
        }
        // A slot count over the budget still gets its one-sample batch.
        assert_eq!(warm_up_shapes(&[512], 256).len(), 1);
    }

    #[test]
    fn warm_up_samples_have_distinct_sequences_of_max_bp() {
        let batch = WarmUpBatch {
            largest: 40,
            samples: 3,
            others: 2,
        };
        let samples = batch.samples(150);
        assert_eq!(samples.len(), 3);
        assert_eq!(samples[0].reads.len(), 40);
        assert_eq!(samples[2].reads.len(), 2);
        let distinct: HashSet<&str> = samples[0].reads.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(distinct.len(), 40);
        assert!(samples[0].reads.iter().all(|(s, _)| s.len() == 150));
    }
}
