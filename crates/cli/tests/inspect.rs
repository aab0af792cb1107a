//! `aam-rs inspect` through the binary: real inputs that a run accepts exit 0
//! with the right counts; inputs it would stop on exit non-zero and say why.
//!
//! The oral2550 study is read from `../shared/data` beside the repository
//! (as `crates/data/tests/real_data.rs` locates it). Unlike those tests, these
//! fail when the folder is absent: the acceptance check of `inspect` is on
//! that data, and a silent pass would hide that it never ran.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// `../shared/data` beside the checkout; as in `crates/data/tests/real_data.rs`,
/// a checkout without it prints a note and the test returns.
fn shared_data_dir() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!("note: {} is absent; skipping this test", dir.display());
        None
    }
}

macro_rules! shared_data {
    () => {
        match shared_data_dir() {
            Some(d) => d,
            None => return,
        }
    };
}

fn demo(file: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../data/demo")
        .join(file)
        .display()
        .to_string()
}

fn aam_rs(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_aam-rs"))
        .args(args)
        .output()
        .expect("runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}):\n{}",
            text(&out.stdout)
        )
    })
}

#[test]
fn oral2550_passes_with_full_coverage() {
    let d = shared_data!().join("oral2550");
    let (table, matrix, map) = (
        d.join("oral_2550.biom"),
        d.join("unifrac.unweighted.h5"),
        d.join("oral_2550_map.txt"),
    );
    let out = aam_rs(&[
        "inspect",
        "--table",
        table.to_str().unwrap(),
        "--unifrac-matrix",
        matrix.to_str().unwrap(),
        "--metadata",
        map.to_str().unwrap(),
        "--metadata-column",
        "age",
        "--rarefy-depth",
        "1000",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let s = json(&out);
    assert_eq!(s["ok"], true);
    assert_eq!(s["problems"], Value::Array(vec![]));
    assert_eq!(s["table"]["samples"], 2537);
    assert_eq!(s["table"]["asvs"], 5574);
    // The study is already rarefied to 1,000 reads per sample.
    assert_eq!(s["table"]["depth"]["min"], 1000.0);
    assert_eq!(s["table"]["depth"]["max"], 1000.0);
    assert_eq!(s["table"]["below_depth"], 0);
    assert_eq!(s["rarefaction"]["samples"], 2537);
    assert_eq!(s["sequences"]["length"]["max"], 100.0);
    for part in ["matrix", "metadata"] {
        assert_eq!(s[part]["covered"], 2537, "{part}");
        assert_eq!(s[part]["missing"], 0, "{part}");
    }
    assert_eq!(s["target"]["kind"], "numeric");
    assert_eq!(s["target"]["with_value"], 2537);
    let (min, max) = (
        s["target"]["range"]["min"].as_f64().unwrap(),
        s["target"]["range"]["max"].as_f64().unwrap(),
    );
    assert!(
        (18.0..=85.0).contains(&min) && (18.0..=85.0).contains(&max) && min < max,
        "age {min}..{max}"
    );
    assert_eq!(s["usable_samples"], 2537);
}

#[test]
fn a_matrix_of_another_study_fails_naming_missing_ids() {
    let mp_matrix = shared_data!().join("moving-pictures/unifrac.unweighted.h5");
    let (table, map) = (demo("demo.biom"), demo("demo_map.txt"));
    let base = [
        "inspect",
        "--table",
        &table,
        "--unifrac-matrix",
        mp_matrix.to_str().unwrap(),
        "--rarefy-depth",
        "1000",
    ];

    // The readable report: every demo sample is missing, and the reasons are on stderr.
    let out = aam_rs(&base);
    assert!(!out.status.success());
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        stdout.contains("problem:") && stdout.contains("NOT OK"),
        "{stdout}"
    );
    assert!(
        stderr.contains(
            "64 of the 64 samples kept by rarefaction are missing from the distance matrix"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("moving-pictures/unifrac.unweighted.h5")
            && stderr.contains("(and 54 more)"),
        "{stderr}"
    );

    // JSON: the same, with the first IDs listed; they are the demo's samples.
    let mut args = base.to_vec();
    args.extend(["--metadata", &map, "--metadata-column", "age", "--json"]);
    let out = aam_rs(&args);
    assert!(!out.status.success());
    let s = json(&out);
    assert_eq!(s["ok"], false);
    assert_eq!(s["matrix"]["covered"], 0);
    assert_eq!(s["matrix"]["missing"], 64);
    let first = s["matrix"]["missing_first"].as_array().unwrap();
    assert_eq!(first.len(), 10);
    let demo_ids = std::fs::read_to_string(demo("unifrac.sample_ids.txt")).unwrap();
    let id = first[0].as_str().unwrap();
    assert!(demo_ids.lines().any(|l| l == id), "{id}");
    let problems = s["problems"].as_array().unwrap();
    assert!(
        problems.iter().any(|p| p.as_str().unwrap().contains(id)),
        "{problems:?}"
    );
    // The metadata matches: only the matrix is at fault, and dropping would leave nothing.
    assert_eq!(s["metadata"]["missing"], 0);
    assert!(
        problems
            .last()
            .unwrap()
            .as_str()
            .unwrap()
            .contains("0 sample(s) would be left"),
        "{problems:?}"
    );
}

#[test]
fn a_partial_matrix_lists_the_first_missing_samples() {
    // The 64-sample demo matrix against the full oral2550 table.
    let table = shared_data!().join("oral2550/oral_2550.biom");
    let matrix = demo("unifrac.unweighted.h5");
    let args = [
        "inspect",
        "--table",
        table.to_str().unwrap(),
        "--unifrac-matrix",
        &matrix,
        "--rarefy-depth",
        "1000",
        "--json",
    ];
    let out = aam_rs(&args);
    assert!(!out.status.success());
    let s = json(&out);
    assert_eq!(
        (
            s["matrix"]["covered"].as_u64(),
            s["matrix"]["missing"].as_u64()
        ),
        (Some(64), Some(2537 - 64))
    );
    assert!(
        text(&out.stderr).contains(&format!("(and {} more)", 2537 - 64 - 10)),
        "{}",
        text(&out.stderr)
    );
    // With --drop-missing the run would go on with the 64.
    let mut args = args.to_vec();
    args.push("--drop-missing");
    let out = aam_rs(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = json(&out);
    assert_eq!(s["usable_samples"], 64);
    assert_eq!(
        s["warnings"].as_array().unwrap().len(),
        1,
        "{}",
        s["warnings"]
    );
}

#[test]
fn demo_set_passes() {
    let (table, matrix, map) = (
        demo("demo.biom"),
        demo("unifrac.unweighted.h5"),
        demo("demo_map.txt"),
    );
    let out = aam_rs(&[
        "inspect",
        "--table",
        &table,
        "--unifrac-matrix",
        &matrix,
        "--metadata",
        &map,
        "--metadata-column",
        "age",
        "--rarefy-depth",
        "1000",
    ]);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        text(&out.stderr)
    );
    for expected in [
        "64 samples, 534 ASVs",
        "has 64 of the 64 samples kept by rarefaction",
        "\"age\" (numeric): 64 with a value",
        "OK:",
    ] {
        assert!(stdout.contains(expected), "{expected:?} not in:\n{stdout}");
    }
    assert!(!stdout.contains("warning:"), "{stdout}");
}

#[test]
fn unreachable_depth_and_bad_files_are_reported() {
    let (table, map) = (demo("demo.biom"), demo("demo_map.txt"));
    // The default depth, 5,000, is above the demo's 1,000 reads per sample.
    let out = aam_rs(&["inspect", "--table", &table, "--json"]);
    assert!(!out.status.success());
    let s = json(&out);
    assert_eq!(s["table"]["below_depth"], 64);
    assert!(
        text(&out.stderr).contains("rarefaction to depth 5000 leaves no sample"),
        "{}",
        text(&out.stderr)
    );

    // An absent column, a matrix without sample IDs: named with their files.
    let tmp = tempfile::tempdir().unwrap();
    let npy = tmp.path().join("lonely.npy");
    std::fs::copy(demo("unifrac.weighted_normalized.npy"), &npy).unwrap();
    let out = aam_rs(&[
        "inspect",
        "--table",
        &table,
        "--rarefy-depth",
        "1000",
        "--unifrac-matrix",
        npy.to_str().unwrap(),
        "--metadata",
        &map,
        "--metadata-column",
        "agee",
    ]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("reading --unifrac-matrix") && stderr.contains("lonely.npy"),
        "{stderr}"
    );
    assert!(
        stderr.contains("demo_map.txt: no column \"agee\""),
        "{stderr}"
    );

    // A table that cannot be read stops at once, naming the flag and the file.
    let missing = tmp.path().join("nope.biom");
    let out = aam_rs(&["inspect", "--table", missing.to_str().unwrap()]);
    assert!(!out.status.success() && out.stdout.is_empty());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("reading --table") && stderr.contains("nope.biom"),
        "{stderr}"
    );
}
