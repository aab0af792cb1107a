//! Which matmul kernel runs a dense product: a rule, not a search.
//!
//! CubeCL's tuner times every candidate kernel on the first problem of each
//! bucket, compiling each one first. With the eight candidates of
//! [`super::dense_matmul_candidates`] and the ~16 buckets of a training step
//! that was over 270 s of an H200's first f32 step (2026-11-28), again on
//! every node whose kernel cache is empty, and again mid-run whenever a batch
//! brought a new bucket. The rule below is what that tuner chose on an H200
//! (f32 and bf16, the default model; `benches/results/2026-11-28_h200_matmul_plan.txt`
//! compares the two): the products fall
//! into four kinds, and each kind's winners were within a few percent of one
//! another. Every kernel the rule names was checked against a float64 product
//! wherever it runs, and each list ends with the unit kernel, which runs
//! everywhere: a kernel that cannot take the device or the operands (TMA
//! before Hopper, tensor cores absent) refuses before launching, and the next
//! in the list runs.

use std::sync::atomic::{AtomicU8, Ordering};

use burn::tensor::DType;
use cubek::matmul::components::tile::TileMatmulKind::{Cmma, Mma};
use cubek::matmul::launch::Strategy;
use cubek::matmul::routines::{
    double_buffering::DoubleBufferingArgs, simple::SimpleArgs, BlueprintStrategy::Inferred,
};

use super::{DenseKernel, TmaTiling};

/// How the dense layers' products pick their kernel on the CubeCL backends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulTuning {
    /// [`dense_matmul_plan`]: no timing runs; a GPU's first step compiles one
    /// kernel per product.
    #[default]
    Plan,
    /// CubeCL's tuner times every candidate once per problem bucket and keeps
    /// the winners in its on-disk cache: minutes on a GPU's first run, and
    /// again for each new bucket.
    Autotune,
}

static TUNING: AtomicU8 = AtomicU8::new(0);

/// Sets how the dense products pick their kernel, for the whole process (the
/// products are reached from deep inside the model, where no run option is
/// at hand). Programs call it once, from their configuration, before the
/// first step.
pub fn set_matmul_tuning(tuning: MatmulTuning) {
    TUNING.store(tuning as u8, Ordering::Relaxed);
}

pub(crate) fn matmul_tuning() -> MatmulTuning {
    match TUNING.load(Ordering::Relaxed) {
        0 => MatmulTuning::Plan,
        _ => MatmulTuning::Autotune,
    }
}

/// A dense product `[m, k]·[k, n]` (batched or not) as the rule sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub dtype: DType,
}

/// Rows from which a product counts as token-sized: the ASV level's rows
/// (every nucleotide of every ASV of the batch; ~300,000 at the reference's
/// batch) rather than the sample level's (batch × ASV slots, ~8,000).
const TOKEN_ROWS: usize = 65_536;

/// Widths below this leave tensor-core stages mostly empty.
const NARROW: usize = 64;

/// The kernels for `shape`, in the order they are tried: the first that
/// accepts the device and operands runs.
///
/// The kinds, with what CubeCL's tuner measured on an H200 (2026-11-28):
/// - *weight gradients* (`xᵀ·dy`: the inner size is the rows, the output a
///   weight's shape): `specialized_tma_mma` won 15 of 18 buckets and was
///   within 8% in the other three;
/// - *token-sized, f32*: the `256 × 128` TMA stage ([`TmaTiling`]) won 5
///   of 7 (0.42 ms in the bucket of `[~300k, 128]·[128, 512]` against
///   0.49 ms for the next kernel);
/// - *token-sized, f16/bf16*: `double_tma_mma` won 3 of 7 and was within 3%
///   of the winner in two more;
/// - *narrow* (a width under 64): `simple_tma_mma`;
/// - the rest (the sample level): `specialized_tma_mma`, falling back to
///   `simple_cyclic_cmma` without TMA.
pub fn dense_matmul_plan(shape: &MatmulShape) -> Vec<DenseKernel> {
    let simple = |tile_matmul, multi_rows| SimpleArgs {
        multi_rows,
        tile_matmul,
    };
    let specialized = DenseKernel::Cubek(Strategy::SpecializedTmaMma(Inferred(().into())));
    let simple_tma = DenseKernel::Cubek(Strategy::SimpleTmaMma(Inferred(simple(Mma, false))));
    let double_tma = DenseKernel::Cubek(Strategy::DoubleTmaMma(Inferred(DoubleBufferingArgs {
        tile_matmul: Mma,
        specialized: false,
    })));
    let wide_stage = DenseKernel::TmaDouble(TmaTiling::WIDE_STAGE);
    let cyclic_cmma = DenseKernel::Cubek(Strategy::SimpleCyclicCmma(Inferred(simple(Cmma, false))));
    let unit = DenseKernel::Cubek(Strategy::SimpleUnit(Inferred(Default::default())));

    let MatmulShape { m, n, k, dtype } = *shape;
    let half = matches!(dtype, DType::F16 | DType::BF16);
    let weight_gradient = k >= 4 * m.max(n);
    let mut plan = if m < NARROW {
        vec![]
    } else if weight_gradient {
        vec![specialized]
    } else if n < NARROW || k < NARROW {
        vec![simple_tma]
    } else if m >= TOKEN_ROWS && half {
        vec![double_tma, specialized]
    } else if m >= TOKEN_ROWS {
        vec![wide_stage, double_tma, specialized]
    } else {
        vec![specialized]
    };
    plan.extend([cyclic_cmma, unit]);
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn first(m: usize, n: usize, k: usize, dtype: DType) -> String {
        dense_matmul_plan(&MatmulShape { m, n, k, dtype })[0].to_string()
    }

    /// The kinds of the default model's products (embedding 128, feed-forward
    /// 512, the reference's batch), and the unit kernel last everywhere.
    #[test]
    fn plan_per_kind() {
        let tokens = 302_000;
        assert_eq!(
            first(tokens, 512, 128, DType::F32),
            TmaTiling::WIDE_STAGE.to_string()
        );
        assert_eq!(
            first(tokens, 512, 128, DType::BF16),
            "matmul_double_tma_mma"
        );
        assert_eq!(first(tokens, 16, 128, DType::F32), "matmul_simple_tma_mma");
        assert_eq!(
            first(128, 512, 2048, DType::F32),
            "matmul_specialized_tma_mma"
        );
        assert_eq!(
            first(8192, 128, 128, DType::F32),
            "matmul_specialized_tma_mma"
        );
        assert_eq!(
            first(16, 128, 2048, DType::F32),
            "matmul_simple_cyclic_cmma"
        );
        for m in [1, 16, 8192, tokens] {
            let plan = dense_matmul_plan(&MatmulShape {
                m,
                n: 128,
                k: 512,
                dtype: DType::F32,
            });
            assert_eq!(
                plan.last().unwrap().to_string(),
                "matmul_simple_unit_max_tile_size"
            );
        }
    }

    /// The plan only names kernels that `kernels/tests/matmul_kernels.rs`
    /// checks (the candidates).
    #[test]
    fn plan_names_only_validated_kernels() {
        let validated: Vec<String> = super::super::dense_matmul_candidates()
            .iter()
            .map(ToString::to_string)
            .collect();
        for m in [1, 100, 8192, 300_000] {
            for (n, k) in [(16, 128), (128, 16), (128, 512), (512, 128), (128, 4096)] {
                for dtype in [DType::F32, DType::F16, DType::BF16] {
                    for kernel in dense_matmul_plan(&MatmulShape { m, n, k, dtype }) {
                        assert!(validated.contains(&kernel.to_string()), "{kernel}");
                    }
                }
            }
        }
    }
}
