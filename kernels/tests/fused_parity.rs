//! Fused vs math: the CubeCL kernel against the plain-tensor reference on the
//! CPU (ndarray, f32), forward and gradients, on random inputs drawn fresh per
//! case, with random key-padding masks, all-padding rows and one-key rows.
//!
//! Each fallback the plan would not pick on this device (rows split over
//! lanes or head dims in parts, the backward as separate dQ and dK/dV
//! kernels, CUDA cores instead of tensor cores) runs here too, by passing a
//! [`KernelChoice`].
//!
//! Runs on CUDA when built with `--features cuda` (the device machine), else on
//! wgpu: in CI through Mesa's lavapipe (a CPU Vulkan driver).

use crate::common::*;
use aam_kernels::{fused_attention, reference_attention, AttentionDropout, KernelChoice};
use burn::prelude::*;

#[test]
fn lengths_1_7_64_151_and_odd() {
    for (i, &t) in [1usize, 7, 64, 151, 33, 97].iter().enumerate() {
        check(
            &Case::new(100 + i as u64, 3, 2, t, t, 32),
            KernelChoice::AUTO,
        );
    }
}

#[test]
fn sample_level_1024_slots() {
    check(&Case::new(7, 2, 4, 1024, 1024, 32), KernelChoice::AUTO);
}

#[test]
fn head_dims_16_64_128() {
    for (i, &dh) in [16usize, 64, 128].iter().enumerate() {
        check(
            &Case::new(200 + i as u64, 3, 2, 40, 40, dh),
            KernelChoice::AUTO,
        );
    }
}

/// Shared-memory tiles hold quads (four floats): a head dim that is not a
/// multiple of four is zero-padded there.
#[test]
fn head_dims_not_a_multiple_of_four() {
    check(&Case::new(250, 2, 2, 23, 23, 10), KernelChoice::AUTO);
    check(&Case::new(251, 2, 3, 9, 30, 3), KernelChoice::AUTO);
}

#[test]
fn several_batch_and_head_counts_and_cross_lengths() {
    check(&Case::new(300, 1, 1, 5, 5, 32), KernelChoice::AUTO);
    check(&Case::new(301, 5, 8, 17, 17, 16), KernelChoice::AUTO);
    check(&Case::new(302, 4, 3, 9, 70, 32), KernelChoice::AUTO);
}

#[test]
fn dropout_is_reproducible_and_its_backward_uses_the_same_mask() {
    check_dropout(KernelChoice::AUTO);
}

/// dQ, dK and dV with dropout against the math path with the kernels' mask:
/// the ASV level's 151 tokens, cross lengths, and the sample level's 1024
/// slots (7 s on lavapipe).
#[test]
fn dropout_gradients_match_the_math_path() {
    let drop = AttentionDropout {
        prob: 0.2,
        seed: 4321,
    };
    check_dropout_gradients(&Case::new(500, 3, 2, 151, 151, 32), drop);
    check_dropout_gradients(&Case::new(501, 3, 2, 9, 70, 16), drop);
    check_dropout_gradients(&Case::new(502, 2, 4, 1024, 1024, 32), drop);
}

/// The attention dropout mask itself, read out: with `q = k = 0` every
/// probability is `1/T`, and with `v_j` the unit vector `e_j` the output is
/// the mask, `out[i, j] = keep(i, j)·scale/T`. About `p` of the
/// probabilities are dropped overall, per head, per row and per column, and
/// neighbours (next row, next column, next head) are uncorrelated: the
/// hash's one mix round per probability leaves no structure a model could
/// pick up.
#[test]
fn dropout_mask_drops_about_p_without_structure() {
    let (n, h, t) = (8, 4, 128);
    let prob = 0.3;
    let gpu = Default::default();
    let zeros = Tensor::<Gpu, 4>::zeros([n, h, t, t], &gpu);
    let v = Tensor::<Gpu, 2>::eye(t, &gpu)
        .reshape([1, 1, t, t])
        .expand([n, h, t, t]);
    let drop = AttentionDropout { prob, seed: 2024 };
    let out = values(fused_attention(
        zeros.clone(),
        zeros,
        v,
        None,
        drop,
        KernelChoice::AUTO,
    ));
    let kept_value = (1.0 / (1.0 - prob)) as f32 / t as f32;
    let dropped: Vec<f64> = out
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            assert!(
                x == 0.0 || (x - kept_value).abs() <= 1e-6,
                "output {i} = {x}: neither 0 nor {kept_value}"
            );
            f64::from(u8::from(x == 0.0))
        })
        .collect();
    let at = |head: usize, i: usize, j: usize| dropped[(head * t + i) * t + j];
    let heads = n * h;
    let fraction = |cells: &mut dyn Iterator<Item = f64>| {
        let (sum, count) = cells.fold((0.0, 0.0), |(s, c), x| (s + x, c + 1.0));
        sum / count
    };
    let overall = fraction(&mut dropped.iter().copied());
    assert!(
        (overall - prob).abs() < 0.005,
        "dropped {overall}, want {prob}"
    );
    for head in 0..heads {
        let f = fraction(&mut (0..t * t).map(|c| at(head, c / t, c % t)));
        assert!((f - prob).abs() < 0.06, "head {head}: dropped {f}");
    }
    for line in 0..t {
        let row = fraction(&mut (0..heads * t).map(|c| at(c / t, line, c % t)));
        let col = fraction(&mut (0..heads * t).map(|c| at(c / t, c % t, line)));
        assert!((row - prob).abs() < 0.04, "row {line}: dropped {row}");
        assert!((col - prob).abs() < 0.04, "column {line}: dropped {col}");
    }
    // Correlation of each probability's decision with a neighbour's.
    let correlation = |neighbour: &dyn Fn(usize, usize, usize) -> f64, heads: usize| {
        let (mut sxy, mut count) = (0.0, 0.0);
        for head in 0..heads {
            for i in 0..t - 1 {
                for j in 0..t - 1 {
                    sxy += (at(head, i, j) - overall) * (neighbour(head, i, j) - overall);
                    count += 1.0;
                }
            }
        }
        sxy / count / (overall * (1.0 - overall))
    };
    for (what, r) in [
        ("next row", correlation(&|hd, i, j| at(hd, i + 1, j), heads)),
        (
            "next column",
            correlation(&|hd, i, j| at(hd, i, j + 1), heads),
        ),
        (
            "next head",
            correlation(&|hd, i, j| at(hd + 1, i, j), heads - 1),
        ),
        (
            "next row and column",
            correlation(&|hd, i, j| at(hd, i + 1, j + 1), heads),
        ),
    ] {
        assert!(r.abs() < 0.015, "{what}: correlation {r}");
    }
}

/// f16 / bf16 forward (acceptance: ≤1e-2). The reference runs in f32 on the
/// inputs rounded to the half type, so what is measured is the kernel's own
/// error: its f32 accumulation and the rounding of its output.
const FORWARD_RTOL_HALF: f32 = 1e-2;

#[test]
fn half_precision_forward() {
    use burn::tensor::{bf16, f16, DType};
    let gpu = Default::default();
    let cpu = Default::default();
    let mut checked = 0;
    for dtype in [DType::F16, DType::BF16] {
        if !Gpu::supports_dtype(&gpu, dtype) {
            eprintln!("{dtype:?}: not supported by this device, skipped");
            continue;
        }
        let round = |x: &Vec<f32>| -> Vec<f32> {
            x.iter()
                .map(|&v| match dtype {
                    DType::F16 => f16::from_f32(v).to_f32(),
                    _ => bf16::from_f32(v).to_f32(),
                })
                .collect()
        };
        for (i, &(t, dh)) in [(1, 32), (7, 32), (151, 32), (33, 16), (40, 64), (1024, 32)]
            .iter()
            .enumerate()
        {
            let n = if t == 1024 { 2 } else { 3 };
            let mut case = Case::new(500 + i as u64, n, 2, t, t, dh);
            (case.q, case.k, case.v) = (round(&case.q), round(&case.k), round(&case.v));
            let [q, k, v, _] = case.tensors::<Gpu>(&gpu);
            let out = fused_attention(
                q.cast(dtype),
                k.cast(dtype),
                v.cast(dtype),
                Some(case.mask::<Gpu>(&gpu)),
                AttentionDropout::NONE,
                KernelChoice::AUTO,
            );
            assert_eq!(out.dtype(), dtype, "the kernel keeps the input type");
            let fused = values(out.cast(DType::F32));
            let [q, k, v, _] = case.tensors::<Cpu>(&cpu);
            let reference = values(reference_attention(q, k, v, Some(case.mask::<Cpu>(&cpu))));
            let e = rel(&fused, &reference);
            eprintln!("{dtype:?} t={t} dh={dh}: forward rel err {e:e}");
            assert!(
                e <= FORWARD_RTOL_HALF,
                "{dtype:?} t={t} dh={dh}: forward rel err {e:e}"
            );
            if n > 2 {
                let row0 = case.h * case.tq * case.dh;
                assert!(
                    fused[..row0].iter().all(|x| *x == 0.0),
                    "all-padding sample must give zeros"
                );
            }
            checked += 1;
        }
    }
    // Every device aam-rs runs the kernel on has at least f16 (lavapipe, CUDA).
    assert!(checked > 0, "no half type was checked");
}

/// Every row split over 4 lanes: the partial softmax states and gradient
/// sums of a row's lanes are merged with plane shuffles, which the default
/// plan uses on CUDA and HIP only for calls with few rows (the sample level).
/// Forcing it here runs that merge at every shape, and in CI on wgpu through
/// lavapipe, where it is otherwise never taken.
#[test]
fn rows_split_over_lanes() {
    let lanes = KernelChoice {
        lanes: Some(4),
        ..KernelChoice::AUTO
    };
    check_layout_shapes(600, lanes);
    check_dropout(lanes);
}

/// The layout CUDA and HIP use for calls with one lane per row (the ASV and
/// sample levels): every row kernel splits each row's head dimensions over
/// two units, whose partial dot products are added with plane shuffles (a
/// masked key's or past-the-end row's partner runs the loop only for those
/// shuffles). With parts, head dim 12 is not split (6 dims are not whole
/// quads).
#[test]
fn head_dims_split_in_two_parts() {
    let parts = KernelChoice {
        lanes: Some(1),
        parts: Some(2),
        ..KernelChoice::AUTO
    };
    check_layout_shapes(700, parts);
    check_dropout(parts);
}

/// The backward as two kernels (dQ, then dK/dV) at every shape. By default a
/// head whose keys fit one cube runs the tiled kernel (CUDA) or the merged
/// one (dK, dV and dQ in one), so the short lengths of the other tests never
/// reach the dQ kernel alone; here they do.
#[test]
fn separate_backward_kernels() {
    let separate = KernelChoice {
        separate_backward: true,
        ..KernelChoice::AUTO
    };
    check_layout_shapes(800, separate);
    check_dropout(separate);
}

/// CUDA cores only: on CUDA the row forward (which `mma` shadows) and the
/// merged backward at head dims the tiled one does not take, at one lane a
/// row as the ASV level has. (On wgpu it is the default plan.)
#[cfg(feature = "cuda")]
#[test]
fn cuda_cores_one_lane_a_row() {
    let cores = KernelChoice {
        lanes: Some(1),
        cuda_cores: true,
        ..KernelChoice::AUTO
    };
    check_layout_shapes(900, cores);
    check_dropout(cores);
}
