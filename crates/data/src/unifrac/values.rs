//! One value per sample, matched by ID: the Faith's PD target of
//! `--unifrac-metric faith_pd` (§2.6, `matrix_format='faith_pd'`).
//!
//! The files are those of a distance matrix with one column: `faithpd`'s
//! (and QIIME 2's) TSV, a header line then `sample<TAB>value` rows; a CSV
//! with the IDs in its first column; `.npy` of shape `[N]` or `[N, 1]`; an
//! `.npz` or `.h5` array under `faith_pd` (or the other names a matrix is
//! looked for under), with its IDs beside it or in a sidecar file, exactly
//! as [`DistanceMatrix`](super::DistanceMatrix) finds them. Every value must
//! be finite and every ID unique.

use std::path::{Path, PathBuf};

use super::{read_bytes, read_raw, row_ids, MatrixIds, MissingPolicy, Rows, TextLayout};
use crate::error::{Error, Result};

/// Validated per-sample values with their sample IDs.
#[derive(Debug, Clone)]
pub struct SampleValues {
    rows: Rows,
    values: Vec<f32>,
}

impl SampleValues {
    /// Read and validate a file; see the module doc for formats and IDs.
    pub fn read(path: impl AsRef<Path>, ids: &MatrixIds) -> Result<Self> {
        let path = path.as_ref();
        Self::from_bytes(read_bytes(path)?, path, ids)
    }

    /// Parse values held in memory; `path` gives the format (extension),
    /// the place of sidecar ID files and the name in errors.
    pub fn from_bytes(bytes: Vec<u8>, path: &Path, ids: &MatrixIds) -> Result<Self> {
        if let Some(line) = headerless_text(&bytes, path) {
            return Err(Error::MatrixText {
                path: path.to_path_buf(),
                line,
                reason: "the first line holds a value, not a header: per-sample values start \
                         with a header line such as `#SampleID<TAB>faith_pd`, as faithpd writes"
                    .into(),
            });
        }
        let (shape, raw, embedded) = read_raw(bytes, path, TextLayout::Column)?;
        let n = match shape.as_slice() {
            [n] | [n, 1] => *n,
            _ => {
                return Err(Error::NotAVector {
                    path: path.to_path_buf(),
                    shape,
                })
            }
        };
        let (ids, id_source) = row_ids(path, embedded, ids)?;
        if ids.len() != n {
            return Err(Error::MatrixIdCount {
                path: path.to_path_buf(),
                rows: n,
                ids: ids.len(),
                source_name: id_source,
            });
        }
        let values = match raw {
            super::Raw::F32(v) => v.into_iter().map(f64::from).collect(),
            super::Raw::F64(v) => v,
        };
        Self::from_values(path, ids, values)
    }

    /// Build from values in the order of `ids` and validate.
    pub fn from_values(
        source: impl Into<PathBuf>,
        ids: Vec<String>,
        values: Vec<f64>,
    ) -> Result<Self> {
        let source = source.into();
        if values.len() != ids.len() {
            return Err(Error::InvalidConfig {
                reason: format!(
                    "{}: {} values for {} sample IDs",
                    source.display(),
                    values.len(),
                    ids.len()
                ),
            });
        }
        let rows = Rows::new(source, ids, "sample")?;
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(Error::ValueNonFinite {
                path: rows.source,
                id: rows.ids[i].clone(),
                value: values[i],
            });
        }
        Ok(Self {
            rows,
            values: values.into_iter().map(|v| v as f32).collect(),
        })
    }

    /// The file the values came from.
    pub fn source(&self) -> &Path {
        &self.rows.source
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// True without any sample.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Sample IDs in row order.
    pub fn ids(&self) -> &[String] {
        &self.rows.ids
    }

    /// The value of row `i`.
    ///
    /// # Panics
    /// If the row is out of range (a programmer error).
    pub fn get(&self, i: usize) -> f32 {
        self.values[i]
    }

    /// The value of a sample by ID.
    pub fn value(&self, id: &str) -> Option<f32> {
        self.rows.position(id).map(|i| self.values[i])
    }

    /// The row of each of `sample_ids`, as
    /// [`DistanceMatrix::match_samples`](super::DistanceMatrix::match_samples).
    pub fn match_samples<S: AsRef<str>>(
        &self,
        sample_ids: &[S],
        policy: MissingPolicy,
    ) -> Result<Vec<(usize, usize)>> {
        self.rows
            .match_samples("per-sample values", sample_ids, policy)
    }
}

/// The line number of a text file's first line when that line is a
/// sample and its value (no header), else `None`.
fn headerless_text(bytes: &[u8], path: &Path) -> Option<usize> {
    let ext = path.extension()?.to_str()?.to_ascii_lowercase();
    let delimiter = match ext.as_str() {
        "csv" => ',',
        "tsv" | "txt" => '\t',
        _ => return None,
    };
    let text = std::str::from_utf8(bytes).ok()?;
    let (i, line) = text
        .lines()
        .enumerate()
        .find(|(_, l)| !l.trim().is_empty())?;
    let mut cells = line.split(delimiter).skip(1);
    let value = cells.next()?.trim().trim_matches('"');
    (cells.next().is_none() && value.parse::<f64>().is_ok()).then_some(i + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn faithpd_tsv_and_csv() {
        let v = SampleValues::from_bytes(
            b"#SampleID\tfaith_pd\nb\t2.5\na\t1.0\n".to_vec(),
            Path::new("f.tsv"),
            &MatrixIds::Auto,
        )
        .unwrap();
        assert_eq!(v.ids(), ids(&["b", "a"]));
        assert_eq!(v.value("a"), Some(1.0));
        let c = SampleValues::from_bytes(
            b"sample_id,faith_pd\na,1\nb,2\n".to_vec(),
            Path::new("f.csv"),
            &MatrixIds::Auto,
        )
        .unwrap();
        assert_eq!(c.get(1), 2.0);
        // One sample: its single column is not mistaken for a square matrix.
        let one = SampleValues::from_bytes(
            b"#SampleID\tfaith_pd\na\t3\n".to_vec(),
            Path::new("f.tsv"),
            &MatrixIds::Auto,
        )
        .unwrap();
        assert_eq!(one.len(), 1);
    }

    #[test]
    fn errors_name_file_line_and_sample() {
        let err = |bytes: &[u8], name: &str| {
            SampleValues::from_bytes(bytes.to_vec(), Path::new(name), &MatrixIds::Auto)
                .unwrap_err()
                .to_string()
        };
        let msg = err(b"a\t1.5\nb\t2\n", "f.tsv");
        assert!(msg.contains("f.tsv:1") && msg.contains("header"), "{msg}");
        let msg = err(b"id\tfaith_pd\na\tnan\n", "f.tsv");
        assert!(msg.contains("\"a\"") && msg.contains("NaN"), "{msg}");
        let msg = err(b"id\tx\ty\na\t1\t2\n", "f.tsv");
        assert!(msg.contains("N x 1") && msg.contains("[1, 2]"), "{msg}");
        let msg = err(b"id\tfaith_pd\na\t1\na\t2\n", "f.tsv");
        assert!(msg.contains("duplicate") && msg.contains("\"a\""), "{msg}");
        let msg = err(b"id\tfaith_pd\na\tx\n", "f.tsv");
        assert!(msg.contains("f.tsv:2") && msg.contains("\"x\""), "{msg}");
    }

    #[test]
    fn matching_names_the_missing_samples() {
        let v = SampleValues::from_values("f.tsv", ids(&["a", "b"]), vec![1.0, 2.0]).unwrap();
        assert_eq!(
            v.match_samples(&["b", "a"], MissingPolicy::Error).unwrap(),
            vec![(0, 1), (1, 0)]
        );
        let msg = v
            .match_samples(&["a", "c"], MissingPolicy::Error)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("per-sample values") && msg.contains("\"c\""),
            "{msg}"
        );
        assert_eq!(
            v.match_samples(&["a", "c"], MissingPolicy::Drop).unwrap(),
            vec![(0, 0)]
        );
    }
}
