//! The crate's errors: invalid configurations ([`ModelError`]) and weight
//! files that cannot be read, written or matched to a model ([`ImportError`]).
//! Each names the field or file at fault.

use std::path::PathBuf;

/// Errors of this crate: invalid configurations and weight files.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A configuration field has an invalid value.
    #[error("invalid model configuration: `{field}` {reason}")]
    InvalidConfig {
        /// The field at fault.
        field: &'static str,
        /// Why.
        reason: String,
    },
}

/// Errors reading or writing weights.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file is not a readable checkpoint / weights file.
    #[error("{path}: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Tensor names or shapes do not fit the architecture.
    #[error("{path}: weights do not fit the model:{}", mismatch_lines(.unknown, .missing, .misshaped))]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// In the file, not in the model.
        unknown: Vec<String>,
        /// In the model, not in the file.
        missing: Vec<String>,
        /// `(key, file shape, model shape)`.
        misshaped: Vec<(String, Vec<usize>, Vec<usize>)>,
    },
    /// The architecture cannot be worked out from the tensors.
    #[error("{path}: cannot infer the architecture: {reason}")]
    Inference {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::ModelError),
}

fn mismatch_lines(
    unknown: &[String],
    missing: &[String],
    misshaped: &[(String, Vec<usize>, Vec<usize>)],
) -> String {
    let mut out = String::new();
    let list = |out: &mut String, what: &str, items: Vec<String>| {
        if !items.is_empty() {
            out.push_str(&format!(
                "\n  {what} ({}): {}",
                items.len(),
                items.join(", ")
            ));
        }
    };
    list(&mut out, "unknown tensors", unknown.to_vec());
    list(&mut out, "missing tensors", missing.to_vec());
    list(
        &mut out,
        "wrong shapes",
        misshaped
            .iter()
            .map(|(k, f, m)| format!("{k} is {f:?} in the file, {m:?} in the model"))
            .collect(),
    );
    out
}
