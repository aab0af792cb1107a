//! Results and the files they are written to, atomically (a reader or a
//! killed job sees the old file or the whole new one).
//!
//! - `.h5`/`.hdf5`: `ssu`'s layout: `matrix` (N×N, fp64, or fp32 on request),
//!   `order` (the sample IDs, variable-length strings) and the `format`
//!   (`BDSM`) and `version` datasets `ssu` writes; `aam-rs`, the reference
//!   (`unifrac.h5unifrac`) and QIIME 2 read it.
//! - `.tsv`/`.txt`: scikit-bio's lsmat: a header row of IDs, then one row per
//!   sample led by its ID.
//! - Faith's PD: a TSV with `#SampleID` and `faith_pd` columns, as `faithpd` writes.

use std::fmt::Write as _;
use std::path::Path;

use crate::error::{Error, Result};

/// A symmetric distance matrix with zero diagonal, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Distances {
    ids: Vec<String>,
    values: Vec<f64>,
}

impl Distances {
    pub(crate) fn new(ids: Vec<String>, values: Vec<f64>) -> Self {
        debug_assert_eq!(values.len(), ids.len() * ids.len());
        Self { ids, values }
    }

    /// Sample IDs, in row order.
    pub fn ids(&self) -> &[String] {
        &self.ids
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True for a matrix of no samples.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The distance between rows `i` and `j`.
    pub fn get(&self, i: usize, j: usize) -> f64 {
        self.values[i * self.ids.len() + j]
    }

    /// All values, row-major.
    pub fn values(&self) -> &[f64] {
        &self.values
    }

    /// Write to `path` (`.h5`/`.hdf5` or `.tsv`/`.txt`), in single precision
    /// when `fp32`.
    pub fn write(&self, path: &Path, fp32: bool) -> Result<()> {
        let bytes = match extension(path).as_str() {
            "h5" | "hdf5" => {
                // Streamed to the file: an N×N matrix is not held twice more.
                let ids: Vec<&str> = self.ids.iter().map(String::as_str).collect();
                let n = self.ids.len() as u64;
                let mut b = hdf5_pure::FileBuilder::new();
                b.create_dataset("format").with_vlen_strings(&["BDSM"]);
                b.create_dataset("version").with_vlen_strings(&["2020.12"]);
                b.create_dataset("order").with_vlen_strings(&ids);
                // The matrix's bytes, converted on every core (gigabytes at
                // 20,000 samples).
                let (datatype, raw) = if fp32 {
                    (
                        hdf5_pure::make_f32_type(),
                        le_bytes(&self.values, |x| (x as f32).to_le_bytes()),
                    )
                } else {
                    (
                        hdf5_pure::make_f64_type(),
                        le_bytes(&self.values, f64::to_le_bytes),
                    )
                };
                b.create_dataset("matrix")
                    .with_raw_data(datatype, raw, n * n)
                    .with_shape(&[n, n]);
                return aam_data::write_atomic_with(path, |w| {
                    b.finish_to(w).map_err(std::io::Error::other)
                })
                .map_err(Error::from);
            }
            "tsv" | "txt" => {
                let mut s = String::new();
                for id in &self.ids {
                    s.push('\t');
                    s.push_str(id);
                }
                s.push('\n');
                for (i, id) in self.ids.iter().enumerate() {
                    s.push_str(id);
                    for j in 0..self.ids.len() {
                        number(&mut s, self.get(i, j), fp32);
                    }
                    s.push('\n');
                }
                s.into_bytes()
            }
            other => return Err(unknown_extension(path, other, ".h5, .hdf5, .tsv or .txt")),
        };
        aam_data::write_atomic(path, &bytes).map_err(Error::from)
    }
}

/// `values` as little-endian bytes of `B` bytes each, converted in parallel.
fn le_bytes<const B: usize>(values: &[f64], bytes: impl Fn(f64) -> [u8; B] + Sync) -> Vec<u8> {
    use rayon::prelude::*;
    const BLOCK: usize = 1 << 16;
    let mut raw = vec![0u8; values.len() * B];
    raw.par_chunks_mut(BLOCK * B)
        .zip(values.par_chunks(BLOCK))
        .for_each(|(out, values)| {
            for (o, &v) in out.chunks_exact_mut(B).zip(values) {
                o.copy_from_slice(&bytes(v));
            }
        });
    raw
}

/// Faith's phylogenetic diversity per sample.
#[derive(Debug, Clone, PartialEq)]
pub struct FaithPd {
    /// Sample IDs.
    pub ids: Vec<String>,
    /// Their PD, in the same order.
    pub values: Vec<f64>,
}

impl FaithPd {
    /// Write as a TSV (`.tsv`/`.txt`): `#SampleID`, `faith_pd`.
    pub fn write(&self, path: &Path) -> Result<()> {
        match extension(path).as_str() {
            "tsv" | "txt" => {}
            other => return Err(unknown_extension(path, other, ".tsv or .txt")),
        }
        let mut s = String::from("#SampleID\tfaith_pd\n");
        for (id, v) in self.ids.iter().zip(&self.values) {
            let _ = writeln!(s, "{id}\t{v}");
        }
        aam_data::write_atomic(path, s.as_bytes()).map_err(Error::from)
    }
}

fn extension(path: &Path) -> String {
    path.extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase()
}

fn unknown_extension(path: &Path, found: &str, accepted: &str) -> Error {
    Error::Option(format!(
        "--output {}: unknown extension {found:?}; use {accepted}",
        path.display()
    ))
}

fn number(s: &mut String, v: f64, fp32: bool) {
    if fp32 {
        let _ = write!(s, "\t{}", v as f32);
    } else {
        let _ = write!(s, "\t{v}");
    }
}
