//! The dense layers' products on CubeCL ([`DenseOps::dense_matmul`]:
//! autotuned over a list of validated kernels, not over all of Burn's
//! candidates) against a float64 product, at the layouts the dense backward
//! makes: transposed views on either side, batched parts, and leftover rows
//! as a view into the middle of a buffer; and each kernel of that list
//! ([`aam_kernels::dense_matmul_candidates`]) on its own, wherever it runs.
//!
//! On CUDA (the device machine) two more tests: each listed kernel over 64
//! consecutive inner sizes (one of Burn's candidates is wrong at one residue
//! modulo 64), and every candidate of Burn's matmul autotune on AAM's
//! weight-gradient shapes, printing each one's error and time: the table
//! behind the list (`docs/performance.md`, 2026-11-26).
//!
//! Runs on CUDA when built with `--features cuda`, else on wgpu: in CI
//! through Mesa's lavapipe (a CPU Vulkan driver, where the unit kernel runs).

use crate::common::Rng;
use aam_kernels::DenseOps;
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn_cubecl::CubeBackend;
#[cfg(feature = "cuda")]
use cubecl::cuda::CudaRuntime as Runtime;
#[cfg(not(feature = "cuda"))]
use cubecl::wgpu::WgpuRuntime as Runtime;

type B = CubeBackend<Runtime, f32, i32, u32>;

/// CUDA's f32 matmuls run on TF32 tensor cores (~1e-3); lavapipe in f32.
#[cfg(feature = "cuda")]
const RTOL: f64 = 1e-2;
#[cfg(not(feature = "cuda"))]
const RTOL: f64 = 1e-5;

/// Standard normal values from a seed.
fn draw(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..len).map(|_| rng.normal()).collect()
}

/// `[b, r, c]` holding `values` (row-major), stored as `[b, c, r]` and
/// viewed transposed when `transposed`.
fn tensor(values: &[f32], [b, r, c]: [usize; 3], transposed: bool) -> Tensor<B, 3> {
    let device = Default::default();
    if !transposed {
        return Tensor::from_data(TensorData::new(values.to_vec(), [b, r, c]), &device);
    }
    let mut stored = vec![0f32; values.len()];
    for (i, v) in values.iter().enumerate() {
        let (bi, ri, ci) = (i / (r * c), i / c % r, i % c);
        stored[bi * r * c + ci * r + ri] = *v;
    }
    Tensor::<B, 3>::from_data(TensorData::new(stored, [b, c, r]), &device).swap_dims(1, 2)
}

/// `lhs·rhs` in float64 (row-major `[b, m, k]` and `[b, k, n]`).
fn reference(lhs: &[f32], rhs: &[f32], [b, m, k, n]: [usize; 4]) -> Vec<f64> {
    let mut out = vec![0f64; b * m * n];
    for bi in 0..b {
        for i in 0..m {
            for l in 0..k {
                let a = lhs[(bi * m + i) * k + l] as f64;
                for j in 0..n {
                    out[(bi * m + i) * n + j] += a * rhs[(bi * k + l) * n + j] as f64;
                }
            }
        }
    }
    out
}

/// Largest absolute error over the largest reference value.
fn rel(got: &[f32], want: &[f64]) -> f64 {
    let (mut err, mut scale) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        err = err.max((*g as f64 - w).abs());
        scale = scale.max(w.abs());
    }
    err / scale.max(1e-30)
}

fn dense_matmul(lhs: Tensor<B, 3>, rhs: Tensor<B, 3>) -> Vec<f32> {
    let out = B::dense_matmul(lhs.into_primitive().tensor(), rhs.into_primitive().tensor());
    Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out))
        .into_data()
        .to_vec::<f32>()
        .expect("f32")
}

#[test]
fn dense_products_equal_a_float64_product_in_every_layout() {
    // `[b, m, k, n]`: the forward's shapes where `double_unit` goes wrong
    // with a transposed right operand, a weight gradient's batched parts, and
    // inner sizes 32 more than a multiple of 64 (`specialized_cyclic` with a
    // transposed left operand on CUDA).
    let shapes = [
        [1, 1000, 24, 16],
        [1, 7, 1000, 128],
        [1, 128, 1000, 7],
        [3, 16, 256, 24],
        [1, 24, 96, 40],
        [1, 40, 608, 16],
    ];
    for [b, m, k, n] in shapes {
        let (lhs, rhs) = (draw(b * m * k, 1), draw(b * k * n, 2));
        let want = reference(&lhs, &rhs, [b, m, k, n]);
        for (lhs_t, rhs_t) in [(false, false), (true, false), (false, true), (true, true)] {
            let got = dense_matmul(
                tensor(&lhs, [b, m, k], lhs_t),
                tensor(&rhs, [b, k, n], rhs_t),
            );
            let err = rel(&got, &want);
            assert!(
                err <= RTOL,
                "[{b}, {m}, {k}]·[{b}, {k}, {n}], lhs transposed {lhs_t}, rhs transposed {rhs_t}: rel err {err:e}"
            );
        }
    }
}

/// `lhs·rhs` on one kernel; `None` where it cannot run on this device and
/// these operands (CubeCL's own check: no tensor cores on lavapipe, no TMA
/// before sm_90, strides TMA cannot take).
fn launched(
    strategy: &aam_kernels::DenseKernel,
    lhs: Tensor<B, 3>,
    rhs: Tensor<B, 3>,
) -> Option<Vec<f32>> {
    let [b, m, _] = lhs.dims();
    let n = rhs.dims()[2];
    let out = Tensor::<B, 3>::zeros([b, m, n], &Default::default())
        .into_primitive()
        .tensor();
    let (lhs, rhs) = (lhs.into_primitive().tensor(), rhs.into_primitive().tensor());
    aam_kernels::launch_matmul(strategy, &lhs, &rhs, &out).ok()?;
    Some(
        Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out))
            .into_data()
            .to_vec::<f32>()
            .expect("f32"),
    )
}

#[test]
fn every_listed_kernel_equals_a_float64_product_where_it_runs() {
    let shapes = [[1, 1000, 24, 16], [3, 16, 256, 24], [1, 40, 608, 16]];
    let mut ran = 0;
    for strategy in aam_kernels::dense_matmul_candidates() {
        for [b, m, k, n] in shapes {
            let (lhs, rhs) = (draw(b * m * k, 5), draw(b * k * n, 6));
            let want = reference(&lhs, &rhs, [b, m, k, n]);
            for (lhs_t, rhs_t) in [(false, false), (true, false), (false, true), (true, true)] {
                let lhs = tensor(&lhs, [b, m, k], lhs_t);
                let Some(got) = launched(&strategy, lhs, tensor(&rhs, [b, k, n], rhs_t)) else {
                    continue;
                };
                ran += 1;
                let err = rel(&got, &want);
                assert!(
                    err <= RTOL,
                    "{strategy}: [{b}, {m}, {k}]·[{b}, {k}, {n}], lhs transposed {lhs_t}, \
                     rhs transposed {rhs_t}: rel err {err:e}"
                );
            }
        }
    }
    // The unit kernel runs everywhere: at least its 12 products.
    assert!(ran >= 12, "only {ran} products ran");
}

/// Each listed kernel at `[128, k]ᵀ·[k, 512]`-like products for 64
/// consecutive inner sizes `k`, in the three layouts with a transposed view,
/// against CubeCL's naive kernel: `specialized_cyclic` (not listed) is wrong
/// at `k ≡ 32 (mod 64)` with a transposed left operand, and
/// `double_cyclic_mma` (specialized; listed until this test caught it) at
/// `k = 1952` with a transposed right operand.
#[cfg(feature = "cuda")]
#[test]
fn listed_kernels_over_inner_sizes_modulo_64() {
    use cubek::matmul::launch::Strategy;
    let (m, n) = (128, 512);
    let mut failures = Vec::new();
    for k in 1920..1984 {
        let (lhs, rhs) = (draw(m * k, k as u64), draw(k * n, k as u64 + 1));
        for (lhs_t, rhs_t) in [(true, false), (false, true), (true, true)] {
            let operands = || {
                (
                    tensor(&lhs, [1, m, k], lhs_t),
                    tensor(&rhs, [1, k, n], rhs_t),
                )
            };
            let (a, b) = operands();
            let want: Vec<f64> = launched(&Strategy::Naive.into(), a, b)
                .expect("naive runs")
                .iter()
                .map(|v| *v as f64)
                .collect();
            for strategy in aam_kernels::dense_matmul_candidates() {
                let (a, b) = operands();
                if let Some(got) = launched(&strategy, a, b) {
                    let err = rel(&got, &want);
                    if err > RTOL {
                        failures.push(format!(
                            "{strategy} k {k} lhsT {lhs_t} rhsT {rhs_t}: {err:.1e}"
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "wrong products: {failures:#?}");
}

#[test]
fn leftover_rows_as_a_view_into_the_buffer() {
    // The dense backward's leftover rows: `dyᵀ·x` over rows [split, rows) of
    // two `[rows, width]` buffers, the left side a transposed view at an offset.
    let (rows, split, p, q) = (2 * 64 + 96, 128, 24, 40);
    let (dy, x) = (draw(rows * p, 3), draw(rows * q, 4));
    let device = Default::default();
    let dy_t = Tensor::<B, 2>::from_data(TensorData::new(dy.clone(), [rows, p]), &device);
    let x_t = Tensor::<B, 2>::from_data(TensorData::new(x.clone(), [rows, q]), &device);
    let lhs = dy_t
        .narrow(0, split, rows - split)
        .transpose()
        .unsqueeze::<3>();
    let rhs = x_t.narrow(0, split, rows - split).unsqueeze::<3>();
    let tail = rows - split;
    let mut dy_tail_t = vec![0f32; p * tail];
    for r in 0..tail {
        for c in 0..p {
            dy_tail_t[c * tail + r] = dy[(split + r) * p + c];
        }
    }
    let want = reference(&dy_tail_t, &x[split * q..], [1, p, tail, q]);
    let err = rel(&dense_matmul(lhs, rhs), &want);
    assert!(err <= RTOL, "leftover rows: rel err {err:e}");
}

/// Every candidate of Burn's matmul autotune, and the validated list, on the
/// dense weight gradient's products at AAM's ASV level (`AAM_ROWS`: row
/// counts, default batch 7's 53,152 and three others; widths 128 and 512),
/// against CubeCL's naive kernel. Prints one line per product; fails if the
/// validated list is wrong.
#[cfg(feature = "cuda")]
#[test]
fn autotune_candidates_at_aam_shapes() {
    use cubek::matmul::components::tile::TileMatmulKind::{self, Cmma, Mma};
    use cubek::matmul::launch::Strategy;
    use cubek::matmul::routines::{
        double_buffering::DoubleBufferingArgs, double_unit::DoubleUnitSelectionArgs,
        ordered_double_buffering::OrderedSelectionArgs, simple::SimpleArgs,
        simple_unit::SimpleUnitSelectionArgs, BlueprintStrategy, TileSizeSelection,
    };
    use BlueprintStrategy::Inferred;

    let mut candidates = vec![Strategy::Naive];
    for tile_size in [
        TileSizeSelection::MaxTileSize,
        TileSizeSelection::MinTileSize,
    ] {
        candidates.push(Strategy::SimpleUnit(Inferred(SimpleUnitSelectionArgs {
            tile_size,
        })));
        candidates.push(Strategy::DoubleUnit(Inferred(DoubleUnitSelectionArgs {
            tile_size,
        })));
    }
    let tiles: [TileMatmulKind; 2] = [Cmma, Mma];
    for tile_matmul in tiles {
        let pick = |cmma: Strategy, mma: Strategy| if tile_matmul == Cmma { cmma } else { mma };
        for multi_rows in [false, true] {
            let a = SimpleArgs {
                multi_rows,
                tile_matmul,
            };
            candidates.push(pick(
                Strategy::SimpleCyclicCmma(Inferred(a.clone())),
                Strategy::SimpleCyclicMma(Inferred(a.clone())),
            ));
            candidates.push(pick(
                Strategy::SimpleTmaCmma(Inferred(a.clone())),
                Strategy::SimpleTmaMma(Inferred(a)),
            ));
        }
        for row_count in [4, 8] {
            let a = OrderedSelectionArgs {
                partition_k: Some(2),
                row_count: Some(row_count),
                rows_per_plane: Some(2),
                tile_matmul,
            };
            candidates.push(pick(
                Strategy::OrderedDoubleCmma(Inferred(a.clone())),
                Strategy::OrderedDoubleMma(Inferred(a)),
            ));
        }
        for specialized in [false, true] {
            let a = DoubleBufferingArgs {
                specialized,
                tile_matmul,
            };
            candidates.push(pick(
                Strategy::DoubleCyclicCmma(Inferred(a.clone())),
                Strategy::DoubleCyclicMma(Inferred(a.clone())),
            ));
            candidates.push(pick(
                Strategy::DoubleTmaCmma(Inferred(a.clone())),
                Strategy::DoubleTmaMma(Inferred(a)),
            ));
        }
        candidates.push(pick(
            Strategy::SpecializedCyclicCmma(Inferred(().into())),
            Strategy::SpecializedCyclicMma(Inferred(().into())),
        ));
        candidates.push(pick(
            Strategy::SpecializedTmaCmma(Inferred(().into())),
            Strategy::SpecializedTmaMma(Inferred(().into())),
        ));
    }
    // `AAM_MATMUL_BRIEF`: only the TMA kernels with `mma` tiles (the fastest
    // at these shapes).
    if std::env::var_os("AAM_MATMUL_BRIEF").is_some() {
        candidates.retain(|s| {
            matches!(
                s,
                Strategy::Naive
                    | Strategy::SimpleTmaMma(_)
                    | Strategy::SpecializedTmaMma(_)
                    | Strategy::DoubleTmaMma(_)
            )
        });
    }
    let mut candidates: Vec<aam_kernels::DenseKernel> =
        candidates.into_iter().map(Into::into).collect();
    // `AAM_MATMUL_TILINGS`: CubeCL's TMA double-buffered kernel with other
    // stage shapes than it infers (`aam_kernels::TmaTiling`: a stage of
    // `16·p × 8·p` outputs, `r` 16-row tiles a plane, `8·k` deep), each
    // `p,r,k,swizzled,specialized` (0/1) with `;` between, or `1` for a
    // list of twelve.
    let listed = match std::env::var("AAM_MATMUL_TILINGS").unwrap_or_default() {
        one if one == "1" => "8,2,4,0,0;8,1,4,1,0;8,1,4,0,0;8,2,2,0,0;8,2,8,0,0;4,1,4,0,0;\
                              16,1,4,0,0;16,2,4,0,0;16,2,2,0,0;16,4,2,0,0;8,1,4,0,1;16,2,4,0,1"
            .to_string(),
        other => other,
    };
    for item in listed.split(';').filter(|item| !item.is_empty()) {
        let v: Vec<u32> = item
            .split(',')
            .map(|x| {
                x.trim()
                    .parse()
                    .expect("AAM_MATMUL_TILINGS: p,r,k,swizzled,specialized")
            })
            .collect();
        assert_eq!(
            v.len(),
            5,
            "AAM_MATMUL_TILINGS: p,r,k,swizzled,specialized, not {item:?}"
        );
        candidates.push(aam_kernels::DenseKernel::TmaDouble(
            aam_kernels::TmaTiling {
                planes: Some(v[0]),
                rows_per_plane: Some(v[1]),
                partition_k: Some(v[2]),
                swizzled: v[3] == 1,
                specialized: v[4] == 1,
            },
        ));
    }
    // One candidate's output and mean time over 5 launches (µs), if it runs.
    let run = |strategy: &aam_kernels::DenseKernel, lhs: &Tensor<B, 3>, rhs: &Tensor<B, 3>| {
        let [b, m, _] = lhs.dims();
        let n = rhs.dims()[2];
        let (lhs, rhs) = (
            lhs.clone().into_primitive().tensor(),
            rhs.clone().into_primitive().tensor(),
        );
        let out = Tensor::<B, 3>::zeros([b, m, n], &Default::default())
            .into_primitive()
            .tensor();
        aam_kernels::launch_matmul(strategy, &lhs, &rhs, &out).ok()?;
        let got = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(out.clone()))
            .into_data()
            .to_vec::<f32>()
            .expect("f32");
        let start = std::time::Instant::now();
        for _ in 0..5 {
            aam_kernels::launch_matmul(strategy, &lhs, &rhs, &out).ok()?;
        }
        <B as burn::tensor::backend::Backend>::sync(&Default::default()).expect("sync");
        Some((got, start.elapsed().as_secs_f64() / 5.0 * 1e6))
    };
    let rows_list: Vec<usize> = std::env::var("AAM_ROWS")
        .map(|v| {
            v.split(',')
                .map(|r| r.parse().expect("AAM_ROWS: row counts"))
                .collect()
        })
        .unwrap_or(vec![53152, 60000, 47000, 62967]);
    let device = Default::default();
    // `AAM_MATMUL_PRODUCTS=rows`: the forward and input-gradient products
    // (`x·wᵀ` with the weight as a transposed view, `dy·w`) at the dense
    // layers' widths instead of the weight gradients.
    if std::env::var("AAM_MATMUL_PRODUCTS").as_deref() == Ok("rows") {
        for (i, &rows) in rows_list.iter().enumerate() {
            for (k, n) in [(128, 384), (128, 512), (512, 128), (128, 128), (384, 128)] {
                let seed = 20 * i as u64;
                let x = Tensor::<B, 2>::from_data(
                    TensorData::new(draw(rows * k, seed), [rows, k]),
                    &device,
                );
                let w = Tensor::<B, 2>::from_data(
                    TensorData::new(draw(n * k, seed + 1), [n, k]),
                    &device,
                );
                // The forward's view, and the input gradient's contiguous
                // right operand of the same shape.
                let wt = w.transpose();
                let contiguous = wt.clone().reshape([n * k]).reshape([k, n]);
                for (what, rhs) in [("x·wᵀ (view)", wt), ("x·w (contiguous)", contiguous)] {
                    let (lhs, rhs) = (x.clone().unsqueeze::<3>(), rhs.unsqueeze::<3>());
                    let want = run(&Strategy::Naive.into(), &lhs, &rhs)
                        .expect("naive runs")
                        .0;
                    let want: Vec<f64> = want.iter().map(|v| *v as f64).collect();
                    let validated = rel(&dense_matmul(lhs.clone(), rhs.clone()), &want);
                    let mut line =
                        format!("rows {rows}, [{k}→{n}] {what}: validated {validated:.1e}");
                    for strategy in &candidates[1..] {
                        if let Some((got, us)) = run(strategy, &lhs, &rhs) {
                            line += &format!(" | {strategy} {:.1e} {us:.0}us", rel(&got, &want));
                        }
                    }
                    println!("{line}");
                    assert!(validated <= RTOL, "{line}");
                }
            }
        }
        return;
    }
    for (i, &rows) in rows_list.iter().enumerate() {
        for (p, q) in [(128, 512), (512, 128)] {
            let seed = 10 * i as u64;
            let dy = Tensor::<B, 2>::from_data(
                TensorData::new(draw(rows * p, seed), [rows, p]),
                &device,
            );
            let x = Tensor::<B, 2>::from_data(
                TensorData::new(draw(rows * q, seed + 1), [rows, q]),
                &device,
            );
            let (parts, split) = (rows / 2048, rows / 2048 * 2048);
            let products = [
                (
                    format!("{parts} parts"),
                    dy.clone()
                        .narrow(0, 0, split)
                        .reshape([parts, 2048, p])
                        .swap_dims(1, 2),
                    x.clone().narrow(0, 0, split).reshape([parts, 2048, q]),
                ),
                (
                    format!("leftover {}", rows - split),
                    dy.clone()
                        .narrow(0, split, rows - split)
                        .transpose()
                        .unsqueeze::<3>(),
                    x.clone().narrow(0, split, rows - split).unsqueeze::<3>(),
                ),
            ];
            for (what, lhs, rhs) in products {
                let want = run(&Strategy::Naive.into(), &lhs, &rhs)
                    .expect("naive runs")
                    .0;
                let want: Vec<f64> = want.iter().map(|v| *v as f64).collect();
                let validated = rel(&dense_matmul(lhs.clone(), rhs.clone()), &want);
                let mut line = format!("rows {rows}, [{p}x{q}] {what}: validated {validated:.1e}");
                for strategy in &candidates[1..] {
                    if let Some((got, us)) = run(strategy, &lhs, &rhs) {
                        line += &format!(" | {strategy} {:.1e} {us:.0}us", rel(&got, &want));
                    }
                }
                println!("{line}");
                assert!(validated <= RTOL, "{line}");
            }
        }
    }
}
