//! The Adam/AdamW kernel (`AdamOps::adam_step` on a CubeCL backend,
//! one op per parameter) against the same step as Burn tensor ops
//! (`adam_step_ops`), on the same backend and on ndarray, over several steps
//! whose moments feed the next: AdamW with decoupled decay, Adam with the L2
//! term, no decay, a changing β₁ (one-cycle), sizes around a cube's 256 units.
//!
//! Runs on CUDA when built with `--features cuda` (the device machine), else on
//! wgpu: in CI through Mesa's lavapipe (a CPU Vulkan driver). With `fusion`
//! the kernel runs as a custom op of Burn's fusion stream.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use crate::common::*;
use aam_kernels::{adam_step_ops, AdamOps, AdamStep};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;

fn tensor<B: Backend>(values: &[f32], device: &B::Device) -> Tensor<B, 1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

fn host<B: Backend>(t: &Tensor<B, 1>) -> Vec<f32> {
    t.to_data().to_vec().expect("f32 values")
}

/// `|a − b| ≤ rtol·max(|a|, |b|) + atol·max|b|` element by element.
///
/// The absolute part, relative to the tensor's largest value, is for
/// elements where the update's terms cancel (a moment whose decayed value and
/// new gradient share nearly equal magnitudes and opposite signs): there a
/// device that fuses the multiply and add (CUDA) and one that rounds twice
/// (ndarray) differ by an ulp of the terms, not of the result.
fn assert_close(what: &str, a: &[f32], b: &[f32], rtol: f32, atol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        assert!(x.is_finite() && y.is_finite(), "{what}[{i}]: {x} vs {y}");
        let bound = rtol * x.abs().max(y.abs()) + atol * scale + 1e-30;
        assert!(
            (x - y).abs() <= bound,
            "{what}[{i}]: {x} vs {y} (rtol {rtol})"
        );
    }
}

/// Steps 1..=3 of one optimiser setting on `n` elements; the kernel's state
/// feeds its next step, the ops' state theirs.
fn check(n: usize, decoupled: bool, weight_decay: f64, seed: u64) {
    let gpu = Default::default();
    let cpu = Default::default();
    let mut rng = Rng::new(seed);
    let param: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
    let zeros = vec![0.0f32; n];
    let mut kernel = [&param, &zeros, &zeros].map(|v| tensor::<Gpu>(v, &gpu));
    let mut ops = kernel.clone();
    let mut cpu_ops = [&param, &zeros, &zeros].map(|v| tensor::<Cpu>(v, &cpu));
    for t in 1..=3 {
        // Gradients of mixed scales, some exactly zero.
        let grad: Vec<f32> = (0..n)
            .map(|i| {
                if i % 17 == 3 {
                    0.0
                } else {
                    rng.normal() * 10f32.powi(i as i32 % 5 - 2)
                }
            })
            .collect();
        // One-cycle moves β₁ between steps.
        let beta1 = [0.9, 0.85, 0.95][t as usize - 1];
        let step = AdamStep::new(1e-3, beta1, 0.999, 1e-8, weight_decay, decoupled, t);
        let before = host(&kernel[0]);
        let [p, m, v] = kernel.map(|x| x.into_primitive().tensor());
        let g = tensor::<Gpu>(&grad, &gpu).into_primitive().tensor();
        let (p, m, v) = Gpu::adam_step(p, g, m, v, step);
        kernel = [p, m, v].map(|x| Tensor::from_primitive(TensorPrimitive::Float(x)));
        let [p, m, v] = ops;
        let (p, m, v) = adam_step_ops(p, tensor::<Gpu>(&grad, &gpu), m, v, step);
        ops = [p, m, v];
        let [p, m, v] = cpu_ops;
        let (p, m, v) = adam_step_ops(p, tensor::<Cpu>(&grad, &cpu), m, v, step);
        cpu_ops = [p, m, v];
        for (i, name) in ["param", "first moment", "second moment"]
            .iter()
            .enumerate()
        {
            let what = format!("n {n}, decoupled {decoupled}, wd {weight_decay}, step {t}: {name}");
            let k = host(&kernel[i]);
            // The same arithmetic in the same order on the same device: only
            // the compiler's contractions may differ.
            // Where the decayed parameter and its update nearly cancel (a
            // result ~1e-4 of its terms), an ulp of the terms shows: hence
            // the absolute part, 1e-7 of the largest value.
            assert_close(
                &format!("{what} (kernel vs ops)"),
                &k,
                &host(&ops[i]),
                1e-6,
                1e-7,
            );
            // Another device's sqrt, division and contractions may differ by
            // a few ulps.
            let cpu = host(&cpu_ops[i]);
            assert_close(&format!("{what} (kernel vs ndarray)"), &k, &cpu, 1e-5, 1e-6);
        }
        // The update itself (~lr, small beside the parameter, so the
        // comparison of parameters above hardly sees it), to 0.1% and the
        // rounding of the parameters subtracted.
        let (k, o) = (host(&kernel[0]), host(&ops[0]));
        for i in 0..n {
            let (dk, dop) = (
                k[i] as f64 - before[i] as f64,
                o[i] as f64 - before[i] as f64,
            );
            let bound = 1e-3 * dop.abs() + 4.0 * f32::EPSILON as f64 * (before[i] as f64).abs();
            assert!(
                (dk - dop).abs() <= bound,
                "n {n}, step {t}: update [{i}] {dk} vs {dop}"
            );
        }
    }
    // The parameter moved: the step is not a no-op.
    let moved = host(&kernel[0])
        .iter()
        .zip(&param)
        .filter(|(a, b)| a != b)
        .count();
    assert!(moved > n / 2, "only {moved} of {n} elements changed");
}

#[test]
fn adamw_kernel_matches_the_ops() {
    for (n, seed) in [(1, 1), (255, 2), (257, 3), (10_007, 4)] {
        check(n, true, 0.01, seed);
    }
}

#[test]
fn adam_l2_and_no_decay_match_the_ops() {
    check(1_001, false, 0.01, 5);
    check(513, true, 0.0, 6);
    check(513, false, 0.0, 7);
}

/// All parameters of a step in one call (`adam_steps`: one custom op under
/// fusion, up to 32 parameters a launch), in their own shapes, against one
/// flat `adam_step` each: the same values (to an ulp), each parameter back in
/// its shape, each item with its own coefficients; moments that are shared
/// stay as they were.
#[test]
fn adam_steps_of_many_parameters_equal_one_at_a_time() {
    use aam_kernels::AdamItem;
    use burn::tensor::ops::FloatTensorOps;
    use burn::tensor::TensorMetadata;
    let device = Default::default();
    let mut rng = Rng::new(8);
    // More parameters than one launch takes (32), of assorted sizes.
    let mut shapes: Vec<Vec<usize>> = vec![vec![3, 5], vec![7], vec![2, 3, 300]];
    shapes.extend((0..40).map(|i| vec![1 + (i * 37) % 61, 1 + i % 3]));
    let mut normals = |n: usize| (0..n).map(|_| rng.normal()).collect::<Vec<f32>>();
    let cases: Vec<_> = shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let n = shape.iter().product();
            let step = AdamStep::new(1e-3 * (i + 1) as f64, 0.9, 0.999, 1e-8, 0.01, i % 3 != 1, 2);
            let second = normals(n).iter().map(|x| x * x).collect::<Vec<_>>();
            (
                shape.to_vec(),
                normals(n),
                normals(n),
                normals(n),
                second,
                step,
            )
        })
        .collect();
    let float = |values: &[f32], shape: &[usize]| {
        let flat =
            Tensor::<Gpu, 1>::from_data(TensorData::new(values.to_vec(), [values.len()]), &device);
        Gpu::float_reshape(flat.into_primitive().tensor(), Shape::from(shape.to_vec()))
    };
    let flat = |values: &[f32]| float(values, &[values.len()]);
    let items = cases
        .iter()
        .map(|(shape, p, g, m, v, step)| AdamItem::<Gpu> {
            param: float(p, shape),
            grad: float(g, shape),
            first: flat(m),
            second: flat(v),
            step: *step,
        })
        .collect();
    let many = Gpu::adam_steps(items);
    assert_eq!(many.len(), cases.len());
    let host = |t: burn::tensor::ops::FloatTensor<Gpu>| {
        Tensor::<Gpu, 1>::from_primitive(TensorPrimitive::Float(t))
            .into_data()
            .to_vec::<f32>()
            .expect("f32")
    };
    for ((shape, p, g, m, v, step), [p_many, m_many, v_many]) in cases.iter().zip(many) {
        assert_eq!(p_many.shape(), Shape::from(shape.clone()));
        // A moment held elsewhere too is not updated in place.
        let shared = flat(m);
        let (p1, m1, v1) = Gpu::adam_step(flat(p), flat(g), shared.clone(), flat(v), *step);
        assert_eq!(
            host(shared),
            *m,
            "{shape:?}: a shared moment was overwritten"
        );
        let updated = host(p_many);
        assert_ne!(&updated, p, "{shape:?}: the parameter did not move");
        // The same kernel, one parameter a launch against up to 32: to an
        // ulp, as CUDA may contract the two compiled variants' multiplies and
        // adds into FMAs differently.
        let what = |name: &str| format!("{shape:?}: {name} (steps vs step)");
        assert_close(&what("parameter"), &updated, &host(p1), 1e-6, 0.0);
        assert_close(&what("first moment"), &host(m_many), &host(m1), 1e-6, 0.0);
        assert_close(&what("second moment"), &host(v_many), &host(v1), 1e-6, 0.0);
    }
}
