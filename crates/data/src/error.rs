//! The one error type of `aam-data`.
//!
//! Every variant names what the user has to look at: the file, and where it
//! applies the sample/observation ID, line (1-based) or column. Lists of
//! missing IDs are cut to their first [`MAX_LISTED`] entries plus a count, so
//! a message stays readable when a whole study is missing.

use std::fmt;
use std::path::PathBuf;

/// How many IDs an error message lists before it says "and N more".
pub const MAX_LISTED: usize = 10;

/// A list of IDs shown as `a, b, c (and 12 more)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdList {
    /// The first IDs (at most [`MAX_LISTED`]).
    pub first: Vec<String>,
    /// The total number of IDs, listed or not.
    pub total: usize,
}

impl IdList {
    /// Keep the first [`MAX_LISTED`] of `ids` and their total count.
    pub fn new<S: AsRef<str>>(ids: &[S]) -> Self {
        Self {
            first: ids
                .iter()
                .take(MAX_LISTED)
                .map(|s| s.as_ref().to_string())
                .collect(),
            total: ids.len(),
        }
    }
}

impl fmt::Display for IdList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, id) in self.first.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{id:?}")?;
        }
        let more = self.total - self.first.len();
        if more > 0 {
            write!(f, " (and {more} more)")?;
        }
        Ok(())
    }
}

/// Errors from reading and preparing AAM inputs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The file could not be opened or read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },

    /// The file has no bytes at all.
    #[error("{}: the file is empty (0 bytes)", path.display())]
    EmptyFile {
        /// The file.
        path: PathBuf,
    },

    /// The file is not in a format this reader understands.
    #[error("{}: unsupported format: {reason}", path.display())]
    UnsupportedFormat {
        /// The file.
        path: PathBuf,
        /// What was found and what is accepted.
        reason: String,
    },

    /// The HDF5 layer failed on an object of the file.
    #[error("{}: HDF5 object {object:?}: {message}", path.display())]
    Hdf5 {
        /// The file.
        path: PathBuf,
        /// The dataset or group path inside the file.
        object: String,
        /// The reader's message.
        message: String,
    },

    /// The JSON of a BIOM 1.0 file is malformed.
    #[error("{}: invalid BIOM 1.0 JSON at line {line}, column {column}: {message}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// 1-based line of the fault.
        line: usize,
        /// 1-based column of the fault.
        column: usize,
        /// The parser's message.
        message: String,
    },

    /// A BIOM table is structurally inconsistent (lengths, offsets, indices).
    #[error("{}: invalid BIOM table: {reason}", path.display())]
    InvalidTable {
        /// The file.
        path: PathBuf,
        /// What is inconsistent.
        reason: String,
    },

    /// An ID occurs twice where IDs must be unique.
    #[error("{}: duplicate {kind} ID {id:?}", path.display())]
    DuplicateId {
        /// The file.
        path: PathBuf,
        /// "sample", "observation", "matrix row", ...
        kind: &'static str,
        /// The repeated ID.
        id: String,
    },

    /// A count is negative, NaN or infinite.
    #[error("{}: invalid count {value} for sample {sample:?}, observation {observation:?}", path.display())]
    InvalidCount {
        /// The file.
        path: PathBuf,
        /// Sample ID.
        sample: String,
        /// Observation (ASV) ID.
        observation: String,
        /// The offending value.
        value: f64,
    },

    /// Rarefaction draws reads, so it needs whole-number counts.
    #[error(
        "cannot rarefy: sample {sample:?} has the non-integer count {value} for observation \
         {observation:?} (rarefaction draws whole reads; use an unrarefied count table)"
    )]
    NonIntegerCount {
        /// Sample ID.
        sample: String,
        /// Observation (ASV) ID.
        observation: String,
        /// The offending value.
        value: f64,
    },

    /// No sample reaches the rarefaction depth.
    #[error(
        "rarefaction to depth {depth} leaves no sample ({samples} samples, deepest has {max_depth} reads)"
    )]
    RarefiedEmpty {
        /// Requested depth.
        depth: u64,
        /// Number of samples before rarefaction.
        samples: usize,
        /// Largest sample total.
        max_depth: f64,
    },

    /// A rarefaction depth of zero.
    #[error("the rarefaction depth must be at least 1")]
    ZeroDepth,

    /// Samples with no positive count, which cannot be fed to the model.
    #[error("{count} sample(s) have no observation with a positive count: {ids}")]
    EmptySamples {
        /// How many.
        count: usize,
        /// Their IDs.
        ids: IdList,
    },

    /// A `.npy` array (or one inside a `.npz`) is malformed or of an unsupported type.
    #[error("{}: {what}: {reason}", path.display())]
    Npy {
        /// The file.
        path: PathBuf,
        /// The file, or `archive key "name"` inside a .npz.
        what: String,
        /// What is wrong.
        reason: String,
    },

    /// A `.npz`/`.h5` holds several arrays and none has a known name.
    #[error("{}: cannot tell which array is the distance matrix; expected one of {expected}, found {found:?}", path.display())]
    AmbiguousArrays {
        /// The file.
        path: PathBuf,
        /// The accepted names.
        expected: &'static str,
        /// The names found.
        found: Vec<String>,
    },

    /// A distance-matrix file has no sample IDs and none were found next to it.
    #[error(
        "{}: the matrix carries no sample IDs and no ID file was found (looked for {}); \
         pass the IDs file explicitly, or opt in to table order",
        path.display(), tried.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    MatrixIdsNotFound {
        /// The matrix file.
        path: PathBuf,
        /// The sidecar files looked for.
        tried: Vec<PathBuf>,
    },

    /// The number of IDs does not match the matrix size.
    #[error("{}: the matrix has {rows} rows but {ids} sample IDs were given (from {source_name})", path.display())]
    MatrixIdCount {
        /// The matrix file.
        path: PathBuf,
        /// Matrix rows.
        rows: usize,
        /// Number of IDs.
        ids: usize,
        /// Where the IDs came from.
        source_name: String,
    },

    /// A distance matrix that is not N x N.
    #[error("{}: the distance matrix is not square: {rows} x {cols}", path.display())]
    MatrixNotSquare {
        /// The file.
        path: PathBuf,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },

    /// NaN or infinity in a distance matrix.
    #[error("{}: non-finite distance {value} between samples {row:?} and {col:?}", path.display())]
    MatrixNonFinite {
        /// The file.
        path: PathBuf,
        /// Row sample ID.
        row: String,
        /// Column sample ID.
        col: String,
        /// The value.
        value: f64,
    },

    /// d(a, b) != d(b, a).
    #[error("{}: the matrix is not symmetric: d({a:?}, {b:?}) = {ab} but d({b:?}, {a:?}) = {ba}", path.display())]
    MatrixNotSymmetric {
        /// The file.
        path: PathBuf,
        /// First sample.
        a: String,
        /// Second sample.
        b: String,
        /// d(a, b).
        ab: f64,
        /// d(b, a).
        ba: f64,
    },

    /// d(a, a) != 0.
    #[error("{}: the matrix diagonal is not zero: d({id:?}, {id:?}) = {value}", path.display())]
    MatrixDiagonal {
        /// The file.
        path: PathBuf,
        /// The sample.
        id: String,
        /// The value.
        value: f64,
    },

    /// A per-sample values file that is not one value per sample.
    #[error("{}: expected one value per sample (N or N x 1), found shape {shape:?}", path.display())]
    NotAVector {
        /// The file.
        path: PathBuf,
        /// Its shape.
        shape: Vec<usize>,
    },

    /// NaN or infinity among per-sample values.
    #[error("{}: sample {id:?} has the non-finite value {value}", path.display())]
    ValueNonFinite {
        /// The file.
        path: PathBuf,
        /// The sample.
        id: String,
        /// The value.
        value: f64,
    },

    /// A line of a text matrix (CSV/TSV) is malformed.
    #[error("{}:{line}: {reason}", path.display())]
    MatrixText {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// What is wrong.
        reason: String,
    },

    /// Table samples absent from the distance matrix.
    #[error("{}: {count} of the table's {of} sample(s) are missing from the {what}{}: {ids}", path.display(), if count == of { " (none is in it: a file of another study?)" } else { "" })]
    SamplesMissingFromMatrix {
        /// The matrix (or per-sample values) file.
        path: PathBuf,
        /// What the file holds ("distance matrix", "Faith's PD values").
        what: &'static str,
        /// How many.
        count: usize,
        /// The table's samples.
        of: usize,
        /// Their IDs.
        ids: IdList,
    },

    /// A metadata file whose header cannot be used.
    #[error("{}:{line}: {reason}", path.display())]
    MetadataFormat {
        /// The metadata file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// What is wrong.
        reason: String,
    },

    /// A sample appears twice in the metadata.
    #[error("{}:{line}: sample {id:?} already appeared on line {first_line}", path.display())]
    DuplicateSample {
        /// The metadata file.
        path: PathBuf,
        /// The sample ID.
        id: String,
        /// Where it appeared first.
        first_line: usize,
        /// Where it appears again.
        line: usize,
    },

    /// A column requested by name is not in the metadata.
    #[error("{}: no column {column:?}; the columns are {available:?}", path.display())]
    ColumnNotFound {
        /// The metadata file.
        path: PathBuf,
        /// The requested column.
        column: String,
        /// The columns present.
        available: Vec<String>,
    },

    /// A target value that is not a finite number.
    #[error("{}:{line}: sample {sample:?}, column {column:?}: {value:?} is not a finite number", path.display())]
    NonNumericTarget {
        /// The metadata file.
        path: PathBuf,
        /// Sample ID.
        sample: String,
        /// Column name.
        column: String,
        /// 1-based line.
        line: usize,
        /// The text found.
        value: String,
    },

    /// Table samples with no metadata row, or a missing target value.
    #[error("{}: {count} sample(s) have no value in column {column:?}: {ids}", path.display())]
    MissingTargets {
        /// The metadata file.
        path: PathBuf,
        /// The target column (or the ID column when the rows are absent).
        column: String,
        /// How many.
        count: usize,
        /// Their IDs.
        ids: IdList,
    },

    /// A log transform of a target <= -1.
    #[error("sample {sample:?}: target {value} is out of the log transform's domain (needs > -1)")]
    LogDomain {
        /// Sample ID.
        sample: String,
        /// The target value.
        value: f64,
    },

    /// A normaliser or encoder fitted on no value at all.
    #[error("cannot fit {what}: no usable training value")]
    NothingToFit {
        /// What was being fitted.
        what: String,
    },

    /// A transform name that is not one of the known ones.
    #[error("unknown target transform {name:?}; expected one of none, minmax, zscore, zscore-category, log-minmax, log-zscore, log-zscore-category")]
    UnknownTransform {
        /// The name given.
        name: String,
    },

    /// An invalid train/validation split request.
    #[error("invalid split of {samples} samples with test size {test_size}: {reason}")]
    InvalidSplit {
        /// Number of samples.
        samples: usize,
        /// Requested validation fraction.
        test_size: f64,
        /// What is wrong.
        reason: String,
    },

    /// An invalid batch or dataset configuration.
    #[error("invalid configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },

    /// A sample given directly (not from a table file) that cannot be used.
    #[error("sample {sample:?}: {reason}")]
    InvalidSample {
        /// Its ID.
        sample: String,
        /// What is wrong.
        reason: String,
    },

    /// IDs requested from a dataset that it does not hold.
    #[error("{count} sample ID(s) are not in the dataset: {ids}")]
    UnknownSamples {
        /// How many.
        count: usize,
        /// Their IDs.
        ids: IdList,
    },

    /// A batch worker thread panicked (a bug; reported instead of hanging).
    #[error("batch worker panicked while building batch {batch}: {message}")]
    WorkerPanic {
        /// The batch index.
        batch: usize,
        /// The panic message.
        message: String,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_list_truncates_and_counts() {
        let ids: Vec<String> = (0..25).map(|i| format!("s{i}")).collect();
        let list = IdList::new(&ids);
        assert_eq!(list.first.len(), MAX_LISTED);
        let text = list.to_string();
        assert!(text.starts_with("\"s0\", \"s1\""), "{text}");
        assert!(text.ends_with("(and 15 more)"), "{text}");
        assert_eq!(IdList::new(&["a"]).to_string(), "\"a\"");
    }
}
