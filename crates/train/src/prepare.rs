//! From the user's files to the samples of a run: the table read and
//! rarefied, joined by sample ID with the UniFrac matrix (and, for `train`,
//! the metadata target), and split into training and validation samples.
//!
//! `pretrain`, `train` and `diagnose gradients` all start here, so the same
//! options give the same samples in the same order everywhere (the split and
//! the rarefaction depend only on `seed`). A classifier's label column
//! becomes class indices here, with the labels' order fixed (sorted, or a
//! resumed run's), so that class `k` means the same label in every
//! checkpoint of a run.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use aam_data::{
    BiomTable, Dataset, DistanceMatrix, MatrixIds, Metadata, MissingPolicy, Transforms,
};

use crate::checkpoint::DataInfo;
use crate::error::{Result, TrainError};

/// The inputs of a run and how to prepare them.
#[derive(Clone, Debug)]
pub struct DataSpec {
    /// BIOM table whose observation IDs are the ASV sequences.
    pub table: PathBuf,
    /// UniFrac distance matrix.
    pub unifrac_matrix: PathBuf,
    /// Reads per sample after rarefaction (samples with fewer are dropped).
    pub rarefy_depth: u64,
    /// Fraction of samples held out for validation, in `[0, 1)`.
    pub test_size: f64,
    /// Bases kept per ASV.
    pub max_bp: usize,
    /// Drop samples absent from the matrix or metadata instead of failing.
    pub drop_missing: bool,
    /// Seed of rarefaction and of the split.
    pub seed: u64,
}

/// The target of `train`: a metadata column, numeric or (with `classifier`)
/// labels; `labels` fixes the label order (a resumed run's).
#[derive(Clone, Copy, Debug)]
pub struct TargetSpec<'a> {
    /// Metadata TSV.
    pub path: &'a Path,
    /// The target column.
    pub column: &'a str,
    /// Whether the column holds class labels.
    pub classifier: bool,
    /// The labels' order, when it is already fixed.
    pub labels: Option<&'a [String]>,
}

/// The table, rarefied, and the dataset joined with the matrix (and metadata).
#[derive(Clone, Debug)]
pub struct Prepared {
    /// Every sample of the run.
    pub dataset: Arc<Dataset>,
    /// Training positions in `dataset`.
    pub train: Vec<usize>,
    /// Validation positions in `dataset`.
    pub validation: Vec<usize>,
    /// Where the inputs came from (`table`, `unifrac_matrix`, `metadata`).
    pub sources: BTreeMap<String, String>,
    /// The classifier's labels (index = class), when the target is a label column.
    pub class_labels: Option<Vec<String>>,
}

/// Reads, rarefies, joins and splits the inputs of `spec`.
pub fn prepare(spec: &DataSpec, target: Option<TargetSpec>) -> Result<Prepared> {
    if !(0.0..1.0).contains(&spec.test_size) {
        return Err(TrainError::arg(
            "test-size",
            format!("must lie in [0, 1), got {}", spec.test_size),
        ));
    }
    let input = |option: &'static str| move |source| TrainError::Input { option, source };
    let table = BiomTable::read(&spec.table).map_err(input("table"))?;
    let rarefied = table
        .rarefy(spec.rarefy_depth, spec.seed)
        .map_err(input("rarefy-depth"))?;
    if !rarefied.dropped.is_empty() {
        tracing::warn!(
            "{} sample(s) have fewer than {} reads and were dropped by rarefaction: {}",
            rarefied.dropped.len(),
            spec.rarefy_depth,
            aam_data::IdList::new(&rarefied.dropped)
        );
    }
    let matrix = DistanceMatrix::read(&spec.unifrac_matrix, &MatrixIds::Auto)
        .map_err(input("unifrac-matrix"))?;
    let policy = if spec.drop_missing {
        MissingPolicy::Drop
    } else {
        MissingPolicy::Error
    };
    let mut builder = Dataset::builder(&rarefied.table)
        .max_bp(spec.max_bp)
        .unifrac(Arc::new(matrix), policy);
    let mut sources = BTreeMap::from([
        ("table".to_string(), spec.table.display().to_string()),
        (
            "unifrac_matrix".to_string(),
            spec.unifrac_matrix.display().to_string(),
        ),
    ]);
    let mut class_labels = None;
    if let Some(t) = target {
        let mut meta = Metadata::read(t.path).map_err(input("metadata"))?;
        if t.classifier {
            // The dataset reads numeric targets: labels become class indices.
            let (indexed, labels) =
                class_indexed(&meta, t.column, rarefied.table.sample_ids(), t.labels)?;
            meta = indexed;
            class_labels = Some(labels);
        }
        builder = builder.metadata(Arc::new(meta)).target(t.column, policy);
        sources.insert("metadata".into(), t.path.display().to_string());
    }
    let dataset = builder.build()?;
    let split = dataset.split(spec.test_size, spec.seed)?;
    tracing::info!(
        "{} samples ({} train, {} validation), {} ASVs",
        dataset.len(),
        split.train.len(),
        split.validation.len(),
        dataset.asv_ids().len()
    );
    Ok(Prepared {
        dataset: Arc::new(dataset),
        train: split.train,
        validation: split.validation,
        sources,
        class_labels,
    })
}

impl Prepared {
    /// What a checkpoint records of these samples: the fitted `transforms`,
    /// the classifier's labels, the target column and the split's IDs.
    pub fn data_info(
        &self,
        spec: &DataSpec,
        transforms: Transforms,
        class_labels: Option<Vec<String>>,
        target: Option<String>,
    ) -> DataInfo {
        let ids = |pos: &[usize]| {
            pos.iter()
                .map(|&s| self.dataset.sample_ids()[s].clone())
                .collect()
        };
        DataInfo {
            transforms,
            class_labels,
            max_bp: spec.max_bp,
            target_column: target,
            rarefy_depth: Some(spec.rarefy_depth as usize),
            sources: self.sources.clone(),
            train_ids: ids(&self.train),
            validation_ids: ids(&self.validation),
        }
    }
}

/// A copy of `meta` whose `column` holds class indices instead of labels, and
/// the labels (index = class): `known` ones (a resumed run's), or the sorted
/// distinct labels of the samples in `ids` (missing values stay missing).
fn class_indexed(
    meta: &Metadata,
    column: &str,
    ids: &[String],
    known: Option<&[String]>,
) -> Result<(Metadata, Vec<String>)> {
    let col = meta.column(column)?;
    let labels: Vec<String> = match known {
        Some(l) => l.to_vec(),
        None => {
            let mut l: Vec<String> = ids
                .iter()
                .filter_map(|id| meta.row(id).and_then(|r| meta.value(r, col)))
                .map(str::to_string)
                .collect();
            l.sort();
            l.dedup();
            l
        }
    };
    let bad = |reason: String| TrainError::arg("metadata-column", reason);
    if labels.is_empty() {
        return Err(bad(format!(
            "{}: column {column} has no values for the table's samples",
            meta.source().display()
        )));
    }
    let index: BTreeMap<&str, usize> = labels
        .iter()
        .enumerate()
        .map(|(i, l)| (l.as_str(), i))
        .collect();
    let in_table: HashSet<&str> = ids.iter().map(String::as_str).collect();
    let mut text = std::iter::once(meta.id_column())
        .chain(meta.columns().iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("\t");
    text.push('\n');
    for (row, id) in meta.sample_ids().iter().enumerate() {
        text.push_str(id);
        for c in 0..meta.columns().len() {
            text.push('\t');
            match (meta.value(row, c), c == col) {
                (Some(v), true) => match index.get(v) {
                    Some(i) => text.push_str(&i.to_string()),
                    // Only a resumed run's labels can miss one; a sample outside the table is left out.
                    None if in_table.contains(id.as_str()) => {
                        return Err(bad(format!(
                            "{}: sample {id:?} has label {v:?} in column {column}, not one of the checkpoint's {labels:?}",
                            meta.source().display()
                        )))
                    }
                    None => {}
                },
                (Some(v), false) => text.push_str(v),
                (None, _) => {}
            }
        }
        text.push('\n');
    }
    let indexed = Metadata::from_bytes(text.as_bytes(), meta.source())?;
    Ok((indexed, labels))
}
