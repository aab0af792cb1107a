//! The training step's dense matmuls, alone, on CUDA: Burn's fusion backend
//! (what `aam-rs --features cuda,fusion` runs) against the plain CubeCL
//! backend, and the weight gradient as one matmul against a split over the
//! row axis. `benches/matmul_device.sh` runs PyTorch on the same shapes in the
//! same call.
//!
//! Why: CubeCL's kernel profile of a training step put 28-34% of its GPU time
//! in matmuls running at ~7 TFLOP/s (H100, 2026-11-23).
//! The linear layers' shapes are tall: the ASV level packs every token of every
//! non-empty ASV into one row axis (417 ASVs x 151 tokens = 62,967 rows on a
//! real-sized batch), against widths of 128-512. Their weight gradient
//! `xᵀ·dy` reduces over those rows into a 128 x 512 output, a handful of
//! output tiles for 132 SMs, unless the rows are split first.
//!
//! Prints one JSON object per measurement: `pipelined_ms` (mean of `ITERS`
//! calls queued back to back, one sync) and TFLOP/s.
//!
//! ```text
//! matmul-bench [--rows 62976] [--splits 8,16,32,64]
//! ```

use std::time::Instant;

use burn::prelude::*;
use burn::tensor::Distribution;
use clap::Parser;

const WARMUP: usize = 3;
const ITERS: usize = 20;

type Plain = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
type Fused = burn::backend::Cuda<f32, i32>;

#[derive(Parser)]
struct Args {
    /// Rows of the packed activations (tokens of a batch). Must divide by every split.
    #[arg(long, default_value_t = 62_976)]
    rows: usize,
    /// Row splits to try for the weight gradient.
    #[arg(long, value_delimiter = ',', default_values_t = [8, 16, 32, 64])]
    splits: Vec<usize>,
    /// Only this backend (plain or fused).
    #[arg(long)]
    only: Option<String>,
}

/// (input width, output width) of the step's linear layers: QKV, attention
/// output, feed-forward in, feed-forward out.
const LAYERS: [(usize, usize); 4] = [(128, 384), (128, 128), (128, 512), (512, 128)];

fn main() {
    let args = Args::parse();
    for s in &args.splits {
        assert!(
            args.rows % s == 0,
            "--rows {} does not divide by split {s}",
            args.rows
        );
    }
    let device = burn::backend::cuda::CudaDevice::new(0);
    if args.only.as_deref() != Some("fused") {
        bench::<Plain>("plain", &args, &device);
    }
    if args.only.as_deref() != Some("plain") {
        bench::<Fused>("fused", &args, &device);
    }
}

fn bench<B: Backend>(backend: &str, args: &Args, device: &B::Device) {
    let m = args.rows;
    for (k, n) in LAYERS {
        let x = Tensor::<B, 2>::random([m, k], Distribution::Normal(0.0, 1.0), device);
        let w = Tensor::<B, 2>::random([k, n], Distribution::Normal(0.0, 0.1), device);
        let b = Tensor::<B, 1>::random([n], Distribution::Normal(0.0, 0.1), device);
        let dy = Tensor::<B, 2>::random([m, n], Distribution::Normal(0.0, 1.0), device);
        let flops = 2.0 * (m * k * n) as f64;
        let shape = format!("{m}x{k}x{n}");

        let ms = time_ms::<B, _>(device, || x.clone().matmul(w.clone()));
        report(backend, &shape, "forward", None, ms, flops);
        let ms = time_ms::<B, _>(device, || {
            x.clone().matmul(w.clone()) + b.clone().unsqueeze::<2>()
        });
        report(backend, &shape, "forward+bias", None, ms, flops);
        let ms = time_ms::<B, _>(device, || dy.clone().matmul(w.clone().transpose()));
        report(backend, &shape, "input_grad", None, ms, flops);
        let ms = time_ms::<B, _>(device, || x.clone().transpose().matmul(dy.clone()));
        report(backend, &shape, "weight_grad", None, ms, flops);
        for &s in &args.splits {
            let ms = time_ms::<B, _>(device, || {
                x.clone()
                    .reshape([s, m / s, k])
                    .swap_dims(1, 2)
                    .matmul(dy.clone().reshape([s, m / s, n]))
                    .sum_dim(0)
                    .reshape([k, n])
            });
            report(backend, &shape, "weight_grad_split", Some(s), ms, flops);
        }
        let ms = time_ms::<B, _>(device, || dy.clone().sum_dim(0));
        report(backend, &shape, "bias_grad", None, ms, 0.0);
        for &s in &args.splits {
            let parts = || dy.clone().reshape([s, m / s, n]);
            let ms = time_ms::<B, _>(device, || parts().sum_dim(1).sum_dim(0));
            report(
                backend,
                &shape,
                "bias_grad_split_rows_first",
                Some(s),
                ms,
                0.0,
            );
            let ms = time_ms::<B, _>(device, || parts().sum_dim(0).sum_dim(1));
            report(
                backend,
                &shape,
                "bias_grad_split_parts_first",
                Some(s),
                ms,
                0.0,
            );
        }
    }
}

/// Mean ms of `ITERS` calls queued back to back, their outputs kept alive
/// until one sync (so a lazy backend cannot skip them).
fn time_ms<B: Backend, T>(device: &B::Device, mut op: impl FnMut() -> T) -> f64 {
    let mut keep = Vec::with_capacity(ITERS);
    for _ in 0..WARMUP {
        keep.push(op());
    }
    B::sync(device).unwrap();
    keep.clear();
    let start = Instant::now();
    for _ in 0..ITERS {
        keep.push(op());
    }
    B::sync(device).unwrap();
    let ms = start.elapsed().as_secs_f64() * 1e3 / ITERS as f64;
    drop(keep);
    ms
}

fn report(backend: &str, shape: &str, op: &str, split: Option<usize>, ms: f64, flops: f64) {
    println!(
        "{}",
        serde_json::json!({
            "side": "aam-rs", "backend": backend, "shape": shape, "op": op, "split": split,
            "pipelined_ms": ms, "tflops": (flops > 0.0).then(|| flops / ms / 1e9),
        })
    );
}
