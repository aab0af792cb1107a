//! §2.6 UniFrac distance matrices, matched to table samples by ID.
//!
//! Formats (by extension): `.h5`/`.hdf5` (the `ssu` layout `/matrix` +
//! `/order`, or the reference's `distances` / `stripe_distances` / `faith_pd`
//! keys, or a single dataset), `.npy`, `.npz` (key `distances` ->
//! `stripe_distances` -> `faith_pd` -> `matrix` -> the single key), `.csv`
//! (comma) and `.tsv`/`.txt` (tab, scikit-bio lsmat); fp32 or fp64.
//!
//! Every matrix carries sample IDs. Where the file has none (`.npy`, a keyless
//! `.npz`/`.h5`), they come from a sidecar text file, one ID per line (`ssu`
//! users keep them in `<prefix>.sample_ids.txt`), or, only when the caller
//! says so with [`MatrixIds::TableOrder`], from the table. The reference
//! silently assumes table order for such files (§8 item 7); here that
//! assumption is an explicit opt-in.
//!
//! Validation at load: square, one ID per row, unique IDs, every value finite,
//! zero diagonal, symmetric (tolerance [`TOLERANCE`]), as scikit-bio's
//! `DistanceMatrix` does for the reference. Values are kept as f32, the
//! precision of the training target.

mod npy;
mod text;
mod values;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, IdList, Result};
use crate::hdf5_util::H5;

pub use values::SampleValues;

/// Absolute tolerance of the symmetry and zero-diagonal checks.
pub const TOLERANCE: f64 = 1e-6;

/// Where the sample IDs of a matrix come from when the file itself has none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum MatrixIds {
    /// Look next to the matrix for `<stem>.sample_ids.txt`, `<stem>.ids.txt`,
    /// `<prefix>.sample_ids.txt` (prefix = name up to the first dot) and
    /// `sample_ids.txt`, in that order; error if none exists.
    #[default]
    Auto,
    /// Read them from this file (one ID per line).
    File(PathBuf),
    /// The rows are in this order (the reference's assumption for ID-less
    /// files, e.g. the table's sample order); the count must match.
    TableOrder(Vec<String>),
}

/// What to do with table samples that the matrix lacks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MissingPolicy {
    /// Fail, listing the missing IDs.
    #[default]
    Error,
    /// Drop them (logged as a warning).
    Drop,
}

/// A validated square distance matrix with sample IDs.
#[derive(Debug, Clone)]
pub struct DistanceMatrix {
    rows: Rows,
    data: Vec<f32>,
}

/// The sample IDs of a file's rows (unique), indexed, and the file.
#[derive(Debug, Clone)]
pub(crate) struct Rows {
    source: PathBuf,
    ids: Vec<String>,
    index: HashMap<String, usize>,
}

impl Rows {
    /// Fails on an ID given twice, naming it (`kind`: what the IDs are).
    fn new(source: PathBuf, ids: Vec<String>, kind: &'static str) -> Result<Self> {
        let mut index = HashMap::with_capacity(ids.len());
        for (i, id) in ids.iter().enumerate() {
            if index.insert(id.clone(), i).is_some() {
                return Err(Error::DuplicateId {
                    path: source,
                    kind,
                    id: id.clone(),
                });
            }
        }
        Ok(Self { source, ids, index })
    }

    fn position(&self, id: &str) -> Option<usize> {
        self.index.get(id).copied()
    }

    /// The row of each of `sample_ids` (see [`DistanceMatrix::match_samples`]);
    /// `what` names the file's content in the error and the warning.
    fn match_samples<S: AsRef<str>>(
        &self,
        what: &'static str,
        sample_ids: &[S],
        policy: MissingPolicy,
    ) -> Result<Vec<(usize, usize)>> {
        let mut matched = Vec::with_capacity(sample_ids.len());
        let mut missing = Vec::new();
        for (k, id) in sample_ids.iter().enumerate() {
            match self.position(id.as_ref()) {
                Some(row) => matched.push((k, row)),
                None => missing.push(id.as_ref().to_string()),
            }
        }
        if !missing.is_empty() {
            match policy {
                MissingPolicy::Error => {
                    return Err(Error::SamplesMissingFromMatrix {
                        path: self.source.clone(),
                        what,
                        count: missing.len(),
                        of: sample_ids.len(),
                        ids: IdList::new(&missing),
                    })
                }
                MissingPolicy::Drop => tracing::warn!(
                    file = %self.source.display(),
                    "dropping {} table sample(s) missing from the {what}: {}",
                    missing.len(),
                    IdList::new(&missing)
                ),
            }
        }
        Ok(matched)
    }
}

/// The names under which the reference looks for a matrix, in order.
const MATRIX_KEYS: [&str; 4] = ["distances", "stripe_distances", "faith_pd", "matrix"];
/// Names under which sample IDs are stored beside a matrix.
const ID_KEYS: [&str; 3] = ["order", "ids", "sample_ids"];
/// `ssu` writes these string datasets beside `/matrix`.
const SSU_META_KEYS: [&str; 2] = ["format", "version"];

/// Values as read, before validation.
enum Raw {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// What makes a matrix invalid, by row-major position.
enum Violation {
    NonFinite {
        i: usize,
        j: usize,
        value: f64,
    },
    Diagonal {
        i: usize,
        value: f64,
    },
    Asymmetric {
        i: usize,
        j: usize,
        ab: f64,
        ba: f64,
    },
}

/// Side of the square tiles of the symmetry check: two 64 x 64 f64 tiles
/// (64 KiB) stay in L2, so the transposed reads do not miss the cache on
/// every element as a row-by-column scan of a 2,537-wide matrix does.
const TILE: usize = 64;

/// The first non-finite value (row-major), else the first non-zero diagonal,
/// else the first asymmetric pair (tile by tile) of the `n x n` matrix `v`.
fn first_violation<T: Copy + Into<f64>>(v: &[T], n: usize) -> Option<Violation> {
    if let Some(k) = v.iter().position(|&x| !x.into().is_finite()) {
        let (i, j) = (k / n, k % n);
        return Some(Violation::NonFinite {
            i,
            j,
            value: v[k].into(),
        });
    }
    if let Some(i) = (0..n).find(|&i| v[i * n + i].into().abs() > TOLERANCE) {
        return Some(Violation::Diagonal {
            i,
            value: v[i * n + i].into(),
        });
    }
    for bi in (0..n).step_by(TILE) {
        for bj in (0..=bi).step_by(TILE) {
            for i in bi..(bi + TILE).min(n) {
                for j in bj..(bj + TILE).min(i) {
                    let (ab, ba) = (v[i * n + j].into(), v[j * n + i].into());
                    if (ab - ba).abs() > TOLERANCE {
                        return Some(Violation::Asymmetric { i, j, ab, ba });
                    }
                }
            }
        }
    }
    None
}

impl Raw {
    fn into_f32(self) -> Vec<f32> {
        match self {
            Raw::F32(v) => v,
            Raw::F64(v) => v.into_iter().map(|x| x as f32).collect(),
        }
    }
}

impl DistanceMatrix {
    /// Read and validate a matrix file; see the module doc for formats and IDs.
    pub fn read(path: impl AsRef<Path>, ids: &MatrixIds) -> Result<Self> {
        let path = path.as_ref();
        Self::from_bytes(read_bytes(path)?, path, ids)
    }

    /// Parse a matrix held in memory. The format is chosen by `path`'s
    /// extension, sidecar ID files (for [`MatrixIds::Auto`]) are looked for
    /// next to `path`, and `path` names the matrix in error messages.
    pub fn from_bytes(bytes: Vec<u8>, path: &Path, ids: &MatrixIds) -> Result<Self> {
        let (shape, raw, embedded) = read_raw(bytes, path, TextLayout::Square)?;
        let (rows, cols) = match shape.as_slice() {
            [r, c] => (*r, *c),
            [n] => (*n, 1),
            other => {
                return Err(Error::MatrixNotSquare {
                    path: path.to_path_buf(),
                    rows: other.first().copied().unwrap_or(0),
                    cols: other.iter().skip(1).product(),
                })
            }
        };
        if rows != cols {
            return Err(Error::MatrixNotSquare {
                path: path.to_path_buf(),
                rows,
                cols,
            });
        }
        let (ids, id_source) = row_ids(path, embedded, ids)?;
        Self::validate(path.to_path_buf(), ids, &id_source, rows, raw)
    }

    /// Build from row-major values (`ids.len()`² of them) and validate.
    pub fn from_values(
        source: impl Into<PathBuf>,
        ids: Vec<String>,
        values: Vec<f64>,
    ) -> Result<Self> {
        let source = source.into();
        let n = ids.len();
        if values.len() != n * n {
            return Err(Error::InvalidConfig {
                reason: format!(
                    "{}: {} distances for {n} sample IDs (expected {})",
                    source.display(),
                    values.len(),
                    n * n
                ),
            });
        }
        Self::validate(source, ids, "the caller", n, Raw::F64(values))
    }

    fn validate(
        source: PathBuf,
        ids: Vec<String>,
        id_source: &str,
        n: usize,
        raw: Raw,
    ) -> Result<Self> {
        if ids.len() != n {
            return Err(Error::MatrixIdCount {
                path: source,
                rows: n,
                ids: ids.len(),
                source_name: id_source.to_string(),
            });
        }
        let rows = Rows::new(source, ids, "matrix sample")?;
        let (source, ids) = (&rows.source, &rows.ids);
        let violation = match &raw {
            Raw::F32(v) => first_violation(v, n),
            Raw::F64(v) => first_violation(v, n),
        };
        if let Some(violation) = violation {
            let source = source.clone();
            return Err(match violation {
                Violation::NonFinite { i, j, value } => Error::MatrixNonFinite {
                    path: source,
                    row: ids[i].clone(),
                    col: ids[j].clone(),
                    value,
                },
                Violation::Diagonal { i, value } => Error::MatrixDiagonal {
                    path: source,
                    id: ids[i].clone(),
                    value,
                },
                Violation::Asymmetric { i, j, ab, ba } => Error::MatrixNotSymmetric {
                    path: source,
                    a: ids[i].clone(),
                    b: ids[j].clone(),
                    ab,
                    ba,
                },
            });
        }
        Ok(Self {
            rows,
            data: raw.into_f32(),
        })
    }

    /// The file the matrix came from.
    pub fn source(&self) -> &Path {
        &self.rows.source
    }

    /// Number of samples (rows = columns).
    pub fn len(&self) -> usize {
        self.rows.ids.len()
    }

    /// True for a 0 x 0 matrix.
    pub fn is_empty(&self) -> bool {
        self.rows.ids.is_empty()
    }

    /// Sample IDs in row order.
    pub fn ids(&self) -> &[String] {
        &self.rows.ids
    }

    /// Row of a sample ID.
    pub fn position(&self, id: &str) -> Option<usize> {
        self.rows.position(id)
    }

    /// Distance between rows `i` and `j`.
    ///
    /// # Panics
    /// If a row is out of range (a programmer error).
    pub fn get(&self, i: usize, j: usize) -> f32 {
        self.data[i * self.len() + j]
    }

    /// Distance between two samples by ID.
    pub fn distance(&self, a: &str, b: &str) -> Option<f32> {
        Some(self.get(self.position(a)?, self.position(b)?))
    }

    /// The matrix row of each of `sample_ids`. Samples the matrix lacks are an
    /// error listing them ([`MissingPolicy::Error`]), or are left out of the
    /// result with a warning ([`MissingPolicy::Drop`]): the result then pairs
    /// each kept sample's position in `sample_ids` with its matrix row.
    pub fn match_samples<S: AsRef<str>>(
        &self,
        sample_ids: &[S],
        policy: MissingPolicy,
    ) -> Result<Vec<(usize, usize)>> {
        self.rows
            .match_samples("distance matrix", sample_ids, policy)
    }

    /// Write the [B, B] block of `rows` (in that order) into `out`, row-major.
    ///
    /// # Panics
    /// If a row is out of range (a programmer error).
    pub fn block_into(&self, rows: &[usize], out: &mut Vec<f32>) {
        out.clear();
        out.reserve(rows.len() * rows.len());
        let n = self.len();
        for &i in rows {
            let row = &self.data[i * n..(i + 1) * n];
            out.extend(rows.iter().map(|&j| row[j]));
        }
    }
}

/// A matrix or values file's bytes; an error names the file.
fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// How the rows of a text file are laid out.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TextLayout {
    /// Square, with column sample IDs in the header (lsmat).
    Square,
    /// One value column per sample (a vector such as Faith's PD).
    Column,
}

/// (shape, values, embedded IDs) of a matrix or vector file, by extension.
fn read_raw(
    bytes: Vec<u8>,
    path: &Path,
    layout: TextLayout,
) -> Result<(Vec<usize>, Raw, Option<Vec<String>>)> {
    if bytes.is_empty() {
        return Err(Error::EmptyFile {
            path: path.to_path_buf(),
        });
    }
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .unwrap_or_default();
    Ok(match ext.as_str() {
        "h5" | "hdf5" => read_h5(bytes, path)?,
        "npy" => {
            let a = npy::parse(&bytes, path, "array")?;
            let raw = numeric(a.values, path, "array")?;
            (a.shape, raw, None)
        }
        "npz" => read_npz(&bytes, path)?,
        "csv" | "tsv" | "txt" => {
            let delimiter = if ext == "csv" { ',' } else { '\t' };
            let m = text::parse(&bytes, path, delimiter, layout == TextLayout::Square)?;
            (vec![m.rows, m.cols], Raw::F64(m.values), Some(m.ids))
        }
        _ => {
            return Err(Error::UnsupportedFormat {
                path: path.to_path_buf(),
                reason: "distance matrices and per-sample values are read from .h5, .hdf5, \
                         .npy, .npz, .csv, .tsv or .txt"
                    .into(),
            })
        }
    })
}

/// The sample IDs of a file's rows: its own, else those `ids` gives.
fn row_ids(
    path: &Path,
    embedded: Option<Vec<String>>,
    ids: &MatrixIds,
) -> Result<(Vec<String>, String)> {
    match embedded {
        Some(embedded) => {
            if *ids != MatrixIds::Auto {
                tracing::warn!(file = %path.display(), "the file carries its own sample IDs; the IDs given by the caller are not used");
            }
            Ok((embedded, "the file itself".to_string()))
        }
        None => resolve_ids(path, ids),
    }
}

/// IDs of an ID-less matrix: the explicit choice, or the sidecar search.
fn resolve_ids(path: &Path, ids: &MatrixIds) -> Result<(Vec<String>, String)> {
    match ids {
        MatrixIds::TableOrder(ids) => Ok((ids.clone(), "the table's sample order".into())),
        MatrixIds::File(file) => Ok((read_id_file(file)?, file.display().to_string())),
        MatrixIds::Auto => {
            let tried = sidecar_candidates(path);
            for candidate in &tried {
                if candidate.is_file() {
                    tracing::info!(matrix = %path.display(), ids = %candidate.display(), "matrix sample IDs read from a sidecar file");
                    return Ok((read_id_file(candidate)?, candidate.display().to_string()));
                }
            }
            Err(Error::MatrixIdsNotFound {
                path: path.to_path_buf(),
                tried,
            })
        }
    }
}

/// Sidecar ID files looked for next to `path`, in order.
pub fn sidecar_candidates(path: &Path) -> Vec<PathBuf> {
    let dir = path.parent().unwrap_or(Path::new(""));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let stem = path.file_stem().and_then(|n| n.to_str()).unwrap_or(name);
    let prefix = name.split('.').next().unwrap_or(name);
    let mut out: Vec<PathBuf> = Vec::new();
    for candidate in [
        dir.join(format!("{stem}.sample_ids.txt")),
        dir.join(format!("{stem}.ids.txt")),
        dir.join(format!("{prefix}.sample_ids.txt")),
        dir.join("sample_ids.txt"),
    ] {
        if !out.contains(&candidate) {
            out.push(candidate);
        }
    }
    out
}

/// One ID per line; surrounding whitespace and blank lines ignored.
pub fn read_id_file(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect())
}

fn numeric(values: npy::Values, path: &Path, what: &str) -> Result<Raw> {
    match values {
        npy::Values::F32(v) => Ok(Raw::F32(v)),
        npy::Values::F64(v) => Ok(Raw::F64(v)),
        npy::Values::Str(_) => Err(Error::Npy {
            path: path.to_path_buf(),
            what: what.into(),
            reason: "holds strings, not distances".into(),
        }),
    }
}

/// (shape, values, embedded IDs) of an `.npz`.
fn read_npz(bytes: &[u8], path: &Path) -> Result<(Vec<usize>, Raw, Option<Vec<String>>)> {
    let mut members = npy::parse_npz(bytes, path)?;
    let take = |members: &mut Vec<(String, npy::Array)>, key: &str| {
        members
            .iter()
            .position(|(k, _)| k == key)
            .map(|i| members.remove(i).1)
    };
    let mut ids = None;
    for key in ID_KEYS {
        if let Some(a) = take(&mut members, key) {
            match a.values {
                npy::Values::Str(v) => {
                    ids = Some(v);
                    break;
                }
                _ => {
                    return Err(Error::Npy {
                        path: path.to_path_buf(),
                        what: format!("archive key {key:?}"),
                        reason: "sample IDs must be strings".into(),
                    })
                }
            }
        }
    }
    let chosen = MATRIX_KEYS.iter().find_map(|k| take(&mut members, k));
    let array = match chosen {
        Some(a) => a,
        None if members.len() == 1 => members.remove(0).1,
        None => {
            return Err(Error::AmbiguousArrays {
                path: path.to_path_buf(),
                expected: "distances, stripe_distances, faith_pd, matrix (or a single array)",
                found: members.into_iter().map(|(k, _)| k).collect(),
            })
        }
    };
    let raw = numeric(array.values, path, "matrix")?;
    Ok((array.shape, raw, ids))
}

/// (shape, values, embedded IDs) of an `.h5`.
fn read_h5(bytes: Vec<u8>, path: &Path) -> Result<(Vec<usize>, Raw, Option<Vec<String>>)> {
    let file = H5::open(bytes, path)?;
    let names = file.root_datasets()?;
    let key = match MATRIX_KEYS.iter().find(|k| names.iter().any(|n| n == *k)) {
        Some(k) => k.to_string(),
        None => {
            let others: Vec<&String> = names
                .iter()
                .filter(|n| !ID_KEYS.contains(&n.as_str()) && !SSU_META_KEYS.contains(&n.as_str()))
                .collect();
            match others.as_slice() {
                [only] => (*only).clone(),
                _ => {
                    return Err(Error::AmbiguousArrays {
                        path: path.to_path_buf(),
                        expected:
                            "distances, stripe_distances, faith_pd, matrix (or a single dataset)",
                        found: names,
                    })
                }
            }
        }
    };
    let shape: Vec<usize> = file.shape(&key)?.into_iter().map(|d| d as usize).collect();
    let raw = if file.is_f32(&key)? {
        Raw::F32(file.read_f32(&key)?)
    } else {
        Raw::F64(file.read_f64(&key)?)
    };
    let ids = match ID_KEYS.iter().find(|k| names.iter().any(|n| n == *k)) {
        Some(k) if file.len(k)? > 0 => Some(
            file.read_strings(k)?
                .into_iter()
                .map(unwrap_bytes_repr)
                .collect(),
        ),
        Some(_) => Some(Vec::new()),
        None => None,
    };
    Ok((shape, raw, ids))
}

/// Some writers store `str(b'id')`; the reference unwraps those (§2.6).
fn unwrap_bytes_repr(s: String) -> String {
    for q in ['\'', '"'] {
        if let Some(inner) = s
            .strip_prefix('b')
            .and_then(|r| r.strip_prefix(q))
            .and_then(|r| r.strip_suffix(q))
        {
            return inner.to_string();
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use npy::tests::{f64_bytes, npy};

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    const M3: [f64; 9] = [0.0, 0.1, 0.2, 0.1, 0.0, 0.3, 0.2, 0.3, 0.0];

    #[test]
    fn npy_with_sidecar_ids_and_table_order_opt_in() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            dir.path(),
            "unifrac.w.npy",
            &npy("<f8", false, &[3, 3], &f64_bytes(&M3)),
        );
        // No sidecar: an error listing where it looked.
        let err = DistanceMatrix::read(&p, &MatrixIds::Auto).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("unifrac.w.npy") && msg.contains("unifrac.sample_ids.txt"),
            "{msg}"
        );
        // Opt-in to table order.
        let ids: Vec<String> = vec!["a".into(), "b".into(), "c".into()];
        let m = DistanceMatrix::read(&p, &MatrixIds::TableOrder(ids.clone())).unwrap();
        assert_eq!(m.distance("b", "c"), Some(0.3));
        let err = DistanceMatrix::read(&p, &MatrixIds::TableOrder(ids[..2].to_vec())).unwrap_err();
        assert!(
            matches!(
                err,
                Error::MatrixIdCount {
                    rows: 3,
                    ids: 2,
                    ..
                }
            ),
            "{err}"
        );
        // Sidecar found by prefix.
        write(dir.path(), "unifrac.sample_ids.txt", b"x\ny\nz\n");
        let m = DistanceMatrix::read(&p, &MatrixIds::Auto).unwrap();
        assert_eq!(
            m.ids(),
            &["x".to_string(), "y".to_string(), "z".to_string()]
        );
        assert_eq!(m.distance("z", "x"), Some(0.2));
    }

    #[test]
    fn invalid_matrices_are_errors_naming_file_and_samples() {
        let dir = tempfile::tempdir().unwrap();
        let ids = MatrixIds::TableOrder(vec!["a".into(), "b".into(), "c".into()]);
        let mut nan = M3;
        nan[5] = f64::NAN;
        nan[7] = f64::NAN;
        let p = write(
            dir.path(),
            "nan.npy",
            &npy("<f8", false, &[3, 3], &f64_bytes(&nan)),
        );
        let msg = DistanceMatrix::read(&p, &ids).unwrap_err().to_string();
        assert!(
            msg.contains("nan.npy")
                && msg.contains("\"b\"")
                && msg.contains("\"c\"")
                && msg.contains("NaN"),
            "{msg}"
        );
        let mut asym = M3;
        asym[1] = 0.9;
        let p = write(
            dir.path(),
            "asym.npy",
            &npy("<f8", false, &[3, 3], &f64_bytes(&asym)),
        );
        let msg = DistanceMatrix::read(&p, &ids).unwrap_err().to_string();
        assert!(
            msg.contains("asym.npy") && msg.contains("not symmetric"),
            "{msg}"
        );
        let mut diag = M3;
        diag[4] = 0.5;
        let p = write(
            dir.path(),
            "diag.npy",
            &npy("<f8", false, &[3, 3], &f64_bytes(&diag)),
        );
        let msg = DistanceMatrix::read(&p, &ids).unwrap_err().to_string();
        assert!(msg.contains("diag.npy") && msg.contains("\"b\""), "{msg}");
        let p = write(
            dir.path(),
            "stripe.npy",
            &npy("<f8", false, &[3, 2], &f64_bytes(&M3[..6])),
        );
        let err = DistanceMatrix::read(&p, &ids).unwrap_err();
        assert!(
            matches!(
                err,
                Error::MatrixNotSquare {
                    rows: 3,
                    cols: 2,
                    ..
                }
            ),
            "{err}"
        );
        let p = write(
            dir.path(),
            "faith.npy",
            &npy("<f8", false, &[3], &f64_bytes(&M3[..3])),
        );
        assert!(matches!(
            DistanceMatrix::read(&p, &ids).unwrap_err(),
            Error::MatrixNotSquare {
                rows: 3,
                cols: 1,
                ..
            }
        ));
        let p = write(dir.path(), "dup.csv", b",a,a\na,0,1\na,1,0\n");
        let err = DistanceMatrix::read(&p, &MatrixIds::Auto).unwrap_err();
        assert!(err.to_string().contains("dup.csv"), "{err}");
        let p = write(dir.path(), "empty.npy", b"");
        assert!(matches!(
            DistanceMatrix::read(&p, &ids).unwrap_err(),
            Error::EmptyFile { .. }
        ));
        let p = write(dir.path(), "m.parquet", b"x");
        assert!(matches!(
            DistanceMatrix::read(&p, &ids).unwrap_err(),
            Error::UnsupportedFormat { .. }
        ));
    }

    #[test]
    fn matching_is_by_id_and_missing_samples_are_listed_or_dropped() {
        let m = DistanceMatrix::from_values(
            "m.csv",
            vec!["a".into(), "b".into(), "c".into()],
            M3.to_vec(),
        )
        .unwrap();
        let table = ["c", "a", "zz", "b", "yy"];
        let err = m.match_samples(&table, MissingPolicy::Error).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("m.csv")
                && msg.contains("2 of the table's 5 sample(s)")
                && msg.contains("\"zz\"")
                && msg.contains("\"yy\""),
            "{msg}"
        );
        assert!(DistanceMatrix::from_values("m", vec!["a".into()], vec![0.0, 1.0]).is_err());
        let matched = m.match_samples(&table, MissingPolicy::Drop).unwrap();
        assert_eq!(matched, vec![(0, 2), (1, 0), (3, 1)]);
        let mut block = Vec::new();
        m.block_into(&[2, 0, 1], &mut block);
        // Rows/cols in the order c, a, b.
        assert_eq!(block, vec![0.0, 0.2, 0.3, 0.2, 0.0, 0.1, 0.3, 0.1, 0.0]);
    }

    #[test]
    fn npz_keys_and_embedded_ids() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.npz");
        {
            let mut zip = zip::ZipWriter::new(std::fs::File::create(&p).unwrap());
            let opts = zip::write::SimpleFileOptions::default()
                .compression_method(zip::CompressionMethod::Deflated);
            zip.start_file("distances.npy", opts).unwrap();
            zip.write_all(&npy("<f8", false, &[3, 3], &f64_bytes(&M3)))
                .unwrap();
            zip.start_file("ids.npy", opts).unwrap();
            zip.write_all(&npy("|S1", false, &[3], b"pqr")).unwrap();
            zip.start_file("other.npy", opts).unwrap();
            zip.write_all(&npy("<f8", false, &[1], &f64_bytes(&[1.0])))
                .unwrap();
            zip.finish().unwrap();
        }
        let m = DistanceMatrix::read(&p, &MatrixIds::Auto).unwrap();
        assert_eq!(
            m.ids(),
            &["p".to_string(), "q".to_string(), "r".to_string()]
        );
        assert_eq!(m.distance("p", "r"), Some(0.2));

        let p2 = dir.path().join("two.npz");
        {
            let mut zip = zip::ZipWriter::new(std::fs::File::create(&p2).unwrap());
            let opts = zip::write::SimpleFileOptions::default();
            for name in ["x.npy", "y.npy"] {
                zip.start_file(name, opts).unwrap();
                zip.write_all(&npy("<f8", false, &[1], &f64_bytes(&[1.0])))
                    .unwrap();
            }
            zip.finish().unwrap();
        }
        let err = DistanceMatrix::read(&p2, &MatrixIds::Auto).unwrap_err();
        assert!(
            matches!(&err, Error::AmbiguousArrays { found, .. } if found.len() == 2),
            "{err}"
        );
    }

    /// An HDF5 image with the given root datasets (f64 matrices as [n, n]).
    fn h5(datasets: &[(&str, &[f64])], ids: Option<(&str, &[&str])>) -> Vec<u8> {
        let mut b = hdf5_pure::FileBuilder::new();
        for (name, values) in datasets {
            let n = (values.len() as f64).sqrt() as u64;
            b.create_dataset(name)
                .with_f64_data(values)
                .with_shape(&[n, n]);
        }
        if let Some((name, ids)) = ids {
            b.create_dataset(name).with_vlen_strings(ids);
        }
        b.finish().unwrap()
    }

    #[test]
    fn h5_reference_keys_single_dataset_and_ambiguity() {
        let dir = tempfile::tempdir().unwrap();
        let order = ["x", "y", "z"];
        // The reference's key, with IDs beside it.
        let p = write(
            dir.path(),
            "a.h5",
            &h5(
                &[("distances", &M3), ("other", &M3)],
                Some(("sample_ids", &order)),
            ),
        );
        let m = DistanceMatrix::read(&p, &MatrixIds::Auto).unwrap();
        assert_eq!(
            m.ids(),
            &["x".to_string(), "y".to_string(), "z".to_string()]
        );
        assert_eq!(m.distance("y", "z"), Some(0.3));
        // One unnamed dataset, no IDs: the sidecar is required, table order on request.
        let p = write(dir.path(), "b.hdf5", &h5(&[("dm", &M3)], None));
        assert!(matches!(
            DistanceMatrix::read(&p, &MatrixIds::Auto),
            Err(Error::MatrixIdsNotFound { .. })
        ));
        let ids: Vec<String> = order.iter().map(|s| s.to_string()).collect();
        assert_eq!(
            DistanceMatrix::read(&p, &MatrixIds::TableOrder(ids))
                .unwrap()
                .distance("x", "z"),
            Some(0.2)
        );
        // Two unknown datasets: ambiguous.
        let p = write(dir.path(), "c.h5", &h5(&[("p", &M3), ("q", &M3)], None));
        let err = DistanceMatrix::read(&p, &MatrixIds::Auto).unwrap_err();
        assert!(
            matches!(&err, Error::AmbiguousArrays { found, .. } if found.len() == 2),
            "{err}"
        );
        // Not HDF5 at all.
        let p = write(dir.path(), "d.h5", b"not an hdf5 file");
        let err = DistanceMatrix::read(&p, &MatrixIds::Auto).unwrap_err();
        assert!(
            matches!(err, Error::Hdf5 { .. }) && err.to_string().contains("d.h5"),
            "{err}"
        );
    }

    #[test]
    fn bytes_reprs_are_unwrapped() {
        assert_eq!(unwrap_bytes_repr("b'abc'".into()), "abc");
        assert_eq!(unwrap_bytes_repr("b\"x\"".into()), "x");
        assert_eq!(unwrap_bytes_repr("bob".into()), "bob");
    }
}
