//! `aam-baseline`: the random-forest baseline that AAM's results are read
//! against (`aam-rs rf-baseline`, the reference's `aam rf-baseline`).
//!
//! **Job.** Given a BIOM table, a numeric metadata column and the
//! train/validation sample lists of a run, fit a random-forest regressor on
//! the training samples' raw (unrarefied) counts and predict the
//! validation samples (reference §2.12, §5.4): [`Features::from_table`]
//! builds the samples × ASVs matrix (ASVs absent from every training sample
//! dropped), [`Forest::fit`] grows the trees, [`Forest::predict`] averages
//! them, and [`Metrics`] holds R², MAE and RMSE.
//!
//! **The forest is scikit-learn's `RandomForestRegressor`** with the
//! reference's settings, written here rather than taken from a crate:
//! each tree is grown on a bootstrap sample (n draws with replacement, kept
//! as per-sample weights), to purity (no depth limit, ≥ 2 samples to split,
//! ≥ 1 per leaf), choosing at each node the split of least weighted squared
//! error among `max_features` features drawn without replacement (features
//! constant in the node count as drawn, and drawing goes on past
//! `max_features` until one that varies is found, as scikit-learn's
//! `BestSplitter` does), the threshold halfway between the two values.
//! Predictions are the mean of the trees' leaf means. The smartcore and
//! linfa forests re-sort or re-partition every feature at every node, which
//! on a 16S table (thousands of ASVs, nearly all zero in a node) is orders
//! of magnitude slower than drawing the few features a node looks at; and
//! the baseline only means something if it is the forest the reference ran.
//! Trees grow in parallel (rayon), each from its own seed, so a forest
//! depends only on `seed`, not on the number of threads.

#![deny(missing_docs)]

mod forest;

pub use forest::{Forest, ForestConfig, MaxFeatures};

use std::collections::HashSet;

use aam_data::{BiomTable, IdList};

/// What went wrong; each names the sample, option or file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An invalid option.
    #[error("--{option}: {reason}")]
    Option {
        /// The option (CLI spelling without dashes).
        option: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Nothing to fit or predict.
    #[error("{0}")]
    NoSamples(String),
}

/// The samples × features matrix of some samples, row-major.
#[derive(Debug, Clone)]
pub struct Features {
    /// Sample IDs, one per row.
    pub ids: Vec<String>,
    /// Feature (ASV) IDs, one per column.
    pub names: Vec<String>,
    /// `[ids.len(), names.len()]` counts, row-major.
    pub values: Vec<f32>,
}

impl Features {
    /// Rows of `table` for `train` and `validation` (in their order), on the
    /// ASVs with reads in some training sample (reference §2.12); IDs absent
    /// from the table are left out and returned.
    pub fn from_table(
        table: &BiomTable,
        train: &[String],
        validation: &[String],
    ) -> (Features, Features, Vec<String>) {
        let index = table.sample_index();
        let mut missing = Vec::new();
        let mut keep = |ids: &[String]| -> Vec<(String, usize)> {
            ids.iter()
                .filter_map(|id| match index.get(id.as_str()) {
                    Some(&s) => Some((id.clone(), s)),
                    None => {
                        missing.push(id.clone());
                        None
                    }
                })
                .collect()
        };
        let (train, validation) = (keep(train), keep(validation));
        let mut used = vec![false; table.n_observations()];
        for &(_, s) in &train {
            let counts = table.sample(s);
            for (&o, &c) in counts.observations.iter().zip(counts.counts) {
                if c > 0.0 {
                    used[o as usize] = true;
                }
            }
        }
        let column: Vec<Option<usize>> = used
            .iter()
            .scan(0usize, |next, &u| {
                Some(u.then(|| {
                    *next += 1;
                    *next - 1
                }))
            })
            .collect();
        let names: Vec<String> = table
            .observation_ids()
            .iter()
            .zip(&used)
            .filter(|(_, &u)| u)
            .map(|(n, _)| n.clone())
            .collect();
        let build = |rows: &[(String, usize)]| {
            let p = names.len();
            let mut values = vec![0f32; rows.len() * p];
            for (r, &(_, s)) in rows.iter().enumerate() {
                let counts = table.sample(s);
                for (&o, &c) in counts.observations.iter().zip(counts.counts) {
                    if let Some(j) = column[o as usize] {
                        values[r * p + j] = c as f32;
                    }
                }
            }
            Features {
                ids: rows.iter().map(|(id, _)| id.clone()).collect(),
                names: names.clone(),
                values,
            }
        };
        (build(&train), build(&validation), missing)
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Number of features.
    pub fn width(&self) -> usize {
        self.names.len()
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        let p = self.width();
        &self.values[i * p..(i + 1) * p]
    }

    /// The rows whose `keep` is true.
    pub fn select(&self, keep: &[bool]) -> Features {
        let p = self.width();
        let mut out = Features {
            ids: Vec::new(),
            names: self.names.clone(),
            values: Vec::new(),
        };
        for (i, _) in keep.iter().enumerate().filter(|(_, &k)| k) {
            out.ids.push(self.ids[i].clone());
            out.values
                .extend_from_slice(&self.values[i * p..(i + 1) * p]);
        }
        out
    }
}

/// R², MAE and RMSE of predictions against actual values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Metrics {
    /// Coefficient of determination, `1 − SS_res / SS_tot`.
    pub r2: f64,
    /// Mean absolute error.
    pub mae: f64,
    /// Root mean squared error.
    pub rmse: f64,
}

impl Metrics {
    /// The metrics of `predicted` against `actual` (same length, ≥ 1).
    pub fn of(actual: &[f64], predicted: &[f64]) -> Metrics {
        let n = actual.len().max(1) as f64;
        let mean = actual.iter().sum::<f64>() / n;
        let ss_res: f64 = actual
            .iter()
            .zip(predicted)
            .map(|(a, p)| (a - p).powi(2))
            .sum();
        let ss_tot: f64 = actual.iter().map(|a| (a - mean).powi(2)).sum();
        Metrics {
            r2: if ss_tot > 0.0 {
                1.0 - ss_res / ss_tot
            } else {
                f64::NAN
            },
            mae: actual
                .iter()
                .zip(predicted)
                .map(|(a, p)| (a - p).abs())
                .sum::<f64>()
                / n,
            rmse: (ss_res / n).sqrt(),
        }
    }
}

/// Reads an ID list (one per line; blank lines skipped, whitespace
/// stripped), as `train_samples.txt` of `aam-rs train`; an ID listed twice
/// is an error naming it.
pub fn read_ids(text: &str) -> Result<Vec<String>, String> {
    let mut seen = HashSet::new();
    let mut ids = Vec::new();
    let mut twice = Vec::new();
    for id in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if seen.insert(id) {
            ids.push(id.to_string());
        } else {
            twice.push(id.to_string());
        }
    }
    if twice.is_empty() {
        Ok(ids)
    } else {
        Err(format!("IDs listed twice: {}", IdList::new(&twice)))
    }
}
