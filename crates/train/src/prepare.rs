//! From the user's files to the samples of a run: the table read and
//! rarefied, joined by sample ID with the UniFrac matrix (and, for `train`,
//! the metadata target), and split into training and validation samples.
//! The UniFrac distances come from a matrix file or, with a tree, are
//! computed here for the rarefied table's samples (`aam-unifrac`) and kept in
//! the run's folder, so a second run on the same inputs reads them back.
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
    BiomTable, Dataset, DistanceMatrix, MatrixIds, Metadata, MissingPolicy, SampleValues,
    Transforms,
};

use crate::checkpoint::DataInfo;
use crate::error::{Result, TrainError};

/// The inputs of a run and how to prepare them.
#[derive(Clone, Debug)]
pub struct DataSpec {
    /// BIOM table whose observation IDs are the ASV sequences.
    pub table: PathBuf,
    /// Where the UniFrac distances come from.
    pub unifrac: UnifracSource,
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

/// Where a run's UniFrac distances come from.
#[derive(Clone, Debug)]
pub enum UnifracSource {
    /// A matrix file: `ssu`'s HDF5, `.npy`/`.npz` with its sample IDs beside
    /// it, `.tsv`/`.csv`.
    Matrix(PathBuf),
    /// Computed from the rarefied table and this Newick tree. With a
    /// `cache_dir`, the matrix is written there as
    /// `unifrac-<method>-<key>.h5`, the key a hash of the table's and the
    /// tree's bytes, the rarefaction depth, the seed and the method, and read
    /// back by a later run whose key matches.
    Tree {
        /// The tree (its tips include the table's observations).
        tree: PathBuf,
        /// The UniFrac variant.
        method: aam_unifrac::Method,
        /// Where to keep the matrix (a run's output folder).
        cache_dir: Option<PathBuf>,
        /// Compute it on this GPU instead of the CPU's threads (a matrix of
        /// a single-precision GPU is cached under a key of its own).
        gpu: Option<aam_unifrac::Gpu>,
    },
    /// Faith's PD per sample (`--unifrac-metric faith_pd`) from a file:
    /// `faithpd`'s TSV, a CSV, or `.npy`/`.npz`/`.h5` with sample IDs.
    FaithPd(PathBuf),
    /// Faith's PD of the rarefied table's samples over this Newick tree
    /// (computed in well under a second per thousand samples; not cached).
    FaithPdTree(PathBuf),
}

/// The base target of a run, read or computed.
enum BaseTarget {
    Distances(DistanceMatrix),
    FaithPd(SampleValues),
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
    let (base, base_source) = match &spec.unifrac {
        UnifracSource::Matrix(path) => (
            BaseTarget::Distances(
                DistanceMatrix::read(path, &MatrixIds::Auto).map_err(input("unifrac-matrix"))?,
            ),
            path.display().to_string(),
        ),
        UnifracSource::Tree {
            tree,
            method,
            cache_dir,
            gpu,
        } => {
            let (matrix, source) = tree_matrix(
                spec,
                &rarefied.table,
                tree,
                *method,
                cache_dir.as_deref(),
                *gpu,
            )?;
            (BaseTarget::Distances(matrix), source)
        }
        UnifracSource::FaithPd(path) => (
            BaseTarget::FaithPd(
                SampleValues::read(path, &MatrixIds::Auto).map_err(input("unifrac-matrix"))?,
            ),
            path.display().to_string(),
        ),
        UnifracSource::FaithPdTree(tree) => (
            BaseTarget::FaithPd(tree_faith_pd(&rarefied.table, tree)?),
            format!("Faith's PD computed from {}", tree.display()),
        ),
    };
    let policy = if spec.drop_missing {
        MissingPolicy::Drop
    } else {
        MissingPolicy::Error
    };
    check_sequences(&rarefied.table, spec)?;
    let builder = Dataset::builder(&rarefied.table).max_bp(spec.max_bp);
    let (mut builder, base_key) = match base {
        BaseTarget::Distances(m) => (builder.unifrac(Arc::new(m), policy), "unifrac_matrix"),
        BaseTarget::FaithPd(v) => (builder.faith_pd(Arc::new(v), policy), "faith_pd"),
    };
    let mut sources = BTreeMap::from([
        ("table".to_string(), spec.table.display().to_string()),
        (base_key.to_string(), base_source),
    ]);
    if let UnifracSource::Tree { tree, .. } | UnifracSource::FaithPdTree(tree) = &spec.unifrac {
        sources.insert("tree".into(), tree.display().to_string());
    }
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
    let dataset = builder.build().map_err(|e| match e {
        e @ aam_data::Error::SamplesMissingFromMatrix { .. } => input("unifrac-matrix")(e),
        e => e.into(),
    })?;
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

/// The UniFrac matrix of `table` (the rarefied table) over `tree`: read
/// back from `cache_dir` when a run with the same inputs computed it, else
/// computed on every core (or on `gpu`) and, with a `cache_dir`, written
/// there. Returns the matrix and where it is (or, without a cache, where it
/// came from).
fn tree_matrix(
    spec: &DataSpec,
    table: &BiomTable,
    tree: &Path,
    method: aam_unifrac::Method,
    cache_dir: Option<&Path>,
    gpu: Option<aam_unifrac::Gpu>,
) -> Result<(DistanceMatrix, String)> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| TrainError::Io {
            path: path.to_path_buf(),
            source,
        })
    };
    let mut key = Fnv::default();
    key.write(&read(&spec.table)?);
    key.write(&read(tree)?);
    key.write(format!("{}|{}|{method:?}", spec.rarefy_depth, spec.seed).as_bytes());
    // Double precision on a GPU gives the CPU's distances (within 1e-14);
    // single precision does not, and is kept apart.
    if gpu.is_some_and(|g| !g.double_precision()) {
        key.write(b"|f32");
    }
    let cached =
        cache_dir.map(|dir| dir.join(format!("unifrac-{}-{:016x}.h5", method.name(), key.0)));
    if let Some(path) = cached.as_deref().filter(|p| p.exists()) {
        match DistanceMatrix::read(path, &MatrixIds::Auto) {
            Ok(matrix) => {
                tracing::info!(
                    "UniFrac distances from {} (computed by an earlier run)",
                    path.display()
                );
                return Ok((matrix, path.display().to_string()));
            }
            Err(e) => tracing::warn!("recomputing the UniFrac distances: {e}"),
        }
    }
    let start = std::time::Instant::now();
    let parsed = aam_unifrac::Tree::read(tree)?;
    let options = aam_unifrac::Options::new(method);
    let (distances, report) = match gpu {
        None => aam_unifrac::unifrac(table, &parsed, &options, &mut |_, _| {})?,
        Some(gpu) => aam_unifrac::unifrac_on_gpu(table, &parsed, &options, gpu, &mut |_, _| {})?,
    };
    tracing::info!(
        "{} UniFrac distances of {} samples over {} branches of {} in {:.1} s{}",
        method.name(),
        distances.len(),
        report.branches,
        tree.display(),
        start.elapsed().as_secs_f64(),
        gpu.map(|g| format!(" on {g:?}")).unwrap_or_default()
    );
    let source = match &cached {
        Some(path) => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(|source| TrainError::Io {
                    path: dir.to_path_buf(),
                    source,
                })?;
            }
            distances.write(path, false)?;
            path.display().to_string()
        }
        None => format!("computed from {}", tree.display()),
    };
    let matrix = DistanceMatrix::from_values(
        &source,
        distances.ids().to_vec(),
        distances.values().to_vec(),
    )
    .map_err(|source| TrainError::Input {
        option: "tree",
        source,
    })?;
    Ok((matrix, source))
}

/// Faith's PD of every sample of `table` (the rarefied table) over `tree`.
fn tree_faith_pd(table: &BiomTable, tree: &Path) -> Result<SampleValues> {
    let start = std::time::Instant::now();
    let parsed = aam_unifrac::Tree::read(tree)?;
    let (pd, _) = aam_unifrac::faith_pd(
        table,
        &parsed,
        &aam_unifrac::Options::new(aam_unifrac::Method::Unweighted),
    )?;
    tracing::info!(
        "Faith's PD of {} samples over {} in {:.2} s",
        pd.ids.len(),
        tree.display(),
        start.elapsed().as_secs_f64()
    );
    SampleValues::from_values(tree, pd.ids, pd.values).map_err(|source| TrainError::Input {
        option: "tree",
        source,
    })
}

/// FNV-1a, 64 bits: a stable hash (the same in every build and process) for
/// cache keys; not for untrusted input.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
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

/// The ASVs are read from the table's observation IDs. IDs of which most
/// are not nucleotide sequences (QIIME 2 feature hashes, OTU numbers) are an
/// error; other characters than A/C/G/T become the padding token and
/// sequences longer than `--max-bp` are cut to it, as in the reference, and
/// both are logged.
fn check_sequences(table: &aam_data::BiomTable, spec: &DataSpec) -> Result<()> {
    let seqs = aam_data::summary::sequences(table, spec.max_bp);
    let n = table.n_observations();
    if 2 * seqs.not_sequences > n {
        let example = seqs.not_sequence_example.unwrap_or_default();
        return Err(TrainError::arg(
            "table",
            format!(
                "{}: {} of its {n} observation IDs are not nucleotide sequences (e.g. {example:?}); AAM reads each ASV's sequence from its ID, so the table must have sequences as observation IDs",
                spec.table.display(),
                seqs.not_sequences
            ),
        ));
    }
    if seqs.asvs_with_non_acgt > 0 {
        tracing::warn!(
            "{} of {n} ASVs contain characters other than A/C/G/T ({} in all); they are read as padding, as in the reference",
            seqs.asvs_with_non_acgt,
            seqs.non_acgt_bases
        );
    }
    if seqs.longer_than_max_bp > 0 {
        tracing::info!(
            "{} of {n} ASVs are longer than --max-bp {} and are cut to it",
            seqs.longer_than_max_bp,
            spec.max_bp
        );
    }
    Ok(())
}
