//! UniFrac distances and Faith's PD from a BIOM table and a Newick tree, so
//! that aam-rs needs no `ssu` (unifrac-binaries) before it can pretrain.
//!
//! The pieces, in the order data flows:
//!
//! - [`Tree`] ([`newick`]): a Newick reader for real trees (200k+ tips, deep,
//!   quoted labels, comments), iterative, errors with byte offsets; the tree
//!   is kept flat in postorder.
//! - [`on_tree`]: the table placed on the tree: observations matched to tips
//!   (missing ones reported, or dropped with [`Options::drop_missing`]),
//!   empty samples reported (or dropped with [`Options::drop_empty`]), the
//!   tree sheared to the observed tips and single-child nodes collapsed.
//! - [`striped`]: Striped UniFrac on the CPU with rayon threads; its doc
//!   explains the layout and why most pairs cost nothing per branch.
//! - `gpu` (with the `wgpu`, `cuda` or `rocm` feature): the same distances
//!   on a GPU through CubeCL, every pair summed densely in tiles
//!   ([`unifrac_on_gpu`]).
//! - [`output`]: matrices as `ssu`'s HDF5 (`matrix` + `order`, which aam-rs,
//!   the reference and QIIME 2 read) or as a TSV; Faith's PD as a TSV.
//!
//! Results match `ssu` (the oracle in this crate's tests) within 1e-9 in
//! double precision for every method it has.
//!
//! ```no_run
//! use aam_unifrac::{unifrac, Method, Options, Tree};
//! let table = aam_data::BiomTable::read("table.biom")?;
//! let tree = Tree::read("tree.nwk")?;
//! let options = Options::new(Method::WeightedNormalized);
//! let (matrix, report) = unifrac(&table, &tree, &options, &mut |_, _| {})?;
//! matrix.write("unifrac.h5".as_ref(), false)?;
//! # Ok::<(), aam_unifrac::Error>(())
//! ```

#![deny(missing_docs)]

mod error;
#[cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]
pub mod gpu;
pub mod newick;
pub mod on_tree;
pub mod output;
pub mod striped;

pub use error::{Error, Result};
pub use newick::Tree;
pub use on_tree::Report;
pub use output::{Distances, FaithPd};

use on_tree::OnTree;

/// A GPU runtime compiled into this build (none without the `wgpu`, `cuda`
/// or `rocm` feature: then no value of it exists and [`unifrac_on_gpu`]
/// cannot be called).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gpu {
    /// wgpu's default adapter (Vulkan, Metal, DirectX), single precision.
    #[cfg(feature = "wgpu")]
    Wgpu,
    /// CUDA device 0, double precision.
    #[cfg(feature = "cuda")]
    Cuda,
    /// ROCm/HIP device 0, double precision.
    #[cfg(feature = "rocm")]
    Rocm,
}

impl Gpu {
    /// Whether it computes in double precision (CUDA, ROCm; wgpu's WGSL has
    /// no f64).
    pub fn double_precision(self) -> bool {
        match self {
            #[cfg(feature = "wgpu")]
            Self::Wgpu => false,
            #[cfg(feature = "cuda")]
            Self::Cuda => true,
            #[cfg(feature = "rocm")]
            Self::Rocm => true,
        }
    }
}

/// A UniFrac variant (Lozupone et al. 2005, 2007; Chen et al. 2012).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Method {
    /// Shared branch length over total: presence only.
    Unweighted,
    /// Σ L|u−v| / Σ L(u+v), u and v the proportions below a branch.
    WeightedNormalized,
    /// Σ L|u−v|.
    WeightedUnnormalized,
    /// Generalized UniFrac: Σ L(u+v)^α |u−v|/(u+v) / Σ L(u+v)^α, α in [0, 1].
    Generalized {
        /// Weight of abundant lineages: 0 is close to unweighted, 1 is
        /// weighted normalized.
        alpha: f64,
    },
}

impl Method {
    /// The method's name as `ssu -m` spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Method::Unweighted => "unweighted",
            Method::WeightedNormalized => "weighted_normalized",
            Method::WeightedUnnormalized => "weighted_unnormalized",
            Method::Generalized { .. } => "generalized",
        }
    }
}

/// How to compute.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// The variant.
    pub method: Method,
    /// Variance-adjusted weights (Chang et al. 2011): each branch's term is
    /// divided by sqrt(m_b (m − m_b)), m_b the two samples' counts below it
    /// and m their total.
    pub variance_adjusted: bool,
    /// Worker threads; 0 uses every core.
    pub threads: usize,
    /// Leave out observations that are not tips of the tree, instead of an error.
    pub drop_missing: bool,
    /// Leave out samples without counts, instead of an error.
    pub drop_empty: bool,
}

impl Options {
    /// `method` without variance adjustment, on every core, strict about input.
    pub fn new(method: Method) -> Self {
        Self {
            method,
            variance_adjusted: false,
            threads: 0,
            drop_missing: false,
            drop_empty: false,
        }
    }

    fn check(&self) -> Result<()> {
        if let Method::Generalized { alpha } = self.method {
            if !(0.0..=1.0).contains(&alpha) {
                return Err(Error::Option(format!(
                    "--alpha {alpha}: generalized UniFrac needs 0 <= alpha <= 1"
                )));
            }
        }
        Ok(())
    }

    fn pool(&self) -> Result<rayon::ThreadPool> {
        rayon::ThreadPoolBuilder::new()
            .num_threads(self.threads)
            .build()
            .map_err(|e| Error::Option(format!("--threads {}: {e}", self.threads)))
    }
}

/// The UniFrac distance between every two samples of `table` over `tree`.
/// `progress(done, total)` is called as branches are processed.
pub fn unifrac(
    table: &aam_data::BiomTable,
    tree: &Tree,
    options: &Options,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Distances, Report)> {
    options.check()?;
    let pool = options.pool()?;
    let (on, report) = OnTree::new(table, tree, options.drop_missing, options.drop_empty)?;
    let values = striped::distances(
        &on,
        options.method,
        options.variance_adjusted,
        &pool,
        progress,
    );
    Ok((Distances::new(on.sample_ids, values), report))
}

/// [`unifrac`] on a GPU: the same distances, in double precision on CUDA and
/// ROCm (on an H200 within 6.5e-15 of `ssu`), in single precision on wgpu
/// (within 1e-5 of `ssu`'s fp32 output), variance adjusted or not;
/// `options.threads` does not apply. A GPU that fails (no
/// device, out of memory) is an [`Error::Gpu`].
/// `progress(done, total)` is called as batches of branches are sent.
pub fn unifrac_on_gpu(
    table: &aam_data::BiomTable,
    tree: &Tree,
    options: &Options,
    gpu: Gpu,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Distances, Report)> {
    options.check()?;
    let (on, report) = OnTree::new(table, tree, options.drop_missing, options.drop_empty)?;
    let values = on_gpu(
        &on,
        options.method,
        options.variance_adjusted,
        gpu,
        progress,
    )?;
    Ok((Distances::new(on.sample_ids, values), report))
}

#[cfg(any(feature = "wgpu", feature = "cuda", feature = "rocm"))]
use gpu::distances as on_gpu;

/// Without a GPU runtime there is no [`Gpu`] to call this with.
#[cfg(not(any(feature = "wgpu", feature = "cuda", feature = "rocm")))]
fn on_gpu(
    _: &OnTree,
    _: Method,
    _: bool,
    gpu: Gpu,
    _: &mut dyn FnMut(usize, usize),
) -> Result<Vec<f64>> {
    match gpu {}
}

/// Faith's phylogenetic diversity of every sample of `table` over `tree`
/// (only `drop_missing` and `drop_empty` of `options` apply).
pub fn faith_pd(
    table: &aam_data::BiomTable,
    tree: &Tree,
    options: &Options,
) -> Result<(FaithPd, Report)> {
    let (on, report) = OnTree::new(table, tree, options.drop_missing, options.drop_empty)?;
    let values = striped::faith_pd(&on);
    Ok((
        FaithPd {
            ids: on.sample_ids,
            values,
        },
        report,
    ))
}
