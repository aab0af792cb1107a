//! `aam-dev` through the binary: `step` times training steps of a tiny model
//! on a fixed batch (and its loss falls); `dense` checks the split weight
//! gradient part by part and fails when a part is over tolerance.

use std::process::Command;

use serde_json::Value;

/// `aam-dev step` on a tiny model: it trains (the loss of the fixed
/// batch falls), reports every timed step and says what it cannot measure.
#[test]
fn step_times_training_steps_on_a_fixed_batch() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("step.json");
    let tiny = [
        "step",
        "--asvs-per-sample",
        "5,9,3,7",
        "--token-limit",
        "16",
        "--max-bp",
        "30",
        "--embedding-dim",
        "16",
        "--attention-heads",
        "2",
        "--attention-layers",
        "1",
        "--lr",
        "1e-2",
        "--warmup",
        "1",
        "--steps",
        "6",
    ];
    let out = Command::new(env!("CARGO_BIN_EXE_aam-dev"))
        .args(tiny)
        .arg("--json-out")
        .arg(&json)
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("samples/s"), "{stdout}");
    let r: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(r["batch_size"], 4);
    assert_eq!(r["step_times_ms"].as_array().unwrap().len(), 6);
    assert!(r["step_ms"].as_f64().unwrap() > 0.0);
    assert!(r["peak_reserved_mib"].is_null() && r["peak_in_use_mib"].is_null());
    let losses: Vec<f64> = r["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert!(losses.iter().all(|l| l.is_finite()));
    assert!(
        losses[5] < losses[0],
        "the fixed batch's loss should fall: {losses:?}"
    );
    // The host's threads' CPU time per step (Linux: /proc, in 10 ms ticks,
    // so only threads that ran a tick are listed), busiest first.
    let threads = r["thread_cpu_ms"].as_array().unwrap();
    let ms: Vec<f64> = threads.iter().map(|t| t[1].as_f64().unwrap()).collect();
    assert!(ms.iter().all(|&m| m > 0.0) && ms.windows(2).all(|w| w[0] >= w[1]));
    let timed_ms: f64 = r["step_times_ms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .sum();
    if cfg!(target_os = "linux") && timed_ms > 100.0 {
        assert!(!threads.is_empty(), "no thread CPU time: {r}");
        assert!(stdout.contains("thread CPU (ms per step)"), "{stdout}");
    }

    // A binary built without the sampler says so, before running anything.
    let out = Command::new(env!("CARGO_BIN_EXE_aam-dev"))
        .args(tiny)
        .arg("--cpu-profile")
        .arg(dir.path().join("cpu.folded"))
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if cfg!(feature = "cpu-profile") {
        assert!(out.status.success(), "{stderr}");
        let folded = std::fs::read_to_string(dir.path().join("cpu.folded")).unwrap();
        assert!(folded.lines().all(|l| l.rsplit_once(' ').is_some()));
    } else {
        assert!(!out.status.success());
        assert!(stderr.contains("--cpu-profile") && stderr.contains("cpu-profile` feature"));
    }

    let out = Command::new(env!("CARGO_BIN_EXE_aam-dev"))
        .args(["step", "--asvs-per-sample", "5"])
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--asvs-per-sample"));
}

/// `aam-dev dense` takes the split weight gradient apart (the whole
/// op, the batched parts, the sum over them) against a float64 product.
#[test]
fn dense_checks_the_split_weight_gradient_part_by_part() {
    let dense = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_aam-dev"))
            .args(["dense", "--backend", "ndarray", "--widths", "16x8"])
            .args(args)
            .output()
            .expect("runs")
    };
    let out = dense(&["--rows", "5000,2100", "--part-rows", "1024"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("4 parts of 1024"), "{stdout}");
    assert_eq!(stdout.matches("rel err").count(), 8, "{stdout}");
    assert!(stdout.contains("every product within"), "{stdout}");
    // A tolerance nothing meets fails the command.
    let out = dense(&["--rows", "3000", "--tolerance", "0"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("OVER TOLERANCE"));
}

/// A backend that `aam-cli` has and this binary was built without (the
/// workspace's test build turns on `aam-cli/wgpu`, not `aam-dev/wgpu`) is an
/// error naming the cargo feature, not a panic.
#[test]
fn a_backend_not_built_in_is_an_error_naming_its_feature() {
    if cfg!(feature = "wgpu") {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_aam-dev"))
        .args(["dense", "--backend", "wgpu", "--widths", "16x8"])
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("build it with the cargo feature `wgpu`")
            || stderr.contains("invalid value 'wgpu'"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}
