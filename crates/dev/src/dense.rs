//! `aam-dev dense`: is a dense layer's weight gradient right on this
//! backend, at the row counts a real batch gives?
//!
//! A dense layer's weight gradient `dyᵀ·x` sums over every row; aam-rs cuts
//! the rows into parts (`aam_kernels::row_product`: one batched matmul, a
//! sum over the parts, and the leftover rows). `diagnose gradients` points
//! at a parameter; this takes the op apart on random inputs of a chosen
//! shape, against a float64 product on the host: the whole op, each part of
//! the batched matmul, the batched matmul with its left operand copied to a
//! contiguous layout first, and the sum over the parts.

use aam_kernels::{matmul, row_product, ROWS_PER_PART};
use anyhow::{ensure, Result};
use burn::prelude::*;
use clap::Args;
use rand::{Rng, SeedableRng};

use aam_cli::backend::BackendKind;

/// `aam-dev dense`.
#[derive(Args, Debug)]
pub struct DenseArgs {
    /// Backend to check.
    #[arg(long, value_enum, default_value_t = BackendKind::default())]
    backend: BackendKind,
    /// Row counts to check (comma-separated): a batch's ASV tokens (the
    /// default: oral2550's batch 7 at the default model).
    #[arg(long, value_delimiter = ',', default_value = "53152")]
    rows: Vec<usize>,
    /// Widths `(dy, x)` to check, as `PxQ` (comma-separated): the layer's
    /// output and input widths.
    #[arg(long, value_delimiter = ',', default_value = "128x512,512x128")]
    widths: Vec<String>,
    /// Rows per part of the split (the op itself uses `ROWS_PER_PART`).
    #[arg(long, default_value_t = ROWS_PER_PART)]
    part_rows: usize,
    /// Largest accepted difference, relative to the largest entry.
    #[arg(long, default_value_t = 1e-2)]
    tolerance: f64,
}

/// `|want − got|` at its largest, over the largest `|want|`.
fn rel_err(want: &[f64], got: &[f32]) -> f64 {
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    let worst = want
        .iter()
        .zip(got)
        .map(|(&w, &g)| (w - g as f64).abs())
        .fold(
            0f64,
            |m, d| if d.is_nan() { f64::INFINITY } else { m.max(d) },
        );
    if got.iter().all(|g| g.is_finite()) {
        worst / scale
    } else {
        f64::INFINITY
    }
}

/// `aᵀ·b` over rows `range`, in f64. a: `[M, P]`, b: `[M, Q]` → `[P, Q]`.
fn host_product(
    a: &[f32],
    b: &[f32],
    p: usize,
    q: usize,
    range: std::ops::Range<usize>,
) -> Vec<f64> {
    let mut out = vec![0f64; p * q];
    for r in range {
        let (ar, br) = (&a[r * p..(r + 1) * p], &b[r * q..(r + 1) * q]);
        for (i, &x) in ar.iter().enumerate() {
            let row = &mut out[i * q..(i + 1) * q];
            for (o, &y) in row.iter_mut().zip(br) {
                *o += x as f64 * y as f64;
            }
        }
    }
    out
}

fn read<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().expect("f32")
}

pub fn run(args: DenseArgs) -> Result<()> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut failed = false;
    for &m in &args.rows {
        for widths in &args.widths {
            let (p, q) = widths
                .split_once('x')
                .and_then(|(p, q)| Some((p.parse::<usize>().ok()?, q.parse::<usize>().ok()?)))
                .ok_or_else(|| anyhow::anyhow!("--widths {widths}: expected PxQ, e.g. 128x512"))?;
            let a: Vec<f32> = (0..m * p).map(|_| rng.random_range(-1.0..1.0)).collect();
            let b: Vec<f32> = (0..m * q).map(|_| rng.random_range(-1.0..1.0)).collect();
            let rows = args.part_rows;
            let parts = m / rows;
            let want = host_product(&a, &b, p, q, 0..m);
            let want_parts: Vec<Vec<f64>> = (0..parts)
                .map(|k| host_product(&a, &b, p, q, k * rows..(k + 1) * rows))
                .collect();
            // `(what, rel err)` of each check.
            let lines: Vec<(String, f64)> = aam_cli::with_backend!(args.backend, |B, device| {
                let ta = Tensor::<B, 2>::from_data(TensorData::new(a.clone(), [m, p]), &device);
                let tb = Tensor::<B, 2>::from_data(TensorData::new(b.clone(), [m, q]), &device);
                let mut lines = vec![(
                    "row_product (the op)".to_string(),
                    rel_err(&want, &read(row_product(ta.clone(), tb.clone()))),
                )];
                if parts >= 1 {
                    let head_a = ta.narrow(0, 0, parts * rows).reshape([parts, rows, p]);
                    let head_b = tb.narrow(0, 0, parts * rows).reshape([parts, rows, q]);
                    let batched = matmul(head_a.clone().swap_dims(1, 2), head_b.clone());
                    let each = read(batched.clone());
                    let errs: Vec<f64> = (0..parts)
                        .map(|k| rel_err(&want_parts[k], &each[k * p * q..(k + 1) * p * q]))
                        .collect();
                    let bad: Vec<usize> =
                        (0..parts).filter(|&k| errs[k] > args.tolerance).collect();
                    lines.push((
                        format!("batched matmul [{parts}, {p}, {rows}]·[{parts}, {rows}, {q}], lhs a swapped view (parts over tolerance: {bad:?})"),
                        errs.iter().fold(0f64, |x, &y| x.max(y)),
                    ));
                    // The left operand copied to [parts, P, rows], contiguous.
                    let contiguous = head_a
                        .swap_dims(1, 2)
                        .reshape([parts, p * rows])
                        .reshape([parts, p, rows]);
                    let each_c = read(matmul(contiguous, head_b));
                    let errs_c: Vec<f64> = (0..parts)
                        .map(|k| rel_err(&want_parts[k], &each_c[k * p * q..(k + 1) * p * q]))
                        .collect();
                    lines.push((
                        "batched matmul, lhs contiguous".to_string(),
                        errs_c.iter().fold(0f64, |x, &y| x.max(y)),
                    ));
                    // The sum over parts of the backend's own parts.
                    let host_sum: Vec<f64> = (0..p * q)
                        .map(|i| (0..parts).map(|k| each[k * p * q + i] as f64).sum())
                        .collect();
                    lines.push((
                        "sum over the parts (sum_dim 0)".to_string(),
                        rel_err(&host_sum, &read(batched.sum_dim(0))),
                    ));
                }
                Ok::<_, anyhow::Error>(lines)
            })?;
            println!("rows {m}, widths {p}x{q}, {parts} parts of {rows}:");
            for (what, err) in &lines {
                let over = err.is_nan() || *err > args.tolerance;
                println!(
                    "  {what}: rel err {err:.2e}{}",
                    if over { " OVER TOLERANCE" } else { "" }
                );
                failed |= over;
            }
        }
    }
    ensure!(
        !failed,
        "a product differs by more than --tolerance {} (above)",
        args.tolerance
    );
    println!("every product within {}", args.tolerance);
    Ok(())
}
