//! `aam-rs diagnose` through the binary. `attention` passes a correct
//! backend, fails (exit 1, naming the path) when a wrong attention is injected,
//! and on wgpu (lavapipe in CI) checks the fused kernel (through the attention
//! boundary and on a packed `qkv`) beside the math path.
//! `gradients` compares a backend's training step with the CPU's on the demo
//! data, and fails when one gradient is off.

use std::process::{Command, Output};

use serde_json::Value;

fn diagnose(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_aam-rs"))
        .args(["diagnose", "attention", "--quick", "--reps", "1"])
        .args(args)
        .output()
        .expect("runs")
}

fn report(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn rows(report: &Value) -> &Vec<Value> {
    report["rows"].as_array().expect("rows")
}

#[test]
fn ndarray_math_path_agrees_with_the_f64_oracle() {
    math_path_agrees_with_the_f64_oracle("ndarray");
}

/// burn-candle 0.21 cannot build a bool tensor from data; the diagnostic's
/// masks do not need it, so candle is checked, not reported wrong.
#[cfg(feature = "candle")]
#[test]
fn candle_math_path_agrees_with_the_f64_oracle() {
    math_path_agrees_with_the_f64_oracle("candle");
}

/// The math path (the only one of a CPU backend) right in f32 on every
/// case, forward and gradients; other float types skipped or right.
fn math_path_agrees_with_the_f64_oracle(backend: &str) {
    let out = diagnose(&["--backend", backend, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = report(&out);
    assert_eq!(r["correct"], true);
    let rows = rows(&r);
    // Every case (masked and unmasked) checked forward and in three gradients.
    let f32_rows: Vec<&Value> = rows.iter().filter(|row| row["dtype"] == "f32").collect();
    assert_eq!(f32_rows.len(), 6 * 4, "6 cases x (forward + dq, dk, dv)");
    for row in &f32_rows {
        assert_eq!(row["path"], "math");
        assert_eq!(row["verdict"], "ok", "{row}");
        // On the CPU f32 is far inside the (TF32-sized) tolerance.
        let rel = row["errors"]["relative"].as_f64().unwrap();
        assert!(rel < 1e-5, "{row}");
        assert_eq!(row["errors"]["padding_rows_max"], 0.0, "{row}");
    }
    // Where the backend has no f16/bf16 (ndarray) or no half-precision
    // matmul on the CPU (candle) that is said, not failed.
    assert!(rows.iter().filter(|row| row["dtype"] != "f32").all(|row| {
        ["skipped", "unsupported", "ok"].contains(&row["verdict"].as_str().unwrap())
    }));
}

#[test]
fn an_inverted_mask_is_reported_wrong_and_fails_the_command() {
    let out = diagnose(&[
        "--dtypes",
        "f32",
        "--no-backward",
        "--inject-fault",
        "inverted-mask",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("WRONG"), "{stdout}");
    assert!(
        stderr.contains("attention is not computed correctly on backend ndarray")
            && stderr.contains("math+inverted-mask forward on asv masked"),
        "{stderr}"
    );
    // The table: every masked case wrong, every unmasked one right.
    let json = diagnose(&[
        "--dtypes",
        "f32",
        "--no-backward",
        "--inject-fault",
        "inverted-mask",
        "--json",
    ]);
    assert_eq!(json.status.code(), Some(1));
    let r = report(&json);
    assert_eq!(r["correct"], false);
    for row in rows(&r) {
        let expected = if row["masked"] == true { "wrong" } else { "ok" };
        assert_eq!(row["verdict"], expected, "{row}");
    }
}

#[test]
fn bad_arguments_name_the_flag() {
    let out = diagnose(&["--dtypes", "f8"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--dtypes"));
    let out = diagnose(&["--cases", "asv,sampel"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--cases"));
    // Selecting no path this backend has checks nothing, which must not pass.
    let out = diagnose(&["--backend", "ndarray", "--paths", "fused"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing was checked"));
}

/// The sample level (masked and not) and the two edge cases; the ASV level's
/// shapes of the fused and packed kernels are the `kernels` tests'. (On
/// lavapipe with an empty shader cache, 2 cores, 2026-11-30: 90 s for these
/// four cases, 125 s with the ASV level's two.)
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_fused_packed_and_math_paths_agree_with_the_f64_oracle() {
    let out = diagnose(&[
        "--backend",
        "wgpu",
        "--dtypes",
        "f32",
        "--cases",
        "sample,edge-dh16,edge-dh64",
        "--json",
    ]);
    let r = report(&out);
    assert!(
        out.status.success(),
        "{r:#}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = rows(&r);
    for path in ["math", "fused", "packed"] {
        let of_path: Vec<&Value> = rows.iter().filter(|row| row["path"] == path).collect();
        assert_eq!(
            of_path.len(),
            4 * 4,
            "{path}: 4 cases x (forward + 3 gradients)"
        );
        assert!(of_path.iter().all(|row| row["verdict"] == "ok"), "{path}");
    }
}

/// `aam-rs diagnose gradients` on a small model and the demo data (real
/// 100-nt ASVs in 150-nt rows): the arguments, the JSON report, and the
/// command's failure when one gradient is off by 5% (`--inject-fault`).
fn gradients(backend: &str, extra: &[&str]) -> (Output, Value) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("gradients.json");
    let demo = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/demo");
    let out = Command::new(env!("CARGO_BIN_EXE_aam-rs"))
        .args(["diagnose", "gradients", "--backend", backend])
        .args(["--table", &format!("{demo}/demo.biom")])
        .args(["--unifrac-matrix", &format!("{demo}/unifrac.unweighted.h5")])
        .args(["--rarefy-depth", "500", "--token-limit", "256"])
        .args([
            "--embedding-dim",
            "32",
            "--attention-heads",
            "2",
            "--attention-layers",
            "1",
        ])
        .args(["--batches", "1", "--json-out", json.to_str().unwrap()])
        .args(extra)
        .output()
        .expect("runs");
    let report = std::fs::read(&json)
        .map(|bytes| serde_json::from_slice(&bytes).expect("JSON report"))
        .unwrap_or(Value::Null);
    (out, report)
}

#[test]
fn gradients_on_the_cpu_agree_and_an_injected_fault_fails() {
    // Weights drawn on the checked backend, here the CPU itself: the same
    // draw, so every parameter passes the draw check.
    let (out, r) = gradients("ndarray", &["--weights-on", "backend"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(r["passed"], true);
    let weights = r["weights"].as_array().unwrap();
    assert!(weights.len() > 20, "{weights:?}");
    assert!(
        weights.iter().all(|w| w["problem"].is_null()),
        "{weights:?}"
    );
    assert!(stdout.contains("0 of"), "{stdout}");
    let batch = &r["batches"][0];
    // The same computation on both sides: equal to the last bit.
    assert_eq!(batch["worst_rel_err"], 0.0, "{batch}");
    let norm = batch["grad_norm_cpu"].as_f64().unwrap();
    assert!(norm > 0.0);
    let device = batch["grad_norm_backend_device"].as_f64().unwrap();
    assert!((device - norm).abs() <= 1e-5 * norm, "{batch}");
    assert!(batch["asvs"].as_u64().unwrap() > 8, "{batch}");

    let (out, r) = gradients("ndarray", &["--inject-fault"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(r["passed"], false);
    let failures = r["batches"][0]["failures"].as_array().unwrap();
    assert_eq!(failures.len(), 1, "{failures:?}");
    let rel = failures[0][1].as_f64().unwrap();
    assert!((rel - 0.05).abs() < 1e-3, "{failures:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("over tolerance"), "{stdout}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("differs from the CPU's"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let (out, _) = gradients("ndarray", &["--batch-size", "3"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--batch-size"));

    let (out, _) = gradients(
        "ndarray",
        &[
            "--weights-on",
            "backend",
            "--checkpoint",
            "ckpt.safetensors",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--weights-on"));
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_gradients_equal_the_cpus_on_the_demo_data() {
    // Weights drawn on wgpu, as `pretrain` draws them: CubeCL's random
    // kernels must give the CPU's distributions.
    let (out, r) = gradients("wgpu", &["--tolerance", "1e-3", "--weights-on", "backend"]);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let batch = &r["batches"][0];
    let (cpu, gpu) = (
        batch["grad_norm_cpu"].as_f64().unwrap(),
        batch["grad_norm_backend"].as_f64().unwrap(),
    );
    assert!((cpu - gpu).abs() <= 1e-4 * cpu, "{batch}");
    let device = batch["grad_norm_backend_device"].as_f64().unwrap();
    assert!((device - gpu).abs() <= 1e-4 * gpu, "{batch}");
    assert!(r["weights"].as_array().unwrap().len() > 20);
}
