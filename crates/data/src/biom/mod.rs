//! §2.1 BIOM tables: an in-memory sparse samples x observations count matrix.
//!
//! [`BiomTable::read`] sniffs the file: the HDF5 signature means BIOM 2.x
//! ([`hdf5`]), a leading `{` means BIOM 1.0 JSON ([`json`]). Anything else,
//! including the 0-byte file and classic tab-separated tables, is a clear error.
//!
//! Storage is compressed by sample (CSC in BIOM's observations x samples
//! terms): for sample `s`, `indptr[s]..indptr[s + 1]` indexes the observation
//! indices (ascending, i.e. table row order, as the reference iterates them)
//! and their counts. Only positive counts are stored; explicit zeros in a file
//! are dropped, duplicates are summed (scipy's COO semantics, which biom uses).

mod hdf5;
mod json;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The counts of one sample: parallel slices of observation indices (ascending)
/// and positive counts.
#[derive(Debug, Clone, Copy)]
pub struct SampleCounts<'a> {
    /// Observation (row) indices into [`BiomTable::observation_ids`], ascending.
    pub observations: &'a [u32],
    /// The counts, all > 0.
    pub counts: &'a [f64],
}

impl SampleCounts<'_> {
    /// Number of observations with a positive count.
    pub fn len(&self) -> usize {
        self.observations.len()
    }

    /// True when the sample has no positive count.
    pub fn is_empty(&self) -> bool {
        self.observations.is_empty()
    }

    /// Sum of the counts (the sequencing depth).
    pub fn total(&self) -> f64 {
        self.counts.iter().sum()
    }
}

/// A BIOM table: sample IDs, observation IDs (ASV sequences) and sparse counts.
#[derive(Debug, Clone, PartialEq)]
pub struct BiomTable {
    source: PathBuf,
    sample_ids: Vec<String>,
    observation_ids: Vec<String>,
    indptr: Vec<usize>,
    indices: Vec<u32>,
    data: Vec<f64>,
}

impl BiomTable {
    /// Read a BIOM 2.x (HDF5) or BIOM 1.0 (JSON) table.
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(bytes, path)
    }

    /// Parse a table held in memory; `path` is only used in error messages.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        Self::parse(bytes.to_vec(), path)
    }

    fn parse(bytes: Vec<u8>, path: &Path) -> Result<Self> {
        if bytes.is_empty() {
            return Err(Error::EmptyFile {
                path: path.to_path_buf(),
            });
        }
        if hdf5_pure::is_hdf5_bytes(&bytes) {
            return hdf5::read(bytes, path);
        }
        let text = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&bytes);
        let first = text.iter().copied().find(|b| !b.is_ascii_whitespace());
        match first {
            Some(b'{') => json::read(text, path),
            Some(b'#') => Err(Error::UnsupportedFormat {
                path: path.to_path_buf(),
                reason: "this looks like a classic tab-separated BIOM table; convert it with \
                         `biom convert -i <in> -o <out> --to-hdf5` first"
                    .into(),
            }),
            _ => Err(Error::UnsupportedFormat {
                path: path.to_path_buf(),
                reason: "neither BIOM 2.x (HDF5 signature) nor BIOM 1.0 (JSON object)".into(),
            }),
        }
    }

    /// Build a table from (observation, sample, count) triplets, in any order.
    ///
    /// Zeros are dropped, duplicates summed; negative or non-finite counts,
    /// duplicate IDs and out-of-range indices are errors. `source` names the
    /// table in error messages.
    pub fn from_triplets(
        source: impl Into<PathBuf>,
        sample_ids: Vec<String>,
        observation_ids: Vec<String>,
        observations: &[u32],
        samples: &[u32],
        counts: &[f64],
    ) -> Result<Self> {
        let source = source.into();
        let invalid = |reason: String| Error::InvalidTable {
            path: source.clone(),
            reason,
        };
        if observations.len() != samples.len() || samples.len() != counts.len() {
            return Err(invalid(format!(
                "{} observation indices, {} sample indices, {} counts",
                observations.len(),
                samples.len(),
                counts.len()
            )));
        }
        let n_samples = sample_ids.len();
        let mut indptr = vec![0usize; n_samples + 1];
        for (k, &s) in samples.iter().enumerate() {
            if s as usize >= n_samples {
                return Err(invalid(format!(
                    "entry {k}: sample index {s} out of range (table has {n_samples} samples)"
                )));
            }
            indptr[s as usize + 1] += 1;
        }
        for s in 0..n_samples {
            indptr[s + 1] += indptr[s];
        }
        let mut next = indptr.clone();
        let mut indices = vec![0u32; counts.len()];
        let mut data = vec![0f64; counts.len()];
        for k in 0..counts.len() {
            let slot = &mut next[samples[k] as usize];
            indices[*slot] = observations[k];
            data[*slot] = counts[k];
            *slot += 1;
        }
        Self::from_csc(source, sample_ids, observation_ids, indptr, indices, data)
    }

    /// Build a table from sample-major compressed arrays (BIOM's `sample/matrix`).
    /// Validates everything and normalises: per-sample sorted, no zeros, no duplicates.
    pub(crate) fn from_csc(
        source: PathBuf,
        sample_ids: Vec<String>,
        observation_ids: Vec<String>,
        mut indptr: Vec<usize>,
        mut indices: Vec<u32>,
        mut data: Vec<f64>,
    ) -> Result<Self> {
        let invalid = |reason: String| Error::InvalidTable {
            path: source.clone(),
            reason,
        };
        check_unique(&source, "sample", &sample_ids)?;
        check_unique(&source, "observation", &observation_ids)?;
        let n_samples = sample_ids.len();
        let n_obs = observation_ids.len();
        if indptr.len() != n_samples + 1 {
            return Err(invalid(format!(
                "indptr has {} entries for {n_samples} samples (expected {})",
                indptr.len(),
                n_samples + 1
            )));
        }
        if indices.len() != data.len() {
            return Err(invalid(format!(
                "{} indices but {} values",
                indices.len(),
                data.len()
            )));
        }
        if indptr[0] != 0 || indptr[n_samples] != data.len() {
            return Err(invalid(format!(
                "indptr runs from {} to {} but there are {} values",
                indptr[0],
                indptr[n_samples],
                data.len()
            )));
        }
        if let Some(s) = (0..n_samples).find(|&s| indptr[s] > indptr[s + 1]) {
            return Err(invalid(format!(
                "indptr decreases at sample {:?}",
                sample_ids[s]
            )));
        }
        // Validate, sort each sample by observation, merge duplicates, drop zeros; in place.
        let mut pairs: Vec<(u32, f64)> = Vec::new();
        let mut write = 0usize;
        for s in 0..n_samples {
            let (start, end) = (indptr[s], indptr[s + 1]);
            let row_start = write;
            let sorted = indices[start..end].windows(2).all(|w| w[0] < w[1]);
            if !sorted {
                pairs.clear();
                pairs.extend(
                    indices[start..end]
                        .iter()
                        .copied()
                        .zip(data[start..end].iter().copied()),
                );
                pairs.sort_by_key(|p| p.0);
                for (k, &(o, v)) in pairs.iter().enumerate() {
                    indices[start + k] = o;
                    data[start + k] = v;
                }
            }
            for k in start..end {
                let (o, v) = (indices[k], data[k]);
                if o as usize >= n_obs {
                    return Err(invalid(format!(
                        "sample {:?}: observation index {o} out of range (table has {n_obs} observations)",
                        sample_ids[s]
                    )));
                }
                if !v.is_finite() || v < 0.0 {
                    return Err(Error::InvalidCount {
                        path: source.clone(),
                        sample: sample_ids[s].clone(),
                        observation: observation_ids[o as usize].clone(),
                        value: v,
                    });
                }
                if v == 0.0 {
                    continue;
                }
                if write > row_start && indices[write - 1] == o {
                    data[write - 1] += v;
                } else {
                    indices[write] = o;
                    data[write] = v;
                    write += 1;
                }
            }
            indptr[s] = row_start;
        }
        indptr[n_samples] = write;
        indices.truncate(write);
        data.truncate(write);
        indices.shrink_to_fit();
        data.shrink_to_fit();
        Ok(Self {
            source,
            sample_ids,
            observation_ids,
            indptr,
            indices,
            data,
        })
    }

    /// The file the table was read from (or the name given to [`Self::from_triplets`]).
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Write the table as BIOM 2.1 (HDF5, both axes), atomically; errors name `path`.
    pub fn write_hdf5(&self, path: &Path) -> Result<()> {
        crate::write_atomic(path, &hdf5::write(self)?)
    }

    /// Number of samples (columns).
    pub fn n_samples(&self) -> usize {
        self.sample_ids.len()
    }

    /// Number of observations (rows, ASVs).
    pub fn n_observations(&self) -> usize {
        self.observation_ids.len()
    }

    /// Number of stored (positive) counts.
    pub fn nnz(&self) -> usize {
        self.data.len()
    }

    /// True when the table has no sample or no observation.
    pub fn is_empty(&self) -> bool {
        self.n_samples() == 0 || self.n_observations() == 0
    }

    /// Sample IDs in table column order.
    pub fn sample_ids(&self) -> &[String] {
        &self.sample_ids
    }

    /// Observation IDs in table row order; for Deblur/DADA2 tables these are
    /// the ASV sequences themselves (§2.1).
    pub fn observation_ids(&self) -> &[String] {
        &self.observation_ids
    }

    /// The positive counts of sample `s` (by position).
    ///
    /// # Panics
    /// If `s >= n_samples()` (a programmer error).
    pub fn sample(&self, s: usize) -> SampleCounts<'_> {
        let range = self.indptr[s]..self.indptr[s + 1];
        SampleCounts {
            observations: &self.indices[range.clone()],
            counts: &self.data[range],
        }
    }

    /// Per-sample totals (sequencing depths), in sample order.
    pub fn sample_totals(&self) -> Vec<f64> {
        (0..self.n_samples())
            .map(|s| self.sample(s).total())
            .collect()
    }

    /// Per-observation totals, in observation order.
    pub fn observation_totals(&self) -> Vec<f64> {
        let mut totals = vec![0.0; self.n_observations()];
        for (&o, &v) in self.indices.iter().zip(&self.data) {
            totals[o as usize] += v;
        }
        totals
    }

    /// Sum of all counts.
    pub fn total(&self) -> f64 {
        self.data.iter().sum()
    }

    /// True when every count is a whole number.
    pub fn is_integer(&self) -> bool {
        self.data.iter().all(|v| v.fract() == 0.0)
    }

    /// A map from sample ID to its position.
    pub fn sample_index(&self) -> HashMap<&str, usize> {
        self.sample_ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.as_str(), i))
            .collect()
    }

    /// A new table with only the samples at `positions` (in that order), and
    /// only the observations that keep a positive count.
    ///
    /// # Panics
    /// If a position is out of range (a programmer error).
    pub fn select_samples(&self, positions: &[usize]) -> Self {
        let mut indptr = Vec::with_capacity(positions.len() + 1);
        indptr.push(0);
        let nnz: usize = positions.iter().map(|&s| self.sample(s).len()).sum();
        let mut indices = Vec::with_capacity(nnz);
        let mut data = Vec::with_capacity(nnz);
        for &s in positions {
            let sample = self.sample(s);
            indices.extend_from_slice(sample.observations);
            data.extend_from_slice(sample.counts);
            indptr.push(indices.len());
        }
        let sample_ids = positions
            .iter()
            .map(|&s| self.sample_ids[s].clone())
            .collect();
        Self::with_used_observations(
            self.source.clone(),
            sample_ids,
            &self.observation_ids,
            indptr,
            indices,
            data,
        )
    }

    /// Assemble a table, keeping only observations referenced by `indices` and
    /// renumbering them in their original order.
    pub(crate) fn with_used_observations(
        source: PathBuf,
        sample_ids: Vec<String>,
        all_observations: &[String],
        indptr: Vec<usize>,
        mut indices: Vec<u32>,
        data: Vec<f64>,
    ) -> Self {
        let mut remap = vec![u32::MAX; all_observations.len()];
        for &o in &indices {
            remap[o as usize] = 0;
        }
        let mut observation_ids = Vec::new();
        for (o, slot) in remap.iter_mut().enumerate() {
            if *slot == 0 {
                *slot = observation_ids.len() as u32;
                observation_ids.push(all_observations[o].clone());
            }
        }
        for o in &mut indices {
            *o = remap[*o as usize];
        }
        Self {
            source,
            sample_ids,
            observation_ids,
            indptr,
            indices,
            data,
        }
    }
}

/// Error on the first repeated ID.
fn check_unique(path: &Path, kind: &'static str, ids: &[String]) -> Result<()> {
    let mut seen = std::collections::HashSet::with_capacity(ids.len());
    for id in ids {
        if !seen.insert(id.as_str()) {
            return Err(Error::DuplicateId {
                path: path.to_path_buf(),
                kind,
                id: id.clone(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A 3-sample, 4-observation table:
    /// S1 = {o0: 1, o2: 3}, S2 = {o1: 5}, S3 = {o0: 2, o3: 4}.
    pub(crate) fn small() -> BiomTable {
        BiomTable::from_triplets(
            "small",
            vec!["S1".into(), "S2".into(), "S3".into()],
            vec!["AAAA".into(), "CCCC".into(), "GGGG".into(), "TTTT".into()],
            &[2, 0, 1, 3, 0],
            &[0, 0, 1, 2, 2],
            &[3.0, 1.0, 5.0, 4.0, 2.0],
        )
        .unwrap()
    }

    #[test]
    fn triplets_are_sorted_per_sample() {
        let t = small();
        assert_eq!(t.n_samples(), 3);
        assert_eq!(t.n_observations(), 4);
        assert_eq!(t.sample(0).observations, &[0, 2]);
        assert_eq!(t.sample(0).counts, &[1.0, 3.0]);
        assert_eq!(t.sample(2).observations, &[0, 3]);
        assert_eq!(t.sample_totals(), vec![4.0, 5.0, 6.0]);
        assert_eq!(t.observation_totals(), vec![3.0, 5.0, 3.0, 4.0]);
        assert!(t.is_integer());
    }

    #[test]
    fn zeros_dropped_and_duplicates_summed() {
        let t = BiomTable::from_triplets(
            "t",
            vec!["a".into()],
            vec!["x".into(), "y".into()],
            &[1, 0, 1],
            &[0, 0, 0],
            &[2.0, 0.0, 3.0],
        )
        .unwrap();
        assert_eq!(t.sample(0).observations, &[1]);
        assert_eq!(t.sample(0).counts, &[5.0]);
    }

    #[test]
    fn negative_and_nan_counts_are_errors_naming_sample_and_observation() {
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            let err = BiomTable::from_triplets(
                "t.biom",
                vec!["a".into()],
                vec!["x".into()],
                &[0],
                &[0],
                &[bad],
            )
            .unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, Error::InvalidCount { .. }), "{msg}");
            assert!(
                msg.contains("t.biom") && msg.contains("\"a\"") && msg.contains("\"x\""),
                "{msg}"
            );
        }
    }

    #[test]
    fn out_of_range_and_duplicate_ids_are_errors() {
        let err = BiomTable::from_triplets(
            "t.biom",
            vec!["a".into()],
            vec!["x".into()],
            &[1],
            &[0],
            &[1.0],
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("observation index 1 out of range"),
            "{err}"
        );
        let err = BiomTable::from_triplets(
            "t.biom",
            vec!["a".into(), "a".into()],
            vec!["x".into()],
            &[],
            &[],
            &[],
        )
        .unwrap_err();
        assert!(
            matches!(err, Error::DuplicateId { kind: "sample", .. }),
            "{err}"
        );
        assert!(err.to_string().contains("\"a\""));
    }

    #[test]
    fn select_samples_prunes_unused_observations() {
        let t = small().select_samples(&[2, 1]);
        assert_eq!(t.sample_ids(), &["S3".to_string(), "S2".to_string()]);
        assert_eq!(
            t.observation_ids(),
            &["AAAA".to_string(), "CCCC".to_string(), "TTTT".to_string()]
        );
        assert_eq!(t.sample(0).observations, &[0, 2]);
        assert_eq!(t.sample(1).observations, &[1]);
    }

    #[test]
    fn empty_bytes_and_unknown_formats_are_errors() {
        let p = Path::new("x.biom");
        assert!(matches!(
            BiomTable::from_bytes(b"", p),
            Err(Error::EmptyFile { .. })
        ));
        let err =
            BiomTable::from_bytes(b"# Constructed from biom file\n#OTU ID\ta\n", p).unwrap_err();
        assert!(err.to_string().contains("classic tab-separated"), "{err}");
        let err = BiomTable::from_bytes(b"hello", p).unwrap_err();
        assert!(
            matches!(err, Error::UnsupportedFormat { .. }) && err.to_string().contains("x.biom")
        );
    }
}
