//! The dense layers' matrix products on the CubeCL backends.
//!
//! Which kernel runs a product is decided here, from the device and the
//! problem ([`plan`]): a short rule over kernels that were each checked
//! against a float64 product in every operand layout the dense backward
//! makes (`kernels/tests/matmul_kernels.rs`). With
//! [`MatmulTuning::Autotune`] CubeCL's tuner times every candidate instead,
//! once per problem bucket, which costs minutes of compilation on a GPU's
//! first run and a little time whenever a new bucket appears mid-run.

mod any_rows;
mod plan;
mod tma_tiling;

use any_rows::{any_rows, AnyRows};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubek::matmul::launch::launch_tiling::{launch_ref, launch_ref_tma};
use cubek::matmul::routines::BlueprintStrategy;

pub use plan::{dense_matmul_plan, set_matmul_tuning, MatmulShape, MatmulTuning};
pub use tma_tiling::TmaTiling;
use tma_tiling::TunedTmaDoubleBuffering;

/// `a·b` for the dense layers (rank 2, or rank 3 batched over the leading
/// axis), on the kernel [`plan`] names or, with [`MatmulTuning::Autotune`],
/// on the fastest of [`dense_matmul_candidates`] for the problem's bucket.
pub(crate) fn dense_matmul<R: CubeRuntime>(a: CubeTensor<R>, b: CubeTensor<R>) -> CubeTensor<R> {
    match plan::matmul_tuning() {
        MatmulTuning::Plan => planned_matmul(a, b),
        MatmulTuning::Autotune => tuned_matmul(a, b),
    }
}

/// `lhs·rhs` on the first kernel of [`dense_matmul_plan`] that accepts the
/// device and operands; the choice is logged once per shape at debug level.
fn planned_matmul<R: CubeRuntime>(lhs: CubeTensor<R>, rhs: CubeTensor<R>) -> CubeTensor<R> {
    let out = burn_cubecl::kernel::matmul::init_matmul_output(&lhs, &rhs, lhs.dtype);
    let (lhs_dims, rhs_dims) = (lhs.meta.shape(), rhs.meta.shape());
    let shape = MatmulShape {
        m: lhs_dims[lhs_dims.num_dims() - 2],
        k: lhs_dims[lhs_dims.num_dims() - 1],
        n: rhs_dims[rhs_dims.num_dims() - 1],
        dtype: lhs.dtype,
    };
    let plan = dense_matmul_plan(&shape);
    // Kernels refuse before launching (TMA before Hopper, no tensor cores);
    // the reasons are only formatted for the log.
    let mut refusals = Vec::new();
    for (index, kernel) in plan.iter().enumerate() {
        match launch_matmul(kernel, &lhs, &rhs, &out) {
            Ok(()) => {
                log_once(&shape, &plan, index, &refusals);
                return out;
            }
            Err(error) => refusals.push(error),
        }
    }
    // The unit kernel, last in every plan, takes every float problem of
    // every runtime; reaching this is a bug.
    panic!("no matmul kernel accepted {shape:?}: {refusals:?}")
}

/// Logs the kernel `plan[index]` that a dense product runs on (after the
/// `refusals` of the kernels before it), once per problem (rows rounded up
/// to a power of two) and kernel. Cheap when already logged: no allocation.
fn log_once(
    shape: &MatmulShape,
    plan: &[DenseKernel],
    index: usize,
    refusals: &[cubek::matmul::definition::MatmulSetupError],
) {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static SEEN: OnceLock<Mutex<HashSet<(MatmulShape, usize)>>> = OnceLock::new();
    let bucket = MatmulShape {
        m: shape.m.next_power_of_two(),
        ..*shape
    };
    let seen = SEEN.get_or_init(Default::default);
    if !seen
        .lock()
        .is_ok_and(|mut seen| seen.insert((bucket, index)))
    {
        return;
    }
    let refused: Vec<String> = plan
        .iter()
        .zip(refusals)
        .map(|(kernel, error)| format!("{kernel}: {error:?}"))
        .collect();
    tracing::debug!(
        "dense matmul [{}, {}]·[{}, {}] {:?}: {}{}",
        shape.m,
        shape.k,
        shape.k,
        shape.n,
        shape.dtype,
        plan[index],
        if refused.is_empty() {
            String::new()
        } else {
            format!(" (refused: {})", refused.join("; "))
        }
    );
}

/// The CubeCL matmul kernels the dense layers' products may run on, each
/// checked against a float64 product in every operand layout the dense
/// backward makes (`kernels/tests/matmul_kernels.rs`, on CUDA also over
/// every inner size modulo 64).
///
/// Why not all of Burn's autotune candidates: autotune times the candidates
/// once per *bucket* of problems (sizes rounded to a coarse grid, layouts)
/// and reuses the winner for every problem in the bucket, and three
/// candidates are wrong on problems their bucket admits (`docs/performance.md`,
/// 2026-11-26):
/// - `specialized_cyclic_{cmma,mma}` with a transposed left operand whose
///   inner size is 32 more than a multiple of 64 (on an H100: relative error
///   8-23 at `[128, 1952]ᵀ·[1952, 512]`). The dense weight gradient's leftover
///   rows hit this once every ~64 batch sizes; if autotune picks it on a
///   batch where it is right, two batches an epoch of oral2550 get weight
///   gradients ~5,000x too large and real-data pretraining on CUDA diverges.
/// - `double_unit` with a transposed right operand (CUDA and lavapipe,
///   e.g. `[1000, 24]·[24, 16]`, relative error 0.1-1.5).
/// - `double_cyclic_mma` (specialized) with a transposed right operand and
///   an inner size 32 more than a multiple of 64 (on an H100: relative
///   error 0.13-5 at `[128, 1952]·[1952, 512]ᵀ`, `[40, 608]·[608, 16]ᵀ` and
///   `[24, 96]·[96, 40]ᵀ`; 2026-11-26). It is the fastest kernel on the
///   weight gradient's leftover rows; `kernels/tests/matmul_kernels.rs`
///   finds it wrong.
///
/// Autotune over this list is safe because every member is right wherever
/// it runs, whichever wins a bucket. The unit kernel comes first: it runs
/// everywhere (lavapipe in CI), and a tuner's first candidate is its
/// fallback. TMA needs an sm_90 GPU (Hopper and later), CMMA/MMA tensor
/// cores; a kernel that cannot run on the device or operands is skipped.
pub fn dense_matmul_candidates() -> Vec<DenseKernel> {
    use cubek::matmul::components::tile::TileMatmulKind::{Cmma, Mma};
    use cubek::matmul::launch::Strategy;
    use cubek::matmul::routines::{
        double_buffering::DoubleBufferingArgs, simple::SimpleArgs, BlueprintStrategy::Inferred,
    };

    let simple = |tile_matmul, multi_rows| SimpleArgs {
        multi_rows,
        tile_matmul,
    };
    let double = |specialized| DoubleBufferingArgs {
        tile_matmul: Mma,
        specialized,
    };
    vec![
        Strategy::SimpleUnit(Inferred(Default::default())),
        Strategy::SimpleCyclicCmma(Inferred(simple(Cmma, false))),
        Strategy::SimpleTmaMma(Inferred(simple(Mma, false))),
        // The weight gradient's parts of 2,048 rows at the reference's batch
        // (H100): 509-522 µs, against 623 on `specialized_tma_mma`.
        Strategy::SimpleTmaMma(Inferred(simple(Mma, true))),
        Strategy::SpecializedTmaMma(Inferred(().into())),
        // Two shared-memory stages filled by TMA, two 16-row tiles a plane:
        // the dense layers' forward and input-gradient products at 302,000
        // rows (H100, 2026-11-27) in 0.77-0.97x
        // `simple_tma_mma`'s time (e.g. `[128→384]` 499 against 603 µs).
        Strategy::DoubleTmaMma(Inferred(double(false))),
        Strategy::DoubleTmaMma(Inferred(double(true))),
    ]
    .into_iter()
    .map(DenseKernel::Cubek)
    .chain([
        // Slower than CubeCL's tilings on the weight gradients' leftover
        // rows, where autotune keeps CubeCL's.
        DenseKernel::TmaDouble(TmaTiling::WIDE_STAGE),
    ])
    .collect()
}

/// A kernel for the dense products: one of CubeCL's strategies with the
/// tiling CubeCL infers, or CubeCL's TMA double-buffered kernel with a
/// stage shape chosen here ([`TmaTiling`]).
#[derive(Clone)]
pub enum DenseKernel {
    Cubek(cubek::matmul::launch::Strategy),
    TmaDouble(TmaTiling),
}

impl From<cubek::matmul::launch::Strategy> for DenseKernel {
    fn from(strategy: cubek::matmul::launch::Strategy) -> Self {
        Self::Cubek(strategy)
    }
}

impl std::fmt::Display for DenseKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cubek(strategy) => strategy.fmt(f),
            Self::TmaDouble(tiling) => tiling.fmt(f),
        }
    }
}

/// `lhs·rhs` on the fastest of [`dense_matmul_candidates`] for the problem's
/// autotune bucket (CubeCL's tuner: timed on the first problem of a bucket,
/// kept in CubeCL's on-disk autotune cache).
fn tuned_matmul<R: CubeRuntime>(lhs: CubeTensor<R>, rhs: CubeTensor<R>) -> CubeTensor<R> {
    use cubecl::tune::{local_tuner, LocalTuner, Tunable, TunableSet};
    use cubek::matmul::launch::MatmulAutotuneKey;

    type Operands<R> = (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>);
    static TUNER: LocalTuner<MatmulAutotuneKey, cubecl::CubeTuneId> = local_tuner!("dense-matmul");

    let out = burn_cubecl::kernel::matmul::init_matmul_output(&lhs, &rhs, lhs.dtype);
    let client = lhs.client.clone();
    let id = cubecl::CubeTuneId::new(&lhs.client, &lhs.device);
    let tunables = TUNER.init(|| {
        let key = |(lhs, rhs, out): &Operands<R>| {
            MatmulAutotuneKey::generate(
                &lhs.client,
                lhs.meta.shape(),
                rhs.meta.shape(),
                lhs.meta.strides(),
                rhs.meta.strides(),
                lhs.dtype.into(),
                rhs.dtype.into(),
                out.dtype.into(),
                None,
                None,
            )
        };
        // Timing runs write a copy of the output, not the output itself.
        let inputs = |_: &MatmulAutotuneKey, (lhs, rhs, out): &Operands<R>| {
            (lhs.clone(), rhs.clone(), out.copy())
        };
        let mut set = TunableSet::new(key, inputs);
        for strategy in dense_matmul_candidates() {
            set = set.with(Tunable::new(
                &strategy.to_string(),
                move |(lhs, rhs, out): Operands<R>| {
                    launch_matmul(&strategy, &lhs, &rhs, &out).map_err(|e| format!("{e:?}"))
                },
            ));
        }
        set
    });
    TUNER.execute(&id, &client, tunables, (lhs, rhs, out.clone()));
    out
}

/// `out = lhs·rhs` on one CubeCL matmul kernel, no autotune: an error where
/// that kernel cannot run on the device or operands (CubeCL's own check,
/// before any launch). Operands of one float type, rank 2 or batched rank 3,
/// in any strides CubeCL's matmul takes (transposed views included). The
/// kernels the dense layers use run with their row and inner-size bounds
/// checks on (`any_rows.rs`): one compiled kernel for every row count.
pub fn launch_matmul<R: CubeRuntime>(
    kernel: &DenseKernel,
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    out: &CubeTensor<R>,
) -> Result<(), cubek::matmul::definition::MatmulSetupError> {
    use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
    use cubek::std::InputBinding;

    let dtype = lhs.dtype;
    let mut elems = MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: dtype.into(),
        rhs: dtype.into(),
        out: out.dtype.into(),
    });
    let client = &lhs.client;
    let lhs = InputBinding::new(lhs.clone().binding(), dtype.into());
    // Both operands read as the left one's type, as Burn's matmul does.
    let rhs = InputBinding::new(rhs.clone().binding(), dtype.into());
    let out = out.clone().binding();
    match kernel {
        DenseKernel::Cubek(strategy) => launch_cubek(strategy, client, lhs, rhs, out, &mut elems),
        DenseKernel::TmaDouble(tiling) => launch_ref_tma::<R, AnyRows<TunedTmaDoubleBuffering>>(
            client,
            lhs,
            rhs,
            out,
            &BlueprintStrategy::Inferred(*tiling),
            &mut elems,
        ),
    }
}

/// One of cubek's strategies, as cubek's `launch_ref` launches it (the same
/// routine, loaders and tile kind), but [`AnyRows`]: the kernels the dense
/// layers use serve every batch's row count. Strategies no list here names
/// launch as cubek launches them.
fn launch_cubek<R: CubeRuntime>(
    strategy: &cubek::matmul::launch::Strategy,
    client: &cubecl::client::ComputeClient<R>,
    lhs: cubek::std::InputBinding<R>,
    rhs: cubek::std::InputBinding<R>,
    out: cubecl::prelude::TensorBinding<R>,
    elems: &mut cubek::matmul::definition::MatmulElems,
) -> Result<(), cubek::matmul::definition::MatmulSetupError> {
    use cubek::matmul::components::tile::TileMatmulKind::{Cmma, Mma};
    use cubek::matmul::launch::Strategy;
    use cubek::matmul::routines::{
        double_buffering::TmaDoubleBufferingAlgorithm,
        simple::{SimpleAlgorithm, SimpleTmaAlgorithm},
        simple_unit::SimpleUnitAlgorithm,
        specialized::SpecializedAlgorithm,
    };

    match strategy {
        Strategy::SimpleUnit(s) => launch_ref::<R, AnyRows<SimpleUnitAlgorithm>>(
            client,
            lhs,
            rhs,
            out,
            &any_rows(s),
            elems,
        ),
        Strategy::SimpleCyclicCmma(s) => {
            let s = stamp(s, |args| args.tile_matmul = Cmma);
            launch_ref::<R, AnyRows<SimpleAlgorithm>>(client, lhs, rhs, out, &s, elems)
        }
        Strategy::SimpleTmaMma(s) => {
            let s = stamp(s, |args| args.tile_matmul = Mma);
            launch_ref_tma::<R, AnyRows<SimpleTmaAlgorithm>>(client, lhs, rhs, out, &s, elems)
        }
        Strategy::SpecializedTmaMma(s) => {
            let s = stamp(s, |args| args.tile_matmul = Mma);
            launch_ref_tma::<R, AnyRows<SpecializedAlgorithm>>(client, lhs, rhs, out, &s, elems)
        }
        Strategy::DoubleTmaMma(s) => {
            let s = stamp(s, |args| args.tile_matmul = Mma);
            launch_ref_tma::<R, AnyRows<TmaDoubleBufferingAlgorithm>>(
                client, lhs, rhs, out, &s, elems,
            )
        }
        other => cubek::matmul::launch::launch_ref(other, client, lhs, rhs, out, elems),
    }
}

/// `strategy` as [`AnyRows`]'s, its inferred options edited by `set` (the
/// tile kind the strategy's name promises, as cubek stamps it).
fn stamp<A>(
    strategy: &BlueprintStrategy<(), A>,
    set: impl FnOnce(&mut A::Strategy),
) -> BlueprintStrategy<(), AnyRows<A>>
where
    A: cubek::matmul::routines::Routine<(), Blueprint = cubek::matmul::definition::TilingBlueprint>,
{
    let mut strategy = any_rows(strategy);
    if let BlueprintStrategy::Inferred(options) = &mut strategy {
        set(options);
    }
    strategy
}
