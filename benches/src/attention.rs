//! Masked attention at AAM's two shapes: the fused CubeCL kernel against the
//! math path (plain tensor ops) on the same backend, in the same run; the
//! PyTorch reference is measured by `pt_attention.py` in the same device call.
//!
//! Shapes (as `shared/bench/pt_reference_bench.py`):
//! - ASV level: `2048 × 4 heads × 151 × 32`, 400 of 2048 sequences 100 long;
//! - sample level: `8 × 4 × 1024 × 32`, valid slots 120/250/80/400/300/150/500/200.
//!
//! Prints one JSON object per measurement: median ms over `ITERS` runs after
//! `WARMUP`, for forward and forward+backward, f32 and bf16, and the relative
//! error of the fused output against the math path in the same type. `AAM_BENCH_DTYPES=f32`
//! (or `bf16`) measures one type only; with both, each runs in its own process (Burn fixes
//! a device's float type the first time a backend touches it). `AAM_BENCH_SHAPES=sample` (or
//! `asv`) measures one shape only; `AAM_BENCH_KERNELS` constrains the attention plan
//! ([`kernel_choice`]).

use std::time::Instant;

use aam_kernels::{
    fused_attention, reference_attention, AttentionBackend, AttentionDropout, KernelChoice,
};
use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::{bf16, Distribution};

const WARMUP: usize = 5;
const ITERS: usize = 30;
/// Device-to-device copy bandwidth measured on an H100 80GB HBM3 (bytes read + written per second).
const HBM_BYTES_PER_S: f64 = 3.0e12;

struct Shape {
    name: &'static str,
    n: usize,
    h: usize,
    t: usize,
    dh: usize,
    lengths: Vec<usize>,
}

fn shapes() -> Vec<Shape> {
    // 400 of 2048 ASV rows are 100 long (deterministic positions).
    let asv = (0..2048)
        .map(|i| if (i * 7919) % 2048 < 400 { 100 } else { 151 })
        .collect();
    vec![
        Shape {
            name: "asv[2048x4x151x32]",
            n: 2048,
            h: 4,
            t: 151,
            dh: 32,
            lengths: asv,
        },
        Shape {
            name: "sample[8x4x1024x32]",
            n: 8,
            h: 4,
            t: 1024,
            dh: 32,
            lengths: vec![120, 250, 80, 400, 300, 150, 500, 200],
        },
    ]
}

fn mask<B: Backend>(s: &Shape, device: &B::Device) -> Tensor<B, 2, Bool> {
    let values: Vec<bool> = s
        .lengths
        .iter()
        .flat_map(|&len| (0..s.t).map(move |j| j >= len))
        .collect();
    Tensor::from_data(TensorData::new(values, [s.n, s.t]), device)
}

/// `(median, pipelined)` in ms: the median of `ITERS` calls each followed by
/// a device sync (what one call costs, host work and launch latency
/// included), and the mean of `ITERS` calls queued back to back with one
/// sync at the end (what the device spends per call when the host keeps it
/// fed, comparable to CUDA-event timings of the same loop).
fn time_ms<F: FnMut()>(mut step: F, sync: &dyn Fn()) -> (f64, f64) {
    for _ in 0..WARMUP {
        step();
    }
    sync();
    let mut times: Vec<f64> = (0..ITERS)
        .map(|_| {
            let start = Instant::now();
            step();
            sync();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let start = Instant::now();
    for _ in 0..ITERS {
        step();
    }
    sync();
    let pipelined = start.elapsed().as_secs_f64() * 1e3 / ITERS as f64;
    (times[ITERS / 2], pipelined)
}

fn inputs<B: Backend>(s: &Shape, device: &B::Device) -> [Tensor<B, 4>; 4] {
    core::array::from_fn(|_| {
        Tensor::random(
            [s.n, s.h, s.t, s.dh],
            Distribution::Normal(0.0, 1.0),
            device,
        )
    })
}

fn report(
    shape: &Shape,
    dtype: &str,
    pass: &str,
    path: &str,
    (ms, pipelined_ms): (f64, f64),
    extra: serde_json::Value,
) {
    let elem = if dtype == "f32" { 4.0 } else { 2.0 };
    let tensors = if pass == "forward" { 4.0 } else { 10.0 }; // q,k,v,o (+ dO, dq, dk, dv, o, lse≈)
    let bytes = tensors * (shape.n * shape.h * shape.t * shape.dh) as f64 * elem;
    let mut row = serde_json::json!({
        "shape": shape.name, "dtype": dtype, "pass": pass, "path": path, "ms": ms,
        "pipelined_ms": pipelined_ms,
        "bandwidth_floor_ms": bytes / HBM_BYTES_PER_S * 1e3,
    });
    if let (Some(obj), serde_json::Value::Object(more)) = (row.as_object_mut(), extra) {
        obj.extend(more);
    }
    println!("{row}");
}

fn bench<B: AttentionBackend>(dtype: &str, device: &B::Device)
where
    Autodiff<B>: AttentionBackend,
{
    assert!(B::has_fused_attention(), "this backend has no fused kernel");
    let kernels = kernel_choice();
    let sync = || B::sync(device).unwrap();
    for shape in shapes().into_iter().filter(|s| shape_wanted(s.name)) {
        let [q, k, v, w] = inputs::<B>(&shape, device);
        // Burn fixes a device's default float type the first time a backend touches it, so a
        // second backend type in the same process silently gets the first one's tensors.
        assert_eq!(
            q.dtype(),
            <B::FloatElem as burn::tensor::Element>::dtype(),
            "{dtype}: the device already holds another float type; time one type per process"
        );
        let m = mask::<B>(&shape, device);
        // accuracy of the fused output against the math path in the same float type
        let fused = fused_attention(
            q.clone(),
            k.clone(),
            v.clone(),
            Some(m.clone()),
            AttentionDropout::NONE,
            kernels,
        );
        let math = reference_attention(q.clone(), k.clone(), v.clone(), Some(m.clone()));
        let diff = (fused.clone().cast(burn::tensor::DType::F32)
            - math.clone().cast(burn::tensor::DType::F32))
        .abs()
        .max()
        .into_scalar()
        .elem::<f64>();
        let scale = math
            .cast(burn::tensor::DType::F32)
            .abs()
            .max()
            .into_scalar()
            .elem::<f64>();
        let rel = serde_json::json!({"rel_err_vs_math": diff / scale});
        let ms = time_ms(
            || {
                let _ = fused_attention(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    Some(m.clone()),
                    AttentionDropout::NONE,
                    kernels,
                );
            },
            &sync,
        );
        report(&shape, dtype, "forward", "fused", ms, rel);
        let ms = time_ms(
            || {
                let _ = reference_attention(q.clone(), k.clone(), v.clone(), Some(m.clone()));
            },
            &sync,
        );
        report(&shape, dtype, "forward", "math", ms, serde_json::json!({}));

        let [qa, ka, va, wa] = [q, k, v, w].map(|t| Tensor::<Autodiff<B>, 4>::from_inner(t));
        let ma = Tensor::<Autodiff<B>, 2, Bool>::from_inner(m);
        let step = |fused: bool| {
            let (q, k, v) = (
                qa.clone().require_grad(),
                ka.clone().require_grad(),
                va.clone().require_grad(),
            );
            let out = if fused {
                fused_attention(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    Some(ma.clone()),
                    AttentionDropout::NONE,
                    kernels,
                )
            } else {
                reference_attention(q.clone(), k.clone(), v.clone(), Some(ma.clone()))
            };
            // `backward` seeds `out · w` with ones, so dO = w: no scalar
            // loss, whose reduction is not attention (`pt_attention.py`
            // does the same).
            let grads = (out * wa.clone()).backward();
            let _ = (q.grad(&grads), k.grad(&grads), v.grad(&grads));
        };
        let ms = time_ms(|| step(true), &sync);
        report(
            &shape,
            dtype,
            "forward+backward",
            "fused",
            ms,
            serde_json::json!({}),
        );
        let ms = time_ms(|| step(false), &sync);
        report(
            &shape,
            dtype,
            "forward+backward",
            "math",
            ms,
            serde_json::json!({}),
        );
    }
}

/// `AAM_BENCH_KERNELS`: constraints on the attention plan, comma-separated:
/// `lanes=N`, `parts=N`, `cuda-cores`, `separate-backward` (default none:
/// the plan's own choice; `aam_kernels::KernelChoice`).
fn kernel_choice() -> KernelChoice {
    let mut choice = KernelChoice::AUTO;
    let list = std::env::var("AAM_BENCH_KERNELS").unwrap_or_default();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let number = |v: &str| v.parse().expect("AAM_BENCH_KERNELS: lanes=N, parts=N");
        match item.split_once('=') {
            Some(("lanes", v)) => choice.lanes = Some(number(v)),
            Some(("parts", v)) => choice.parts = Some(number(v)),
            None if item == "cuda-cores" => choice.cuda_cores = true,
            None if item == "separate-backward" => choice.separate_backward = true,
            _ => panic!("AAM_BENCH_KERNELS: unknown {item:?}"),
        }
    }
    choice
}

/// Whether `AAM_BENCH_SHAPES` (comma-separated prefixes of the shapes' names,
/// e.g. `sample`; default all) asks for the shape `name`.
fn shape_wanted(name: &str) -> bool {
    std::env::var("AAM_BENCH_SHAPES")
        .map(|list| list.split(',').any(|p| name.starts_with(p.trim())))
        .unwrap_or(true)
}

/// Whether `AAM_BENCH_DTYPES` (comma-separated, default `f32,bf16`) asks for `dtype`.
#[cfg(feature = "cuda")]
fn wanted(dtype: &str) -> bool {
    std::env::var("AAM_BENCH_DTYPES")
        .map(|list| list.split(',').any(|d| d.trim() == dtype))
        .unwrap_or(true)
}

fn main() {
    #[cfg(feature = "cuda")]
    {
        use burn::backend::Cuda;
        // As `aam-rs` does: compiled kernels kept on disk between runs.
        aam_kernels::persist_compiled_kernels();
        let device = burn::backend::cuda::CudaDevice::default();
        // One float type per process: Burn keeps the first backend's default float type for
        // the device (`burn_backend::get_device_settings`), so `Cuda<bf16>` after `Cuda<f32>`
        // in the same process would time f32 tensors under the bf16 label.
        let dtypes: Vec<&str> = ["f32", "bf16"].into_iter().filter(|d| wanted(d)).collect();
        match dtypes.as_slice() {
            ["f32"] => bench::<Cuda<f32>>("f32", &device),
            ["bf16"] => bench::<Cuda<bf16>>("bf16", &device),
            several => {
                let exe = std::env::current_exe().expect("the bench's own path");
                for dtype in several {
                    let status = std::process::Command::new(&exe)
                        .env("AAM_BENCH_DTYPES", dtype)
                        .status()
                        .expect("re-running the bench for one float type");
                    assert!(status.success(), "the {dtype} run failed: {status}");
                }
            }
        }
    }
    #[cfg(all(feature = "wgpu", not(feature = "cuda")))]
    {
        use burn::backend::Wgpu;
        let device = burn::backend::wgpu::WgpuDevice::default();
        bench::<Wgpu<f32>>("f32", &device);
    }
    let _ = bf16::from_f32(0.0);
}
