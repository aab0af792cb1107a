//! End to end through the binary: `aam-rs convert` on a reference checkpoint,
//! then `aam-rs forward` on the fixture's inputs, reproduces the reference
//! outputs; bad inputs fail with messages that name the file and the fault.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

use ndarray::ArrayD;
use ndarray_npy::{NpzReader, NpzWriter, WriteNpyExt};

/// Same bound as the library-level parity tests: fp32 vs fp32 CPU reference.
const FORWARD_ATOL: f32 = 1e-5;

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/reference")
        .join(case)
}

fn aam_rs(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_aam-rs"))
        .args(args)
        .output()
        .expect("runs")
}

fn npz_f32(path: &Path) -> BTreeMap<String, ArrayD<f32>> {
    let mut npz = NpzReader::new(File::open(path).unwrap()).unwrap();
    let names = npz.names().unwrap();
    names
        .into_iter()
        .filter_map(|n| {
            npz.by_name::<ndarray::OwnedRepr<f32>, ndarray::IxDyn>(&n)
                .ok()
                .map(|a| (n.trim_end_matches(".npy").into(), a))
        })
        .collect()
}

fn npz_i64(path: &Path) -> BTreeMap<String, ArrayD<i64>> {
    let mut npz = NpzReader::new(File::open(path).unwrap()).unwrap();
    let names = npz.names().unwrap();
    names
        .into_iter()
        .filter_map(|n| {
            npz.by_name::<ndarray::OwnedRepr<i64>, ndarray::IxDyn>(&n)
                .ok()
                .map(|a| (n.trim_end_matches(".npy").into(), a))
        })
        .collect()
}

/// Converts `case`, runs forward, and compares every output with the reference.
fn convert_and_forward(case: &str, convert_flags: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture(case);
    let model_dir = tmp.path().join("model");
    let checkpoint = dir.join("state_dict.pt");
    let mut args = vec![
        "convert",
        "--from",
        checkpoint.to_str().unwrap(),
        "--out",
        model_dir.to_str().unwrap(),
    ];
    args.extend_from_slice(convert_flags);
    let out = aam_rs(&args);
    assert!(
        out.status.success(),
        "convert failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        model_dir.join("config.json").is_file() && model_dir.join("model.safetensors").is_file()
    );

    // Inputs as a user would have them: tokens .npy, categoricals .npz by column.
    let inputs = npz_i64(&dir.join("inputs.npz"));
    let tokens = tmp.path().join("tokens.npy");
    inputs["tokens"]
        .write_npy(File::create(&tokens).unwrap())
        .unwrap();
    let mut args = vec![
        "forward".to_string(),
        "--model".into(),
        model_dir.to_str().unwrap().into(),
    ];
    args.extend(["--tokens".into(), tokens.to_str().unwrap().into()]);
    let cats: Vec<(&String, &ArrayD<i64>)> = inputs
        .iter()
        .filter(|(k, _)| k.starts_with("cat."))
        .collect();
    if !cats.is_empty() {
        let path = tmp.path().join("categorical.npz");
        let mut npz = NpzWriter::new(File::create(&path).unwrap());
        for (k, v) in cats {
            npz.add_array(k.trim_start_matches("cat."), v).unwrap();
        }
        npz.finish().unwrap();
        args.extend(["--categorical".into(), path.to_str().unwrap().into()]);
    }
    let outputs = tmp.path().join("out.npz");
    args.extend(["--out".into(), outputs.to_str().unwrap().into()]);
    let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = aam_rs(&arg_refs);
    assert!(
        out.status.success(),
        "forward failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let ours = npz_f32(&outputs);
    let theirs = npz_f32(&dir.join("outputs.npz"));
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>(),
        "{case}: output names"
    );
    for (key, want) in &theirs {
        let got = &ours[key];
        assert_eq!(got.shape(), want.shape(), "{case}/{key}: shape");
        let diff = got
            .iter()
            .zip(want.iter())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(diff <= FORWARD_ATOL, "{case}/{key}: max |Δ| = {diff:e}");
    }
}

#[test]
fn trainer_checkpoint_of_a_pretrained_encoder() {
    convert_and_forward("encoder_unifrac", &[]);
}

#[test]
fn ddp_prefixed_predictor_with_categoricals() {
    convert_and_forward(
        "predictor_cat_concat",
        &["--conditional-scaling-columns", "season"],
    );
}

#[test]
fn out_of_vocabulary_token_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let model_dir = tmp.path().join("model");
    let ckpt = fixture("encoder_faith_pd").join("state_dict.pt");
    let out = aam_rs(&[
        "convert",
        "--from",
        ckpt.to_str().unwrap(),
        "--out",
        model_dir.to_str().unwrap(),
        "--stack-activation",
        "encoder=relu",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut tokens = npz_i64(&fixture("encoder_faith_pd").join("inputs.npz"))["tokens"].clone();
    tokens[[1, 2, 3]] = 9;
    let path = tmp.path().join("bad_tokens.npy");
    tokens.write_npy(File::create(&path).unwrap()).unwrap();
    let out = aam_rs(&[
        "forward",
        "--model",
        model_dir.to_str().unwrap(),
        "--tokens",
        path.to_str().unwrap(),
        "--out",
        tmp.path().join("o.npz").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad_tokens.npy") && stderr.contains("token 9 at index [1, 2, 3]"),
        "{stderr}"
    );
    assert!(!tmp.path().join("o.npz").exists(), "no output on failure");
}

#[test]
fn missing_checkpoint_and_wrong_file_are_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let out = aam_rs(&[
        "convert",
        "--from",
        "/nonexistent/model.pt",
        "--out",
        tmp.path().to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/model.pt"));
    let junk = tmp.path().join("junk.pt");
    std::fs::write(&junk, b"this is not a checkpoint").unwrap();
    let out = aam_rs(&[
        "convert",
        "--from",
        junk.to_str().unwrap(),
        "--out",
        tmp.path().join("m").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("junk.pt") && stderr.contains("not a readable PyTorch checkpoint"),
        "{stderr}"
    );
}
