//! §2.4 The prepared dataset: a (rarefied) table joined to its UniFrac matrix
//! and metadata **by sample ID**, with every distinct ASV tokenised once.
//!
//! Joining happens once, here, and every mismatch is decided here: a table
//! sample missing from the matrix or lacking a target is an error listing the
//! IDs, or is dropped with a warning when the caller asks
//! ([`MissingPolicy::Drop`]). After [`DatasetBuilder::build`] every sample has
//! its matrix row and its target, so batches cannot silently shrink (the
//! reference's ticket TRN-1) or pick the wrong distances (§8 item 7).
//!
//! Targets are kept raw; normalisers and encoders are fitted on the training
//! split afterwards ([`Dataset::fit_target_normalizer`], ...) and applied when
//! batches are built.

use std::collections::HashMap;
use std::sync::Arc;

use crate::biom::BiomTable;
use crate::categorical::{CategoricalEncoder, CategoryWeights};
use crate::error::{Error, IdList, Result};
use crate::metadata::Metadata;
use crate::normalize::{CountNormalizer, TargetNormalizer, TargetTransform};
use crate::split::{train_val_split, Split};
use crate::tokenize::{TokenCache, DEFAULT_MAX_BP};
use crate::unifrac::{DistanceMatrix, MissingPolicy, SampleValues};

/// Samples ready for batching.
#[derive(Debug, Clone)]
pub struct Dataset {
    sample_ids: Vec<String>,
    index: HashMap<String, usize>,
    indptr: Vec<usize>,
    asvs: Vec<u32>,
    counts: Vec<f32>,
    asv_ids: Vec<String>,
    tokens: TokenCache,
    unifrac: Option<(Arc<DistanceMatrix>, Vec<usize>)>,
    faith_pd: Option<(Arc<SampleValues>, Vec<usize>)>,
    metadata: Option<(Arc<Metadata>, Vec<Option<usize>>)>,
    target_column: Option<String>,
    targets: Option<Vec<f64>>,
}

/// One sample given directly (a service's request, a library caller): its ID
/// and its reads per ASV sequence, in the order the model sees them (the
/// order of a table's rows, for a sample read from a table).
#[derive(Debug, Clone, PartialEq)]
pub struct SampleReads {
    /// Sample ID.
    pub id: String,
    /// (ASV sequence, reads), in order; zero counts are skipped.
    pub reads: Vec<(String, f64)>,
}

impl SampleReads {
    /// Every sample of a table, each with its ASVs in table row order.
    pub fn from_table(table: &BiomTable) -> Vec<SampleReads> {
        (0..table.n_samples())
            .map(|s| {
                let sample = table.sample(s);
                SampleReads {
                    id: table.sample_ids()[s].clone(),
                    reads: sample
                        .observations
                        .iter()
                        .zip(sample.counts)
                        .map(|(&o, &c)| (table.observation_ids()[o as usize].clone(), c))
                        .collect(),
                }
            })
            .collect()
    }
}

/// Builds a [`Dataset`] from a table and, optionally, a matrix and metadata.
#[derive(Debug)]
pub struct DatasetBuilder<'a> {
    table: &'a BiomTable,
    max_bp: usize,
    unifrac: Option<(Arc<DistanceMatrix>, MissingPolicy)>,
    faith_pd: Option<(Arc<SampleValues>, MissingPolicy)>,
    metadata: Option<Arc<Metadata>>,
    target: Option<(String, MissingPolicy)>,
}

impl Dataset {
    /// Start building from a table (usually rarefied).
    pub fn builder(table: &BiomTable) -> DatasetBuilder<'_> {
        DatasetBuilder {
            table,
            max_bp: DEFAULT_MAX_BP,
            unifrac: None,
            faith_pd: None,
            metadata: None,
            target: None,
        }
    }

    /// A dataset of samples given directly, each keeping its ASVs' order,
    /// with `metadata` rows for its categorical columns (optional; no matrix,
    /// no target: for prediction and embedding).
    ///
    /// Errors name the sample: an ID given twice, no positive count, a
    /// negative or non-finite count, a sequence listed twice in one sample.
    pub fn from_samples(
        samples: &[SampleReads],
        max_bp: usize,
        metadata: Option<Arc<Metadata>>,
    ) -> Result<Dataset> {
        if samples.is_empty() {
            return Err(Error::InvalidConfig {
                reason: "no sample was given".into(),
            });
        }
        let invalid = |sample: &str, reason: String| Error::InvalidSample {
            sample: sample.to_string(),
            reason,
        };
        let mut index = HashMap::with_capacity(samples.len());
        let mut asv_index: HashMap<&str, u32> = HashMap::new();
        let mut asv_ids: Vec<String> = Vec::new();
        // last_sample[a]: the last sample (+1) that listed ASV a.
        let mut last_sample: Vec<usize> = Vec::new();
        let mut indptr = Vec::with_capacity(samples.len() + 1);
        indptr.push(0);
        let (mut asvs, mut counts) = (Vec::new(), Vec::new());
        let mut empty = Vec::new();
        for (s, sample) in samples.iter().enumerate() {
            if index.insert(sample.id.clone(), s).is_some() {
                return Err(invalid(&sample.id, "the ID is given twice".into()));
            }
            let start = asvs.len();
            for (sequence, count) in &sample.reads {
                if !count.is_finite() || *count < 0.0 {
                    return Err(invalid(
                        &sample.id,
                        format!("ASV {sequence:?} has count {count} (counts are finite and ≥ 0)"),
                    ));
                }
                if *count == 0.0 {
                    continue;
                }
                let next = asv_ids.len() as u32;
                let a = *asv_index.entry(sequence.as_str()).or_insert(next);
                if a == next {
                    asv_ids.push(sequence.clone());
                    last_sample.push(0);
                }
                if std::mem::replace(&mut last_sample[a as usize], s + 1) == s + 1 {
                    return Err(invalid(
                        &sample.id,
                        format!("ASV {sequence:?} is listed twice"),
                    ));
                }
                asvs.push(a);
                counts.push(*count as f32);
            }
            if asvs.len() == start {
                empty.push(sample.id.clone());
            }
            indptr.push(asvs.len());
        }
        if !empty.is_empty() {
            return Err(Error::EmptySamples {
                count: empty.len(),
                ids: IdList::new(&empty),
            });
        }
        let sample_ids: Vec<String> = samples.iter().map(|s| s.id.clone()).collect();
        let metadata = metadata.map(|m| {
            let rows = sample_ids.iter().map(|id| m.row(id)).collect();
            (m, rows)
        });
        Ok(Dataset {
            tokens: TokenCache::new(&asv_ids, max_bp),
            sample_ids,
            index,
            indptr,
            asvs,
            counts,
            asv_ids,
            unifrac: None,
            faith_pd: None,
            metadata,
            target_column: None,
            targets: None,
        })
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.sample_ids.len()
    }

    /// True when there is no sample (never, for a built dataset).
    pub fn is_empty(&self) -> bool {
        self.sample_ids.is_empty()
    }

    /// Sample IDs, in table order.
    pub fn sample_ids(&self) -> &[String] {
        &self.sample_ids
    }

    /// Position of a sample.
    pub fn position(&self, id: &str) -> Option<usize> {
        self.index.get(id).copied()
    }

    /// Positions of `ids`; unknown IDs are an error listing them.
    pub fn positions<S: AsRef<str>>(&self, ids: &[S]) -> Result<Vec<usize>> {
        let mut out = Vec::with_capacity(ids.len());
        let mut unknown = Vec::new();
        for id in ids {
            match self.position(id.as_ref()) {
                Some(p) => out.push(p),
                None => unknown.push(id.as_ref().to_string()),
            }
        }
        if unknown.is_empty() {
            Ok(out)
        } else {
            Err(Error::UnknownSamples {
                count: unknown.len(),
                ids: IdList::new(&unknown),
            })
        }
    }

    /// The ASVs of sample `s`: indices into [`Self::asv_ids`] (table row order)
    /// and their counts.
    ///
    /// # Panics
    /// If `s >= len()` (a programmer error).
    pub fn sample(&self, s: usize) -> (&[u32], &[f32]) {
        let r = self.indptr[s]..self.indptr[s + 1];
        (&self.asvs[r.clone()], &self.counts[r])
    }

    /// The distinct ASVs (observation IDs = sequences) of the dataset.
    pub fn asv_ids(&self) -> &[String] {
        &self.asv_ids
    }

    /// The token rows of [`Self::asv_ids`].
    pub fn tokens(&self) -> &TokenCache {
        &self.tokens
    }

    /// L, tokens per ASV (max_bp + 1).
    pub fn seq_len(&self) -> usize {
        self.tokens.seq_len()
    }

    /// The distance matrix and each sample's row in it.
    pub fn unifrac(&self) -> Option<(&DistanceMatrix, &[usize])> {
        self.unifrac
            .as_ref()
            .map(|(m, rows)| (m.as_ref(), rows.as_slice()))
    }

    /// The Faith's PD values and each sample's row in them.
    pub fn faith_pd(&self) -> Option<(&SampleValues, &[usize])> {
        self.faith_pd
            .as_ref()
            .map(|(v, rows)| (v.as_ref(), rows.as_slice()))
    }

    /// The metadata and each sample's row (None: absent from the metadata).
    pub fn metadata(&self) -> Option<(&Metadata, &[Option<usize>])> {
        self.metadata
            .as_ref()
            .map(|(m, rows)| (m.as_ref(), rows.as_slice()))
    }

    /// The target column's name.
    pub fn target_column(&self) -> Option<&str> {
        self.target_column.as_deref()
    }

    /// Raw (untransformed) targets, one per sample.
    pub fn targets(&self) -> Option<&[f64]> {
        self.targets.as_deref()
    }

    /// Seeded train/validation split of the samples (positions).
    pub fn split(&self, test_size: f64, seed: u64) -> Result<Split> {
        train_val_split(self.len(), test_size, seed)
    }

    /// Fit a target transform on the samples at `train`; per-category
    /// transforms take their key columns from `category_columns`.
    pub fn fit_target_normalizer(
        &self,
        transform: TargetTransform,
        category_columns: &[String],
        train: &[usize],
    ) -> Result<TargetNormalizer> {
        let targets = self.targets.as_ref().ok_or_else(|| Error::InvalidConfig {
            reason: "the dataset has no target column".into(),
        })?;
        let ids: Vec<&str> = train.iter().map(|&s| self.sample_ids[s].as_str()).collect();
        let values: Vec<f64> = train.iter().map(|&s| targets[s]).collect();
        let (names, keys) = if transform.is_per_category() {
            let (meta, rows) = self.metadata().ok_or_else(|| Error::InvalidConfig {
                reason: format!("the {transform} transform needs metadata"),
            })?;
            let cols = category_columns
                .iter()
                .map(|c| meta.column(c))
                .collect::<Result<Vec<_>>>()?;
            let names: Vec<String> = cols.iter().map(|&c| meta.columns()[c].clone()).collect();
            let keys: Vec<String> = train
                .iter()
                .map(|&s| rows[s].map_or_else(String::new, |r| meta.category_key(r, &cols)))
                .collect();
            (names, Some(keys))
        } else {
            (category_columns.to_vec(), None)
        };
        TargetNormalizer::fit(transform, &ids, &values, &names, keys.as_deref())
    }

    /// Fit a categorical encoder on the samples at `train`.
    pub fn fit_categorical(
        &self,
        columns: &[String],
        train: &[usize],
    ) -> Result<CategoricalEncoder> {
        let (meta, _) = self.metadata().ok_or_else(|| Error::InvalidConfig {
            reason: "categorical columns need metadata".into(),
        })?;
        let ids: Vec<&str> = train.iter().map(|&s| self.sample_ids[s].as_str()).collect();
        CategoricalEncoder::fit(meta, columns, &ids)
    }

    /// Per-category loss weights of `column` balanced over the samples at
    /// `train` (`--categorical-loss-weights auto`, §2.10).
    pub fn fit_loss_weights(&self, column: &str, train: &[usize]) -> Result<CategoryWeights> {
        let (meta, _) = self.metadata().ok_or_else(|| Error::InvalidConfig {
            reason: "categorical loss weights need metadata".into(),
        })?;
        let ids: Vec<&str> = train.iter().map(|&s| self.sample_ids[s].as_str()).collect();
        CategoryWeights::balanced(meta, column, &ids)
    }

    /// Fit count normalisation (§2.9) on the samples at `train`.
    pub fn fit_count_normalizer(&self, train: &[usize]) -> Result<CountNormalizer> {
        CountNormalizer::fit(
            train
                .iter()
                .flat_map(|&s| self.sample(s).1.iter().map(|&c| c as f64)),
        )
    }
}

impl<'a> DatasetBuilder<'a> {
    /// Nucleotides kept per ASV (L = max_bp + 1). Default: 150 (§5).
    pub fn max_bp(mut self, max_bp: usize) -> Self {
        self.max_bp = max_bp;
        self
    }

    /// Attach a UniFrac matrix; `missing` decides about table samples it lacks.
    pub fn unifrac(mut self, matrix: Arc<DistanceMatrix>, missing: MissingPolicy) -> Self {
        self.unifrac = Some((matrix, missing));
        self
    }

    /// Attach Faith's PD values (the base target of `faith_pd` pretraining);
    /// `missing` decides about table samples they lack.
    pub fn faith_pd(mut self, values: Arc<SampleValues>, missing: MissingPolicy) -> Self {
        self.faith_pd = Some((values, missing));
        self
    }

    /// Attach metadata (for targets and categorical columns).
    pub fn metadata(mut self, metadata: Arc<Metadata>) -> Self {
        self.metadata = Some(metadata);
        self
    }

    /// Use a numeric metadata column as the target; `missing` decides about
    /// samples without a value (absent row or missing cell).
    pub fn target(mut self, column: &str, missing: MissingPolicy) -> Self {
        self.target = Some((column.trim().to_string(), missing));
        self
    }

    /// Join, validate and tokenise.
    pub fn build(self) -> Result<Dataset> {
        let table = self.table;
        let ids = table.sample_ids();
        if table.n_samples() == 0 {
            return Err(Error::InvalidConfig {
                reason: format!("{}: the table has no sample", table.source().display()),
            });
        }
        let empty: Vec<&String> = (0..table.n_samples())
            .filter(|&s| table.sample(s).is_empty())
            .map(|s| &ids[s])
            .collect();
        if !empty.is_empty() {
            return Err(Error::EmptySamples {
                count: empty.len(),
                ids: IdList::new(&empty),
            });
        }
        // keep[s]: the sample survives matching; matrix_row[s]: its matrix row.
        let mut keep: Vec<bool> = vec![true; ids.len()];
        let mut matrix_row = vec![usize::MAX; ids.len()];
        if let Some((matrix, policy)) = &self.unifrac {
            keep.fill(false);
            for (s, row) in matrix.match_samples(ids, *policy)? {
                keep[s] = true;
                matrix_row[s] = row;
            }
        }
        let mut faith_row = vec![usize::MAX; ids.len()];
        if let Some((values, policy)) = &self.faith_pd {
            let mut matched = vec![false; ids.len()];
            for (s, row) in values.match_samples(ids, *policy)? {
                matched[s] = true;
                faith_row[s] = row;
            }
            keep.iter_mut().zip(matched).for_each(|(k, m)| *k &= m);
        }
        let mut meta_row: Vec<Option<usize>> = vec![None; ids.len()];
        let mut target = vec![f64::NAN; ids.len()];
        if let Some(meta) = &self.metadata {
            for (s, id) in ids.iter().enumerate() {
                meta_row[s] = meta.row(id);
            }
            if let Some((column, policy)) = &self.target {
                let values = meta.numeric(column)?;
                let mut missing = Vec::new();
                for s in 0..ids.len() {
                    match meta_row[s].and_then(|r| values[r]) {
                        Some(v) => target[s] = v,
                        None if keep[s] => {
                            missing.push(ids[s].clone());
                            keep[s] = false;
                        }
                        None => {}
                    }
                }
                if !missing.is_empty() {
                    let err = Error::MissingTargets {
                        path: meta.source().to_path_buf(),
                        column: column.clone(),
                        count: missing.len(),
                        ids: IdList::new(&missing),
                    };
                    match policy {
                        MissingPolicy::Error => return Err(err),
                        MissingPolicy::Drop => tracing::warn!("dropping samples: {err}"),
                    }
                }
            } else {
                let absent = (0..ids.len())
                    .filter(|&s| keep[s] && meta_row[s].is_none())
                    .count();
                if absent > 0 {
                    tracing::warn!(metadata = %meta.source().display(), "{absent} sample(s) have no metadata row; their categorical values encode as unknown (0)");
                }
            }
        } else if self.target.is_some() {
            return Err(Error::InvalidConfig {
                reason: "a target column needs metadata".into(),
            });
        }

        let kept: Vec<usize> = (0..ids.len()).filter(|&s| keep[s]).collect();
        if kept.is_empty() {
            return Err(Error::InvalidConfig {
                reason: "no sample is left after matching the table to the matrix (or per-sample \
                         values) and metadata"
                    .into(),
            });
        }
        let selected = table.select_samples(&kept);
        let tokens = TokenCache::new(selected.observation_ids(), self.max_bp);
        let mut indptr = Vec::with_capacity(kept.len() + 1);
        indptr.push(0);
        let mut asvs = Vec::with_capacity(selected.nnz());
        let mut counts = Vec::with_capacity(selected.nnz());
        for s in 0..selected.n_samples() {
            let sample = selected.sample(s);
            asvs.extend_from_slice(sample.observations);
            counts.extend(sample.counts.iter().map(|&c| c as f32));
            indptr.push(asvs.len());
        }
        let sample_ids: Vec<String> = selected.sample_ids().to_vec();
        let index = sample_ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.clone(), i))
            .collect();
        let unifrac = self
            .unifrac
            .map(|(m, _)| (m, kept.iter().map(|&s| matrix_row[s]).collect()));
        let faith_pd = self
            .faith_pd
            .map(|(v, _)| (v, kept.iter().map(|&s| faith_row[s]).collect()));
        let targets = self
            .target
            .as_ref()
            .map(|_| kept.iter().map(|&s| target[s]).collect());
        let metadata = self
            .metadata
            .map(|m| (m, kept.iter().map(|&s| meta_row[s]).collect()));
        Ok(Dataset {
            sample_ids,
            index,
            indptr,
            asvs,
            counts,
            asv_ids: selected.observation_ids().to_vec(),
            tokens,
            unifrac,
            faith_pd,
            metadata,
            target_column: self.target.map(|(c, _)| c),
            targets,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::biom::tests::small;
    use std::path::Path;

    pub(crate) fn matrix(ids: &[&str]) -> DistanceMatrix {
        let n = ids.len();
        let mut v = vec![0.0; n * n];
        for i in 0..n {
            for j in 0..n {
                if i != j {
                    v[i * n + j] = (i + j) as f64 / 10.0 + if i.min(j) == 0 { 0.05 } else { 0.0 };
                }
            }
        }
        DistanceMatrix::from_values("m.h5", ids.iter().map(|s| s.to_string()).collect(), v).unwrap()
    }

    pub(crate) fn meta(text: &str) -> Arc<Metadata> {
        Arc::new(Metadata::from_bytes(text.as_bytes(), Path::new("meta.tsv")).unwrap())
    }

    #[test]
    fn joins_by_id_whatever_the_order() {
        let t = small();
        // The matrix lists the samples in another order, plus an extra one.
        let m = Arc::new(matrix(&["X", "S3", "S1", "S2"]));
        let md = meta("#SampleID\tage\nS2\t20\nS3\t30\nS1\t10\n");
        let d = Dataset::builder(&t)
            .max_bp(4)
            .unifrac(m.clone(), MissingPolicy::Error)
            .metadata(md)
            .target("age", MissingPolicy::Error)
            .build()
            .unwrap();
        assert_eq!(d.sample_ids(), t.sample_ids());
        let (mat, rows) = d.unifrac().unwrap();
        for (s, id) in d.sample_ids().iter().enumerate() {
            assert_eq!(mat.ids()[rows[s]], *id);
        }
        assert_eq!(d.targets().unwrap(), &[10.0, 20.0, 30.0]);
        assert_eq!(d.seq_len(), 5);
        assert_eq!(d.tokens().row(d.sample(0).0[0] as usize), &[5, 1, 1, 1, 1]);
    }

    #[test]
    fn missing_samples_error_or_drop() {
        let t = small();
        let m = Arc::new(matrix(&["S1", "S3"]));
        let err = Dataset::builder(&t)
            .unifrac(m.clone(), MissingPolicy::Error)
            .build()
            .unwrap_err();
        assert!(
            err.to_string().contains("\"S2\"") && err.to_string().contains("m.h5"),
            "{err}"
        );
        let d = Dataset::builder(&t)
            .unifrac(m, MissingPolicy::Drop)
            .build()
            .unwrap();
        assert_eq!(d.sample_ids(), &["S1".to_string(), "S3".to_string()]);
        // The ASV only S2 had is gone from the token cache.
        assert_eq!(d.asv_ids().len(), 3);

        let md = meta("id\tage\nS1\t1\nS2\tNA\n");
        let err = Dataset::builder(&t)
            .metadata(md.clone())
            .target("age", MissingPolicy::Error)
            .build()
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("meta.tsv")
                && msg.contains("\"age\"")
                && msg.contains("\"S2\"")
                && msg.contains("\"S3\""),
            "{msg}"
        );
        let d = Dataset::builder(&t)
            .metadata(md)
            .target("age", MissingPolicy::Drop)
            .build()
            .unwrap();
        assert_eq!(d.sample_ids(), &["S1".to_string()]);
        let md = meta("id\tage\nS1\t1\nS2\tabc\nS3\t2\n");
        let err = Dataset::builder(&t)
            .metadata(md)
            .target("age", MissingPolicy::Drop)
            .build()
            .unwrap_err();
        assert!(
            matches!(err, Error::NonNumericTarget { line: 3, .. }),
            "{err}"
        );
    }

    #[test]
    fn samples_given_directly_equal_their_table() {
        let t = small();
        let from_table = Dataset::builder(&t).max_bp(3).build().unwrap();
        let given = Dataset::from_samples(&SampleReads::from_table(&t), 3, None).unwrap();
        assert_eq!(given.sample_ids(), from_table.sample_ids());
        for s in 0..t.n_samples() {
            let (a, ca) = from_table.sample(s);
            let (b, cb) = given.sample(s);
            assert_eq!(ca, cb);
            let rows = |d: &Dataset, asvs: &[u32]| -> Vec<Vec<u8>> {
                asvs.iter()
                    .map(|&a| d.tokens().row(a as usize).to_vec())
                    .collect()
            };
            assert_eq!(rows(&from_table, a), rows(&given, b));
        }
        // Each sample keeps its own order.
        let reads = |r: &[(&str, f64)]| r.iter().map(|(s, c)| (s.to_string(), *c)).collect();
        let two = [
            SampleReads {
                id: "A".into(),
                reads: reads(&[("CC", 1.0), ("AA", 2.0)]),
            },
            SampleReads {
                id: "B".into(),
                reads: reads(&[("AA", 3.0), ("GG", 0.0), ("CC", 4.0)]),
            },
        ];
        let d = Dataset::from_samples(&two, 4, None).unwrap();
        assert_eq!(d.asv_ids(), &["CC".to_string(), "AA".to_string()]);
        assert_eq!(d.sample(0), (&[0u32, 1][..], &[1.0f32, 2.0][..]));
        assert_eq!(d.sample(1), (&[1u32, 0][..], &[3.0f32, 4.0][..]));
        // Errors name the sample.
        let bad = |samples: &[SampleReads]| {
            Dataset::from_samples(samples, 4, None)
                .unwrap_err()
                .to_string()
        };
        let twice = [two[0].clone(), two[0].clone()];
        assert!(
            bad(&twice).contains("\"A\": the ID is given twice"),
            "{}",
            bad(&twice)
        );
        let dup = [SampleReads {
            id: "D".into(),
            reads: reads(&[("AA", 1.0), ("AA", 1.0)]),
        }];
        assert!(
            bad(&dup).contains("\"D\": ASV \"AA\" is listed twice"),
            "{}",
            bad(&dup)
        );
        let neg = [SampleReads {
            id: "N".into(),
            reads: reads(&[("AA", -1.0)]),
        }];
        assert!(
            bad(&neg).contains("\"N\": ASV \"AA\" has count -1"),
            "{}",
            bad(&neg)
        );
        let zero = [SampleReads {
            id: "Z".into(),
            reads: reads(&[("AA", 0.0)]),
        }];
        assert!(bad(&zero).contains("Z"), "{}", bad(&zero));
    }

    #[test]
    fn empty_samples_are_rejected() {
        let t = BiomTable::from_triplets(
            "t",
            vec!["a".into(), "b".into()],
            vec!["A".into()],
            &[0],
            &[0],
            &[1.0],
        )
        .unwrap();
        let err = Dataset::builder(&t).build().unwrap_err();
        assert!(
            matches!(err, Error::EmptySamples { count: 1, .. })
                && err.to_string().contains("\"b\""),
            "{err}"
        );
    }

    #[test]
    fn fitting_helpers_use_the_training_positions() {
        let t = small();
        let md = meta("id\tage\tsite\nS1\t10\tgut\nS2\t20\tskin\nS3\t40\tgut\n");
        let d = Dataset::builder(&t)
            .metadata(md)
            .target("age", MissingPolicy::Error)
            .build()
            .unwrap();
        let n = d
            .fit_target_normalizer(TargetTransform::MinMax, &[], &[0, 2])
            .unwrap();
        assert_eq!((n.min, n.max), (10.0, 40.0));
        let n = d
            .fit_target_normalizer(
                TargetTransform::ZScoreCategory,
                &["site".to_string()],
                &[0, 1, 2],
            )
            .unwrap();
        assert_eq!(n.category.as_ref().unwrap().stats.len(), 2);
        let e = d.fit_categorical(&["site".to_string()], &[1]).unwrap();
        assert_eq!(e.cardinalities(), vec![2]);
        let c = d.fit_count_normalizer(&[0]).unwrap();
        assert_eq!((c.min, c.max), (1.0, 3.0));
        assert!(d
            .positions(&["S3", "nope"])
            .unwrap_err()
            .to_string()
            .contains("\"nope\""));
    }
}
