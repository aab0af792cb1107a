//! One compiled matmul kernel for every row count of a product.
//!
//! cubek bakes into each kernel, as compile-time values, whether the rows
//! (`m`) and the inner size (`k`) are multiples of its stage: where they
//! are, the loads and stores skip their bounds checks. The dense layers'
//! row count is the batch's (tokens at the ASV level, samples × ASV slots at
//! the sample level), so a training epoch or a service answering requests of
//! every size flips those flags batch after batch, and every flip is a new
//! kernel to compile: 47 cubek kernels, 85 s, in the first epoch of oral2550
//! on an H200 (2026-11-28), against 15 in one step. The weight gradients
//! (`xᵀ·dy`) carry the rows in `k`; the other products in `m`. The widths
//! (`n`, and `k` outside the weight gradients) are the model's and never
//! change, so their flags stay as cubek infers them.
//!
//! [`AnyRows`] is a cubek routine that is another routine with the `m` and
//! `k` checks always on: the same kernel code cubek runs for a problem whose
//! sizes are not multiples of the stage, which is right for every size. The
//! tiling cubek infers still depends on the rows where a problem is small
//! (a few hundred rows: fewer tiles a plane, narrower instructions), so the
//! kernels of a product are a handful, not one per batch.

use std::marker::PhantomData;

use cubecl::prelude::*;
use cubek::matmul::components::stage::NumStages;
use cubek::matmul::definition::{
    MatmulElems, MatmulProblem, MatmulSetupError, MatmulVectorSizes, TilingBlueprint,
};
use cubek::matmul::routines::{BlueprintStrategy, DeviceSettings, ExpandInfo, LaunchInfo, Routine};

/// The routine `A` with its blueprint's `m` and `k` bounds checks on.
pub(super) struct AnyRows<A>(PhantomData<A>);

/// `A`'s launch choice as [`AnyRows`]'s (the same options or blueprint).
pub(super) fn any_rows<A: Routine<()>>(
    strategy: &BlueprintStrategy<(), A>,
) -> BlueprintStrategy<(), AnyRows<A>>
where
    AnyRows<A>: Routine<(), Strategy = A::Strategy, Blueprint = A::Blueprint>,
{
    match strategy {
        BlueprintStrategy::Forced(blueprint) => BlueprintStrategy::Forced(blueprint.clone()),
        BlueprintStrategy::Inferred(options) => BlueprintStrategy::Inferred(options.clone()),
    }
}

impl<A> Routine<()> for AnyRows<A>
where
    A: Routine<(), Blueprint = TilingBlueprint>,
{
    type Strategy = A::Strategy;
    type Blueprint = TilingBlueprint;
    type Config = A::Config;
    type BatchMatmul = A::BatchMatmul;

    fn expand_blueprint<R: Runtime>(
        problem: &MatmulProblem,
        device_settings: &DeviceSettings<R>,
        strategy: &BlueprintStrategy<(), Self>,
    ) -> Result<ExpandInfo<TilingBlueprint>, MatmulSetupError> {
        let strategy = match strategy {
            BlueprintStrategy::Forced(blueprint) => BlueprintStrategy::Forced(blueprint.clone()),
            BlueprintStrategy::Inferred(options) => BlueprintStrategy::Inferred(options.clone()),
        };
        let mut info = A::expand_blueprint(problem, device_settings, &strategy)?;
        info.blueprint.check_m_bounds = true;
        info.blueprint.check_k_bounds = true;
        Ok(info)
    }

    fn prepare<R: Runtime>(
        problem: &MatmulProblem,
        device_settings: &DeviceSettings<R>,
        expand_info: ExpandInfo<TilingBlueprint>,
    ) -> Result<LaunchInfo<TilingBlueprint>, MatmulSetupError> {
        A::prepare(problem, device_settings, expand_info)
    }

    fn num_stages() -> NumStages {
        A::num_stages()
    }

    fn device_settings<R: Runtime>(
        client: &ComputeClient<R>,
        vector_sizes: MatmulVectorSizes,
    ) -> DeviceSettings<R> {
        A::device_settings(client, vector_sizes)
    }

    fn validate_blueprint<R: Runtime>(
        client: &ComputeClient<R>,
        blueprint: &TilingBlueprint,
        problem: &MatmulProblem,
        dtypes: &MatmulElems,
        vector_sizes: &MatmulVectorSizes,
    ) -> Result<(), MatmulSetupError> {
        A::validate_blueprint(client, blueprint, problem, dtypes, vector_sizes)
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use cubecl::wgpu::WgpuRuntime;
    use cubecl::zspace::{Shape, Strides};
    use cubek::matmul::definition::MatmulGlobalElems;
    use cubek::matmul::routines::simple_unit::SimpleUnitAlgorithm;
    use std::collections::HashSet;

    /// The blueprints (each a compiled kernel) `A` expands to for the
    /// products `[m, k]·[k, n]` over `rows`, the rows in `m`, or in `k` as a
    /// weight gradient's are.
    fn blueprints<A: Routine<(), Blueprint = TilingBlueprint>>(
        rows: std::ops::Range<usize>,
        rows_in_k: bool,
    ) -> HashSet<TilingBlueprint> {
        let client = WgpuRuntime::client(&Default::default());
        let f32_type = f32::as_type_native_unchecked().storage_type();
        let vector_sizes = MatmulVectorSizes {
            lhs: 4,
            rhs: 4,
            out: 4,
        };
        let settings = A::device_settings(&client, vector_sizes);
        rows.map(|rows| {
            let (m, k, n) = if rows_in_k {
                (128, rows, 512)
            } else {
                (rows, 128, 512)
            };
            let problem = MatmulProblem::from_shapes_and_strides(
                Shape::new([m, k]),
                Shape::new([k, n]),
                Shape::new([m, n]),
                Strides::new(&[k, 1]),
                Strides::new(&[n, 1]),
                Strides::new(&[n, 1]),
                MatmulGlobalElems {
                    lhs: f32_type,
                    rhs: f32_type,
                    out: f32_type,
                },
                AddressType::U32,
                None,
                None,
            )
            .expect("a plain problem");
            A::expand_blueprint(
                &problem,
                &settings,
                &BlueprintStrategy::Inferred(Default::default()),
            )
            .expect("the unit kernel takes every f32 problem")
            .blueprint
        })
        .collect()
    }

    /// Over 64 consecutive row counts (a batch's tokens), in `m` and in `k`,
    /// cubek's own unit kernel needs several kernels; [`AnyRows`] one.
    #[test]
    fn one_kernel_for_every_row_count() {
        for rows_in_k in [false, true] {
            let plain = blueprints::<SimpleUnitAlgorithm>(5_100..5_164, rows_in_k);
            let any = blueprints::<AnyRows<SimpleUnitAlgorithm>>(5_100..5_164, rows_in_k);
            assert!(plain.len() > 1, "rows in k {rows_in_k}: {}", plain.len());
            assert_eq!(any.len(), 1, "rows in k {rows_in_k}");
        }
    }
}
