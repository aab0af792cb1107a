//! Cross-backend parity (issue 6): the reference fixtures' weights and inputs
//! through every backend compiled into this test (the cargo features of
//! `aam-tests`: `candle`, `wgpu`, `cuda`, `rocm`, `tch`), compared against
//! ndarray f32 on the same weights and inputs:
//! - every forward output in eval mode;
//! - every parameter gradient of `f = Σ_k Σ out_k ⊙ W_k` (the fixture's `W`),
//!   on `Autodiff<backend>` with the same weights in a dropout-free copy of
//!   the model, exactly as `reference_parity.rs` does on ndarray.
//!
//! Metric: the largest |Δ| in a tensor divided by the largest |ndarray| entry
//! of that tensor (`max_rel_diff`), so one number serves logits of ~10 and
//! attention weights of ~0.1. Bool outputs must agree exactly. Every case
//! prints its worst forward and gradient error (`--nocapture`), which is how
//! the backend matrix in docs/backends.md gets its measured numbers.
//!
//! `cargo test -p aam-tests --features wgpu --test parity -- --nocapture backend_parity::wgpu::`

use aam_models::import::{infer_config, TorchCheckpoint};
use aam_models::model::{AamModel, ModelConfig};
use aam_models::output::OutputTensor;
use aam_models::{autocast, AttentionBackend, MixedPrecision};
use aam_tests::*;
use burn::backend::{Autodiff, NdArray};

/// The oracle: ndarray, f32, on the CPU.
type Oracle = NdArray<f32>;

/// How far one backend (at one dtype) may be from ndarray f32, as
/// `max |Δ| / max |ndarray|` per tensor.
#[allow(dead_code)] // only the compiled backends' constants are used
struct Tolerance {
    /// Eval-mode forward outputs.
    forward: f32,
    /// Parameter gradients.
    grad: f32,
}

/// candle f32 CPU: the same IEEE f32 operations, only matmul and reductions
/// sum in another order (gemm vs matrixmultiply); backward through LayerNorm
/// and softmax amplifies that ~10x (measured: forward 3.7e-7, grads 4.5e-6).
#[allow(dead_code)]
const CANDLE_F32: Tolerance = Tolerance {
    forward: 1e-5,
    grad: 5e-5,
};

/// wgpu f32 (CubeCL WGSL): GPU reduction order, FMA, the driver's own
/// exp/log/erf, which GPU drivers may compute to fewer bits than the CPU
/// (measured on lavapipe: forward 4.9e-7, grads 3.5e-6).
#[allow(dead_code)]
const WGPU_F32: Tolerance = Tolerance {
    forward: 1e-4,
    grad: 1e-4,
};

/// CUDA f32 (CubeCL): burn 0.21 runs f32 matmul on TF32 tensor
/// cores (10-bit mantissa; ~70 TFLOP/s measured on the H100, issue 6), so
/// ~1e-3 relative is expected.
#[allow(dead_code)]
const CUDA_F32: Tolerance = Tolerance {
    forward: 1e-2,
    grad: 1e-2,
};

/// ROCm f32 (CubeCL): like CUDA; MI300 matrix cores may run f32
/// matmul as TF32/XF32-class too.
#[allow(dead_code)]
const ROCM_F32: Tolerance = Tolerance {
    forward: 1e-2,
    grad: 1e-2,
};

/// libtorch f32 on the CPU: the reference's own kernels (MKL/oneDNN), the
/// same arithmetic in another summation order.
#[allow(dead_code)]
const TCH_F32: Tolerance = Tolerance {
    forward: 1e-5,
    grad: 1e-5,
};

/// libtorch f32 on a GPU: cuBLAS/hipBLAS full f32 (torch leaves TF32 matmul
/// off by default), GPU reduction order and transcendentals.
#[allow(dead_code)]
const TCH_GPU_F32: Tolerance = Tolerance {
    forward: 1e-4,
    grad: 1e-4,
};

/// Mixed precision, fp16 (`--mixed-precision fp16`): the transformer layers
/// compute in IEEE half (11-bit mantissa, ~5e-4 per rounding), everything
/// else in f32, against ndarray f32 (measured on lavapipe: forward 4.6e-4,
/// grads 1.8e-3).
#[allow(dead_code)]
const FP16_MIXED: Tolerance = Tolerance {
    forward: 5e-3,
    grad: 2e-2,
};

/// Mixed precision, bf16: 8-bit mantissa (~4e-3 per rounding, 8x fp16's).
#[allow(dead_code)]
const BF16_MIXED: Tolerance = Tolerance {
    forward: 4e-2,
    grad: 1.5e-1,
};

/// What one backend computed for one case, on the host.
struct Run {
    /// Forward outputs in the model's order: name, shape, values.
    outputs: Vec<(&'static str, Vec<usize>, Values)>,
    /// Gradient per torch parameter key (None: no part in `f`).
    grads: Vec<(String, Option<Vec<f32>>)>,
}

enum Values {
    F32(Vec<f32>),
    Bool(Vec<bool>),
}

fn load<B: AttentionBackend>(case: &Case, device: &B::Device) -> (ModelConfig, AamModel<B>) {
    let ckpt = TorchCheckpoint::read(&case.checkpoint()).unwrap();
    let config = infer_config(&ckpt.shapes(), &case.hints(), &ckpt.path).unwrap();
    let mut model = config.init::<B>(device).unwrap();
    model
        .load_state_dict(&config, ckpt.tensors, &ckpt.path)
        .unwrap();
    (config, model)
}

fn host(tensor: &OutputTensor<impl AttentionBackend>) -> Values {
    match tensor {
        OutputTensor::Bool3(t) => {
            Values::Bool(t.to_data().convert::<bool>().to_vec::<bool>().unwrap())
        }
        other => Values::F32(other.to_data().convert::<f32>().to_vec::<f32>().unwrap()),
    }
}

/// Forward in eval mode, then the gradients of `f` in training mode without
/// dropout; both inside an `autocast(precision)` scope.
fn run<B: AttentionBackend>(case: &Case, device: &B::Device, precision: MixedPrecision) -> Run {
    let _autocast = autocast(precision);
    let (_, model) = load::<B>(case, device);
    let outputs = model
        .forward_named(case.inputs::<B>(device), case.return_nucleotides())
        .iter()
        .map(|(name, t)| (*name, t.shape(), host(t)))
        .collect();

    let (config, model) = load::<Autodiff<B>>(case, device);
    let model = config
        .without_dropout()
        .init::<Autodiff<B>>(device)
        .unwrap()
        .with_weights_of(model);
    let weights = grad_weights(case);
    let f = model
        .forward_named(
            case.inputs::<Autodiff<B>>(device),
            case.return_nucleotides(),
        )
        .iter()
        .filter_map(|(n, t)| {
            weights
                .get(*n)
                .and_then(|w| t.weighted_sum(w.as_slice().unwrap()))
        })
        .reduce(|a, b| a + b)
        .expect("some weighted output");
    let grads = f.backward();
    let grads = model
        .named_gradients(&config, &grads)
        .into_iter()
        .map(|(key, g)| (key, g.map(|g| g.convert::<f32>().to_vec::<f32>().unwrap())))
        .collect();
    Run { outputs, grads }
}

/// Runs `case` on `B` and on the oracle; asserts every output and gradient
/// within `tol`, listing every violation.
fn check<B: AttentionBackend>(
    backend: &str,
    case_name: &str,
    device: B::Device,
    precision: MixedPrecision,
    tol: &Tolerance,
) {
    let case = Case::load(case_name);
    if let Some(dtype) = precision.dtype() {
        assert!(
            <B as burn::prelude::Backend>::supports_dtype(&device, dtype),
            "{backend}: this device has no {dtype:?} arithmetic"
        );
    }
    let want = run::<Oracle>(&case, &Default::default(), MixedPrecision::None);
    let got = run::<B>(&case, &device, precision);
    let backend = match precision {
        MixedPrecision::None => backend.to_string(),
        p => format!("{backend}/{p:?}"),
    };
    let backend = backend.as_str();
    let mut failures = Vec::new();

    let names = |r: &Run| {
        r.outputs
            .iter()
            .map(|(n, s, _)| (*n, s.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        names(&got),
        names(&want),
        "{backend}/{case_name}: output names and shapes"
    );
    let mut worst_forward = (0.0f32, "");
    for ((name, _, g), (_, _, w)) in got.outputs.iter().zip(&want.outputs) {
        match (g, w) {
            (Values::F32(g), Values::F32(w)) => {
                let rel = max_rel_diff(g, w);
                if !(rel <= tol.forward) {
                    failures.push(format!("output {name}: {rel:e} > {:e}", tol.forward));
                }
                if !(rel <= worst_forward.0) {
                    worst_forward = (rel, name);
                }
            }
            (Values::Bool(g), Values::Bool(w)) => {
                let differ = g.iter().zip(w).filter(|(a, b)| a != b).count();
                if differ > 0 {
                    failures.push(format!("output {name}: {differ} booleans differ"));
                }
            }
            _ => failures.push(format!("output {name}: dtype differs")),
        }
    }

    assert_eq!(
        got.grads.len(),
        want.grads.len(),
        "{backend}/{case_name}: one gradient entry per parameter"
    );
    let mut worst_grad = (0.0f32, String::new());
    for ((key, g), (want_key, w)) in got.grads.iter().zip(&want.grads) {
        assert_eq!(key, want_key, "{backend}/{case_name}: parameter order");
        match (g, w) {
            (Some(g), Some(w)) => {
                let rel = max_rel_diff(g, w);
                if !(rel <= tol.grad) {
                    failures.push(format!("grad {key}: {rel:e} > {:e}", tol.grad));
                }
                if !(rel <= worst_grad.0) {
                    worst_grad = (rel, key.clone());
                }
            }
            (None, None) => {}
            // One side recorded no gradient: the other must be exactly zero.
            (Some(v), None) | (None, Some(v)) => {
                if v.iter().any(|x| *x != 0.0) {
                    failures.push(format!(
                        "grad {key}: present on one side only, and non-zero"
                    ));
                }
            }
        }
    }
    println!(
        "{backend:>8} {case_name:<30} forward {:.1e} ({}), grads {:.1e} ({})",
        worst_forward.0, worst_forward.1, worst_grad.0, worst_grad.1
    );
    assert!(
        failures.is_empty(),
        "{backend}/{case_name} vs ndarray f32:\n  {}",
        failures.join("\n  ")
    );
}

/// One module of tests per backend, one test per fixture case.
macro_rules! backend_parity {
    ($(#[$attr:meta])* $feature:literal, $backend:ident, $B:ty, $device:expr, $tol:expr) => {
        #[cfg(feature = $feature)]
        #[allow(deprecated)] // burn-candle is deprecated upstream after burn 0.21
        mod $backend {
            use super::*;

            fn case(name: &str) {
                check::<$B>(stringify!($backend), name, $device, MixedPrecision::None, &$tol);
            }

            /// Two-layer stacks, nucleotide logits, padded and START-only ASVs.
            #[test]
            $(#[$attr])*
            fn encoder_unifrac() {
                case("encoder_unifrac");
            }

            /// FiLM count embedding (counts input).
            #[test]
            $(#[$attr])*
            fn encoder_countemb_film() {
                case("encoder_countemb_film");
            }

            /// Categorical GMU fusion, count head.
            #[test]
            $(#[$attr])*
            fn predictor_cat_gmu() {
                case("predictor_cat_gmu");
            }

            /// Categorical cross-attention fusion (attention over one key).
            #[test]
            $(#[$attr])*
            fn predictor_cat_cross_attention() {
                case("predictor_cat_cross-attention");
            }

            /// Perceiver fusion (latent cross-attention, padded keys).
            #[test]
            $(#[$attr])*
            fn predictor_cat_perceiver() {
                case("predictor_cat_perceiver");
            }
        }
    };
}

backend_parity!("candle", candle, burn::backend::Candle<f32, i64>, burn::backend::candle::CandleDevice::Cpu, CANDLE_F32);
backend_parity!("wgpu", wgpu, burn::backend::Wgpu<f32, i32>, burn::backend::wgpu::WgpuDevice::DefaultDevice, WGPU_F32);
backend_parity!("cuda", cuda, burn::backend::Cuda<f32, i32>, burn::backend::cuda::CudaDevice::new(0), CUDA_F32);
backend_parity!("rocm", rocm, burn::backend::Rocm<f32, i32>, burn::backend::rocm::RocmDevice::new(0), ROCM_F32);
backend_parity!(
    "tch",
    tch,
    burn::backend::LibTorch<f32>,
    burn::backend::libtorch::LibTorchDevice::Cpu,
    TCH_F32
);
backend_parity!(
    #[ignore = "needs a CUDA or ROCm build of libtorch and a GPU: run with --ignored on a GPU machine"]
    "tch",
    tch_gpu,
    burn::backend::LibTorch<f32>,
    burn::backend::libtorch::LibTorchDevice::Cuda(0),
    TCH_GPU_F32
);

/// Mixed precision on the GPU backends: the encoder case (two transformer
/// stacks, padded ASVs, nucleotide logits) and the count-embedding case, per
/// low type, forward and gradients against ndarray f32.
macro_rules! mixed_precision_parity {
    ($feature:literal, $module:ident, $B:ty, $device:expr, $($test:ident: $precision:expr, $tol:expr;)+) => {
        #[cfg(feature = $feature)]
        mod $module {
            use super::*;
            $(
                #[test]
                fn $test() {
                    for name in ["encoder_unifrac", "encoder_countemb_film"] {
                        check::<$B>(stringify!($module), name, $device, $precision, &$tol);
                    }
                }
            )+
        }
    };
}

// Mesa lavapipe (CI) computes f16 but not bf16.
mixed_precision_parity!("wgpu", wgpu_mixed, burn::backend::Wgpu<f32, i32>,
    burn::backend::wgpu::WgpuDevice::DefaultDevice,
    fp16: MixedPrecision::Fp16, FP16_MIXED;);
mixed_precision_parity!("cuda", cuda_mixed, burn::backend::Cuda<f32, i32>,
    burn::backend::cuda::CudaDevice::new(0),
    fp16: MixedPrecision::Fp16, FP16_MIXED;
    bf16: MixedPrecision::Bf16, BF16_MIXED;);
mixed_precision_parity!("rocm", rocm_mixed, burn::backend::Rocm<f32, i32>,
    burn::backend::rocm::RocmDevice::new(0),
    fp16: MixedPrecision::Fp16, FP16_MIXED;
    bf16: MixedPrecision::Bf16, BF16_MIXED;);
