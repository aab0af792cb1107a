//! The one error type of `aam-unifrac`: each variant names the file, byte,
//! sample or observation the user has to look at.

use std::path::PathBuf;

use aam_data::IdList;

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong, and where.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },

    /// The Newick text is malformed.
    #[error("{}: invalid Newick at byte {offset}: {message}", path.display())]
    Newick {
        /// The tree file.
        path: PathBuf,
        /// 0-based byte offset of the fault.
        offset: usize,
        /// What is wrong there.
        message: String,
    },

    /// Two tips of the tree carry a label that the table uses.
    #[error("{}: the tree has more than one tip labelled {name:?}, an observation of the table", path.display())]
    DuplicateTip {
        /// The tree file.
        path: PathBuf,
        /// The label.
        name: String,
    },

    /// Observations of the table are not tips of the tree.
    #[error(
        "{} observation(s) of {} are not tips of the tree {}: {ids}; \
         use --drop-missing to leave them out (their counts are then ignored)",
        ids.total, table.display(), tree.display()
    )]
    MissingTips {
        /// The table.
        table: PathBuf,
        /// The tree.
        tree: PathBuf,
        /// The observation IDs.
        ids: IdList,
    },

    /// Samples have no counts (on the tree), so their distances are 0/0.
    #[error(
        "{}: {} sample(s) have no counts{}: {ids}; remove them, or use --drop-empty",
        table.display(), ids.total, if *after_drop { " on the tree's tips" } else { "" }
    )]
    EmptySamples {
        /// The table.
        table: PathBuf,
        /// The sample IDs.
        ids: IdList,
        /// True when the counts were lost by dropping observations missing from the tree.
        after_drop: bool,
    },

    /// Nothing is left to compare.
    #[error("{}: {reason}", table.display())]
    NothingToCompare {
        /// The table.
        table: PathBuf,
        /// Why.
        reason: String,
    },

    /// An option is out of range.
    #[error("{0}")]
    Option(String),

    /// The GPU path cannot run this input, or its device failed.
    #[error("GPU: {0}")]
    Gpu(String),

    /// The table could not be read.
    #[error(transparent)]
    Data(#[from] aam_data::Error),
}
