//! Striped UniFrac on the CPU (McDonald et al. 2018, Nature Methods).
//!
//! **Stripes.** For N samples, stripe `s` holds the distances d(k, (k+s+1) mod N)
//! for every k; stripes 0..ceil((N-1)/2) cover every pair once (for even N the
//! last stripe only needs its first half). A thread owns a block of stripes,
//! so threads never write the same memory and need no locks; memory is the
//! stripes themselves, about N²/2 values per accumulator, not N² per thread.
//!
//! **Chunks of branches.** The tree is walked in postorder and its branches
//! are grouped in chunks (32 for the weighted methods, 256 for unweighted).
//! For a chunk, each sample that has counts below any of its branches
//! ("active") gets a dense row: proportions, or presence bits. In
//! postorder, neighbouring branches lie in the same clade, so a chunk's rows
//! cover the samples of the clades it spans (on oral2550, about 60% of the
//! samples per chunk of 64 branches; fewer near the tips, all at the root).
//!
//! **Only pairs that share a chunk cost anything.** Each method is written as
//! per-sample sums plus a correction over branches where *both* samples have
//! counts. Weighted: Σ L|u−v| = S_k + S_l + Σ_both (Σ L|u−v| − S_k,c − S_l,c),
//! with S_k = Σ L u_k the sample's own sum (and S_k,c its part in chunk c);
//! unweighted: the union and the difference follow from A_k = Σ L [u_k > 0]
//! and the shared length I = Σ L [u_k > 0][u_l > 0] (a bitwise AND and a
//! table of per-byte length sums); generalized likewise with Σ L u^α. So a
//! thread visits, per chunk, only the active samples of its stripes and, of
//! those, only partners that are active too. Own sums and corrections are
//! added in the same chunk order, so a sample against an identical one gives
//! exactly 0.
//!
//! **Variance adjusted** weights (Chang et al. 2011) depend on the pair's
//! depths, so they are summed directly over every branch either sample has.

use rayon::prelude::*;

use crate::on_tree::OnTree;
use crate::Method;

const NONE: u32 = u32::MAX;

/// What a chunk keeps per active sample.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rows {
    /// Presence bits and a per-byte length table (unweighted).
    Bits,
    /// Proportions (weighted, generalized).
    Props,
    /// Proportions and counts (variance adjusted).
    PropsAndCounts,
}

/// Branches per chunk.
fn width(rows: Rows) -> usize {
    match rows {
        Rows::Bits => 64 * WORDS,
        _ => 32,
    }
}

/// 64-bit words of presence bits per chunk.
const WORDS: usize = 4;

/// Chunks embedded before the threads compare them.
fn batch(rows: Rows) -> usize {
    match rows {
        Rows::Bits => 4,
        _ => 16,
    }
}

struct Chunk {
    width: usize,
    lengths: Vec<f64>,
    /// Active samples, ascending.
    active: Vec<u32>,
    /// Per sample: its position in `active`, or NONE.
    slot: Vec<u32>,
    /// `active.len() × width` proportions (Props, PropsAndCounts).
    props: Vec<f64>,
    /// `active.len() × width` counts (PropsAndCounts).
    counts: Vec<f64>,
    /// `active.len() × WORDS` presence bits (Bits).
    bits: Vec<u64>,
    /// `WORDS × 8 × 256` length sums per byte value (Bits).
    table: Vec<f64>,
    /// Per active sample, its own sum over the chunk (see the module doc).
    own: Vec<f64>,
}

impl Chunk {
    fn props(&self, a: usize) -> &[f64] {
        &self.props[a * self.width..(a + 1) * self.width]
    }

    fn counts(&self, a: usize) -> &[f64] {
        &self.counts[a * self.width..(a + 1) * self.width]
    }

    /// Σ L over branches present in both rows (bits).
    fn shared_length(&self, a: usize, b: usize) -> f64 {
        let (x, y) = (
            &self.bits[a * WORDS..][..WORDS],
            &self.bits[b * WORDS..][..WORDS],
        );
        let mut sum = 0.0;
        for w in 0..WORDS {
            let mut and = x[w] & y[w];
            let mut byte = 0;
            while and != 0 {
                let v = (and & 0xff) as usize;
                if v != 0 {
                    sum += self.table[(w * 8 + byte) * 256 + v];
                }
                and >>= 8;
                byte += 1;
            }
        }
        sum
    }
}

/// Builds chunks from the branches of the postorder walk.
struct Chunker<'a> {
    on: &'a OnTree,
    rows: Rows,
    width: usize,
    lengths: Vec<f64>,
    entries: Vec<Vec<(u32, f64)>>,
}

impl<'a> Chunker<'a> {
    fn new(on: &'a OnTree, rows: Rows) -> Self {
        Self {
            on,
            rows,
            width: width(rows),
            lengths: Vec::new(),
            entries: Vec::new(),
        }
    }

    fn push(&mut self, length: f64, entries: &[(u32, f64)]) -> Option<Chunk> {
        self.lengths.push(length);
        self.entries.push(entries.to_vec());
        (self.lengths.len() == self.width).then(|| self.seal())
    }

    fn seal(&mut self) -> Chunk {
        let n = self.on.n_samples();
        let width = self.width;
        let mut lengths = std::mem::take(&mut self.lengths);
        lengths.resize(width, 0.0);
        let entries = std::mem::take(&mut self.entries);
        // Active samples in ascending order, so that a thread's writes to a
        // stripe move forward through it.
        let mut slot = vec![NONE; n];
        let mut active = Vec::new();
        for list in &entries {
            for &(s, _) in list {
                if slot[s as usize] == NONE {
                    slot[s as usize] = 0;
                    active.push(s);
                }
            }
        }
        active.sort_unstable();
        for (a, &s) in active.iter().enumerate() {
            slot[s as usize] = a as u32;
        }
        let m = active.len();
        let mut chunk = Chunk {
            width,
            lengths,
            active,
            slot,
            props: Vec::new(),
            counts: Vec::new(),
            bits: Vec::new(),
            table: Vec::new(),
            own: Vec::new(),
        };
        match self.rows {
            Rows::Bits => {
                chunk.bits = vec![0u64; m * WORDS];
                for (e, list) in entries.iter().enumerate() {
                    for &(s, _) in list {
                        let a = chunk.slot[s as usize] as usize;
                        chunk.bits[a * WORDS + e / 64] |= 1u64 << (e % 64);
                    }
                }
                chunk.table = vec![0.0; WORDS * 8 * 256];
                for g in 0..WORDS * 8 {
                    for v in 1..256usize {
                        let mut sum = 0.0;
                        for t in 0..8 {
                            if v & (1 << t) != 0 {
                                sum += chunk.lengths[g * 8 + t];
                            }
                        }
                        chunk.table[g * 256 + v] = sum;
                    }
                }
                chunk.own = (0..m).map(|a| chunk.shared_length(a, a)).collect();
            }
            Rows::Props | Rows::PropsAndCounts => {
                chunk.props = vec![0.0; m * width];
                let with_counts = self.rows == Rows::PropsAndCounts;
                if with_counts {
                    chunk.counts = vec![0.0; m * width];
                }
                for (e, list) in entries.iter().enumerate() {
                    for &(s, c) in list {
                        let a = chunk.slot[s as usize] as usize;
                        chunk.props[a * width + e] = c / self.on.totals[s as usize];
                        if with_counts {
                            chunk.counts[a * width + e] = c;
                        }
                    }
                }
            }
        }
        chunk
    }
}

/// The per-pair sums of one method over one chunk: `(a, b)` are the active
/// positions of samples `k` and `l` (NONE where inactive, only for variance
/// adjusted methods); returns the accumulators' increments.
trait Kernel: Sync {
    /// Two accumulators (numerator and denominator) or one.
    const TWO: bool;
    /// Visit pairs where only one sample is active too.
    const EITHER: bool;
    fn rows(&self) -> Rows;
    /// Per active sample, its own sum over the chunk.
    fn own(&self, chunk: &Chunk, a: usize) -> f64;
    fn pair(&self, chunk: &Chunk, k: usize, l: usize, a: u32, b: u32) -> (f64, f64);
}

struct Unweighted;
impl Kernel for Unweighted {
    const TWO: bool = false;
    const EITHER: bool = false;
    fn rows(&self) -> Rows {
        Rows::Bits
    }
    fn own(&self, chunk: &Chunk, a: usize) -> f64 {
        chunk.own[a]
    }
    #[inline]
    fn pair(&self, chunk: &Chunk, _: usize, _: usize, a: u32, b: u32) -> (f64, f64) {
        (chunk.shared_length(a as usize, b as usize), 0.0)
    }
}

struct Weighted;
impl Kernel for Weighted {
    const TWO: bool = false;
    const EITHER: bool = false;
    fn rows(&self) -> Rows {
        Rows::Props
    }
    fn own(&self, chunk: &Chunk, a: usize) -> f64 {
        chunk
            .props(a)
            .iter()
            .zip(&chunk.lengths)
            .map(|(u, l)| u * l)
            .sum()
    }
    #[inline]
    fn pair(&self, chunk: &Chunk, _: usize, _: usize, a: u32, b: u32) -> (f64, f64) {
        let (a, b) = (a as usize, b as usize);
        let (u, v) = (chunk.props(a), chunk.props(b));
        // Eight independent sums, so that the compiler can use vector lanes.
        let mut lanes = [0.0f64; 8];
        for ((u, v), l) in u
            .chunks_exact(8)
            .zip(v.chunks_exact(8))
            .zip(chunk.lengths.chunks_exact(8))
        {
            for i in 0..8 {
                lanes[i] += (u[i] - v[i]).abs() * l[i];
            }
        }
        let sum = lanes.iter().sum::<f64>();
        (sum - chunk.own[a] - chunk.own[b], 0.0)
    }
}

struct Generalized {
    alpha: f64,
}
impl Kernel for Generalized {
    const TWO: bool = true;
    const EITHER: bool = false;
    fn rows(&self) -> Rows {
        Rows::Props
    }
    fn own(&self, chunk: &Chunk, a: usize) -> f64 {
        let mut sum = 0.0;
        for (&u, &l) in chunk.props(a).iter().zip(&chunk.lengths) {
            if u != 0.0 {
                sum += u.powf(self.alpha) * l;
            }
        }
        sum
    }
    #[inline]
    fn pair(&self, chunk: &Chunk, _: usize, _: usize, a: u32, b: u32) -> (f64, f64) {
        let (a, b) = (a as usize, b as usize);
        let (u, v) = (chunk.props(a), chunk.props(b));
        let (mut num, mut tot) = (0.0, 0.0);
        for e in 0..chunk.width {
            let s = u[e] + v[e];
            if s != 0.0 {
                let p = s.powf(self.alpha) * chunk.lengths[e];
                num += p * ((u[e] - v[e]).abs() / s);
                tot += p;
            }
        }
        let (oa, ob) = (chunk.own[a], chunk.own[b]);
        (num - oa - ob, tot - oa - ob)
    }
}

/// Variance-adjusted methods: summed directly (no own sums).
struct Vaw<'a> {
    method: Method,
    totals: &'a [f64],
    zeros: Vec<f64>,
}
impl Kernel for Vaw<'_> {
    const TWO: bool = true;
    const EITHER: bool = true;
    fn rows(&self) -> Rows {
        Rows::PropsAndCounts
    }
    fn own(&self, _: &Chunk, _: usize) -> f64 {
        0.0
    }
    fn pair(&self, chunk: &Chunk, k: usize, l: usize, a: u32, b: u32) -> (f64, f64) {
        let row = |x: u32, counts: bool| -> &[f64] {
            if x == NONE {
                &self.zeros[..chunk.width]
            } else if counts {
                chunk.counts(x as usize)
            } else {
                chunk.props(x as usize)
            }
        };
        let (u, v, cu, cv) = (row(a, false), row(b, false), row(a, true), row(b, true));
        let m = self.totals[k] + self.totals[l];
        let (mut num, mut tot) = (0.0, 0.0);
        for e in 0..chunk.width {
            let mi = cu[e] + cv[e];
            let vaw = (mi * (m - mi)).sqrt();
            if vaw > 0.0 {
                let length = chunk.lengths[e];
                match self.method {
                    Method::Unweighted => {
                        let (pu, pv) = (cu[e] > 0.0, cv[e] > 0.0);
                        let lv = length / vaw;
                        if pu != pv {
                            num += lv;
                        }
                        tot += lv;
                    }
                    Method::WeightedNormalized | Method::WeightedUnnormalized => {
                        num += ((u[e] - v[e]).abs() * length) / vaw;
                        tot += ((u[e] + v[e]) * length) / vaw;
                    }
                    Method::Generalized { alpha } => {
                        let sum = (u[e] + v[e]) / vaw;
                        let sub = (u[e] - v[e]).abs() / vaw;
                        let p = sum.powf(alpha) * length;
                        num += p * (sub / sum);
                        tot += p;
                    }
                }
            }
        }
        (num, tot)
    }
}

/// The accumulators after every branch: per pair (in stripes) and per sample.
struct Sums {
    n: usize,
    n_stripes: usize,
    num: Vec<f64>,
    tot: Vec<f64>,
    own: Vec<f64>,
}

impl Sums {
    /// The accumulators of the pair (i, j), i != j.
    fn pair(&self, i: usize, j: usize) -> (f64, f64) {
        let (i, j) = if i < j { (i, j) } else { (j, i) };
        let (s, k) = if j - i - 1 < self.n_stripes {
            (j - i - 1, i)
        } else {
            (self.n - (j - i) - 1, j)
        };
        let at = s * self.n + k;
        (
            self.num[at],
            if self.tot.is_empty() {
                0.0
            } else {
                self.tot[at]
            },
        )
    }
}

fn accumulate<K: Kernel>(
    on: &OnTree,
    kernel: &K,
    pool: &rayon::ThreadPool,
    progress: &mut dyn FnMut(usize, usize),
) -> Sums {
    let n = on.n_samples();
    let n_stripes = n / 2;
    let rows = kernel.rows();
    let len = n_stripes * n;
    let mut sums = Sums {
        n,
        n_stripes,
        num: vec![0.0; len],
        tot: if K::TWO { vec![0.0; len] } else { Vec::new() },
        own: vec![0.0; n],
    };
    // Blocks of stripes, a few per thread so that uneven blocks even out.
    let tasks = (pool.current_num_threads() * 4).clamp(1, n_stripes.max(1));
    let per_task = n_stripes.div_ceil(tasks).max(1);
    let total_branches = on.n_nodes().saturating_sub(1);
    let mut done = 0usize;
    let mut chunker = Chunker::new(on, rows);
    let mut pending: Vec<Chunk> = Vec::new();
    let compare = |pending: &mut Vec<Chunk>, sums: &mut Sums| {
        if pending.is_empty() {
            return;
        }
        for chunk in pending.iter_mut() {
            let own: Vec<f64> = (0..chunk.active.len())
                .map(|a| kernel.own(chunk, a))
                .collect();
            for (a, &k) in chunk.active.iter().enumerate() {
                sums.own[k as usize] += own[a];
            }
            chunk.own = own;
        }
        if n_stripes > 0 {
            let mut tot_blocks: Vec<&mut [f64]> = if K::TWO {
                sums.tot.chunks_mut(per_task * n).collect()
            } else {
                (0..len.div_ceil(per_task * n))
                    .map(|_| <&mut [f64]>::default())
                    .collect()
            };
            let chunks = &pending[..];
            pool.install(|| {
                sums.num
                    .par_chunks_mut(per_task * n)
                    .zip(tot_blocks.par_iter_mut())
                    .enumerate()
                    .for_each(|(t, (num, tot))| {
                        stripe_block::<K>(kernel, chunks, n, t * per_task, num, tot)
                    });
            });
        }
        pending.clear();
    };
    on.for_each_branch(|length, entries| {
        done += 1;
        if let Some(chunk) = chunker.push(length, entries) {
            pending.push(chunk);
            if pending.len() == batch(rows) {
                compare(&mut pending, &mut sums);
                progress(done, total_branches);
            }
        }
    });
    if !chunker.lengths.is_empty() {
        pending.push(chunker.seal());
    }
    compare(&mut pending, &mut sums);
    progress(total_branches, total_branches);
    sums
}

/// One thread's work on one batch: stripes `s0..` of `num` (and `tot`).
fn stripe_block<K: Kernel>(
    kernel: &K,
    chunks: &[Chunk],
    n: usize,
    s0: usize,
    num: &mut [f64],
    tot: &mut [f64],
) {
    let stripes = num.len() / n;
    for chunk in chunks {
        for ds in 0..stripes {
            let s = s0 + ds;
            // For even N the last stripe repeats its first half.
            let k_end = if n % 2 == 0 && s == n / 2 - 1 {
                n / 2
            } else {
                n
            };
            let row = &mut num[ds * n..(ds + 1) * n];
            let mut tot_row = if K::TWO {
                Some(&mut tot[ds * n..(ds + 1) * n])
            } else {
                None
            };
            let partner = |k: usize| {
                let l = k + s + 1;
                if l >= n {
                    l - n
                } else {
                    l
                }
            };
            if K::EITHER {
                for k in 0..k_end {
                    let l = partner(k);
                    let (a, b) = (chunk.slot[k], chunk.slot[l]);
                    if a == NONE && b == NONE {
                        continue;
                    }
                    let (x, y) = kernel.pair(chunk, k, l, a, b);
                    row[k] += x;
                    if let Some(t) = tot_row.as_deref_mut() {
                        t[k] += y;
                    }
                }
            } else {
                for (a, &k) in chunk.active.iter().enumerate() {
                    let k = k as usize;
                    if k >= k_end {
                        continue;
                    }
                    let l = partner(k);
                    let b = chunk.slot[l];
                    if b == NONE {
                        continue;
                    }
                    let (x, y) = kernel.pair(chunk, k, l, a as u32, b);
                    row[k] += x;
                    if let Some(t) = tot_row.as_deref_mut() {
                        t[k] += y;
                    }
                }
            }
        }
    }
}

/// The N×N matrix (row-major) of `method` over the table on the tree.
pub(crate) fn distances(
    on: &OnTree,
    method: Method,
    variance_adjusted: bool,
    pool: &rayon::ThreadPool,
    progress: &mut dyn FnMut(usize, usize),
) -> Vec<f64> {
    let n = on.n_samples();
    let finish = |sums: Sums, value: &(dyn Fn(usize, usize, f64, f64) -> f64 + Sync)| {
        let mut out = vec![0.0f64; n * n];
        pool.install(|| {
            out.par_chunks_mut(n).enumerate().for_each(|(i, row)| {
                for (j, d) in row.iter_mut().enumerate() {
                    if i != j {
                        let (x, y) = sums.pair(i, j);
                        *d = value(i, j, x, y);
                    }
                }
            })
        });
        out
    };
    if variance_adjusted {
        let kernel = Vaw {
            method,
            totals: &on.totals,
            zeros: vec![0.0; width(Rows::PropsAndCounts)],
        };
        let sums = accumulate(on, &kernel, pool, progress);
        let normalized = method != Method::WeightedUnnormalized;
        return finish(sums, &|_, _, num, tot| {
            if normalized {
                num / tot
            } else {
                num
            }
        });
    }
    match method {
        Method::Unweighted => {
            let sums = accumulate(on, &Unweighted, pool, progress);
            let own = sums.own.clone();
            finish(sums, &move |i, j, shared, _| {
                let union = own[i] + own[j] - shared;
                (own[i] + own[j] - 2.0 * shared).max(0.0) / union
            })
        }
        Method::WeightedNormalized | Method::WeightedUnnormalized => {
            let sums = accumulate(on, &Weighted, pool, progress);
            let own = sums.own.clone();
            let normalized = method == Method::WeightedNormalized;
            finish(sums, &move |i, j, corr, _| {
                let total = own[i] + own[j];
                let num = (total + corr).max(0.0);
                if normalized {
                    num / total
                } else {
                    num
                }
            })
        }
        Method::Generalized { alpha } => {
            let sums = accumulate(on, &Generalized { alpha }, pool, progress);
            let own = sums.own.clone();
            finish(sums, &move |i, j, num, tot| {
                let base = own[i] + own[j];
                (base + num).max(0.0) / (base + tot)
            })
        }
    }
}

/// Faith's PD of every sample: the length of the branches it has counts below.
pub(crate) fn faith_pd(on: &OnTree) -> Vec<f64> {
    let mut pd = vec![0.0; on.n_samples()];
    on.for_each_branch(|length, entries| {
        for &(s, _) in entries {
            pd[s as usize] += length;
        }
    });
    pd
}
