//! A table placed on a tree: the tree sheared to the table's observations
//! and collapsed, the counts indexed by tip.
//!
//! Shearing drops every subtree without an observed tip; collapsing then
//! merges each internal node left with one child into that child (lengths
//! add), except the root, as `ssu` does. Neither changes a distance (a branch
//! that no sample reaches adds nothing; a chain of single-child nodes is one
//! branch); both shrink a 200k-tip reference tree to the few thousand
//! branches a study touches.

use std::collections::HashMap;

use aam_data::{BiomTable, IdList};

use crate::error::{Error, Result};
use crate::newick::Tree;

/// What placing the table on the tree left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Observations with counts that are not tips of the tree (left out with
    /// `drop_missing`; otherwise an error).
    pub dropped_observations: Vec<String>,
    /// Samples without counts (left out with `drop_empty`; otherwise an error).
    pub dropped_samples: Vec<String>,
    /// Branches of the sheared, collapsed tree (the root excluded).
    pub branches: usize,
}

/// The sheared tree in postorder plus the counts at its tips.
pub(crate) struct OnTree {
    pub sample_ids: Vec<String>,
    /// Per kept sample, its total count on the tree.
    pub totals: Vec<f64>,
    pub lengths: Vec<f64>,
    pub children: Vec<u32>,
    /// Per node: for a tip, its range in `tip_samples`/`tip_counts`.
    pub tip_range: Vec<(u32, u32)>,
    pub tip_samples: Vec<u32>,
    pub tip_counts: Vec<f64>,
}

impl OnTree {
    pub fn new(
        table: &BiomTable,
        tree: &Tree,
        drop_missing: bool,
        drop_empty: bool,
    ) -> Result<(Self, Report)> {
        let mut report = Report::default();
        // Observations with a positive count, transposed to observation-major.
        let n_obs = table.n_observations();
        let mut per_obs: Vec<Vec<(u32, f64)>> = vec![Vec::new(); n_obs];
        for s in 0..table.n_samples() {
            let counts = table.sample(s);
            for (&o, &c) in counts.observations.iter().zip(counts.counts) {
                per_obs[o as usize].push((s as u32, c));
            }
        }
        // Match observed IDs to tips.
        let obs_index: HashMap<&str, usize> = table
            .observation_ids()
            .iter()
            .enumerate()
            .filter(|(o, _)| !per_obs[*o].is_empty())
            .map(|(o, id)| (id.as_str(), o))
            .collect();
        let mut placed = vec![false; n_obs];
        for (node, name) in tree.names().iter().enumerate() {
            if tree.children()[node] != 0 {
                continue;
            }
            if let Some(&o) = obs_index.get(name.as_str()) {
                if placed[o] {
                    return Err(Error::DuplicateTip {
                        path: tree.source().to_path_buf(),
                        name: name.clone(),
                    });
                }
                placed[o] = true;
            }
        }
        let missing: Vec<String> = (0..n_obs)
            .filter(|&o| !per_obs[o].is_empty() && !placed[o])
            .map(|o| table.observation_ids()[o].clone())
            .collect();
        if !missing.is_empty() && !drop_missing {
            return Err(Error::MissingTips {
                table: table.source().to_path_buf(),
                tree: tree.source().to_path_buf(),
                ids: IdList::new(&missing),
            });
        }
        report.dropped_observations = missing;

        // Sample totals on the tree; samples without any are empty.
        let mut totals = vec![0.0f64; table.n_samples()];
        for (o, list) in per_obs.iter().enumerate() {
            if placed[o] {
                for &(s, c) in list {
                    totals[s as usize] += c;
                }
            }
        }
        let empty: Vec<usize> = (0..table.n_samples())
            .filter(|&s| totals[s] <= 0.0)
            .collect();
        if !empty.is_empty() && !drop_empty {
            let ids: Vec<&String> = empty.iter().map(|&s| &table.sample_ids()[s]).collect();
            return Err(Error::EmptySamples {
                table: table.source().to_path_buf(),
                ids: IdList::new(&ids),
                after_drop: !report.dropped_observations.is_empty(),
            });
        }
        // Renumber the kept samples.
        let mut new_index = vec![u32::MAX; table.n_samples()];
        let mut sample_ids = Vec::new();
        let mut kept_totals = Vec::new();
        for s in 0..table.n_samples() {
            if totals[s] > 0.0 {
                new_index[s] = sample_ids.len() as u32;
                sample_ids.push(table.sample_ids()[s].clone());
                kept_totals.push(totals[s]);
            } else {
                report.dropped_samples.push(table.sample_ids()[s].clone());
            }
        }
        if sample_ids.is_empty() {
            return Err(Error::NothingToCompare {
                table: table.source().to_path_buf(),
                reason: "no sample has counts on the tree's tips".into(),
            });
        }

        let no_tip = || Error::NothingToCompare {
            table: table.source().to_path_buf(),
            reason: "no observation of the table is a tip of the tree".into(),
        };
        let sheared = tree
            .sheared(|name| obs_index.contains_key(name))
            .ok_or_else(no_tip)?;
        let mut out = OnTree {
            sample_ids,
            totals: kept_totals,
            lengths: sheared.lengths().to_vec(),
            children: sheared.children().to_vec(),
            tip_range: Vec::with_capacity(sheared.len()),
            tip_samples: Vec::new(),
            tip_counts: Vec::new(),
        };
        for (name, &c) in sheared.names().iter().zip(sheared.children()) {
            let start = out.tip_samples.len() as u32;
            if c == 0 {
                for &(s, count) in &per_obs[obs_index[name.as_str()]] {
                    let s = new_index[s as usize];
                    if s != u32::MAX {
                        out.tip_samples.push(s);
                        out.tip_counts.push(count);
                    }
                }
            }
            out.tip_range.push((start, out.tip_samples.len() as u32));
        }
        report.branches = out.lengths.len() - 1;
        Ok((out, report))
    }

    pub fn n_samples(&self) -> usize {
        self.sample_ids.len()
    }

    pub fn n_nodes(&self) -> usize {
        self.lengths.len()
    }

    /// Walk the nodes in postorder, the root excluded, handing each branch's
    /// length and its (sample, count) entries (counts summed over the tips
    /// below it; every count positive) to `visit`. Zero-length branches are
    /// skipped: they add nothing to any distance or to Faith's PD.
    pub fn for_each_branch(&self, mut visit: impl FnMut(f64, &[(u32, f64)])) {
        let n = self.n_samples();
        let mut acc = vec![0.0f64; n];
        let mut seen = vec![false; n];
        let mut stack: Vec<Vec<(u32, f64)>> = Vec::new();
        let root = self.n_nodes() - 1;
        for node in 0..self.n_nodes() {
            let c = self.children[node] as usize;
            let entries: Vec<(u32, f64)> = if c == 0 {
                let (a, b) = self.tip_range[node];
                let (a, b) = (a as usize, b as usize);
                self.tip_samples[a..b]
                    .iter()
                    .copied()
                    .zip(self.tip_counts[a..b].iter().copied())
                    .collect()
            } else {
                let kids = stack.split_off(stack.len() - c);
                let mut touched: Vec<u32> = Vec::new();
                for kid in &kids {
                    for &(s, v) in kid {
                        let i = s as usize;
                        if !seen[i] {
                            seen[i] = true;
                            touched.push(s);
                        }
                        acc[i] += v;
                    }
                }
                touched
                    .into_iter()
                    .map(|s| {
                        let i = s as usize;
                        seen[i] = false;
                        (s, std::mem::take(&mut acc[i]))
                    })
                    .collect()
            };
            if node != root && self.lengths[node] != 0.0 && !entries.is_empty() {
                visit(self.lengths[node], &entries);
            }
            stack.push(entries);
        }
    }
}
