//! Input summary and pre-flight check (`aam-rs inspect`).
//!
//! [`summarize`] describes a table, and optionally a distance matrix and a
//! metadata file, the way a `pretrain`/`train` run will see them, without
//! building anything: sample and ASV counts, the distribution of reads per
//! sample, ASV sequence lengths and non-ACGT characters, ASVs per sample
//! after rarefaction at the run's depth and seed, how many of the samples the
//! matrix and the metadata cover (with the first missing IDs), and the target
//! column (range of a numeric one, counts of a categorical one).
//!
//! It applies the checks that make a run stop before its first epoch, in the
//! order the run applies them, and records each failure as a readable
//! **problem** (the run would not start) or **warning** (it would start, but
//! look here first):
//!
//! - no sample reaches the rarefaction depth, or a deep-enough sample has a
//!   non-integer count ([`BiomTable::rarefy`]);
//! - samples kept by rarefaction that the matrix lacks, or that have no value
//!   in the target column (no metadata row, or a missing cell): a problem
//!   unless [`SummaryOptions::drop_missing`], then a warning;
//! - a target column that is absent, or not numeric for a regression;
//!   fewer than 2 distinct labels for a classifier;
//! - fewer than 2 samples left after all of that (a train/validation split
//!   needs 2).
//!
//! Reading the files is the caller's job (so that it can name them by its
//! own flags); a file that cannot be read is recorded with
//! [`Summary::add_problem`].
//!
//! Statistics of a set of numbers are `min / median / max`, `null` for an
//! empty set; the median of an even count is the mean of the two middle values.

use std::collections::HashMap;

use serde::Serialize;

use crate::biom::BiomTable;
use crate::error::{Error, IdList, MAX_LISTED};
use crate::metadata::Metadata;
use crate::unifrac::DistanceMatrix;

/// How many categories of a categorical target are listed.
pub const MAX_CATEGORIES: usize = 20;

/// The run's settings that decide what the inputs become.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SummaryOptions {
    /// Reads per sample after rarefaction (the CLIs' `--rarefy-depth`, default 5000).
    pub rarefy_depth: u64,
    /// Rarefaction seed (the CLIs' `--seed`, default 42).
    pub seed: u64,
    /// Bases kept per ASV (`--max-bp`, default 150); longer ASVs are truncated.
    pub max_bp: usize,
    /// The metadata column to predict, if any.
    pub target_column: Option<String>,
    /// The target is a class label (any text) rather than a number.
    pub classifier: bool,
    /// Samples missing from the matrix or the metadata are dropped instead of
    /// stopping the run (`--drop-missing`).
    pub drop_missing: bool,
}

impl Default for SummaryOptions {
    fn default() -> Self {
        Self {
            rarefy_depth: 5000,
            seed: 42,
            max_bp: crate::tokenize::DEFAULT_MAX_BP,
            target_column: None,
            classifier: false,
            drop_missing: false,
        }
    }
}

/// Minimum, median and maximum of a set of numbers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Stats {
    /// Smallest value.
    pub min: f64,
    /// Median (mean of the two middle values for an even count).
    pub median: f64,
    /// Largest value.
    pub max: f64,
}

impl Stats {
    /// The statistics of `values`; `None` when there is none.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Self> {
        let mut v: Vec<f64> = values.into_iter().collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Self {
            min: v[0],
            median,
            max: v[n - 1],
        })
    }
}

/// The table as read.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TableSummary {
    /// The file.
    pub path: String,
    /// Number of samples.
    pub samples: usize,
    /// Number of ASVs (observations).
    pub asvs: usize,
    /// Number of positive counts.
    pub nonzero: usize,
    /// Every count is a whole number (rarefaction needs it).
    pub integer_counts: bool,
    /// Reads per sample.
    pub depth: Option<Stats>,
    /// Samples with fewer reads than the rarefaction depth (dropped by it).
    pub below_depth: usize,
    /// The first of them (at most [`MAX_LISTED`]).
    pub below_depth_first: Vec<String>,
    /// ASVs (positive counts) per sample, before rarefaction.
    pub asvs_per_sample: Option<Stats>,
}

/// The ASV sequences (the table's observation IDs).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SequenceSummary {
    /// Sequence length in characters.
    pub length: Option<Stats>,
    /// The `max_bp` checked against.
    pub max_bp: usize,
    /// ASVs longer than `max_bp` (truncated by tokenisation).
    pub longer_than_max_bp: usize,
    /// ASVs with at least one character other than A, C, G, T (any case);
    /// tokenisation maps those characters to 0, the padding token.
    pub asvs_with_non_acgt: usize,
    /// Total number of such characters over all ASVs.
    pub non_acgt_bases: usize,
    /// IDs of which more than half the characters are not A/C/G/T: not
    /// sequences at all (e.g. QIIME 2 feature hashes).
    pub not_sequences: usize,
    /// The first such ID, if any.
    pub not_sequence_example: Option<String>,
}

/// The table after rarefaction.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RarefactionSummary {
    /// Reads per sample.
    pub depth: u64,
    /// Seed of the draws.
    pub seed: u64,
    /// Rarefaction succeeded (some sample reaches the depth, counts are integers).
    pub done: bool,
    /// Samples kept (those with at least `depth` reads).
    pub samples: usize,
    /// ASVs left with a read.
    pub asvs: usize,
    /// ASVs per kept sample.
    pub asvs_per_sample: Option<Stats>,
}

/// How many of the checked samples a matrix or metadata file has.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Coverage {
    /// The file.
    pub path: String,
    /// Samples in the file.
    pub samples: usize,
    /// Checked samples found in the file.
    pub covered: usize,
    /// Checked samples absent from it.
    pub missing: usize,
    /// The first of those (at most [`MAX_LISTED`]), in table order.
    pub missing_first: Vec<String>,
}

/// Numeric or categorical.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TargetKind {
    /// Every value of the column is a finite number (and not a classifier).
    Numeric,
    /// Labels: some value is not a number, or the target is a class label.
    Categorical,
}

/// Range of a numeric target.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct NumericRange {
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
    /// Mean.
    pub mean: f64,
}

/// One category of a categorical target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CategoryCount {
    /// The label.
    pub value: String,
    /// Checked samples with it.
    pub count: usize,
}

/// The target column over the checked samples.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TargetSummary {
    /// Column name.
    pub column: String,
    /// Numeric or categorical.
    pub kind: TargetKind,
    /// Checked samples with a value.
    pub with_value: usize,
    /// Checked samples without one (no metadata row, or a missing cell).
    pub missing: usize,
    /// The first of those (at most [`MAX_LISTED`]).
    pub missing_first: Vec<String>,
    /// Range, for a numeric target.
    pub range: Option<NumericRange>,
    /// Number of distinct values, for a categorical target.
    pub distinct: Option<usize>,
    /// The most frequent values (at most [`MAX_CATEGORIES`]), by count then
    /// value, for a categorical target.
    pub categories: Vec<CategoryCount>,
}

/// Which samples the coverage and target figures are about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckedSamples {
    /// The samples kept by rarefaction (what a run uses).
    Rarefied,
    /// All table samples (rarefaction failed).
    Table,
}

/// Everything [`summarize`] found; serialises to one JSON object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// No problem: a `pretrain`/`train` run on these inputs would start.
    /// Kept equal to `problems.is_empty()` by [`Summary::add_problem`].
    pub ok: bool,
    /// Why a run would not start.
    pub problems: Vec<String>,
    /// What a run would do silently or with a warning.
    pub warnings: Vec<String>,
    /// The table as read.
    pub table: TableSummary,
    /// The ASV sequences.
    pub sequences: SequenceSummary,
    /// The table after rarefaction.
    pub rarefaction: RarefactionSummary,
    /// Which samples the coverage and target figures count.
    pub checked_samples: CheckedSamples,
    /// Number of those samples.
    pub checked: usize,
    /// Coverage by the distance matrix, when one was given.
    pub matrix: Option<Coverage>,
    /// Coverage by the metadata, when given.
    pub metadata: Option<Coverage>,
    /// The target column, when one was given (and the metadata was read).
    pub target: Option<TargetSummary>,
    /// Samples a run would use: kept by rarefaction, in the matrix (if
    /// given), with a target value (if a target is given); 0 when
    /// rarefaction fails.
    pub usable_samples: usize,
}

impl Summary {
    /// Record a reason the run would not start.
    pub fn add_problem(&mut self, problem: impl Into<String>) {
        self.problems.push(problem.into());
        self.ok = false;
    }

    /// Record something to look at that does not stop the run.
    pub fn add_warning(&mut self, warning: impl Into<String>) {
        self.warnings.push(warning.into());
    }
}

fn first_ids<S: AsRef<str>>(ids: &[S]) -> Vec<String> {
    ids.iter()
        .take(MAX_LISTED)
        .map(|s| s.as_ref().to_string())
        .collect()
}

/// The table's observation IDs read as sequences, against `max_bp`.
pub fn sequences(table: &BiomTable, max_bp: usize) -> SequenceSummary {
    let mut lengths = Vec::with_capacity(table.n_observations());
    let (mut longer, mut with_non_acgt, mut non_acgt, mut not_sequences) = (0, 0, 0, 0);
    let mut not_sequence_example = None;
    for id in table.observation_ids() {
        let (mut n, mut bad) = (0usize, 0usize);
        for c in id.chars() {
            n += 1;
            if !matches!(c, 'A' | 'C' | 'G' | 'T' | 'a' | 'c' | 'g' | 't') {
                bad += 1;
            }
        }
        lengths.push(n as f64);
        longer += usize::from(n > max_bp);
        with_non_acgt += usize::from(bad > 0);
        non_acgt += bad;
        if 2 * bad > n {
            not_sequences += 1;
            not_sequence_example.get_or_insert_with(|| id.clone());
        }
    }
    SequenceSummary {
        length: Stats::of(lengths),
        max_bp,
        longer_than_max_bp: longer,
        asvs_with_non_acgt: with_non_acgt,
        non_acgt_bases: non_acgt,
        not_sequences,
        not_sequence_example,
    }
}

/// Summarise a run's inputs and check them; see the module doc.
///
/// `matrix` and `metadata` are the files the run would be given, already
/// read; the metadata is only checked against the target when
/// `options.target_column` names one.
pub fn summarize(
    table: &BiomTable,
    matrix: Option<&DistanceMatrix>,
    metadata: Option<&Metadata>,
    options: &SummaryOptions,
) -> Summary {
    let depth = options.rarefy_depth;
    let totals = table.sample_totals();
    let below: Vec<&String> = table
        .sample_ids()
        .iter()
        .zip(&totals)
        .filter(|(_, &t)| t < depth as f64)
        .map(|(id, _)| id)
        .collect();
    let table_summary = TableSummary {
        path: table.source().display().to_string(),
        samples: table.n_samples(),
        asvs: table.n_observations(),
        nonzero: table.nnz(),
        integer_counts: table.is_integer(),
        depth: Stats::of(totals.iter().copied()),
        below_depth: below.len(),
        below_depth_first: first_ids(&below),
        asvs_per_sample: Stats::of((0..table.n_samples()).map(|s| table.sample(s).len() as f64)),
    };
    let mut problems = Vec::new();
    let mut warnings = Vec::new();

    let sequences = sequences(table, options.max_bp);
    if sequences.not_sequences > 0 {
        let example = table
            .observation_ids()
            .iter()
            .find(|id| {
                let bad = id
                    .chars()
                    .filter(|c| !matches!(c, 'A' | 'C' | 'G' | 'T' | 'a' | 'c' | 'g' | 't'))
                    .count();
                2 * bad > id.chars().count()
            })
            .cloned()
            .unwrap_or_default();
        warnings.push(format!(
            "{} of the {} observation IDs are mostly not A/C/G/T (e.g. {example:?}): the model reads \
             the observation IDs as the ASV sequences, so a table with hashed feature IDs needs its \
             sequences as IDs",
            sequences.not_sequences,
            table.n_observations()
        ));
    }

    // Rarefaction, as the run does it.
    let rarefied = if table.n_samples() == 0 {
        problems.push(format!(
            "{}: the table has no sample",
            table.source().display()
        ));
        None
    } else {
        match table.rarefy(depth, options.seed) {
            Ok(r) => Some(r.table),
            Err(e @ Error::RarefiedEmpty { .. }) => {
                problems.push(format!("{e}: lower the rarefaction depth (--rarefy-depth)"));
                None
            }
            Err(e) => {
                problems.push(e.to_string());
                None
            }
        }
    };
    if rarefied.is_some() && !below.is_empty() {
        warnings.push(format!(
            "{} of the {} samples have fewer than {depth} reads and are dropped by rarefaction: {}",
            below.len(),
            table.n_samples(),
            IdList::new(&below)
        ));
    }
    let rarefaction = match &rarefied {
        Some(r) => RarefactionSummary {
            depth,
            seed: options.seed,
            done: true,
            samples: r.n_samples(),
            asvs: r.n_observations(),
            asvs_per_sample: Stats::of((0..r.n_samples()).map(|s| r.sample(s).len() as f64)),
        },
        None => RarefactionSummary {
            depth,
            seed: options.seed,
            done: false,
            samples: 0,
            asvs: 0,
            asvs_per_sample: None,
        },
    };
    let (checked_samples, ids) = match &rarefied {
        Some(r) => (CheckedSamples::Rarefied, r.sample_ids()),
        None => (CheckedSamples::Table, table.sample_ids()),
    };
    let of_what = match checked_samples {
        CheckedSamples::Rarefied => "samples kept by rarefaction",
        CheckedSamples::Table => "table samples",
    };
    // usable[s]: sample s of `ids` survives every join.
    let mut usable = vec![rarefied.is_some(); ids.len()];
    let drop_hint = if options.drop_missing {
        ""
    } else {
        "; the run stops on this unless told to drop them (--drop-missing)"
    };

    let matrix_cov = matrix.map(|m| {
        let missing: Vec<&String> = ids.iter().filter(|id| m.position(id).is_none()).collect();
        for (s, id) in ids.iter().enumerate() {
            if m.position(id).is_none() {
                usable[s] = false;
            }
        }
        if !missing.is_empty() {
            let text = format!(
                "{} of the {} {of_what} are missing from the distance matrix {} ({} samples): {}{drop_hint}",
                missing.len(),
                ids.len(),
                m.source().display(),
                m.len(),
                IdList::new(&missing)
            );
            if options.drop_missing {
                warnings.push(text);
            } else {
                problems.push(text);
            }
        }
        Coverage {
            path: m.source().display().to_string(),
            samples: m.len(),
            covered: ids.len() - missing.len(),
            missing: missing.len(),
            missing_first: first_ids(&missing),
        }
    });

    let mut target = None;
    // The target column is absent: no sample is usable, and that is the reason.
    let mut no_column = false;
    let metadata_cov = metadata.map(|meta| {
        let missing: Vec<&String> = ids.iter().filter(|id| meta.row(id).is_none()).collect();
        if options.target_column.is_none() && !missing.is_empty() {
            warnings.push(format!(
                "{} of the {} {of_what} have no row in the metadata {}: {}",
                missing.len(),
                ids.len(),
                meta.source().display(),
                IdList::new(&missing)
            ));
        }
        if let Some(column) = &options.target_column {
            match target_summary(meta, column, ids, options.classifier) {
                Ok(t) => {
                    let lacking: Vec<&String> = ids
                        .iter()
                        .zip(&t.1)
                        .filter(|(_, has)| !**has)
                        .map(|(id, _)| id)
                        .collect();
                    for (s, has) in t.1.iter().enumerate() {
                        usable[s] &= *has;
                    }
                    if !lacking.is_empty() {
                        let text = format!(
                            "{} of the {} {of_what} have no value in column {:?} of {} (no row, or a \
                             missing value): {}{drop_hint}",
                            lacking.len(),
                            ids.len(),
                            t.0.column,
                            meta.source().display(),
                            IdList::new(&lacking)
                        );
                        if options.drop_missing {
                            warnings.push(text);
                        } else {
                            problems.push(text);
                        }
                    }
                    for p in t.2 {
                        problems.push(p);
                    }
                    target = Some(t.0);
                }
                Err(e) => {
                    problems.push(e);
                    usable.fill(false);
                    no_column = true;
                }
            }
        }
        Coverage {
            path: meta.source().display().to_string(),
            samples: meta.len(),
            covered: ids.len() - missing.len(),
            missing: missing.len(),
            missing_first: first_ids(&missing),
        }
    });

    let usable_samples = usable.iter().filter(|&&u| u).count();
    if rarefied.is_some() && !no_column && usable_samples < 2 {
        let missing_reported = matrix_cov.as_ref().is_some_and(|c| c.missing > 0)
            || target.as_ref().is_some_and(|t| t.missing > 0);
        problems.push(format!(
            "{}{usable_samples} sample(s) would be left for the run; a train/validation split needs \
             at least 2",
            if missing_reported && !options.drop_missing {
                "even when the missing samples are dropped, "
            } else {
                ""
            }
        ));
    }

    Summary {
        ok: problems.is_empty(),
        problems,
        warnings,
        table: table_summary,
        sequences,
        rarefaction,
        checked_samples,
        checked: ids.len(),
        matrix: matrix_cov,
        metadata: metadata_cov,
        target,
        usable_samples,
    }
}

/// The target column over `ids`: its summary, which samples have a value,
/// and problems with its values; `Err` when the column is absent.
fn target_summary(
    meta: &Metadata,
    column: &str,
    ids: &[String],
    classifier: bool,
) -> Result<(TargetSummary, Vec<bool>, Vec<String>), String> {
    let c = meta.column(column).map_err(|e| e.to_string())?;
    let mut problems = Vec::new();
    // A regression reads the whole column as numbers (every row, not only the
    // table's), as the run does.
    let numeric = if classifier {
        None
    } else {
        match meta.numeric(column) {
            Ok(v) => Some(v),
            Err(e) => {
                problems.push(format!(
                    "{e}: a regression target must be numeric (`train --classifier` takes labels)"
                ));
                None
            }
        }
    };
    let values: Vec<Option<&str>> = ids
        .iter()
        .map(|id| meta.row(id).and_then(|r| meta.value(r, c)))
        .collect();
    let has: Vec<bool> = values.iter().map(Option::is_some).collect();
    let lacking: Vec<&String> = ids
        .iter()
        .zip(&has)
        .filter(|(_, h)| !**h)
        .map(|(id, _)| id)
        .collect();
    let with_value = ids.len() - lacking.len();
    let mut summary = TargetSummary {
        column: meta.columns()[c].clone(),
        kind: TargetKind::Categorical,
        with_value,
        missing: lacking.len(),
        missing_first: first_ids(&lacking),
        range: None,
        distinct: None,
        categories: Vec::new(),
    };
    if let Some(numbers) = numeric {
        summary.kind = TargetKind::Numeric;
        let present: Vec<f64> = ids
            .iter()
            .filter_map(|id| meta.row(id).and_then(|r| numbers[r]))
            .collect();
        if let (Some(min), Some(max)) = (
            present.iter().copied().reduce(f64::min),
            present.iter().copied().reduce(f64::max),
        ) {
            summary.range = Some(NumericRange {
                min,
                max,
                mean: present.iter().sum::<f64>() / present.len() as f64,
            });
        }
    } else {
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for v in values.iter().flatten() {
            *counts.entry(v).or_default() += 1;
        }
        let mut sorted: Vec<(&str, usize)> = counts.into_iter().collect();
        sorted.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        summary.distinct = Some(sorted.len());
        if classifier && sorted.len() < 2 {
            problems.push(format!(
                "column {:?} of {} has {} distinct label(s) among the samples; a classifier needs at least 2",
                summary.column,
                meta.source().display(),
                sorted.len()
            ));
        }
        summary.categories = sorted
            .into_iter()
            .take(MAX_CATEGORIES)
            .map(|(value, count)| CategoryCount {
                value: value.to_string(),
                count,
            })
            .collect();
    }
    Ok((summary, has, problems))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::biom::tests::small;
    use crate::dataset::tests::{matrix, meta};
    use std::path::Path;

    fn opts(depth: u64) -> SummaryOptions {
        SummaryOptions {
            rarefy_depth: depth,
            ..Default::default()
        }
    }

    #[test]
    fn stats_min_median_max() {
        assert_eq!(Stats::of([]), None);
        let s = Stats::of([3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.min, s.median, s.max), (1.0, 2.0, 3.0));
        let s = Stats::of([4.0, 1.0, 2.0, 10.0]).unwrap();
        assert_eq!((s.min, s.median, s.max), (1.0, 3.0, 10.0));
    }

    #[test]
    fn table_depths_sequences_and_rarefaction() {
        // small(): S1 = {AAAA: 1, GGGG: 3}, S2 = {CCCC: 5}, S3 = {AAAA: 2, TTTT: 4}.
        let t = small();
        let s = summarize(
            &t,
            None,
            None,
            &SummaryOptions {
                max_bp: 3,
                ..opts(5)
            },
        );
        assert!(s.ok, "{:?}", s.problems);
        assert_eq!((s.table.samples, s.table.asvs, s.table.nonzero), (3, 4, 5));
        assert_eq!(s.table.depth, Stats::of([4.0, 5.0, 6.0]));
        assert_eq!(
            (s.table.below_depth, s.table.below_depth_first.clone()),
            (1, vec!["S1".to_string()])
        );
        assert_eq!(s.table.asvs_per_sample, Stats::of([2.0, 1.0, 2.0]));
        let q = &s.sequences;
        assert_eq!(q.length, Stats::of([4.0; 4]));
        assert_eq!(
            (
                q.longer_than_max_bp,
                q.asvs_with_non_acgt,
                q.non_acgt_bases,
                q.not_sequences
            ),
            (4, 0, 0, 0)
        );
        let r = &s.rarefaction;
        assert!(r.done);
        // S2 and S3 are kept; S2 keeps CCCC, S3 keeps 5 of its 6 reads.
        assert_eq!(r.samples, 2);
        assert_eq!(r.asvs_per_sample.unwrap().min, 1.0);
        assert_eq!(s.checked_samples, CheckedSamples::Rarefied);
        assert_eq!((s.checked, s.usable_samples), (2, 2));
        assert_eq!(s.warnings.len(), 1, "{:?}", s.warnings);
        assert!(s.warnings[0].contains("\"S1\""), "{:?}", s.warnings);
        assert!(serde_json::to_value(&s).unwrap()["ok"].as_bool().unwrap());
    }

    #[test]
    fn non_acgt_and_hashed_ids() {
        let t = BiomTable::from_triplets(
            "t",
            vec!["a".into(), "b".into()],
            vec!["ACGN".into(), "acgtRY".into(), "0f3a9c11e2".into()],
            &[0, 1, 2, 0],
            &[0, 0, 1, 1],
            &[2.0, 2.0, 3.0, 1.0],
        )
        .unwrap();
        let s = summarize(&t, None, None, &opts(4));
        let q = &s.sequences;
        assert_eq!(q.length, Stats::of([4.0, 6.0, 10.0]));
        assert_eq!(
            (q.asvs_with_non_acgt, q.non_acgt_bases, q.not_sequences),
            (3, 1 + 2 + 8, 1)
        );
        assert!(
            s.warnings.iter().any(|w| w.contains("0f3a9c11e2")),
            "{:?}",
            s.warnings
        );
        assert!(s.ok);
    }

    #[test]
    fn depth_out_of_reach_is_a_problem() {
        let s = summarize(&small(), Some(&matrix(&["S1"])), None, &opts(100));
        assert!(!s.ok);
        assert!(!s.rarefaction.done);
        assert!(
            s.problems[0].contains("depth 100") && s.problems[0].contains("deepest has 6"),
            "{:?}",
            s.problems
        );
        // Coverage then counts every table sample.
        assert_eq!(s.checked_samples, CheckedSamples::Table);
        let m = s.matrix.unwrap();
        assert_eq!(
            (m.covered, m.missing, m.missing_first),
            (1, 2, vec!["S2".to_string(), "S3".to_string()])
        );
        assert_eq!(s.usable_samples, 0);
    }

    #[test]
    fn missing_samples_are_problems_unless_dropped() {
        let t = small();
        let m = matrix(&["S1", "S2", "X"]);
        let s = summarize(&t, Some(&m), None, &opts(1));
        assert!(!s.ok);
        let cov = s.matrix.as_ref().unwrap();
        assert_eq!((cov.samples, cov.covered, cov.missing), (3, 2, 1));
        assert_eq!(cov.missing_first, vec!["S3".to_string()]);
        assert_eq!(s.problems.len(), 1, "{:?}", s.problems);
        assert!(
            s.problems[0].contains("\"S3\"") && s.problems[0].contains("m.h5"),
            "{:?}",
            s.problems
        );
        assert_eq!(s.usable_samples, 2);

        let dropped = summarize(
            &t,
            Some(&m),
            None,
            &SummaryOptions {
                drop_missing: true,
                ..opts(1)
            },
        );
        assert!(dropped.ok, "{:?}", dropped.problems);
        assert!(dropped.warnings.iter().any(|w| w.contains("\"S3\"")));

        // Dropping would leave one sample: a problem either way.
        let m = matrix(&["S1", "X"]);
        for drop_missing in [false, true] {
            let s = summarize(
                &t,
                Some(&m),
                None,
                &SummaryOptions {
                    drop_missing,
                    ..opts(1)
                },
            );
            assert!(!s.ok);
            assert_eq!(s.usable_samples, 1);
            assert!(
                s.problems
                    .last()
                    .unwrap()
                    .contains("1 sample(s) would be left"),
                "{:?}",
                s.problems
            );
        }
    }

    #[test]
    fn numeric_target_range_and_missing_values() {
        let t = small();
        let md = meta("#SampleID\tage\tsite\nS1\t10\tgut\nS2\tNA\tskin\nS3\t40\tgut\nX\t99\tgut\n");
        let options = SummaryOptions {
            target_column: Some("age".into()),
            ..opts(1)
        };
        let s = summarize(&t, None, Some(&md), &options);
        let cov = s.metadata.as_ref().unwrap();
        assert_eq!((cov.samples, cov.covered, cov.missing), (4, 3, 0));
        let target = s.target.as_ref().unwrap();
        assert_eq!(target.kind, TargetKind::Numeric);
        assert_eq!((target.with_value, target.missing), (2, 1));
        assert_eq!(target.missing_first, vec!["S2".to_string()]);
        // Over the table's samples only: X's 99 is not counted.
        assert_eq!(
            target.range,
            Some(NumericRange {
                min: 10.0,
                max: 40.0,
                mean: 25.0
            })
        );
        assert!(!s.ok);
        assert!(
            s.problems[0].contains("\"age\"") && s.problems[0].contains("\"S2\""),
            "{:?}",
            s.problems
        );
        assert_eq!(s.usable_samples, 2);
        let s = summarize(
            &t,
            None,
            Some(&md),
            &SummaryOptions {
                drop_missing: true,
                ..options
            },
        );
        assert!(s.ok, "{:?}", s.problems);
    }

    #[test]
    fn categorical_target_absent_column_and_classifier() {
        let t = small();
        let md = meta("id\tsite\tone\nS1\tgut\tx\nS2\tskin\tx\nS3\tgut\tx\n");
        let column = |c: &str, classifier: bool| SummaryOptions {
            target_column: Some(c.into()),
            classifier,
            ..opts(1)
        };
        // A regression on text: categories are reported, and it is a problem.
        let s = summarize(&t, None, Some(&md), &column("site", false));
        let target = s.target.as_ref().unwrap();
        assert_eq!(target.kind, TargetKind::Categorical);
        assert_eq!(target.distinct, Some(2));
        assert_eq!(
            target.categories,
            vec![
                CategoryCount {
                    value: "gut".into(),
                    count: 2
                },
                CategoryCount {
                    value: "skin".into(),
                    count: 1
                }
            ]
        );
        assert!(!s.ok);
        assert!(
            s.problems[0].contains("not a finite number") && s.problems[0].contains("meta.tsv:2:"),
            "{:?}",
            s.problems
        );
        // A classifier on it is fine; one label is not.
        assert!(summarize(&t, None, Some(&md), &column("site", true)).ok);
        let s = summarize(&t, None, Some(&md), &column("one", true));
        assert!(
            !s.ok && s.problems[0].contains("1 distinct label"),
            "{:?}",
            s.problems
        );
        // An absent column names the file and lists the columns.
        let s = summarize(&t, None, Some(&md), &column("age", false));
        assert!(!s.ok && s.target.is_none());
        assert_eq!(s.problems.len(), 1, "{:?}", s.problems);
        assert!(
            s.problems[0].contains("meta.tsv") && s.problems[0].contains("\"site\""),
            "{:?}",
            s.problems
        );
        assert_eq!(s.usable_samples, 0);
    }

    #[test]
    fn metadata_without_target_only_warns() {
        let md = meta("id\tsite\nS1\tgut\n");
        let s = summarize(&small(), None, Some(&md), &opts(1));
        assert!(s.ok, "{:?}", s.problems);
        assert_eq!(s.metadata.as_ref().unwrap().missing, 2);
        assert!(
            s.warnings.iter().any(|w| w.contains("\"S2\"")),
            "{:?}",
            s.warnings
        );
    }

    #[test]
    fn demo_set_summary() {
        let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("demo");
        let t = BiomTable::read(demo.join("demo.biom")).unwrap();
        let m = DistanceMatrix::read(demo.join("unifrac.unweighted.h5"), &crate::MatrixIds::Auto)
            .unwrap();
        let md = Metadata::read(demo.join("demo_map.txt")).unwrap();
        let options = SummaryOptions {
            target_column: Some("age".into()),
            ..opts(1000)
        };
        let s = summarize(&t, Some(&m), Some(&md), &options);
        assert!(s.ok, "{:?}", s.problems);
        assert_eq!((s.table.samples, s.table.asvs), (64, 534));
        assert_eq!(
            s.table.depth,
            Some(Stats {
                min: 1000.0,
                median: 1000.0,
                max: 1000.0
            })
        );
        assert_eq!(
            s.sequences.length,
            Some(Stats {
                min: 100.0,
                median: 100.0,
                max: 100.0
            })
        );
        // Every sample has exactly 1,000 reads: rarefying to 1,000 changes nothing.
        assert_eq!(s.rarefaction.asvs_per_sample, s.table.asvs_per_sample);
        assert_eq!(
            (s.matrix.unwrap().covered, s.metadata.unwrap().covered),
            (64, 64)
        );
        let r = s.target.unwrap().range.unwrap();
        assert!(
            r.min >= 18.0 && r.max <= 85.0 && r.min < r.mean && r.mean < r.max,
            "{r:?}"
        );
        assert_eq!(s.usable_samples, 64);
    }
}
