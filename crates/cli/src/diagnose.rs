//! `aam-rs diagnose attention`: is masked attention computed correctly here?
//! (`aam-rs diagnose gradients`, the whole training step on real data against
//! the CPU, lives in `gradients.rs`.)
//!
//! What `python -m aam.tools.rocm_attention_diagnostic` was for the reference,
//! on any backend this binary has. Every attention path the chosen backend can
//! run (the math path everywhere, the fused CubeCL kernel where the backend
//! has it, both through the attention boundary and on a packed `qkv` as the
//! self-attention layers call it) is run through the model's own attention boundary on random inputs
//! at AAM's shapes, with and without key padding masks, in each float type the
//! backend supports, and compared with a float64 oracle computed here on the
//! CPU. Gradients (dQ, dK, dV) are checked too in f32: training runs them.
//!
//! A path is WRONG when its error exceeds the tolerance of its float type, when
//! it gives a non-finite value, or when a query whose keys are all padding does
//! not come out as zeros (the model's semantics, reference §1.3-1.6). The
//! command then exits non-zero, so a cluster job can gate on it.
//!
//! Why it exists: on ROCm the reference's `mem_efficient` SDPA was silently
//! wrong whenever a padding mask was present (max error 1.7, 42% instead of
//! 70% nucleotide accuracy), and it took weeks to find.
//!
//! Errors are normwise: max |path − oracle| / max |oracle| over the tensor, so
//! one number per row of the table, comparable across shapes.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::backend::Autodiff;
use burn::nn::DropoutConfig;
use burn::prelude::*;
use burn::tensor::DType;
use clap::{Args, Subcommand, ValueEnum};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use aam_kernels::{fused_packed_attention, AttentionDropout, KernelChoice};
use aam_models::attention::attention;
use aam_models::{AttentionBackend, AttnImplementation};

use aam_cli::backend::BackendKind;

/// `aam-rs diagnose ...`.
#[derive(Args, Debug)]
pub struct DiagnoseArgs {
    #[command(subcommand)]
    what: Diagnosis,
}

#[derive(Subcommand, Debug)]
enum Diagnosis {
    /// Check every attention path of a backend against a float64 oracle.
    Attention(AttentionArgs),
    /// Compare pretrain's losses and gradients on a backend with the CPU's,
    /// on real batches of a table.
    Gradients(crate::gradients::GradientsArgs),
}

/// `aam-rs diagnose attention`.
#[derive(Args, Debug)]
pub struct AttentionArgs {
    /// Backend to check (one compiled into this binary; `aam-rs backends`).
    #[arg(long, value_enum, default_value_t = BackendKind::default())]
    backend: BackendKind,
    /// Small shapes (seconds on a CPU) instead of AAM's full ASV and sample shapes.
    #[arg(long)]
    quick: bool,
    /// Float types to check; each is skipped where the backend lacks it.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Precision::F32, Precision::F16, Precision::Bf16])]
    dtypes: Vec<Precision>,
    /// Skip the gradient check.
    #[arg(long)]
    no_backward: bool,
    /// Timed repetitions per path (after one warm-up run).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Seed of the random inputs and masks.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json_out: Option<std::path::PathBuf>,
    /// Self-test of this diagnostic: run the math path with a deliberately
    /// broken attention, which must then be reported WRONG.
    #[arg(long, value_enum, hide = true)]
    inject_fault: Option<Fault>,
    /// Only these paths (default: every path the backend has).
    #[arg(long, value_enum, value_delimiter = ',')]
    paths: Vec<PathKind>,
    /// Only these cases (default: all).
    #[arg(long, value_delimiter = ',', value_parser = ["asv", "sample", "edge-dh16", "edge-dh64"])]
    cases: Vec<String>,
}

/// An attention path of `--paths`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PathKind {
    Math,
    Fused,
    /// The fused kernel on one packed `qkv [N, T, 3D]`, as the model's
    /// self-attention calls it (heads read and written in place).
    Packed,
}

/// How a path reaches attention: the model's boundary with an
/// implementation, or the packed self-attention entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Boundary(AttnImplementation),
    Packed,
}

/// A float type of the attention inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Precision {
    F32,
    F16,
    Bf16,
}

impl Precision {
    fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::F16 => DType::F16,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// Normwise tolerance against the f64 oracle. f32 allows for TF32-class
    /// tensor-core matmuls (CUDA's math path: ~1e-3); a wrong mask or softmax
    /// gives errors of order 0.1-1, far above every tolerance.
    fn tolerance(self) -> f64 {
        match self {
            Precision::F32 => 5e-3,
            Precision::F16 => 1e-2,
            Precision::Bf16 => 5e-2,
        }
    }
}

/// Faults the self-test can inject into the math path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Fault {
    /// Attend to the padding keys and ignore the real ones.
    InvertedMask,
}

/// Tolerance of the gradient check (f32, normwise per gradient).
const GRAD_TOLERANCE: f64 = 1e-2;

/// One attention problem: `[n, h, t, dh]` queries, keys and values.
struct Case {
    name: &'static str,
    n: usize,
    h: usize,
    t: usize,
    dh: usize,
    /// Valid keys per sequence (the rest is padding), or no mask at all.
    lengths: Option<Vec<usize>>,
}

impl Case {
    fn masked(&self) -> bool {
        self.lengths.is_some()
    }
}

/// AAM's attention shapes (reference §1.0): the ASV level (sequences of START +
/// 150 nt, ~20% of them 100 nt, here a chunk of 256), the sample level (8
/// samples of 1024 ASV slots with 120-500 real ASVs), and edge rows (all
/// padding, one valid key) at head dims 16 and 64. Each with and without mask.
fn cases(quick: bool, rng: &mut ChaCha8Rng) -> Vec<Case> {
    let (asv_n, sample_n, sample_t, valid) = if quick {
        (32, 2, 256, 60..=200)
    } else {
        (256, 8, 1024, 120..=500)
    };
    let asv_lengths: Vec<usize> = (0..asv_n)
        .map(|_| if rng.random_bool(0.2) { 101 } else { 151 })
        .collect();
    let sample_lengths: Vec<usize> = (0..sample_n)
        .map(|_| rng.random_range(valid.clone()))
        .collect();
    let mut out = Vec::new();
    for (name, n, t, dh, lengths) in [
        ("asv", asv_n, 151, 32, asv_lengths),
        ("sample", sample_n, sample_t, 32, sample_lengths),
        ("edge-dh16", 4, 64, 16, vec![0, 1, 37, 64]),
        ("edge-dh64", 4, 33, 64, vec![33, 0, 1, 20]),
    ] {
        out.push(Case {
            name,
            n,
            h: 4,
            t,
            dh,
            lengths: Some(lengths),
        });
        if !name.starts_with("edge") {
            out.push(Case {
                name,
                n,
                h: 4,
                t,
                dh,
                lengths: None,
            });
        }
    }
    out
}

/// Host inputs of one case, row-major `[n, h, t, dh]`.
struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Output gradient of the backward check.
    dout: Vec<f32>,
    /// `[n, t]`, true = padding.
    mask: Option<Vec<bool>>,
}

fn normal(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    // Box-Muller: unit normals, never all zeros.
    (0..len)
        .map(|_| {
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            let phi: f64 = rng.random_range(0.0..std::f64::consts::TAU);
            ((-2.0 * u.ln()).sqrt() * phi.cos()) as f32
        })
        .collect()
}

fn inputs(case: &Case, rng: &mut ChaCha8Rng) -> Inputs {
    let len = case.n * case.h * case.t * case.dh;
    Inputs {
        q: normal(rng, len),
        k: normal(rng, len),
        v: normal(rng, len),
        dout: normal(rng, len),
        mask: case.lengths.as_ref().map(|lengths| {
            lengths
                .iter()
                .flat_map(|&valid| (0..case.t).map(move |j| j >= valid))
                .collect()
        }),
    }
}

/// Float64 attention, forward and backward, in plain loops: independent of
/// every backend's tensor code. Masked keys get zero weight; a query with no
/// valid key gets a zero output and zero gradients.
struct Oracle {
    out: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

fn oracle(case: &Case, x: &Inputs) -> Oracle {
    let (t, dh) = (case.t, case.dh);
    let block = t * dh;
    let scale = 1.0 / (dh as f64).sqrt();
    let heads = case.n * case.h;
    let mut result = Oracle {
        out: vec![0.0; heads * block],
        dq: vec![0.0; heads * block],
        dk: vec![0.0; heads * block],
        dv: vec![0.0; heads * block],
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = heads.div_ceil(threads);
    std::thread::scope(|scope| {
        let chunks = result
            .out
            .chunks_mut(per * block)
            .zip(result.dq.chunks_mut(per * block))
            .zip(result.dk.chunks_mut(per * block))
            .zip(result.dv.chunks_mut(per * block))
            .enumerate();
        for (c, (((out, dq), dk), dv)) in chunks {
            scope.spawn(move || {
                let mut p = vec![0.0f64; t];
                let mut dp = vec![0.0f64; t];
                for local in 0..out.len() / block {
                    let head = c * per + local;
                    let seq = head / case.h;
                    let at = |v: &[f32], i: usize, d: usize| v[head * block + i * dh + d] as f64;
                    let valid = |j: usize| x.mask.as_ref().is_none_or(|m| !m[seq * t + j]);
                    let o = local * block;
                    for i in 0..t {
                        // Softmax over the valid keys.
                        let mut max = f64::NEG_INFINITY;
                        for j in 0..t {
                            p[j] = if valid(j) {
                                (0..dh)
                                    .map(|d| at(&x.q, i, d) * at(&x.k, j, d))
                                    .sum::<f64>()
                                    * scale
                            } else {
                                f64::NEG_INFINITY
                            };
                            max = max.max(p[j]);
                        }
                        if max == f64::NEG_INFINITY {
                            continue; // no valid key: zeros
                        }
                        let sum: f64 = p
                            .iter_mut()
                            .map(|s| {
                                *s = (*s - max).exp();
                                *s
                            })
                            .sum();
                        p.iter_mut().for_each(|s| *s /= sum);
                        for d in 0..dh {
                            out[o + i * dh + d] = (0..t).map(|j| p[j] * at(&x.v, j, d)).sum();
                        }
                        // Backward of sum(out ⊙ dout).
                        for j in 0..t {
                            dp[j] = (0..dh).map(|d| at(&x.dout, i, d) * at(&x.v, j, d)).sum();
                        }
                        let row: f64 = (0..t).map(|j| p[j] * dp[j]).sum();
                        for j in 0..t {
                            let ds = p[j] * (dp[j] - row) * scale;
                            for d in 0..dh {
                                dv[o + j * dh + d] += p[j] * at(&x.dout, i, d);
                                dq[o + i * dh + d] += ds * at(&x.k, j, d);
                                dk[o + j * dh + d] += ds * at(&x.q, i, d);
                            }
                        }
                    }
                }
            });
        }
    });
    result
}

/// Errors of one output against the oracle.
#[derive(Clone, Copy, Debug, Serialize)]
struct Errors {
    max_abs: f64,
    /// max_abs / max |oracle|.
    relative: f64,
    non_finite: usize,
    /// Largest |value| on queries whose keys are all padding (must be 0).
    padding_rows_max: f64,
}

fn errors(got: &[f32], want: &[f64], case: &Case, x: &Inputs) -> Errors {
    let scale = want
        .iter()
        .fold(0.0f64, |m, v| m.max(v.abs()))
        .max(f64::MIN_POSITIVE);
    let mut e = Errors {
        max_abs: 0.0,
        relative: 0.0,
        non_finite: 0,
        padding_rows_max: 0.0,
    };
    let t = case.t;
    // Sequences whose keys are all padding: every value of theirs must be 0.
    let all_padding: Vec<bool> = (0..case.n)
        .map(|seq| {
            x.mask
                .as_ref()
                .is_some_and(|m| m[seq * t..(seq + 1) * t].iter().all(|&p| p))
        })
        .collect();
    let per_sequence = case.h * t * case.dh;
    for (idx, (&g, &w)) in got.iter().zip(want).enumerate() {
        if !g.is_finite() {
            e.non_finite += 1;
            continue;
        }
        e.max_abs = e.max_abs.max((g as f64 - w).abs());
        if all_padding[idx / per_sequence] {
            e.padding_rows_max = e.padding_rows_max.max((g as f64).abs());
        }
    }
    e.relative = e.max_abs / scale;
    e
}

/// One row of the report.
#[derive(Debug, Serialize)]
struct Row {
    case: &'static str,
    shape: [usize; 4],
    masked: bool,
    dtype: Precision,
    path: String,
    /// "forward", or "grad dq" / "grad dk" / "grad dv".
    check: String,
    errors: Option<Errors>,
    tolerance: f64,
    /// Median wall time of one call, synchronised (forward; forward+backward for grads).
    ms: Option<f64>,
    /// Growth of the backend's memory pool during the first call, where reported.
    pool_growth_mib: Option<f64>,
    verdict: Verdict,
    /// Why a path could not run, if it could not.
    note: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Verdict {
    Ok,
    Wrong,
    Error,
    /// The float type is not supported by the backend (not a failure).
    Skipped,
    /// The backend lacks an operation the path needs (it panics with "not
    /// implemented"): a limitation of the backend, which fails loudly where
    /// it is used, not a wrong result (not a failure of the check).
    Unsupported,
}

impl Verdict {
    fn failed(self) -> bool {
        matches!(self, Verdict::Wrong | Verdict::Error)
    }
}

#[derive(Debug, Serialize)]
struct Report {
    backend: String,
    device: String,
    rows: Vec<Row>,
    correct: bool,
}

/// Entry point of `aam-rs diagnose`.
pub fn run(args: DiagnoseArgs) -> Result<()> {
    match args.what {
        Diagnosis::Attention(a) => run_attention(a),
        Diagnosis::Gradients(a) => crate::gradients::run(a),
    }
}

fn run_attention(args: AttentionArgs) -> Result<()> {
    let device_name = args
        .backend
        .devices()
        .ok()
        .and_then(|d| d.into_iter().next())
        .unwrap_or_else(|| "?".into());
    if !args.json {
        print_header(&args.backend.name(), &device_name);
    }
    let mut on_row = |row: &Row| {
        if !args.json {
            print_row(row);
        }
    };
    // A path that panics is reported in its row (with the panic's first
    // line); the default hook would print each panic's whole text as well.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let rows = aam_cli::with_backend!(args.backend, |B, device| Ok(check_backend::<B>(
        &args,
        &device,
        &mut on_row
    )));
    std::panic::set_hook(hook);
    let rows = rows?;
    // A diagnostic that checked nothing must not pass.
    if rows.is_empty() {
        bail!(
            "nothing was checked: --paths {:?} selects no attention path that backend {} has",
            args.paths,
            args.backend.name()
        );
    }
    if rows
        .iter()
        .all(|r| matches!(r.verdict, Verdict::Skipped | Verdict::Unsupported))
    {
        bail!(
            "nothing could be checked: backend {} lacks the float types or operations of every selected path",
            args.backend.name()
        );
    }
    let correct = !rows.iter().any(|r| r.verdict.failed());
    let report = Report {
        backend: args.backend.name(),
        device: device_name,
        rows,
        correct,
    };
    let json = serde_json::to_string_pretty(&report)?;
    if let Some(path) = &args.json_out {
        std::fs::write(path, &json)
            .with_context(|| format!("writing --json-out {}", path.display()))?;
    }
    if args.json {
        println!("{json}");
    } else {
        print_verdict(report.correct);
    }
    if !correct {
        let wrong: Vec<String> = report
            .rows
            .iter()
            .filter(|r| r.verdict.failed())
            .map(|r| {
                let mask = if r.masked { "masked" } else { "unmasked" };
                format!("{} {} on {} {mask} {:?}", r.path, r.check, r.case, r.dtype).to_lowercase()
            })
            .collect();
        let shown = wrong.len().min(4);
        bail!(
            "attention is not computed correctly on backend {}: {} check(s) failed, e.g. {}",
            report.backend,
            wrong.len(),
            wrong[..shown].join("; ")
        );
    }
    Ok(())
}

/// Runs every case, path and float type on backend `B`.
/// Rows are handed to `on_row` as they are measured (a first run on a GPU
/// compiles and autotunes kernels for minutes: the user sees progress, and a
/// job killed by its time limit still shows what was checked).
fn check_backend<B: AttentionBackend>(
    args: &AttentionArgs,
    device: &B::Device,
    on_row: &mut dyn FnMut(&Row),
) -> Vec<Row> {
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let wanted = |p: PathKind| args.paths.is_empty() || args.paths.contains(&p);
    let mut paths = Vec::new();
    if wanted(PathKind::Math) {
        paths.push((
            "math".to_string(),
            Route::Boundary(AttnImplementation::Math),
        ));
    }
    if B::has_fused_attention() && wanted(PathKind::Fused) {
        paths.push((
            "fused".to_string(),
            Route::Boundary(AttnImplementation::Fused),
        ));
    }
    if B::has_fused_attention() && wanted(PathKind::Packed) {
        paths.push(("packed".to_string(), Route::Packed));
    }
    if let (Some(Fault::InvertedMask), Some(math)) = (args.inject_fault, paths.first_mut()) {
        if math.1 == Route::Boundary(AttnImplementation::Math) {
            math.0 = "math+inverted-mask".into();
        }
    }
    let mut rows = Vec::new();
    for case in cases(args.quick, &mut rng) {
        if !args.cases.is_empty() && !args.cases.iter().any(|c| c == case.name) {
            continue;
        }
        let x = inputs(&case, &mut rng);
        let want = oracle(&case, &x);
        for &precision in &args.dtypes {
            let supported =
                precision == Precision::F32 || B::supports_dtype(device, precision.dtype());
            for (name, implementation) in &paths {
                let mut row = Row {
                    case: case.name,
                    shape: [case.n, case.h, case.t, case.dh],
                    masked: case.masked(),
                    dtype: precision,
                    path: name.clone(),
                    check: "forward".into(),
                    errors: None,
                    tolerance: precision.tolerance(),
                    ms: None,
                    pool_growth_mib: None,
                    verdict: Verdict::Ok,
                    note: None,
                };
                if !supported {
                    row.verdict = Verdict::Skipped;
                    row.note = Some("this backend has no such float type".into());
                    on_row(&row);
                    rows.push(row);
                    continue;
                }
                let run = || forward::<B>(&case, &x, device, *implementation, precision, args);
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
                    Ok((got, ms, growth)) => {
                        let e = errors(&got, &want.out, &case, &x);
                        row.verdict = verdict(&e, precision.tolerance());
                        (row.errors, row.ms, row.pool_growth_mib) = (Some(e), Some(ms), growth);
                    }
                    Err(panic) => (row.verdict, row.note) = failure(panic),
                }
                on_row(&row);
                rows.push(row);
            }
        }
        if args.no_backward || !args.dtypes.contains(&Precision::F32) {
            continue;
        }
        for (name, implementation) in &paths {
            let run = || backward::<Autodiff<B>>(&case, &x, device, *implementation, args);
            let base = |check: &str| Row {
                case: case.name,
                shape: [case.n, case.h, case.t, case.dh],
                masked: case.masked(),
                dtype: Precision::F32,
                path: name.clone(),
                check: check.into(),
                errors: None,
                tolerance: GRAD_TOLERANCE,
                ms: None,
                pool_growth_mib: None,
                verdict: Verdict::Ok,
                note: None,
            };
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
                Ok((grads, ms, growth)) => {
                    for ((check, got), want) in ["grad dq", "grad dk", "grad dv"]
                        .into_iter()
                        .zip(grads)
                        .zip([&want.dq, &want.dk, &want.dv])
                    {
                        let e = errors(&got, want, &case, &x);
                        let mut row = base(check);
                        row.verdict = verdict(&e, GRAD_TOLERANCE);
                        (row.errors, row.ms, row.pool_growth_mib) = (Some(e), Some(ms), growth);
                        on_row(&row);
                        rows.push(row);
                    }
                }
                Err(panic) => {
                    let mut row = base("grad");
                    (row.verdict, row.note) = failure(panic);
                    on_row(&row);
                    rows.push(row);
                }
            }
        }
    }
    rows
}

fn verdict(e: &Errors, tolerance: f64) -> Verdict {
    if e.non_finite == 0 && e.padding_rows_max == 0.0 && e.relative <= tolerance {
        Verdict::Ok
    } else {
        Verdict::Wrong
    }
}

/// The verdict and note of a path that panicked: a missing operation of the
/// backend ("not implemented", "not supported") is reported as such, any
/// other panic as an error.
fn failure(panic: Box<dyn std::any::Any + Send>) -> (Verdict, Option<String>) {
    let message = panic_message(panic);
    let lower = message.to_lowercase();
    let missing = [
        "not implemented",
        "unimplemented",
        "not supported",
        "unsupported",
    ]
    .iter()
    .any(|m| lower.contains(m));
    let verdict = if missing {
        Verdict::Unsupported
    } else {
        Verdict::Error
    };
    // Candle's errors carry a backtrace after the first line.
    let first = message.lines().next().unwrap_or_default().to_string();
    (verdict, Some(first))
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "the path panicked".into())
}

/// The device tensors of a case, in `precision`.
fn tensors<B: AttentionBackend>(
    case: &Case,
    x: &Inputs,
    device: &B::Device,
    precision: Precision,
    fault: Option<Fault>,
) -> AttentionInputs<B> {
    let shape = [case.n, case.h, case.t, case.dh];
    let make = |v: &[f32]| {
        let t = Tensor::<B, 4>::from_data(TensorData::new(v.to_vec(), shape), device);
        if precision == Precision::F32 {
            t
        } else {
            t.cast(precision.dtype())
        }
    };
    let mask = x.mask.as_ref().map(|m| {
        let m: Vec<bool> = match fault {
            Some(Fault::InvertedMask) => m.iter().map(|&p| !p).collect(),
            None => m.clone(),
        };
        // Made by a comparison, not from bool data: every backend has that
        // (burn-candle 0.21 cannot build a bool tensor from data).
        let m: Vec<f32> = m.iter().map(|&p| f32::from(u8::from(p))).collect();
        Tensor::<B, 2>::from_data(TensorData::new(m, [case.n, case.t]), device).greater_elem(0.5)
    });
    (make(&x.q), make(&x.k), make(&x.v), mask)
}

fn fault_for(route: Route, args: &AttentionArgs) -> Option<Fault> {
    (route == Route::Boundary(AttnImplementation::Math))
        .then_some(args.inject_fault)
        .flatten()
}

fn host(t: Tensor<impl Backend, 4>) -> Vec<f32> {
    t.cast(DType::F32)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 data")
}

fn pool_growth<B: AttentionBackend>(device: &B::Device, before: Option<u64>) -> Option<f64> {
    let after = B::memory_reserved(device)?;
    Some(after.saturating_sub(before?) as f64 / (1u64 << 20) as f64)
}

/// The model's attention boundary, as the encoders call it (no dropout, no
/// weights), or its packed self-attention: q, k and v laid side by side in
/// one `[N, T, 3D]` tensor, the output `[N, T, D]` split back into heads.
fn attend<B: AttentionBackend>((q, k, v, mask): &AttentionInputs<B>, route: Route) -> Tensor<B, 4> {
    let implementation = match route {
        Route::Boundary(implementation) => implementation,
        Route::Packed => {
            let [n, h, t, dh] = q.dims();
            let merge = |x: &Tensor<B, 4>| x.clone().swap_dims(1, 2).reshape([n, t, h * dh]);
            let qkv = Tensor::cat(vec![merge(q), merge(k), merge(v)], 2);
            return fused_packed_attention(
                qkv,
                None,
                mask.clone(),
                h,
                AttentionDropout::NONE,
                KernelChoice::AUTO,
            )
            .reshape([n, t, h, dh])
            .swap_dims(1, 2);
        }
    };
    let dropout = DropoutConfig::new(0.0).init();
    let mask = mask.clone();
    attention(
        q.clone(),
        k.clone(),
        v.clone(),
        mask,
        &dropout,
        implementation,
        false,
    )
    .0
}

type AttentionInputs<B> = (
    Tensor<B, 4>,
    Tensor<B, 4>,
    Tensor<B, 4>,
    Option<Tensor<B, 2, Bool>>,
);

/// Runs `call` once for its result, measuring the memory pool's growth, then
/// times it: (result, median ms, pool growth in MiB).
fn measure<B: AttentionBackend, T>(
    device: &B::Device,
    reps: usize,
    call: impl Fn() -> T,
) -> (T, f64, Option<f64>) {
    B::memory_cleanup(device);
    let before = B::memory_reserved(device);
    let result = call();
    let _ = B::sync(device);
    let growth = pool_growth::<B>(device, before);
    let ms = median_ms(reps, || {
        let _ = call();
        let _ = B::sync(device);
    });
    (result, ms, growth)
}

/// Forward: (output, median ms, pool growth).
fn forward<B: AttentionBackend>(
    case: &Case,
    x: &Inputs,
    device: &B::Device,
    route: Route,
    precision: Precision,
    args: &AttentionArgs,
) -> (Vec<f32>, f64, Option<f64>) {
    let inputs = tensors::<B>(case, x, device, precision, fault_for(route, args));
    let (out, ms, growth) = measure::<B, _>(device, args.reps, || attend(&inputs, route));
    (host(out), ms, growth)
}

/// Gradients of sum(out ⊙ dout) with respect to q, k and v, in f32.
fn backward<B: AttentionBackend + burn::tensor::backend::AutodiffBackend>(
    case: &Case,
    x: &Inputs,
    device: &B::Device,
    route: Route,
    args: &AttentionArgs,
) -> ([Vec<f32>; 3], f64, Option<f64>) {
    let (q, k, v, mask) = tensors::<B>(case, x, device, Precision::F32, fault_for(route, args));
    let dout = Tensor::<B, 4>::from_data(
        TensorData::new(x.dout.clone(), [case.n, case.h, case.t, case.dh]),
        device,
    );
    let (grads, ms, growth) = measure::<B, _>(device, args.reps, || {
        let inputs = (
            q.clone().require_grad(),
            k.clone().require_grad(),
            v.clone().require_grad(),
            mask.clone(),
        );
        let grads = (attend(&inputs, route) * dout.clone()).sum().backward();
        [inputs.0, inputs.1, inputs.2]
            .map(|t| t.grad(&grads).expect("q, k and v require gradients"))
    });
    (grads.map(host), ms, growth)
}

fn median_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm-up: kernels compiled, autotuned, pool grown
    let mut times: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn print_header(backend: &str, device: &str) {
    println!("aam-rs diagnose attention: backend {backend} ({device})");
    println!(
        "{:<10} {:<16} {:<6} {:<5} {:<20} {:<8} {:>10} {:>10} {:>8} {:>9} {:>9}  verdict",
        "case",
        "shape",
        "mask",
        "dtype",
        "path",
        "check",
        "max_abs",
        "rel_err",
        "tol",
        "ms",
        "pool_MiB"
    );
}

fn print_row(r: &Row) {
    let shape = format!(
        "{}x{}x{}x{}",
        r.shape[0], r.shape[1], r.shape[2], r.shape[3]
    );
    let (abs, rel) = r.errors.map_or(("-".into(), "-".into()), |e| {
        (format!("{:.2e}", e.max_abs), format!("{:.2e}", e.relative))
    });
    let ms = r.ms.map_or("-".into(), |m| format!("{m:.3}"));
    let mem = r.pool_growth_mib.map_or("-".into(), |m| format!("{m:.1}"));
    let mut verdict = match r.verdict {
        Verdict::Ok => "ok".to_string(),
        Verdict::Wrong => "WRONG".to_string(),
        Verdict::Error => "ERROR".to_string(),
        Verdict::Skipped => "skipped".to_string(),
        Verdict::Unsupported => "unsupported by the backend".to_string(),
    };
    if let Some(e) = r.errors {
        if e.non_finite > 0 {
            verdict += &format!(" ({} non-finite)", e.non_finite);
        }
        if e.padding_rows_max != 0.0 {
            verdict += &format!(" (all-padding rows not zero: {:.2e})", e.padding_rows_max);
        }
    }
    if let Some(note) = &r.note {
        verdict += &format!(" ({note})");
    }
    println!(
        "{:<10} {:<16} {:<6} {:<5} {:<20} {:<8} {:>10} {:>10} {:>8.0e} {:>9} {:>9}  {}",
        r.case,
        shape,
        if r.masked { "yes" } else { "no" },
        format!("{:?}", r.dtype).to_lowercase(),
        r.path,
        r.check,
        abs,
        rel,
        r.tolerance,
        ms,
        mem,
        verdict
    );
    // Piped into a log on a cluster: each row as soon as it is measured.
    use std::io::Write;
    let _ = std::io::stdout().flush();
}

fn print_verdict(correct: bool) {
    println!(
        "verdict: {}",
        if correct {
            "every path computes attention correctly on this backend"
        } else {
            "WRONG: at least one path does not compute attention correctly (see above)"
        }
    );
}
