//! CubeCL's TMA double-buffered matmul with its stage shape chosen here.
//!
//! Why: cubek infers one stage shape from the problem, and for f32 on TF32
//! tensor cores (`16 × 8 × 8` tiles) that is a `128 × 64` output block
//! (8 "rows" in cubek's terms: four planes of two 16-row tiles by eight
//! 8-column tiles) 32 deep, or `64 × 32` where a contiguous right operand
//! limits the shared-memory swizzle to 128 bytes a row. At AAM's tall,
//! narrow products (302,000 token rows against widths of 128-512) those
//! kernels run at ~40% of the H100's bandwidth (`docs/performance.md`). This
//! module is cubek's own routine — the same batch, global, stage and tile
//! matmuls and TMA loaders as `Strategy::DoubleTmaMma` — whose blueprint
//! is inferred from options set here ([`TmaTiling`]), so that other stage
//! shapes can be timed and listed among the autotune candidates.
//!
//! How cubek's options map to a stage (f32, `16 × 8 × 8` tiles): with
//! `planes = p` and `rows_per_plane = r`, a stage is `16·p` rows by `8·p`
//! columns computed by `p / r` planes, each `16·r × 8·p` of it; the stage's
//! depth is `8 · partition_k`. Swizzling halves the columns (and the
//! planes) until a contiguous right operand's stage row fits 128 bytes.

use std::fmt;

use cubecl::Runtime;
use cubek::matmul::components::batch::{
    BatchMatmulFamily, PartitionedBatchMatmulFamily, RowMajorGlobalPartitionMatmul,
};
use cubek::matmul::components::global::multi_stage::double_buffering::DoubleBufferingMatmulFamily;
use cubek::matmul::components::global::read::{
    async_full_tma::AsyncFullTmaLoading, async_partial_tma::AsyncPartialTmaLoading,
};
use cubek::matmul::components::global::PlaneWriterFamily;
use cubek::matmul::components::stage::{PlaneMatmulFamily, StridedStageFamily};
use cubek::matmul::components::tile::TileMatmulKind;
use cubek::matmul::definition::{
    adjust_dtypes, MatmulElems, MatmulProblem, MatmulSetupError, MultiRowStrategy, TilingBlueprint,
};
use cubek::matmul::routines::{
    infer_blueprint_plane, BlueprintStrategy, DeviceSettings, ExpandInfo, LaunchInfo,
    PlaneTilingBlueprintOptions, Routine,
};

/// A stage shape for [`TunedTmaDoubleBuffering`]; `None` leaves a choice to
/// cubek's inference (all `None` and `swizzled` is `Strategy::DoubleTmaMma`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TmaTiling {
    /// cubek's `row_count`: a stage of `16·p × 8·p` outputs.
    pub planes: Option<u32>,
    /// 16-row tiles each plane computes (`p / r` planes a cube).
    pub rows_per_plane: Option<u32>,
    /// 8-deep tiles a stage holds along the inner dimension.
    pub partition_k: Option<u32>,
    /// Swizzled shared memory (cubek's default for `mma` tiles), which
    /// caps a stage row at 128 bytes.
    pub swizzled: bool,
    /// Planes that only load (TMA issue) beside the ones that compute.
    pub specialized: bool,
}

impl TmaTiling {
    /// A `256 × 128` stage (eight planes of `32 × 128`) beside planes that
    /// only issue the TMA loads: at 302,000 rows (H100, 2026-11-27)
    /// 0.87-1.01x the time of the best of cubek's inferred tilings on the
    /// dense layers' forward and input-gradient products (`[128→512]` 570
    /// against 653 µs).
    pub const WIDE_STAGE: TmaTiling = TmaTiling {
        planes: Some(16),
        rows_per_plane: Some(2),
        partition_k: Some(4),
        swizzled: false,
        specialized: true,
    };
}

impl Default for TmaTiling {
    fn default() -> Self {
        Self {
            planes: None,
            rows_per_plane: None,
            partition_k: None,
            swizzled: true,
            specialized: false,
        }
    }
}

impl fmt::Display for TmaTiling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let or_auto = |v: Option<u32>| v.map_or("auto".to_string(), |v| v.to_string());
        write!(
            f,
            "tma_double_p{}_r{}_k{}",
            or_auto(self.planes),
            or_auto(self.rows_per_plane),
            or_auto(self.partition_k)
        )?;
        if !self.swizzled {
            f.write_str("_unswizzled")?;
        }
        if self.specialized {
            f.write_str("_specialized")?;
        }
        Ok(())
    }
}

/// cubek's TMA double-buffered routine (`TmaDoubleBufferingAlgorithm`, `mma`
/// tiles) with the blueprint inferred from a [`TmaTiling`].
pub struct TunedTmaDoubleBuffering;

impl Routine<()> for TunedTmaDoubleBuffering {
    type Strategy = TmaTiling;
    type BatchMatmul = PartitionedBatchMatmulFamily<
        (),
        DoubleBufferingMatmulFamily<
            PlaneMatmulFamily<StridedStageFamily, StridedStageFamily, Option<StridedStageFamily>>,
            (),
            AsyncPartialTmaLoading,
            AsyncPartialTmaLoading,
            AsyncFullTmaLoading,
            PlaneWriterFamily,
        >,
        RowMajorGlobalPartitionMatmul,
    >;
    type Blueprint = TilingBlueprint;
    type Config = <Self::BatchMatmul as BatchMatmulFamily<()>>::Config;

    fn expand_blueprint<R: Runtime>(
        problem: &MatmulProblem,
        device_settings: &DeviceSettings<R>,
        strategy: &BlueprintStrategy<(), Self>,
    ) -> Result<ExpandInfo<TilingBlueprint>, MatmulSetupError> {
        let tile_matmul = TileMatmulKind::Mma;
        let client = &device_settings.client;
        let mut dtypes = MatmulElems::from_globals(&problem.global_dtypes);
        dtypes.adjust_stage_dtypes();
        let tiling = match strategy {
            BlueprintStrategy::Forced(blueprint) => {
                // f32 operands on TF32 tiles, as the inference sets them.
                adjust_dtypes(client, &mut dtypes, true);
                return Ok(ExpandInfo {
                    blueprint: blueprint.clone(),
                    dtypes,
                });
            }
            BlueprintStrategy::Inferred(tiling) => tiling,
        };
        let (blueprint, dtypes) = infer_blueprint_plane::<R>(
            tile_matmul,
            client,
            problem,
            device_settings.plane_dim,
            dtypes,
            &device_settings.vector_sizes,
            PlaneTilingBlueprintOptions {
                row_count: tiling.planes,
                partition_k: tiling.partition_k,
                specialized: tiling.specialized,
                multi_row_strategy: match tiling.rows_per_plane {
                    Some(rows) => MultiRowStrategy::Always(rows),
                    None => MultiRowStrategy::Adaptive {
                        minimum_stage_count: 8,
                    },
                },
                swizzled: tiling.swizzled && tile_matmul.should_swizzle(client),
                ..Default::default()
            },
        )?;
        Ok(ExpandInfo { blueprint, dtypes })
    }

    fn prepare<R: Runtime>(
        problem: &MatmulProblem,
        device_settings: &DeviceSettings<R>,
        expand_info: ExpandInfo<TilingBlueprint>,
    ) -> Result<LaunchInfo<TilingBlueprint>, MatmulSetupError> {
        let ExpandInfo { blueprint, dtypes } = expand_info;
        Self::validate_blueprint(
            &device_settings.client,
            &blueprint,
            problem,
            &dtypes,
            &device_settings.vector_sizes,
        )?;
        let cubedim_resource = Self::BatchMatmul::cubedim_resource(
            &blueprint,
            &dtypes,
            &device_settings.vector_sizes,
        )?;
        LaunchInfo::new(
            blueprint,
            dtypes,
            problem,
            cubedim_resource,
            device_settings,
        )
    }
}
