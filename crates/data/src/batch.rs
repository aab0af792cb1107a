//! §2.5 Batches, built ahead of the consumer on worker threads.
//!
//! A [`Batch`] is plain `Vec`s plus shapes, ready to become tensors:
//! tokens `[B, S, L]` (i64), counts `[B, S, 1]` (f32), the UniFrac block
//! `[B, B]` of exactly the batch's samples in batch order, targets `[B, 1]`,
//! one `[B]` vector of categorical ids per column. Every sample is padded to
//! exactly `token_limit` ASV slots (the reference pads to S, not to the batch
//! maximum). A model that masks empty slots can run on fewer:
//! [`Batch::filled_slots`] and [`Batch::with_slots`] (the training crate's
//! `batch_tensors` uses them).
//!
//! [`BatchLoader::epoch`] returns an iterator whose batches are built by
//! `workers` threads at most `prefetch` batches ahead of the consumer
//! (a claim window guarded by a mutex/condvar; results come back over a
//! channel and are yielded in order). Batch `k` of epoch `e` is a pure
//! function of (dataset, transforms, config, e, k): its membership comes from
//! the epoch's seeded shuffle and its random ASV choice from a ChaCha8 stream
//! of its own, so results do not depend on the number of threads.
//!
//! Differences from the reference: validation keeps its last partial batch by
//! default (ticket TRN-5); with `require_even`, a partial batch of odd size
//! loses its last sample (the UniFrac loss needs pairs; the CLIs demand an
//! even batch size).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::str::FromStr;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::categorical::{CategoricalEncoder, CategoryWeights};
use crate::dataset::Dataset;
use crate::error::{Error, Result};
use crate::hdf5_util::panic_message;
use crate::normalize::{CountNormalizer, TargetNormalizer};

/// How ASVs are chosen when a sample has more than `token_limit` (§2.5).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AsvSampling {
    /// The first `token_limit` in table row order (the reference default).
    #[default]
    First,
    /// The `token_limit` largest counts, descending (ties: table order).
    Abundance,
    /// A fresh random subset each time the sample is batched (augmentation).
    Random,
}

impl fmt::Display for AsvSampling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::First => "first",
            Self::Abundance => "abundance",
            Self::Random => "random",
        })
    }
}

impl FromStr for AsvSampling {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "first" => Ok(Self::First),
            "abundance" => Ok(Self::Abundance),
            "random" => Ok(Self::Random),
            other => Err(Error::InvalidConfig {
                reason: format!(
                    "unknown ASV sampling {other:?}; expected first, abundance or random"
                ),
            }),
        }
    }
}

/// How batches are formed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchConfig {
    /// Samples per batch (B).
    pub batch_size: usize,
    /// ASV slots per sample (S). Default in the CLIs: 1024.
    pub token_limit: usize,
    /// ASV choice beyond `token_limit`.
    pub asv_sampling: AsvSampling,
    /// Shuffle the samples every epoch.
    pub shuffle: bool,
    /// Drop the last partial batch.
    pub drop_last: bool,
    /// Demand an even `batch_size`, and trim odd partial batches.
    pub require_even: bool,
    /// Seed of shuffling and random ASV sampling.
    pub seed: u64,
    /// Worker threads building batches.
    pub workers: usize,
    /// Batches that may be built ahead of the consumer.
    pub prefetch: usize,
}

impl BatchConfig {
    /// Training: shuffle, drop the last partial batch, even batch size.
    pub fn train(batch_size: usize, token_limit: usize, seed: u64) -> Self {
        let workers = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, 4);
        Self {
            batch_size,
            token_limit,
            asv_sampling: AsvSampling::First,
            shuffle: true,
            drop_last: true,
            require_even: true,
            seed,
            workers,
            prefetch: 2 * workers,
        }
    }

    /// Validation: table order, keep the last batch (trimmed to even size).
    pub fn validation(batch_size: usize, token_limit: usize, seed: u64) -> Self {
        Self {
            shuffle: false,
            drop_last: false,
            ..Self::train(batch_size, token_limit, seed)
        }
    }
}

/// Fitted transforms applied when batches are built (saved with a model).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Transforms {
    /// Target normalisation (None: raw targets).
    pub target: Option<TargetNormalizer>,
    /// Categorical encoding (None: no categorical ids).
    pub categorical: Option<CategoricalEncoder>,
    /// Count normalisation (None: raw counts).
    pub counts: Option<CountNormalizer>,
    /// Per-category weights of the target loss (None: every sample 1).
    #[serde(default)]
    pub loss_weights: Option<CategoryWeights>,
}

/// One batch; see the module doc for the layouts.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Sample IDs, in batch order.
    pub sample_ids: Vec<String>,
    /// Dataset positions of the samples.
    pub positions: Vec<usize>,
    /// S, ASV slots per sample.
    pub token_limit: usize,
    /// L, tokens per ASV.
    pub seq_len: usize,
    /// `[B, S, L]` tokens, row-major; padding slots are all 0. One byte per
    /// token (the vocabulary is 0..=6): a batch at the default shape is 1.2 MB
    /// to build and upload, not the 9.9 MB an `i64` copy would be; the backend
    /// widens it to its integer type when the tensor is made.
    pub tokens: Vec<u8>,
    /// `[B, S, 1]` counts (normalised if a count normaliser is set); padding 0.
    pub counts: Vec<f32>,
    /// `[B, B]` UniFrac distances between the batch's samples, batch order.
    pub unifrac: Option<Vec<f32>>,
    /// `[B, 1]` Faith's PD of the batch's samples (`faith_pd` pretraining).
    pub faith_pd: Option<Vec<f32>>,
    /// `[B, 1]` targets (normalised if a target normaliser is set).
    pub targets: Option<Vec<f32>>,
    /// Per categorical column, `[B]` indices (0 = unknown).
    pub categorical_ids: Vec<(String, Vec<i64>)>,
    /// `[B]` weights of the samples' target losses (with
    /// [`Transforms::loss_weights`]).
    pub weights: Option<Vec<f32>>,
}

impl Batch {
    /// B.
    pub fn batch_size(&self) -> usize {
        self.sample_ids.len()
    }

    /// `[B, S, L]`.
    pub fn tokens_shape(&self) -> [usize; 3] {
        [self.batch_size(), self.token_limit, self.seq_len]
    }

    /// `[B, S, 1]`.
    pub fn counts_shape(&self) -> [usize; 3] {
        [self.batch_size(), self.token_limit, 1]
    }

    /// `[B, B]`.
    pub fn unifrac_shape(&self) -> [usize; 2] {
        [self.batch_size(), self.batch_size()]
    }

    /// `[B, 1]`.
    pub fn targets_shape(&self) -> [usize; 2] {
        [self.batch_size(), 1]
    }

    /// One past the last filled slot of any sample: the slots a model that
    /// masks empty slots needs (a slot is filled when any of its tokens is
    /// not padding, §1.1).
    pub fn filled_slots(&self) -> usize {
        let (s, l) = (self.token_limit, self.seq_len);
        if l == 0 {
            return 0;
        }
        self.tokens
            .chunks_exact(s * l)
            .map(|sample| {
                sample
                    .chunks_exact(l)
                    .rposition(|row| row.iter().any(|&t| t != 0))
                    .map_or(0, |last| last + 1)
            })
            .max()
            .unwrap_or(0)
    }

    /// This batch with `slots` ASV slots per sample instead of `token_limit`:
    /// the first `slots` of each sample, or padding slots added.
    ///
    /// # Panics
    /// If a filled slot would be cut off (`slots < filled_slots()`).
    pub fn with_slots(&self, slots: usize) -> Batch {
        let filled = self.filled_slots();
        assert!(
            slots >= filled,
            "with_slots({slots}) would drop filled ASV slots ({filled} are needed)"
        );
        self.copy_slots(slots)
    }

    /// This batch on its filled slots ([`Batch::filled_slots`], at least
    /// one) rounded up to a multiple of `multiple`, at most `token_limit`;
    /// borrowed when that is `token_limit`. One scan of the tokens.
    pub fn without_empty_slots(&self, multiple: usize) -> Cow<'_, Batch> {
        let slots = self
            .filled_slots()
            .max(1)
            .next_multiple_of(multiple)
            .min(self.token_limit);
        if slots == self.token_limit {
            Cow::Borrowed(self)
        } else {
            Cow::Owned(self.copy_slots(slots))
        }
    }

    /// The first `slots` of each sample, or padding slots added (the caller
    /// has checked that no filled slot is cut).
    fn copy_slots(&self, slots: usize) -> Batch {
        let (s, l) = (self.token_limit, self.seq_len);
        let kept = slots.min(s);
        let mut tokens = vec![0u8; self.batch_size() * slots * l];
        let mut counts = vec![0f32; self.batch_size() * slots];
        for (i, (tokens, counts)) in tokens
            .chunks_exact_mut(slots * l)
            .zip(counts.chunks_exact_mut(slots))
            .enumerate()
        {
            tokens[..kept * l].copy_from_slice(&self.tokens[i * s * l..][..kept * l]);
            counts[..kept].copy_from_slice(&self.counts[i * s..][..kept]);
        }
        Batch {
            token_limit: slots,
            tokens,
            counts,
            ..self.clone_without_slots()
        }
    }

    /// How many slots of the batch hold an ASV (any token not padding): the
    /// count loss's denominator.
    pub fn occupied_slots(&self) -> usize {
        let l = self.seq_len.max(1);
        self.tokens
            .chunks_exact(l)
            .filter(|row| row.iter().any(|&t| t != 0))
            .count()
    }

    /// The batch cut into `n` consecutive runs of `B / n` samples (data
    /// parallel training: shard `r` goes to replica `r`). Each shard keeps
    /// `token_limit` and the UniFrac block of its own samples.
    ///
    /// # Panics
    /// If `n` is 0 or does not divide the batch size (the trainer checks it).
    pub fn shards(&self, n: usize) -> Vec<Batch> {
        let b = self.batch_size();
        assert!(
            n > 0 && b % n == 0,
            "a batch of {b} does not split into {n} shards"
        );
        let size = b / n;
        let (s, l) = (self.token_limit, self.seq_len);
        (0..n)
            .map(|r| {
                let rows = r * size..(r + 1) * size;
                Batch {
                    sample_ids: self.sample_ids[rows.clone()].to_vec(),
                    positions: self.positions[rows.clone()].to_vec(),
                    token_limit: s,
                    seq_len: l,
                    tokens: self.tokens[rows.start * s * l..rows.end * s * l].to_vec(),
                    counts: self.counts[rows.start * s..rows.end * s].to_vec(),
                    unifrac: self.unifrac.as_ref().map(|u| {
                        rows.clone()
                            .flat_map(|i| u[i * b + rows.start..i * b + rows.end].iter().copied())
                            .collect()
                    }),
                    faith_pd: self.faith_pd.as_ref().map(|v| v[rows.clone()].to_vec()),
                    targets: self.targets.as_ref().map(|t| t[rows.clone()].to_vec()),
                    categorical_ids: self
                        .categorical_ids
                        .iter()
                        .map(|(col, ids)| (col.clone(), ids[rows.clone()].to_vec()))
                        .collect(),
                    weights: self.weights.as_ref().map(|w| w[rows.clone()].to_vec()),
                }
            })
            .collect()
    }

    /// Everything but the per-slot data (tokens and counts left empty).
    fn clone_without_slots(&self) -> Batch {
        Batch {
            sample_ids: self.sample_ids.clone(),
            positions: self.positions.clone(),
            token_limit: self.token_limit,
            seq_len: self.seq_len,
            tokens: Vec::new(),
            counts: Vec::new(),
            unifrac: self.unifrac.clone(),
            faith_pd: self.faith_pd.clone(),
            targets: self.targets.clone(),
            categorical_ids: self.categorical_ids.clone(),
            weights: self.weights.clone(),
        }
    }
}

/// Forms and builds the batches of a set of samples.
#[derive(Debug, Clone)]
pub struct BatchLoader {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    dataset: Arc<Dataset>,
    transforms: Arc<Transforms>,
    positions: Vec<usize>,
    config: BatchConfig,
    /// Metadata columns of the target normaliser's category key.
    key_columns: Vec<usize>,
    /// Metadata columns of the categorical encoder, in encoder order.
    categorical_columns: Vec<usize>,
}

impl BatchLoader {
    /// Batches over the dataset samples at `positions` (e.g. one side of a
    /// split). Checks the configuration and that the transforms' columns exist.
    pub fn new(
        dataset: Arc<Dataset>,
        positions: Vec<usize>,
        transforms: Arc<Transforms>,
        config: BatchConfig,
    ) -> Result<Self> {
        let invalid = |reason: String| Err(Error::InvalidConfig { reason });
        if config.batch_size == 0
            || config.token_limit == 0
            || config.workers == 0
            || config.prefetch == 0
        {
            return invalid(format!(
                "batch_size, token_limit, workers and prefetch must be >= 1: {config:?}"
            ));
        }
        if config.require_even && config.batch_size % 2 == 1 {
            return invalid(format!(
                "the batch size must be even (got {}); the UniFrac loss compares pairs",
                config.batch_size
            ));
        }
        if let Some(&p) = positions.iter().find(|&&p| p >= dataset.len()) {
            return invalid(format!(
                "position {p} is outside the dataset ({} samples)",
                dataset.len()
            ));
        }
        if positions.is_empty() || (config.drop_last && positions.len() < config.batch_size) {
            return invalid(format!(
                "{} sample(s) do not make one batch of {}",
                positions.len(),
                config.batch_size
            ));
        }
        let mut key_columns = Vec::new();
        let mut categorical_columns = Vec::new();
        if let Some(norm) = &transforms.target {
            if dataset.targets().is_none() {
                return invalid(
                    "a target normaliser is set but the dataset has no target column".into(),
                );
            }
            if let Some(cat) = &norm.category {
                let (meta, rows) = dataset.metadata().ok_or_else(|| Error::InvalidConfig {
                    reason: "per-category normalisation needs metadata".into(),
                })?;
                key_columns = cat
                    .columns
                    .iter()
                    .map(|c| meta.column(c))
                    .collect::<Result<_>>()?;
                let mut unseen: Vec<String> = positions
                    .iter()
                    .filter_map(|&s| rows[s].map(|r| meta.category_key(r, &key_columns)))
                    .filter(|k| !norm.knows_key(k))
                    .collect();
                unseen.sort_unstable();
                unseen.dedup();
                if !unseen.is_empty() {
                    tracing::warn!(
                        "category key(s) unseen in training use the global statistics: {}",
                        crate::error::IdList::new(&unseen)
                    );
                }
            }
        }
        if let Some(enc) = &transforms.categorical {
            let (meta, _) = dataset.metadata().ok_or_else(|| Error::InvalidConfig {
                reason: "categorical encoding needs metadata".into(),
            })?;
            categorical_columns = enc
                .column_names()
                .iter()
                .map(|c| meta.column(c))
                .collect::<Result<_>>()?;
        }
        Ok(Self {
            inner: Arc::new(Inner {
                dataset,
                transforms,
                positions,
                config,
                key_columns,
                categorical_columns,
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &BatchConfig {
        &self.inner.config
    }

    /// Number of batches per epoch.
    pub fn num_batches(&self) -> usize {
        let (n, b) = (self.inner.positions.len(), self.inner.config.batch_size);
        let full = n / b;
        let rest = n % b;
        let rest = if self.inner.config.require_even {
            rest - rest % 2
        } else {
            rest
        };
        full + usize::from(!self.inner.config.drop_last && rest > 0)
    }

    /// The dataset positions of each batch of `epoch`.
    pub fn plan(&self, epoch: u64) -> Vec<Vec<usize>> {
        self.inner.plan(epoch)
    }

    /// Build batch `k` of `epoch` on the calling thread.
    pub fn batch(&self, epoch: u64, k: usize) -> Result<Batch> {
        let plan = self.inner.plan(epoch);
        let members = plan.get(k).ok_or_else(|| Error::InvalidConfig {
            reason: format!("batch {k} of {}", plan.len()),
        })?;
        self.inner.build(members, epoch, k)
    }

    /// Iterate over the batches of `epoch`, built ahead on worker threads.
    pub fn epoch(&self, epoch: u64) -> Prefetch {
        Prefetch::start(self.inner.clone(), epoch, 0)
    }

    /// The batches of `epoch` from batch `first` on (a run resumed inside an
    /// epoch): the same batches as [`BatchLoader::epoch`] yields from there,
    /// without building the ones before.
    pub fn epoch_from(&self, epoch: u64, first: usize) -> Prefetch {
        Prefetch::start(self.inner.clone(), epoch, first)
    }
}

impl Inner {
    fn plan(&self, epoch: u64) -> Vec<Vec<usize>> {
        let mut order = self.positions.clone();
        if self.config.shuffle {
            let mut rng = ChaCha8Rng::seed_from_u64(self.config.seed);
            rng.set_stream(epoch);
            order.shuffle(&mut rng);
        }
        let mut plan: Vec<Vec<usize>> = order
            .chunks(self.config.batch_size)
            .map(<[usize]>::to_vec)
            .collect();
        if let Some(last) = plan.last_mut() {
            if last.len() < self.config.batch_size {
                if self.config.drop_last {
                    plan.pop();
                } else if self.config.require_even && last.len() % 2 == 1 {
                    last.pop();
                    if last.is_empty() {
                        plan.pop();
                    }
                }
            }
        }
        plan
    }

    fn build(&self, members: &[usize], epoch: u64, k: usize) -> Result<Batch> {
        let d = &self.dataset;
        let (s_max, l) = (self.config.token_limit, d.seq_len());
        let b = members.len();
        let mut tokens = vec![0u8; b * s_max * l];
        let mut counts = vec![0f32; b * s_max];
        let mut rng = ChaCha8Rng::seed_from_u64(self.config.seed ^ 0x5eed_a5a5_0f0f_3c3c);
        rng.set_stream((epoch << 32) ^ k as u64);
        let mut chosen: Vec<usize> = Vec::with_capacity(s_max);
        for (bi, &s) in members.iter().enumerate() {
            let (asvs, cnts) = d.sample(s);
            select_asvs(cnts, s_max, self.config.asv_sampling, &mut rng, &mut chosen);
            let sample_tokens = &mut tokens[bi * s_max * l..(bi + 1) * s_max * l];
            let sample_counts = &mut counts[bi * s_max..(bi + 1) * s_max];
            for (slot, &a) in chosen.iter().enumerate() {
                sample_tokens[slot * l..(slot + 1) * l]
                    .copy_from_slice(d.tokens().row(asvs[a] as usize));
                let c = cnts[a];
                sample_counts[slot] = match &self.transforms.counts {
                    Some(n) => n.normalize(c as f64) as f32,
                    None => c,
                };
            }
        }
        let unifrac = d.unifrac().map(|(m, rows)| {
            let batch_rows: Vec<usize> = members.iter().map(|&s| rows[s]).collect();
            let mut block = Vec::new();
            m.block_into(&batch_rows, &mut block);
            block
        });
        let faith_pd = d
            .faith_pd()
            .map(|(v, rows)| members.iter().map(|&s| v.get(rows[s])).collect());
        let targets = d.targets().map(|raw| {
            members
                .iter()
                .map(|&s| match &self.transforms.target {
                    None => raw[s] as f32,
                    Some(norm) => {
                        let key = self.category_key(s);
                        norm.normalize(raw[s], key.as_deref()) as f32
                    }
                })
                .collect()
        });
        let categorical_ids = match (&self.transforms.categorical, d.metadata()) {
            (Some(enc), Some((meta, rows))) => enc
                .column_names()
                .iter()
                .enumerate()
                .map(|(ci, name)| {
                    let col = self.categorical_columns[ci];
                    let ids = members
                        .iter()
                        .map(|&s| enc.encode(ci, rows[s].and_then(|r| meta.value(r, col))))
                        .collect();
                    (name.clone(), ids)
                })
                .collect(),
            _ => Vec::new(),
        };
        let weights = match (&self.transforms.loss_weights, d.metadata()) {
            (Some(w), Some((meta, rows))) => {
                let column = meta.column(&w.column)?;
                Some(
                    members
                        .iter()
                        .map(|&s| w.weight(rows[s].and_then(|r| meta.value(r, column))) as f32)
                        .collect(),
                )
            }
            _ => None,
        };
        Ok(Batch {
            sample_ids: members.iter().map(|&s| d.sample_ids()[s].clone()).collect(),
            positions: members.to_vec(),
            token_limit: s_max,
            seq_len: l,
            tokens,
            counts,
            unifrac,
            faith_pd,
            targets,
            categorical_ids,
            weights,
        })
    }

    fn category_key(&self, s: usize) -> Option<String> {
        if self.key_columns.is_empty() {
            return None;
        }
        let (meta, rows) = self.dataset.metadata()?;
        rows[s].map(|r| meta.category_key(r, &self.key_columns))
    }
}

/// The ASVs (indices into a sample's list) that a batch puts in its slots,
/// in slot order, under the deterministic rules (`first`, `abundance`);
/// `None` for `random`, whose choice depends on the batch.
pub fn slot_asvs(counts: &[f32], limit: usize, sampling: AsvSampling) -> Option<Vec<usize>> {
    if sampling == AsvSampling::Random && counts.len() > limit {
        return None;
    }
    let mut out = Vec::new();
    select_asvs(
        counts,
        limit,
        sampling,
        &mut ChaCha8Rng::seed_from_u64(0),
        &mut out,
    );
    Some(out)
}

/// Indices (into the sample's ASV list) of the ASVs to batch, in slot order.
fn select_asvs(
    counts: &[f32],
    limit: usize,
    sampling: AsvSampling,
    rng: &mut ChaCha8Rng,
    out: &mut Vec<usize>,
) {
    out.clear();
    let n = counts.len();
    if n <= limit {
        out.extend(0..n);
        return;
    }
    match sampling {
        AsvSampling::First => out.extend(0..limit),
        AsvSampling::Abundance => {
            out.extend(0..n);
            // Stable: equal counts keep table order.
            out.sort_by(|&a, &b| counts[b].total_cmp(&counts[a]));
            out.truncate(limit);
        }
        AsvSampling::Random => {
            out.extend(0..n);
            for j in 0..limit {
                let r = rng.random_range(j..n);
                out.swap(j, r);
            }
            out.truncate(limit);
        }
    }
}

/// Batches of one epoch, in order, built by worker threads; dropping it stops
/// and joins the workers.
pub struct Prefetch {
    results: Receiver<(usize, Result<Batch>)>,
    pending: BTreeMap<usize, Result<Batch>>,
    next: usize,
    total: usize,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<Claims>,
    wake: Condvar,
}

struct Claims {
    claimed: usize,
    consumed: usize,
    stop: bool,
}

impl Prefetch {
    fn start(inner: Arc<Inner>, epoch: u64, first: usize) -> Self {
        let plan = Arc::new(inner.plan(epoch));
        let total = plan.len();
        let first = first.min(total);
        let window = inner.config.prefetch;
        let shared = Arc::new(Shared {
            state: Mutex::new(Claims {
                claimed: first,
                consumed: first,
                stop: false,
            }),
            wake: Condvar::new(),
        });
        let (tx, results) = channel();
        let workers = (0..inner.config.workers.min((total - first).max(1)))
            .map(|_| {
                let (inner, plan, shared, tx) =
                    (inner.clone(), plan.clone(), shared.clone(), tx.clone());
                std::thread::spawn(move || loop {
                    let k = {
                        let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
                        loop {
                            if st.stop || st.claimed >= total {
                                return;
                            }
                            if st.claimed < st.consumed + window {
                                st.claimed += 1;
                                break st.claimed - 1;
                            }
                            st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
                        }
                    };
                    let result = catch_unwind(AssertUnwindSafe(|| inner.build(&plan[k], epoch, k)))
                        .unwrap_or_else(|p| {
                            Err(Error::WorkerPanic {
                                batch: k,
                                message: panic_message(&p),
                            })
                        });
                    if tx.send((k, result)).is_err() {
                        return;
                    }
                })
            })
            .collect();
        Self {
            results,
            pending: BTreeMap::new(),
            next: first,
            total,
            shared,
            workers,
        }
    }

    /// Number of batches in the epoch.
    pub fn len(&self) -> usize {
        self.total
    }

    /// True for an epoch without batches.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }
}

impl Iterator for Prefetch {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if self.next >= self.total {
            return None;
        }
        loop {
            if let Some(batch) = self.pending.remove(&self.next) {
                self.next += 1;
                self.shared
                    .state
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .consumed += 1;
                self.shared.wake.notify_all();
                return Some(batch);
            }
            match self.results.recv() {
                Ok((k, batch)) => {
                    self.pending.insert(k, batch);
                }
                Err(_) => {
                    let batch = self.next;
                    self.next = self.total;
                    return Some(Err(Error::WorkerPanic {
                        batch,
                        message: "the batch workers exited early".into(),
                    }));
                }
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.total - self.next;
        (left, Some(left))
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stop = true;
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::biom::BiomTable;
    use crate::dataset::tests::{matrix, meta};
    use crate::normalize::TargetTransform;
    use crate::unifrac::MissingPolicy;

    /// 10 samples; sample i has ASVs 0..=i (count k+1 for ASV k) and age 10*i.
    fn dataset() -> Arc<Dataset> {
        let (mut o, mut s, mut v) = (vec![], vec![], vec![]);
        for i in 0..10u32 {
            for k in 0..=i {
                o.push(k);
                s.push(i);
                v.push((k + 1) as f64);
            }
        }
        let bases = ['A', 'C', 'G', 'T'];
        // Distinct sequences: the base-4 digits of k.
        let asvs: Vec<String> = (0..10)
            .map(|k| (0..6).map(|p| bases[(k >> (2 * p)) % 4]).collect())
            .collect();
        let ids: Vec<String> = (0..10).map(|i| format!("s{i}")).collect();
        let t = BiomTable::from_triplets("t", ids.clone(), asvs, &o, &s, &v).unwrap();
        // The matrix and metadata list the samples in reverse order.
        let rev: Vec<&str> = ids.iter().rev().map(String::as_str).collect();
        let m = Arc::new(matrix(&rev));
        let mut text = "sample_name\tage\tsite\n".to_string();
        for i in (0..10).rev() {
            text += &format!(
                "s{i}\t{}\t{}\n",
                10 * i,
                if i % 2 == 0 { "gut" } else { "skin" }
            );
        }
        let d = Dataset::builder(&t)
            .max_bp(5)
            .unifrac(m, MissingPolicy::Error)
            .metadata(meta(&text))
            .target("age", MissingPolicy::Error);
        Arc::new(d.build().unwrap())
    }

    fn config(batch_size: usize, token_limit: usize) -> BatchConfig {
        BatchConfig {
            workers: 3,
            prefetch: 2,
            ..BatchConfig::train(batch_size, token_limit, 11)
        }
    }

    #[test]
    fn layout_padding_and_unifrac_block_by_id() {
        let d = dataset();
        let loader = BatchLoader::new(
            d.clone(),
            vec![1, 4],
            Arc::default(),
            BatchConfig::validation(2, 3, 0),
        )
        .unwrap();
        let b = loader.batch(0, 0).unwrap();
        assert_eq!(b.sample_ids, vec!["s1", "s4"]);
        assert_eq!(b.tokens_shape(), [2, 3, 6]);
        assert_eq!(b.tokens.len(), 2 * 3 * 6);
        // s1 has 2 ASVs: slot 2 is padding.
        assert_eq!(&b.tokens[0..6], d.tokens().row(0));
        assert!(b.tokens[12..18].iter().all(|&t| t == 0));
        assert_eq!(&b.counts[0..3], &[1.0, 2.0, 0.0]);
        // s4 has 5 ASVs, first 3 kept (reference default).
        assert_eq!(&b.counts[3..6], &[1.0, 2.0, 3.0]);
        let (m, _) = d.unifrac().unwrap();
        let u = b.unifrac.as_ref().unwrap();
        assert_eq!(b.unifrac_shape(), [2, 2]);
        assert_eq!(u[1], m.distance("s1", "s4").unwrap());
        assert_eq!(u[2], m.distance("s4", "s1").unwrap());
        assert_eq!(u[0], 0.0);
        assert_eq!(b.targets, Some(vec![10.0, 40.0]));
    }

    /// Samples with 2 and 4 of 6 slots filled: 4 slots are needed, and a
    /// batch cut to them (or widened) keeps every sample's slots in place;
    /// `without_empty_slots` rounds the 4 up, within the 6.
    #[test]
    fn filled_slots_and_with_slots() {
        let d = dataset();
        let loader = BatchLoader::new(
            d,
            vec![1, 3],
            Arc::default(),
            BatchConfig::validation(2, 6, 0),
        )
        .unwrap();
        let b = loader.batch(0, 0).unwrap();
        assert_eq!(b.filled_slots(), 4);
        let (l, s) = (b.seq_len, b.token_limit);
        for slots in [4, 5, 8] {
            let cut = b.with_slots(slots);
            assert_eq!(cut.tokens_shape(), [2, slots, l]);
            assert_eq!(cut.counts_shape(), [2, slots, 1]);
            assert_eq!(cut.filled_slots(), 4);
            for i in 0..2 {
                for slot in 0..slots {
                    let row = &cut.tokens[(i * slots + slot) * l..][..l];
                    let count = cut.counts[i * slots + slot];
                    if slot < s {
                        assert_eq!(row, &b.tokens[(i * s + slot) * l..][..l]);
                        assert_eq!(count, b.counts[i * s + slot]);
                    } else {
                        assert!(row.iter().all(|&t| t == 0) && count == 0.0);
                    }
                }
            }
            assert_eq!(
                (&cut.sample_ids, &cut.unifrac, &cut.targets),
                (&b.sample_ids, &b.unifrac, &b.targets)
            );
        }
        // Rounded up to a multiple, within token_limit (else the batch itself).
        let trimmed = b.without_empty_slots(4);
        assert!(matches!(trimmed, Cow::Owned(_)));
        assert_eq!(*trimmed, b.with_slots(4));
        assert!(matches!(b.without_empty_slots(8), Cow::Borrowed(_)));
        let dropped = std::panic::catch_unwind(|| b.with_slots(3));
        assert!(dropped.is_err(), "cutting a filled slot must panic");
    }

    /// Shards are the batch's consecutive samples, each with the UniFrac block
    /// of its own samples: the batch of those samples, built directly.
    #[test]
    fn shards_are_the_batches_of_their_samples() {
        let d = dataset();
        let positions = vec![7, 2, 9, 4, 1, 5];
        let build = |positions: Vec<usize>| {
            BatchLoader::new(
                d.clone(),
                positions.clone(),
                Arc::default(),
                BatchConfig::validation(positions.len(), 6, 0),
            )
            .unwrap()
            .batch(0, 0)
            .unwrap()
        };
        let whole = build(positions.clone());
        assert_eq!(whole.occupied_slots(), 6 + 3 + 6 + 5 + 2 + 6);
        let shards = whole.shards(3);
        assert_eq!(shards.len(), 3);
        for (r, shard) in shards.iter().enumerate() {
            assert_eq!(*shard, build(positions[2 * r..2 * r + 2].to_vec()));
        }
        assert_eq!(
            shards.iter().map(Batch::occupied_slots).sum::<usize>(),
            whole.occupied_slots()
        );
        assert_eq!(whole.shards(1), vec![whole.clone()]);
    }

    #[test]
    fn asv_sampling_modes() {
        let counts = [1.0, 5.0, 3.0, 5.0, 2.0];
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let mut out = Vec::new();
        select_asvs(&counts, 3, AsvSampling::First, &mut rng, &mut out);
        assert_eq!(out, vec![0, 1, 2]);
        select_asvs(&counts, 3, AsvSampling::Abundance, &mut rng, &mut out);
        assert_eq!(out, vec![1, 3, 2]);
        select_asvs(&counts, 10, AsvSampling::Abundance, &mut rng, &mut out);
        assert_eq!(out, vec![0, 1, 2, 3, 4]);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..50 {
            select_asvs(&counts, 2, AsvSampling::Random, &mut rng, &mut out);
            assert_eq!(out.len(), 2);
            assert_ne!(out[0], out[1]);
            seen.insert(out.clone());
        }
        assert!(seen.len() > 5, "random sampling should vary: {seen:?}");
    }

    #[test]
    fn prefetched_epoch_equals_synchronous_batches_and_is_seeded() {
        let d = dataset();
        let mut cfg = config(2, 4);
        cfg.asv_sampling = AsvSampling::Random;
        let loader = BatchLoader::new(d.clone(), (0..10).collect(), Arc::default(), cfg).unwrap();
        assert_eq!(loader.num_batches(), 5);
        let a: Vec<Batch> = loader.epoch(3).map(|b| b.unwrap()).collect();
        let b: Vec<Batch> = (0..5).map(|k| loader.batch(3, k).unwrap()).collect();
        assert_eq!(a, b);
        let mut members: Vec<usize> = a.iter().flat_map(|b| b.positions.clone()).collect();
        members.sort_unstable();
        assert_eq!(members, (0..10).collect::<Vec<_>>());
        assert_ne!(loader.plan(3), loader.plan(4), "epochs reshuffle");
        let c: Vec<Batch> = loader.epoch(3).map(|b| b.unwrap()).collect();
        assert_eq!(a, c);
        // Starting inside the epoch gives the same batches from there on.
        let d: Vec<Batch> = loader.epoch_from(3, 2).map(|b| b.unwrap()).collect();
        assert_eq!(d, a[2..]);
        assert_eq!(loader.epoch_from(3, 5).count(), 0);
    }

    #[test]
    fn dropping_an_epoch_early_stops_the_workers() {
        let d = dataset();
        let loader = BatchLoader::new(d, (0..10).collect(), Arc::default(), config(2, 4)).unwrap();
        let mut it = loader.epoch(0);
        assert!(it.next().unwrap().is_ok());
        drop(it); // must not hang
    }

    #[test]
    fn even_batches_and_partial_batches() {
        let d = dataset();
        let positions: Vec<usize> = (0..9).collect();
        let err = BatchLoader::new(d.clone(), positions.clone(), Arc::default(), config(3, 4))
            .unwrap_err();
        assert!(err.to_string().contains("must be even"), "{err}");
        let train =
            BatchLoader::new(d.clone(), positions.clone(), Arc::default(), config(4, 4)).unwrap();
        assert_eq!(
            train.plan(0).iter().map(Vec::len).collect::<Vec<_>>(),
            vec![4, 4]
        );
        let val = BatchLoader::new(
            d.clone(),
            positions.clone(),
            Arc::default(),
            BatchConfig::validation(4, 4, 0),
        )
        .unwrap();
        // 9 = 4 + 4 + 1; the odd remainder of 1 is trimmed away entirely.
        assert_eq!(
            val.plan(0).iter().map(Vec::len).collect::<Vec<_>>(),
            vec![4, 4]
        );
        let val = BatchLoader::new(
            d.clone(),
            (0..7).collect(),
            Arc::default(),
            BatchConfig::validation(4, 4, 0),
        )
        .unwrap();
        assert_eq!(
            val.plan(0).iter().map(Vec::len).collect::<Vec<_>>(),
            vec![4, 2]
        );
        assert_eq!(val.num_batches(), 2);
        let odd_ok = BatchConfig {
            require_even: false,
            ..BatchConfig::validation(3, 4, 0)
        };
        let val = BatchLoader::new(d.clone(), (0..7).collect(), Arc::default(), odd_ok).unwrap();
        assert_eq!(
            val.plan(0).iter().map(Vec::len).collect::<Vec<_>>(),
            vec![3, 3, 1]
        );
        assert_eq!(val.epoch(0).count(), 3);
        assert!(BatchLoader::new(d, vec![0, 1], Arc::default(), config(4, 4)).is_err());
    }

    #[test]
    fn transforms_are_applied() {
        let d = dataset();
        let train: Vec<usize> = (0..8).collect();
        let transforms = Transforms {
            target: Some(
                d.fit_target_normalizer(TargetTransform::MinMax, &[], &train)
                    .unwrap(),
            ),
            categorical: Some(d.fit_categorical(&["site".to_string()], &train).unwrap()),
            counts: Some(d.fit_count_normalizer(&train).unwrap()),
            // Balanced over 3 gut and 1 skin samples: N / (K n_k).
            loss_weights: Some(d.fit_loss_weights("site", &[0, 2, 4, 1]).unwrap()),
        };
        let loader = BatchLoader::new(
            d.clone(),
            vec![0, 9],
            Arc::new(transforms),
            BatchConfig::validation(2, 3, 0),
        )
        .unwrap();
        let b = loader.batch(0, 0).unwrap();
        // Ages 0 and 90 with training range [0, 70].
        assert_eq!(b.targets, Some(vec![0.0, 90.0 / 70.0]));
        // gut = 1, skin = 2.
        assert_eq!(b.categorical_ids, vec![("site".to_string(), vec![1, 2])]);
        assert_eq!(b.weights, Some(vec![4.0 / 6.0, 2.0]));
        // Counts 1..=8 in training: (c - 1) / 7; padding stays 0.
        assert_eq!(&b.counts[0..3], &[0.0, 0.0, 0.0]);
        assert_eq!(&b.counts[3..6], &[0.0, 1.0 / 7.0, 2.0 / 7.0]);
    }
}
