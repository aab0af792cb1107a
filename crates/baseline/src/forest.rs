//! The regression forest (see the crate doc for the algorithm and why it
//! is scikit-learn's).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::{Error, Features};

/// Two feature values closer than this are one value (scikit-learn's
/// `FEATURE_THRESHOLD`).
const FEATURE_THRESHOLD: f64 = 1e-7;

/// Features drawn per split (scikit-learn's `max_features`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MaxFeatures {
    /// `⌊√p⌋` (the reference's default).
    Sqrt,
    /// `⌊log₂ p⌋`.
    Log2,
    /// Every feature.
    All,
    /// This many.
    Count(usize),
    /// This fraction of `p` (in (0, 1]), rounded down.
    Fraction(f64),
}

impl std::str::FromStr for MaxFeatures {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}` is not sqrt, log2, all, a count ≥ 1 or a fraction in (0, 1]");
        match s.trim() {
            "sqrt" | "auto" => Ok(Self::Sqrt),
            "log2" => Ok(Self::Log2),
            "all" | "none" | "None" => Ok(Self::All),
            t if t.contains('.') => match t.parse::<f64>() {
                Ok(f) if f > 0.0 && f <= 1.0 => Ok(Self::Fraction(f)),
                _ => Err(bad()),
            },
            t => match t.parse::<usize>() {
                Ok(n) if n >= 1 => Ok(Self::Count(n)),
                _ => Err(bad()),
            },
        }
    }
}

impl MaxFeatures {
    /// The number of features drawn per split, for `p` features.
    pub fn of(self, p: usize) -> usize {
        let n = match self {
            Self::Sqrt => (p as f64).sqrt() as usize,
            Self::Log2 => (p as f64).log2() as usize,
            Self::All => p,
            Self::Count(n) => n,
            Self::Fraction(f) => (f * p as f64) as usize,
        };
        n.clamp(1, p.max(1))
    }
}

/// The forest's settings (the reference's defaults).
#[derive(Debug, Clone)]
pub struct ForestConfig {
    /// Trees. Default 500.
    pub n_estimators: usize,
    /// Features drawn per split. Default `sqrt`.
    pub max_features: MaxFeatures,
    /// Seed of the bootstrap samples and feature draws. Default 42.
    pub seed: u64,
    /// Threads (None: every core).
    pub threads: Option<usize>,
}

impl Default for ForestConfig {
    fn default() -> Self {
        ForestConfig {
            n_estimators: 500,
            max_features: MaxFeatures::Sqrt,
            seed: 42,
            threads: None,
        }
    }
}

#[derive(Debug, Clone)]
enum Node {
    Leaf(f64),
    Split {
        feature: u32,
        threshold: f64,
        left: u32,
        right: u32,
    },
}

#[derive(Debug, Clone)]
struct Tree {
    nodes: Vec<Node>,
}

impl Tree {
    fn predict(&self, row: &[f32]) -> f64 {
        let mut at = 0;
        loop {
            match &self.nodes[at] {
                Node::Leaf(v) => return *v,
                Node::Split {
                    feature,
                    threshold,
                    left,
                    right,
                } => {
                    at = if row[*feature as usize] as f64 <= *threshold {
                        *left as usize
                    } else {
                        *right as usize
                    };
                }
            }
        }
    }
}

/// A fitted regression forest.
#[derive(Debug, Clone)]
pub struct Forest {
    trees: Vec<Tree>,
    width: usize,
}

impl Forest {
    /// Grows `config.n_estimators` trees on `x` (one row per sample) and `y`.
    pub fn fit(x: &Features, y: &[f64], config: &ForestConfig) -> Result<Forest, Error> {
        if config.n_estimators == 0 {
            return Err(Error::Option {
                option: "n-estimators",
                reason: "must be ≥ 1".into(),
            });
        }
        if x.is_empty() || x.len() != y.len() {
            return Err(Error::NoSamples(format!(
                "{} training samples with {} target values; at least one of each is needed",
                x.len(),
                y.len()
            )));
        }
        let max_features = config.max_features.of(x.width());
        let grow = |i: usize| {
            let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
            rng.set_stream(i as u64);
            grow_tree(x, y, max_features, &mut rng)
        };
        let trees = match config.threads {
            Some(n) => rayon::ThreadPoolBuilder::new()
                .num_threads(n.max(1))
                .build()
                .map_err(|e| Error::Option {
                    option: "n-jobs",
                    reason: e.to_string(),
                })?
                .install(|| (0..config.n_estimators).into_par_iter().map(grow).collect()),
            None => (0..config.n_estimators).into_par_iter().map(grow).collect(),
        };
        Ok(Forest {
            trees,
            width: x.width(),
        })
    }

    /// The mean of the trees' predictions for each row of `x` (the same
    /// features as the training rows).
    pub fn predict(&self, x: &Features) -> Vec<f64> {
        assert_eq!(x.width(), self.width, "features of the training rows");
        (0..x.len())
            .into_par_iter()
            .map(|i| {
                let row = x.row(i);
                self.trees.iter().map(|t| t.predict(row)).sum::<f64>() / self.trees.len() as f64
            })
            .collect()
    }
}

/// One tree on a bootstrap sample of the rows.
fn grow_tree(x: &Features, y: &[f64], max_features: usize, rng: &mut ChaCha8Rng) -> Tree {
    let (n, p) = (x.len(), x.width());
    // The bootstrap sample as weights: how often each row was drawn.
    let mut weight = vec![0f64; n];
    for _ in 0..n {
        weight[rng.random_range(0..n)] += 1.0;
    }
    let mut samples: Vec<usize> = (0..n).filter(|&i| weight[i] > 0.0).collect();
    let mut features: Vec<u32> = (0..p as u32).collect();
    let mut nodes = Vec::new();
    // (node index, start, end) of nodes still to split.
    nodes.push(Node::Leaf(0.0));
    let mut stack = vec![(0usize, 0usize, samples.len())];
    let mut column: Vec<(f32, usize)> = Vec::new();
    while let Some((at, start, end)) = stack.pop() {
        let members = &samples[start..end];
        let (mut w, mut sum, mut sumsq) = (0.0, 0.0, 0.0);
        for &s in members {
            w += weight[s];
            sum += weight[s] * y[s];
            sumsq += weight[s] * y[s] * y[s];
        }
        let mean = sum / w;
        let impurity = sumsq / w - mean * mean;
        if members.len() < 2 || impurity <= f64::EPSILON {
            nodes[at] = Node::Leaf(mean);
            continue;
        }
        // Features drawn without replacement; constant ones count as drawn,
        // and drawing goes on until one that varies has been seen.
        let mut best: Option<(f64, u32, f64)> = None;
        let (mut visited, mut constant) = (0usize, 0usize);
        let mut drawn = 0;
        while drawn < p && (visited < max_features || visited <= constant) {
            let j = rng.random_range(drawn..p);
            features.swap(drawn, j);
            let f = features[drawn];
            drawn += 1;
            visited += 1;
            column.clear();
            column.extend(members.iter().map(|&s| (x.row(s)[f as usize], s)));
            let (lo, hi) = column
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &(v, _)| {
                    (l.min(v), h.max(v))
                });
            if (hi as f64) <= lo as f64 + FEATURE_THRESHOLD {
                constant += 1;
                continue;
            }
            column.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
            let (mut wl, mut sl) = (0.0, 0.0);
            for k in 1..column.len() {
                let s = column[k - 1].1;
                wl += weight[s];
                sl += weight[s] * y[s];
                let (prev, next) = (column[k - 1].0 as f64, column[k].0 as f64);
                if next <= prev + FEATURE_THRESHOLD {
                    continue;
                }
                let (wr, sr) = (w - wl, sum - sl);
                let proxy = sl * sl / wl + sr * sr / wr;
                if best.is_none_or(|(b, _, _)| proxy > b) {
                    let mut threshold = prev / 2.0 + next / 2.0;
                    if threshold >= next || !threshold.is_finite() {
                        threshold = prev;
                    }
                    best = Some((proxy, f, threshold));
                }
            }
        }
        let Some((_, feature, threshold)) = best else {
            nodes[at] = Node::Leaf(mean);
            continue;
        };
        // Partition the node's samples: left (≤ threshold) first.
        let members = &mut samples[start..end];
        let mut split = 0;
        for k in 0..members.len() {
            if x.row(members[k])[feature as usize] as f64 <= threshold {
                members.swap(split, k);
                split += 1;
            }
        }
        let (left, right) = (nodes.len(), nodes.len() + 1);
        nodes.push(Node::Leaf(0.0));
        nodes.push(Node::Leaf(0.0));
        nodes[at] = Node::Split {
            feature,
            threshold,
            left: left as u32,
            right: right as u32,
        };
        stack.push((left, start, start + split));
        stack.push((right, start + split, end));
    }
    Tree { nodes }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn features(rows: &[&[f32]]) -> Features {
        Features {
            ids: (0..rows.len()).map(|i| format!("s{i}")).collect(),
            names: (0..rows[0].len()).map(|j| format!("f{j}")).collect(),
            values: rows.iter().flat_map(|r| r.iter().copied()).collect(),
        }
    }

    #[test]
    fn a_forest_learns_a_step_and_ignores_noise() {
        let rows: Vec<Vec<f32>> = (0..200)
            .map(|i| vec![(i % 2) as f32, ((i * 7919) % 13) as f32])
            .collect();
        let x = features(&rows.iter().map(Vec::as_slice).collect::<Vec<_>>());
        let y: Vec<f64> = rows.iter().map(|r| 10.0 * r[0] as f64 + 1.0).collect();
        let config = ForestConfig {
            n_estimators: 20,
            max_features: MaxFeatures::All,
            ..Default::default()
        };
        let forest = Forest::fit(&x, &y, &config).unwrap();
        let predicted = forest.predict(&x);
        for (p, t) in predicted.iter().zip(&y) {
            assert!((p - t).abs() < 1e-9, "{p} vs {t}");
        }
        // The same seed, another thread count: the same forest.
        let one = Forest::fit(
            &x,
            &y,
            &ForestConfig {
                threads: Some(1),
                ..config
            },
        )
        .unwrap();
        assert_eq!(one.predict(&x), predicted);
    }

    #[test]
    fn max_features_parses_the_reference_spellings() {
        assert_eq!("sqrt".parse::<MaxFeatures>().unwrap().of(100), 10);
        assert_eq!("log2".parse::<MaxFeatures>().unwrap().of(1024), 10);
        assert_eq!("0.5".parse::<MaxFeatures>().unwrap().of(10), 5);
        assert_eq!("3".parse::<MaxFeatures>().unwrap().of(10), 3);
        assert!("0".parse::<MaxFeatures>().is_err());
        assert!("half".parse::<MaxFeatures>().is_err());
    }
}
