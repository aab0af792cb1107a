//! A thin wrapper over `hdf5-pure` that names the file and object in every
//! error, and turns a panic inside the third-party parser (malformed input it
//! did not anticipate) into an [`Error::Hdf5`] instead of unwinding into the
//! caller.
//!
//! Every read is bounded first: a dataset whose declared extent could not come
//! from a file of this size (more than [`MAX_EXPANSION`] times the file, the
//! most deflate can expand) is an error. Without the bound a corrupt header
//! asking for exabytes aborts the process in the allocator, which no
//! `catch_unwind` can turn into an error (found by the `biom_hdf5` fuzz target).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use hdf5_pure::AttrValue;

use crate::error::{Error, Result};

/// An open HDF5 file held in memory.
pub(crate) struct H5 {
    file: hdf5_pure::File,
    path: PathBuf,
    /// Size of the file in bytes.
    file_len: u64,
}

/// Largest ratio of a dataset's raw bytes to the file's size that a read
/// accepts: deflate's maximum compression ratio is about 1032:1.
const MAX_EXPANSION: u64 = 1100;

/// Reads below this many bytes are always allowed (tiny files, fill values).
const ALWAYS_ALLOWED: u64 = 64 << 20;

/// Run `f`, mapping both an `hdf5_pure::Error` and a panic to [`Error::Hdf5`].
fn guard<T>(
    path: &Path,
    object: &str,
    f: impl FnOnce() -> Result<T, hdf5_pure::Error>,
) -> Result<T> {
    let wrap = |message: String| Error::Hdf5 {
        path: path.to_path_buf(),
        object: object.to_string(),
        message,
    };
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(wrap(e.to_string())),
        Err(panic) => Err(wrap(format!(
            "malformed file (the HDF5 reader panicked: {})",
            panic_message(&panic)
        ))),
    }
}

/// The text of a panic payload.
pub(crate) fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// An [`Error::Hdf5`] for a value that does not fit its meaning.
pub(crate) fn bad_value(file: &H5, object: &str, value: i64) -> Error {
    Error::Hdf5 {
        path: file.path.clone(),
        object: object.to_string(),
        message: format!("value {value} is not a valid index"),
    }
}

impl H5 {
    /// Parse an HDF5 file from its bytes.
    pub(crate) fn open(bytes: Vec<u8>, path: &Path) -> Result<Self> {
        let file_len = bytes.len() as u64;
        let file = guard(path, "/", || hdf5_pure::File::from_bytes(bytes))?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
            file_len,
        })
    }

    /// Fails unless reading `object` whole allocates a size this file can hold.
    fn check_extent(&self, object: &str) -> Result<()> {
        let (count, element) = guard(&self.path, object, || {
            let dataset = self.file.dataset(object)?;
            let count = dataset
                .shape()?
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d));
            Ok((count, dataset.element_size()?))
        })?;
        let bytes = count.and_then(|n| n.checked_mul(element.max(8)));
        let limit = self
            .file_len
            .saturating_mul(MAX_EXPANSION)
            .max(ALWAYS_ALLOWED);
        match bytes {
            Some(b) if b <= limit => Ok(()),
            _ => Err(Error::Hdf5 {
                path: self.path.clone(),
                object: object.to_string(),
                message: format!(
                    "malformed file: the dataset declares {} elements of {element} bytes, \
                     more than a {}-byte file can hold",
                    count.map_or("over 2^64".to_string(), |n| n.to_string()),
                    self.file_len
                ),
            }),
        }
    }

    /// True when `object` resolves to a dataset.
    pub(crate) fn has(&self, object: &str) -> bool {
        guard(&self.path, object, || self.file.dataset(object)).is_ok()
    }

    /// Names of the datasets directly under the root group.
    pub(crate) fn root_datasets(&self) -> Result<Vec<String>> {
        guard(&self.path, "/", || self.file.root().datasets())
    }

    /// Dimensions of a dataset.
    pub(crate) fn shape(&self, object: &str) -> Result<Vec<u64>> {
        guard(&self.path, object, || self.file.dataset(object)?.shape())
    }

    /// Number of elements of a dataset.
    pub(crate) fn len(&self, object: &str) -> Result<u64> {
        Ok(self.shape(object)?.iter().product())
    }

    /// All elements as f64 (coerced from any numeric type).
    pub(crate) fn read_f64(&self, object: &str) -> Result<Vec<f64>> {
        self.check_extent(object)?;
        guard(&self.path, object, || self.file.dataset(object)?.read_f64())
    }

    /// All elements as f32 (coerced from any numeric type).
    pub(crate) fn read_f32(&self, object: &str) -> Result<Vec<f32>> {
        self.check_extent(object)?;
        guard(&self.path, object, || self.file.dataset(object)?.read_f32())
    }

    /// All elements as i64 (coerced from any integer type).
    pub(crate) fn read_i64(&self, object: &str) -> Result<Vec<i64>> {
        self.check_extent(object)?;
        guard(&self.path, object, || self.file.dataset(object)?.read_i64())
    }

    /// All elements of a fixed- or variable-length string dataset.
    pub(crate) fn read_strings(&self, object: &str) -> Result<Vec<String>> {
        self.check_extent(object)?;
        guard(&self.path, object, || {
            self.file.dataset(object)?.read_string()
        })
    }

    /// True when the dataset holds floating-point values of 4 bytes.
    pub(crate) fn is_f32(&self, object: &str) -> Result<bool> {
        guard(&self.path, object, || {
            Ok(matches!(
                self.file.dataset(object)?.dtype()?,
                hdf5_pure::DType::F32
            ))
        })
    }

    /// The BIOM root attribute `shape` ([observations, samples]), if present.
    pub(crate) fn shape_attr(&self) -> Result<Option<[u64; 2]>> {
        let attrs = guard(&self.path, "/", || self.file.root().attrs())?;
        let Some(value) = attrs.get("shape") else {
            return Ok(None);
        };
        let dims: Option<Vec<u64>> = match value {
            AttrValue::I64Array(v) => v.iter().map(|&x| u64::try_from(x).ok()).collect(),
            AttrValue::I32Array(v) => v.iter().map(|&x| u64::try_from(x).ok()).collect(),
            AttrValue::U64Array(v) => Some(v.clone()),
            AttrValue::U32Array(v) => Some(v.iter().map(|&x| x as u64).collect()),
            _ => None,
        };
        match dims.as_deref() {
            Some(&[a, b]) => Ok(Some([a, b])),
            _ => Err(Error::Hdf5 {
                path: self.path.clone(),
                object: "/".into(),
                message: format!(
                    "the shape attribute is not a pair of non-negative integers: {value:?}"
                ),
            }),
        }
    }
}
