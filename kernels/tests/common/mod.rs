//! Shared by the fused-kernel parity tests: random cases, the f32 check of
//! forward and gradients against the CPU reference, and the dropout check.
#![allow(dead_code)] // some helpers serve only the CUDA or only the wgpu build

use aam_kernels::{fused_attention, reference_attention, AttentionDropout, KernelChoice};
use burn::backend::{Autodiff, NdArray};
use burn::prelude::*;

#[cfg(feature = "cuda")]
pub type Gpu = burn::backend::Cuda;
#[cfg(not(feature = "cuda"))]
pub type Gpu = burn::backend::Wgpu;
pub type GpuAd = Autodiff<Gpu>;
pub type Cpu = NdArray<f32>;
pub type CpuAd = Autodiff<Cpu>;

/// f32 forward: both sides are f32 with f32 accumulation; reductions differ
/// only in order.
pub const FORWARD_RTOL_F32: f32 = 1e-5;
/// f32 gradients: the backward sums over all rows of the other side.
pub const GRAD_RTOL_F32: f32 = 1e-4;

/// xorshift64*: fresh, reproducible random inputs without a dependency.
pub struct Rng(u64);
impl Rng {
    /// A generator from a seed (any value; 0 is remapped).
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    pub fn normal(&mut self) -> f32 {
        let (u1, u2) = (self.uniform().max(1e-7), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

pub struct Case {
    pub n: usize,
    pub h: usize,
    pub tq: usize,
    pub tk: usize,
    pub dh: usize,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub w: Vec<f32>,
    /// `[n, tk]`, true = padding.
    pub mask: Vec<bool>,
}

impl Case {
    /// Row 0 all padding when `n > 2`, row 1 exactly one valid key; the rest
    /// random valid lengths with random holes.
    pub fn new(seed: u64, n: usize, h: usize, tq: usize, tk: usize, dh: usize) -> Case {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut normals = |len: usize| (0..len).map(|_| rng.normal()).collect::<Vec<f32>>();
        let q = normals(n * h * tq * dh);
        let k = normals(n * h * tk * dh);
        let v = normals(n * h * tk * dh);
        let w = normals(n * h * tq * dh);
        let mut rng = Rng(seed ^ 0xdead_beef);
        let mut mask = vec![false; n * tk];
        for s in 0..n {
            let row = &mut mask[s * tk..(s + 1) * tk];
            if n > 2 && s == 0 {
                row.fill(true);
            } else if n > 1 && s == 1 {
                row.fill(true);
                row[rng.below(tk)] = false;
            } else {
                let valid = 1 + rng.below(tk);
                for (j, m) in row.iter_mut().enumerate() {
                    *m = j >= valid || (tk > 4 && rng.below(10) == 0 && j > 0);
                }
            }
        }
        Case {
            n,
            h,
            tq,
            tk,
            dh,
            q,
            k,
            v,
            w,
            mask,
        }
    }

    pub fn tensors<B: Backend>(&self, device: &B::Device) -> [Tensor<B, 4>; 4] {
        let t = |x: &Vec<f32>, len: usize| {
            Tensor::<B, 4>::from_data(
                TensorData::new(x.clone(), [self.n, self.h, len, self.dh]),
                device,
            )
        };
        [
            t(&self.q, self.tq),
            t(&self.k, self.tk),
            t(&self.v, self.tk),
            t(&self.w, self.tq),
        ]
    }

    pub fn mask<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Bool> {
        Tensor::from_data(
            TensorData::new(self.mask.clone(), [self.n, self.tk]),
            device,
        )
    }
}

pub fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    // A tensor of no elements: its bytes from a GPU need not be aligned for
    // a cast, and there is nothing to read.
    if t.shape().num_elements() == 0 {
        return Vec::new();
    }
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

/// Max |Δ| relative to the largest reference magnitude, floored at 0.01: a
/// forward output that is exactly zero in the reference (a row with no
/// valid key) must come out as zero or rounding noise of ~1e-7.
pub fn rel(actual: &[f32], expected: &[f32]) -> f32 {
    rel_above(actual, expected, 1e-2)
}

/// Max |Δ| relative to the largest reference magnitude, floored at `floor`.
pub fn rel_above(actual: &[f32], expected: &[f32], floor: f32) -> f32 {
    assert!(actual.iter().all(|x| x.is_finite()), "non-finite output");
    let scale = expected.iter().fold(0f32, |m, x| m.max(x.abs())).max(floor);
    actual
        .iter()
        .zip(expected)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

/// The floor of the gradients' relative error ([`rel_above`]). Where every
/// query has one valid key (a batch of one such sample), dQ and dK are zero
/// in exact arithmetic: `dS = P·(dP − Δ)` with `P = 1` and `Δ = dO·O =
/// dO·v = dP`. In f32 they come out as the difference of `dP`'s and `Δ`'s
/// rounding, ~1e-6 at these sizes, which depends on the order of the two
/// sums (the merged backward sums Δ a quad at a time); against 0.1 that is
/// 1e-5, inside [`GRAD_RTOL_F32`].
pub const GRAD_FLOOR: f32 = 0.1;

/// Forward and gradients of `f = Σ out ⊙ W` on both sides.
pub fn check(case: &Case, kernels: KernelChoice) {
    let label = format!(
        "n={} h={} tq={} tk={} dh={}",
        case.n, case.h, case.tq, case.tk, case.dh
    );
    let started = std::time::Instant::now();
    let gpu = Default::default();
    let cpu = Default::default();

    // forward
    let [q, k, v, _] = case.tensors::<Gpu>(&gpu);
    let fused = values(fused_attention(
        q,
        k,
        v,
        Some(case.mask::<Gpu>(&gpu)),
        AttentionDropout::NONE,
        kernels,
    ));
    eprintln!("{label}: forward in {:.1?}", started.elapsed());
    let [q, k, v, _] = case.tensors::<Cpu>(&cpu);
    let reference = values(reference_attention(q, k, v, Some(case.mask::<Cpu>(&cpu))));
    let e = rel(&fused, &reference);
    assert!(e <= FORWARD_RTOL_F32, "{label}: forward rel err {e:e}");
    if case.n > 2 {
        let row0 = case.h * case.tq * case.dh;
        assert!(
            fused[..row0].iter().all(|x| *x == 0.0),
            "{label}: all-padding sample must give zeros"
        );
    }

    // gradients
    let [q, k, v, w] = case.tensors::<GpuAd>(&gpu);
    let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
    let out = fused_attention(
        q.clone(),
        k.clone(),
        v.clone(),
        Some(case.mask::<GpuAd>(&gpu)),
        AttentionDropout::NONE,
        kernels,
    );
    let g = (out * w).sum().backward();
    let fused_grads = [
        values(q.grad(&g).unwrap()),
        values(k.grad(&g).unwrap()),
        values(v.grad(&g).unwrap()),
    ];
    let [q, k, v, w] = case.tensors::<CpuAd>(&cpu);
    let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
    let out = reference_attention(
        q.clone(),
        k.clone(),
        v.clone(),
        Some(case.mask::<CpuAd>(&cpu)),
    );
    let g = (out * w).sum().backward();
    let ref_grads = [
        values(q.grad(&g).unwrap()),
        values(k.grad(&g).unwrap()),
        values(v.grad(&g).unwrap()),
    ];
    let errors: Vec<f32> = fused_grads
        .iter()
        .zip(&ref_grads)
        .map(|(a, b)| rel_above(a, b, GRAD_FLOOR))
        .collect();
    eprintln!("{label}: gradient rel errors dq/dk/dv = {errors:?}");
    for (name, (a, b)) in ["dq", "dk", "dv"]
        .iter()
        .zip(fused_grads.iter().zip(&ref_grads))
    {
        let e = rel_above(a, b, GRAD_FLOOR);
        assert!(e <= GRAD_RTOL_F32, "{label}: {name} rel err {e:e}");
    }
    eprintln!("{label}: ok in {:.1?}", started.elapsed());
}

/// Dropout: the same seed gives the same mask, another seed another, and
/// the backward uses the forward's mask.
pub fn check_dropout(kernels: KernelChoice) {
    let case = Case::new(400, 2, 2, 64, 64, 32);
    let gpu = Default::default();
    let drop = AttentionDropout {
        prob: 0.3,
        seed: 1234,
    };
    let run = |d: AttentionDropout| {
        let [q, k, v, _] = case.tensors::<Gpu>(&gpu);
        values(fused_attention(
            q,
            k,
            v,
            Some(case.mask::<Gpu>(&gpu)),
            d,
            kernels,
        ))
    };
    let (a, b, none) = (run(drop), run(drop), run(AttentionDropout::NONE));
    assert_eq!(a, b, "same seed, same mask");
    assert!(rel(&a, &none) > 1e-2, "dropout changed nothing");
    assert_ne!(
        a,
        run(AttentionDropout { seed: 99, ..drop }),
        "another seed, another mask"
    );
    // out is linear in v: f = Σ W ⊙ (P̃ v) = Σ dV ⊙ v holds only if the
    // backward's P̃ is the forward's.
    let [q, k, v, w] = case.tensors::<GpuAd>(&gpu);
    let v = v.require_grad();
    let mask = Some(case.mask::<GpuAd>(&gpu));
    let f = (fused_attention(q, k, v.clone(), mask, drop, kernels) * w).sum();
    let f_value = values(f.clone())[0];
    let g = f.backward();
    let dv = values(v.grad(&g).unwrap());
    let identity: f32 = dv.iter().zip(&case.v).map(|(a, b)| a * b).sum();
    assert!(
        (identity - f_value).abs() <= 1e-3 * f_value.abs().max(1.0),
        "Σ dV⊙v = {identity} but f = {f_value}"
    );
}

/// The shapes a [`KernelChoice`] that forces a fallback is checked on, seeds
/// from `seed`: lengths 1, 7, 151 and 33; head dims 16,
/// 64, 128 and 12 (not whole quads when split in two); cross lengths 9 × 70;
/// and the sample level's 1024 slots.
pub fn check_layout_shapes(seed: u64, kernels: KernelChoice) {
    for (i, &t) in [1usize, 7, 151, 33].iter().enumerate() {
        check(&Case::new(seed + i as u64, 3, 2, t, t, 32), kernels);
    }
    for (i, &dh) in [16usize, 64, 128, 12].iter().enumerate() {
        check(&Case::new(seed + 10 + i as u64, 3, 2, 40, 40, dh), kernels);
    }
    check(&Case::new(seed + 20, 4, 3, 9, 70, 32), kernels);
    check(&Case::new(seed + 21, 2, 2, 1024, 1024, 32), kernels);
}

/// The attention dropout's factors `[n, h, tq, tk]` (0 or `1/(1 − p)`),
/// computed on the host: a replica of `dropout_keep` in `cube.rs` (one
/// murmur3 finaliser round over the head key, the row and the column), so
/// that a test can run the math path with the kernels' own mask.
pub fn dropout_factors(
    drop: AttentionDropout,
    n: usize,
    h: usize,
    tq: usize,
    tk: usize,
) -> Vec<f32> {
    fn mix(mut x: u32) -> u32 {
        x ^= x >> 16;
        x = x.wrapping_mul(0x85eb_ca6b);
        x ^= x >> 13;
        x = x.wrapping_mul(0xc2b2_ae35);
        x ^= x >> 16;
        x
    }
    let threshold = (drop.prob * 4_294_967_296.0).min(u32::MAX as f64) as u32;
    let scale = (1.0 / (1.0 - drop.prob)) as f32;
    let mut factors = Vec::with_capacity(n * h * tq * tk);
    for bh in 0..(n * h) as u32 {
        let head_key = mix(drop.seed ^ bh);
        for row in 0..tq as u32 {
            for col in 0..tk as u32 {
                let x =
                    mix(head_key ^ row.wrapping_mul(0x9e37_79b1) ^ col.wrapping_mul(0x85eb_ca77));
                factors.push(if x >= threshold { scale } else { 0.0 });
            }
        }
    }
    factors
}

/// The math path's probabilities `softmax(q·kᵀ/√dh)` of `case` (0 for
/// masked keys and in rows with no valid key) and the kernels' dropout
/// factors ([`dropout_factors`]), both `[n, h, tq, tk]`.
pub fn probs_and_dropout<B: Backend>(
    case: &Case,
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    drop: AttentionDropout,
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let (n, h, tq, tk) = (case.n, case.h, case.tq, case.tk);
    let factors = Tensor::<B, 4>::from_data(
        TensorData::new(dropout_factors(drop, n, h, tq, tk), [n, h, tq, tk]),
        device,
    );
    let mask = case.mask::<B>(device).reshape([n, 1, 1, tk]);
    let scores = q.matmul(k.swap_dims(2, 3)) / (case.dh as f64).sqrt();
    let shape = scores.dims();
    let keep = mask.clone().bool_not().float().expand(shape);
    let probs =
        burn::tensor::activation::softmax(scores.mask_fill(mask.expand(shape), -1e30), 3) * keep;
    (probs, factors)
}

/// With dropout: the fused gradients (dq, dk, dv of `f = Σ out ⊙ W`)
/// against the CPU math path that applies the kernels' own mask
/// ([`dropout_factors`]) to the softmax. The dV identity of
/// [`check_dropout`] holds for any dQ and dK; this pins them.
pub fn check_dropout_gradients(case: &Case, drop: AttentionDropout) {
    let label = format!(
        "n={} h={} tq={} tk={} dh={} p={}",
        case.n, case.h, case.tq, case.tk, case.dh, drop.prob
    );
    let gpu = Default::default();
    let [q, k, v, w] = case.tensors::<GpuAd>(&gpu);
    let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
    let out = fused_attention(
        q.clone(),
        k.clone(),
        v.clone(),
        Some(case.mask::<GpuAd>(&gpu)),
        drop,
        KernelChoice::AUTO,
    );
    let g = (out * w).sum().backward();
    let fused = [q, k, v].map(|t| values(t.grad(&g).unwrap()));

    let cpu = Default::default();
    let [q, k, v, w] = case.tensors::<CpuAd>(&cpu);
    let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
    let (probs, factors) = probs_and_dropout(case, q.clone(), k.clone(), drop, &cpu);
    let out = (probs * factors).matmul(v.clone());
    let g = (out * w).sum().backward();
    let reference = [q, k, v].map(|t| values(t.grad(&g).unwrap()));
    for (name, (a, b)) in ["dq", "dk", "dv"].iter().zip(fused.iter().zip(&reference)) {
        let e = rel_above(a, b, GRAD_FLOOR);
        let max = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        eprintln!("{label}: {name} rel err {e:e} (max |{name}| {max:e})");
        assert!(e <= GRAD_RTOL_F32, "{label}: {name} rel err {e:e}");
    }
}
