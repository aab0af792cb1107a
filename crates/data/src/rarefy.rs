//! §2.2 Rarefaction: subsample every sample to exactly `depth` reads, without
//! replacement; samples shallower than `depth` are dropped, and observations
//! left with no read anywhere are removed.
//!
//! Each sample's reads are numbered `0..total` (observation by observation, in
//! table row order) and a uniformly random subset of `depth` of them is drawn
//! by a partial Fisher-Yates shuffle: over an explicit array of read labels
//! when the sample is small enough, over a sparse "virtual" array (a hash map
//! of the swapped slots) otherwise. When `depth > total / 2` the complement
//! (the reads *not* kept) is drawn instead, which is the same distribution for
//! half the work. This is the distribution of biom's `subsample` (the
//! multivariate hypergeometric); the draws themselves differ (§2.2: bit-exact
//! reproduction would need NumPy's generator).
//!
//! Determinism: a sample's draw depends only on its own reads, its ID, the
//! depth and the seed: it draws from ChaCha8 seeded with `seed` on the stream
//! FNV-1a(ID), and its reads are numbered in the byte order of their
//! sequences (observation IDs), not in table row order. So a sample rarefies
//! the same whether it comes in a training table, another table, alone
//! through [`rarefy_sample`] (the library and `aam-rs serve`), on any thread.

use std::collections::HashMap;

use rand::Rng;
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::biom::BiomTable;
use crate::error::{Error, Result};

/// The random stream of a sample: FNV-1a (64 bit) of its ID's bytes.
fn sample_stream(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Checks that a sample deep enough to keep has integer counts.
fn integer_counts<'a>(
    sample: &str,
    counts: &[f64],
    observation: impl Fn(usize) -> &'a str,
) -> Result<()> {
    match counts
        .iter()
        .position(|v| v.fract() != 0.0 || *v > (1u64 << 53) as f64)
    {
        Some(k) => Err(Error::NonIntegerCount {
            sample: sample.to_string(),
            observation: observation(k).to_string(),
            value: counts[k],
        }),
        None => Ok(()),
    }
}

/// Rarefies one sample given as its reads per sequence: `Ok(None)` when it
/// has fewer than `depth` reads, else the kept reads of each sequence (in
/// the order given; zeros included). The same draw as
/// [`BiomTable::rarefy`] makes for a sample with this ID and these reads.
///
/// Errors: depth 0; a non-integer count in a sample deep enough to keep.
pub fn rarefy_sample<S: AsRef<str>>(
    id: &str,
    sequences: &[S],
    counts: &[f64],
    depth: u64,
    seed: u64,
) -> Result<Option<Vec<f64>>> {
    if depth == 0 {
        return Err(Error::ZeroDepth);
    }
    assert_eq!(sequences.len(), counts.len(), "one count per sequence");
    if counts.iter().sum::<f64>() < depth as f64 {
        return Ok(None);
    }
    integer_counts(id, counts, |k| sequences[k].as_ref())?;
    let mut drawn = Vec::new();
    draw_sample(
        id,
        counts,
        |k| sequences[k].as_ref(),
        depth,
        seed,
        &mut Scratch::default(),
        &mut drawn,
    );
    Ok(Some(drawn.into_iter().map(|n| n as f64).collect()))
}

/// The draw of one sample (see the module doc): `out[k]` receives the kept
/// reads of category `k`, whose sequence is `sequence(k)`.
fn draw_sample<'a>(
    id: &str,
    counts: &[f64],
    sequence: impl Fn(usize) -> &'a str,
    depth: u64,
    seed: u64,
    scratch: &mut Scratch,
    out: &mut Vec<u64>,
) {
    let mut order: Vec<usize> = (0..counts.len()).collect();
    order.sort_by(|&a, &b| sequence(a).cmp(sequence(b)));
    let sorted: Vec<u64> = order.iter().map(|&k| counts[k] as u64).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(sample_stream(id));
    let mut drawn = std::mem::take(&mut scratch.drawn);
    draw_without_replacement(&sorted, depth, &mut rng, scratch, &mut drawn);
    out.clear();
    out.resize(counts.len(), 0);
    for (&k, &n) in order.iter().zip(&drawn) {
        out[k] = n;
    }
    scratch.drawn = drawn;
}

/// Samples up to this many reads are shuffled in an explicit label array
/// (4 bytes per read); deeper ones use the sparse virtual array.
const DENSE_MAX_READS: u64 = 1 << 22;

/// Below this many samples the work is done on the calling thread.
const PARALLEL_MIN_SAMPLES: usize = 256;

/// A rarefied table and the samples that were too shallow.
#[derive(Debug, Clone)]
pub struct Rarefied {
    /// The rarefied table: every sample sums to the depth.
    pub table: BiomTable,
    /// IDs of the samples dropped because their total was below the depth.
    pub dropped: Vec<String>,
}

impl BiomTable {
    /// Rarefy to `depth` reads per sample, without replacement, with `seed`.
    ///
    /// Errors: depth 0; a non-integer count in a sample deep enough to keep
    /// (names the sample and observation); no sample reaching `depth`.
    pub fn rarefy(&self, depth: u64, seed: u64) -> Result<Rarefied> {
        if depth == 0 {
            return Err(Error::ZeroDepth);
        }
        let mut kept = Vec::new();
        let mut dropped = Vec::new();
        let mut max_depth = 0f64;
        for s in 0..self.n_samples() {
            let sample = self.sample(s);
            let total = sample.total();
            max_depth = max_depth.max(total);
            if total >= depth as f64 {
                integer_counts(&self.sample_ids()[s], sample.counts, |k| {
                    &self.observation_ids()[sample.observations[k] as usize]
                })?;
                kept.push(s);
            } else {
                dropped.push(self.sample_ids()[s].clone());
            }
        }
        if kept.is_empty() {
            return Err(Error::RarefiedEmpty {
                depth,
                samples: self.n_samples(),
                max_depth,
            });
        }

        let threads = if kept.len() < PARALLEL_MIN_SAMPLES {
            1
        } else {
            std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(16)
        };
        let chunk = kept.len().div_ceil(threads);
        let parts: Vec<(Vec<usize>, Vec<u32>, Vec<f64>)> = if threads == 1 {
            vec![rarefy_samples(self, &kept, depth, seed)]
        } else {
            std::thread::scope(|scope| {
                let handles: Vec<_> = kept
                    .chunks(chunk)
                    .map(|part| scope.spawn(move || rarefy_samples(self, part, depth, seed)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                    .collect()
            })
        };

        let mut indptr = Vec::with_capacity(kept.len() + 1);
        indptr.push(0);
        let (mut indices, mut data) = (Vec::new(), Vec::new());
        for (lengths, part_indices, part_data) in parts {
            for len in lengths {
                indptr.push(indptr[indptr.len() - 1] + len);
            }
            indices.extend(part_indices);
            data.extend(part_data);
        }
        let sample_ids = kept.iter().map(|&s| self.sample_ids()[s].clone()).collect();
        let table = BiomTable::with_used_observations(
            self.source().to_path_buf(),
            sample_ids,
            self.observation_ids(),
            indptr,
            indices,
            data,
        );
        Ok(Rarefied { table, dropped })
    }
}

/// Rarefy the samples at `positions`; returns (per-sample nnz, indices, counts).
fn rarefy_samples(
    table: &BiomTable,
    positions: &[usize],
    depth: u64,
    seed: u64,
) -> (Vec<usize>, Vec<u32>, Vec<f64>) {
    let mut lengths = Vec::with_capacity(positions.len());
    let mut indices = Vec::new();
    let mut data = Vec::new();
    let mut drawn: Vec<u64> = Vec::new();
    let mut scratch = Scratch::default();
    for &s in positions {
        let sample = table.sample(s);
        draw_sample(
            &table.sample_ids()[s],
            sample.counts,
            |k| &table.observation_ids()[sample.observations[k] as usize],
            depth,
            seed,
            &mut scratch,
            &mut drawn,
        );
        let before = indices.len();
        for (k, &n) in drawn.iter().enumerate() {
            if n > 0 {
                indices.push(sample.observations[k]);
                data.push(n as f64);
            }
        }
        lengths.push(indices.len() - before);
    }
    (lengths, indices, data)
}

/// Reusable buffers of one worker.
#[derive(Default)]
struct Scratch {
    labels: Vec<u32>,
    drawn: Vec<u64>,
    swapped: HashMap<u64, u64>,
    cumulative: Vec<u64>,
}

/// Draw `depth` of the `sum(counts)` reads uniformly without replacement;
/// `out[k]` receives how many reads of category `k` were drawn.
/// Requires `depth <= sum(counts)`.
fn draw_without_replacement(
    counts: &[u64],
    depth: u64,
    rng: &mut ChaCha8Rng,
    scratch: &mut Scratch,
    out: &mut Vec<u64>,
) {
    let total: u64 = counts.iter().sum();
    debug_assert!(depth <= total);
    out.clear();
    // Draw the smaller of the kept set and its complement.
    let complement = depth > total / 2;
    let draws = if complement { total - depth } else { depth };
    out.resize(counts.len(), 0);
    if draws > 0 {
        if total <= DENSE_MAX_READS {
            draw_dense(counts, total, draws, rng, scratch, out);
        } else {
            draw_sparse(counts, total, draws, rng, scratch, out);
        }
    }
    if complement {
        for (o, &c) in out.iter_mut().zip(counts) {
            *o = c - *o;
        }
    }
}

/// Partial Fisher-Yates over an explicit array of read labels.
fn draw_dense(
    counts: &[u64],
    total: u64,
    draws: u64,
    rng: &mut ChaCha8Rng,
    scratch: &mut Scratch,
    out: &mut [u64],
) {
    let labels = &mut scratch.labels;
    labels.clear();
    labels.reserve(total as usize);
    for (k, &c) in counts.iter().enumerate() {
        labels.extend(std::iter::repeat_n(k as u32, c as usize));
    }
    let n = labels.len();
    for j in 0..draws as usize {
        let r = rng.random_range(j..n);
        labels.swap(j, r);
        out[labels[j] as usize] += 1;
    }
}

/// Partial Fisher-Yates over the virtual array `0..total`, storing only the
/// slots that were swapped; each drawn read position is mapped to its category
/// by binary search in the cumulative counts.
fn draw_sparse(
    counts: &[u64],
    total: u64,
    draws: u64,
    rng: &mut ChaCha8Rng,
    scratch: &mut Scratch,
    out: &mut [u64],
) {
    let cumulative = &mut scratch.cumulative;
    cumulative.clear();
    let mut acc = 0;
    for &c in counts {
        acc += c;
        cumulative.push(acc);
    }
    let swapped = &mut scratch.swapped;
    swapped.clear();
    for j in 0..draws {
        let r = rng.random_range(j..total);
        let at_j = *swapped.get(&j).unwrap_or(&j);
        let at_r = *swapped.get(&r).unwrap_or(&r);
        swapped.insert(r, at_j);
        // Slot j now holds at_r: that read is drawn. Slot j is never visited again.
        let category = cumulative.partition_point(|&c| c <= at_r);
        out[category] += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::biom::tests::small;

    fn table(counts: &[&[f64]]) -> BiomTable {
        let (mut o, mut s, mut v) = (vec![], vec![], vec![]);
        for (si, row) in counts.iter().enumerate() {
            for (oi, &c) in row.iter().enumerate() {
                o.push(oi as u32);
                s.push(si as u32);
                v.push(c);
            }
        }
        let samples = (0..counts.len()).map(|i| format!("S{i}")).collect();
        let obs = (0..counts.iter().map(|r| r.len()).max().unwrap_or(0))
            .map(|i| format!("O{i}"))
            .collect();
        BiomTable::from_triplets("t", samples, obs, &o, &s, &v).unwrap()
    }

    #[test]
    fn depth_respected_and_shallow_samples_dropped() {
        // S1 = 4 reads, S2 = 5, S3 = 6.
        let r = small().rarefy(5, 7).unwrap();
        assert_eq!(r.dropped, vec!["S1".to_string()]);
        assert_eq!(r.table.sample_ids(), &["S2".to_string(), "S3".to_string()]);
        assert_eq!(r.table.sample_totals(), vec![5.0, 5.0]);
        // S2 had exactly 5 reads: kept unchanged.
        assert_eq!(r.table.sample(0).counts, &[5.0]);
        // Observation GGGG (only in S1) is gone.
        assert!(!r.table.observation_ids().contains(&"GGGG".to_string()));
    }

    #[test]
    fn seeded_determinism() {
        let t = table(&[
            &[30.0, 50.0, 20.0, 7.0],
            &[1.0, 99.0, 40.0, 0.0],
            &[10.0, 10.0, 10.0, 10.0],
        ]);
        let a = t.rarefy(25, 42).unwrap();
        let b = t.rarefy(25, 42).unwrap();
        assert_eq!(a.table, b.table);
        let differs = (0..20).any(|seed| t.rarefy(25, seed).unwrap().table != a.table);
        assert!(differs, "different seeds should give different draws");
    }

    #[test]
    fn draws_never_exceed_available_reads() {
        let t = table(&[&[3.0, 1.0, 200.0, 2.0]]);
        for seed in 0..50 {
            for depth in [1, 5, 100, 150, 206] {
                let r = t.rarefy(depth, seed).unwrap();
                let s = r.table.sample(0);
                assert_eq!(s.total(), depth as f64);
                for (&o, &c) in s.observations.iter().zip(s.counts) {
                    // Observations are renumbered after pruning: compare by ID.
                    let id = &r.table.observation_ids()[o as usize];
                    let k = t.observation_ids().iter().position(|x| x == id).unwrap();
                    let original = t.sample(0).counts[t
                        .sample(0)
                        .observations
                        .iter()
                        .position(|&x| x as usize == k)
                        .unwrap()];
                    assert!(c <= original, "drew {c} > {original} of {id}");
                }
            }
        }
    }

    /// Both the dense and the sparse path must follow the hypergeometric
    /// means: E[drawn_k] = depth * c_k / total.
    #[test]
    fn draws_are_unbiased_in_both_paths() {
        let counts = [10u64, 30, 60];
        for (depth, force_sparse) in [(20u64, false), (20, true), (80, false), (80, true)] {
            let mut sums = [0f64; 3];
            let trials = 4000;
            let mut scratch = Scratch::default();
            let mut out = Vec::new();
            for t in 0..trials {
                let mut rng = ChaCha8Rng::seed_from_u64(t);
                let total: u64 = counts.iter().sum();
                let complement = depth > total / 2;
                let draws = if complement { total - depth } else { depth };
                out.clear();
                out.resize(3, 0);
                if force_sparse {
                    draw_sparse(&counts, total, draws, &mut rng, &mut scratch, &mut out);
                } else {
                    draw_dense(&counts, total, draws, &mut rng, &mut scratch, &mut out);
                }
                if complement {
                    for (o, &c) in out.iter_mut().zip(&counts) {
                        *o = c - *o;
                    }
                }
                assert_eq!(out.iter().sum::<u64>(), depth);
                for k in 0..3 {
                    sums[k] += out[k] as f64;
                }
            }
            for k in 0..3 {
                let mean = sums[k] / trials as f64;
                let expected = depth as f64 * counts[k] as f64 / 100.0;
                assert!(
                    (mean - expected).abs() < 0.05 * expected + 0.1,
                    "k={k} depth={depth} sparse={force_sparse}: {mean} vs {expected}"
                );
            }
        }
    }

    #[test]
    fn errors() {
        assert!(matches!(small().rarefy(0, 1), Err(Error::ZeroDepth)));
        let err = small().rarefy(100, 1).unwrap_err();
        assert!(
            matches!(
                err,
                Error::RarefiedEmpty {
                    depth: 100,
                    samples: 3,
                    ..
                }
            ),
            "{err}"
        );
        let t = table(&[&[1.5, 3.0]]);
        let err = t.rarefy(2, 1).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("\"S0\"") && msg.contains("\"O0\"") && msg.contains("1.5"),
            "{msg}"
        );
    }

    #[test]
    fn parallel_path_matches_single_sample_draws() {
        // Enough samples for the threaded path; each sample must equal the draw
        // made for it alone, whatever the chunking.
        let rows: Vec<Vec<f64>> = (0..(PARALLEL_MIN_SAMPLES + 10))
            .map(|i| vec![(i % 7 + 5) as f64, 20.0, (i % 3 + 1) as f64])
            .collect();
        let refs: Vec<&[f64]> = rows.iter().map(|r| r.as_slice()).collect();
        let t = table(&refs);
        let all = t.rarefy(10, 3).unwrap().table;
        for s in [0usize, 100, PARALLEL_MIN_SAMPLES + 9] {
            let sample = t.sample(s);
            let sequences: Vec<&str> = sample
                .observations
                .iter()
                .map(|&o| t.observation_ids()[o as usize].as_str())
                .collect();
            let alone = rarefy_sample(&t.sample_ids()[s], &sequences, sample.counts, 10, 3)
                .unwrap()
                .unwrap();
            let expected: Vec<f64> = alone.into_iter().filter(|&n| n > 0.0).collect();
            assert_eq!(all.sample(s).counts, expected.as_slice());
        }
    }

    /// A sample's draw depends on its reads, ID, depth and seed only: not on
    /// its position in the table, the table's row order or its other samples.
    #[test]
    fn a_sample_rarefies_the_same_in_any_table() {
        let reads = [("AAC", 30.0), ("GTA", 50.0), ("CCG", 20.0), ("TTT", 7.0)];
        let one = |id: &str, order: &[usize], others: usize| {
            let mut o = Vec::new();
            let mut s = Vec::new();
            let mut v = Vec::new();
            let mut ids: Vec<String> = (0..others).map(|i| format!("other{i}")).collect();
            for i in 0..others {
                for (k, _) in reads.iter().enumerate() {
                    o.push(k as u32);
                    s.push(i as u32);
                    v.push(40.0 + (i + k) as f64);
                }
            }
            ids.push(id.to_string());
            for (k, &r) in order.iter().enumerate() {
                o.push(k as u32);
                s.push(others as u32);
                v.push(reads[r].1);
            }
            let obs: Vec<String> = order.iter().map(|&r| reads[r].0.to_string()).collect();
            let t = BiomTable::from_triplets("t", ids, obs, &o, &s, &v).unwrap();
            let r = t.rarefy(25, 42).unwrap().table;
            let x = r.sample(others);
            let mut by_sequence: Vec<(String, f64)> = x
                .observations
                .iter()
                .zip(x.counts)
                .map(|(&o, &c)| (r.observation_ids()[o as usize].clone(), c))
                .collect();
            by_sequence.sort_by(|a, b| a.0.cmp(&b.0));
            by_sequence
        };
        let a = one("S", &[0, 1, 2, 3], 0);
        assert_eq!(a, one("S", &[3, 1, 0, 2], 0));
        assert_eq!(a, one("S", &[2, 0, 3, 1], 5));
        assert_ne!(a, one("T", &[0, 1, 2, 3], 0), "the ID picks the stream");
        let sequences: Vec<&str> = reads.iter().map(|r| r.0).collect();
        let counts: Vec<f64> = reads.iter().map(|r| r.1).collect();
        let alone = rarefy_sample("S", &sequences, &counts, 25, 42)
            .unwrap()
            .unwrap();
        let mut alone: Vec<(String, f64)> = sequences
            .iter()
            .zip(alone)
            .filter(|(_, n)| *n > 0.0)
            .map(|(s, n)| (s.to_string(), n))
            .collect();
        alone.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(a, alone);
        assert_eq!(
            rarefy_sample("S", &sequences, &counts, 1000, 42).unwrap(),
            None
        );
    }
}
