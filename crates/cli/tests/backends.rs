//! `aam-rs backends` and `forward --backend X` through the binary, for every
//! backend compiled into it (this crate's cargo features). Numerical parity
//! per backend is `tests/backend_parity.rs`'s job; here the question is the
//! wiring: the right backend runs and computes this model.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

use ndarray::ArrayD;
use ndarray_npy::{NpzReader, WriteNpyExt};

/// Loose on purpose (the loosest backend bound, CUDA's TF32 matmul): a wrong
/// backend wiring gives unrelated numbers, far above this.
const WIRING_RTOL: f32 = 1e-2;

/// Every backend feature of this build, by its `--backend` name.
fn compiled() -> Vec<&'static str> {
    let mut kinds = vec!["ndarray"];
    if cfg!(feature = "candle") {
        kinds.push("candle");
    }
    if cfg!(feature = "wgpu") {
        kinds.push("wgpu");
    }
    if cfg!(feature = "cuda") {
        kinds.push("cuda");
    }
    if cfg!(feature = "rocm") {
        kinds.push("rocm");
    }
    if cfg!(feature = "tch") {
        kinds.extend(["tch", "tch-gpu"]);
    }
    kinds
}

fn aam_rs(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_aam-rs"))
        .args(args)
        .output()
        .expect("runs")
}

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/reference")
        .join(case)
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

#[test]
fn backends_lists_every_compiled_backend_and_nothing_else() {
    let out = aam_rs(&["backends"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let listed: Vec<&str> = stdout
        .lines()
        .filter(|l| !l.starts_with(' '))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(listed, compiled(), "{stdout}");
    // The CPU backends always see the CPU.
    let ndarray_block: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("ndarray"))
        .skip(1)
        .take(1)
        .collect();
    assert!(ndarray_block[0].contains("[0] cpu"), "{stdout}");
}

/// CubeCL finds a compiled kernel on disk by its type name, not its code:
/// each build of the kernels keeps its own folder, so that a newer build
/// never loads an older one's kernels from a shared cache.
#[test]
fn each_build_keeps_its_compiled_gpu_kernels_in_a_folder_of_its_own() {
    if !cfg!(any(feature = "cuda", feature = "rocm")) {
        return;
    }
    // A folder with a Cargo.toml: CubeCL's cache root is its `target/`.
    let dir = std::env::temp_dir().join(format!("aam-kernel-cache-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // CubeCL starts from the working directory as the OS resolves it.
    let dir = dir.canonicalize().unwrap();
    std::fs::write(dir.join("Cargo.toml"), "").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_aam-rs"))
        .arg("backends")
        .current_dir(&dir)
        .output()
        .expect("runs");
    std::fs::remove_dir_all(&dir).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let roots: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("compiled kernels: "))
        .collect();
    let gpu_kinds = compiled()
        .iter()
        .filter(|k| ["cuda", "rocm"].contains(k))
        .count();
    assert_eq!(roots.len(), gpu_kinds, "{stdout}");
    for root in roots {
        let build = Path::new(root)
            .strip_prefix(dir.join("target"))
            .unwrap_or_else(|_| panic!("{root} is not below {}", dir.display()));
        let name = build.to_str().unwrap();
        let hash = name
            .strip_prefix("aam-kernels-")
            .unwrap_or_else(|| panic!("{name}"));
        assert!(
            hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()),
            "{name}"
        );
    }
}

#[test]
fn unknown_backend_is_refused_with_the_compiled_list() {
    let out = aam_rs(&[
        "forward",
        "--backend",
        "nonesuch",
        "--model",
        "m",
        "--tokens",
        "t.npy",
        "--out",
        "o.npz",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    for kind in compiled() {
        assert!(stderr.contains(kind), "{kind} not offered: {stderr}");
    }
}

/// Which compiled backends `aam-rs backends` reports a device for.
fn available() -> BTreeMap<String, bool> {
    let out = aam_rs(&["backends"]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<&str> = stdout.lines().collect();
    lines
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.starts_with(' '))
        .map(|(i, l)| {
            let name = l.split_whitespace().next().unwrap().to_string();
            (
                name,
                lines
                    .get(i + 1)
                    .is_some_and(|next| next.trim_start().starts_with("[0]")),
            )
        })
        .collect()
}

/// `forward --backend X` for every compiled backend: where `aam-rs backends`
/// lists a device it matches ndarray on the same model and tokens; where it
/// lists none (a GPU backend on a machine without that GPU or driver) it fails
/// with an error message, not a panic, and writes nothing.
#[test]
fn forward_on_every_compiled_backend_matches_ndarray_or_says_why_not() {
    let tmp = tempfile::tempdir().unwrap();
    let model_dir = tmp.path().join("model");
    let ckpt = fixture("encoder_unifrac").join("state_dict.pt");
    let out = aam_rs(&[
        "convert",
        "--from",
        ckpt.to_str().unwrap(),
        "--out",
        model_dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut inputs =
        NpzReader::new(File::open(fixture("encoder_unifrac").join("inputs.npz")).unwrap()).unwrap();
    let tokens: ArrayD<i64> = inputs.by_name("tokens").unwrap();
    let tokens_path = tmp.path().join("tokens.npy");
    tokens
        .write_npy(File::create(&tokens_path).unwrap())
        .unwrap();

    let forward = |kind: &str| {
        let path = tmp.path().join(format!("{kind}.npz"));
        let out = aam_rs(&[
            "forward",
            "--backend",
            kind,
            "--model",
            model_dir.to_str().unwrap(),
            "--tokens",
            tokens_path.to_str().unwrap(),
            "--out",
            path.to_str().unwrap(),
        ]);
        (out, path)
    };
    let (out, path) = forward("ndarray");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want = npz_f32(&path);
    let available = available();
    assert!(
        available["ndarray"] && available.get("candle").copied().unwrap_or(true),
        "CPU backends: {available:?}"
    );
    for kind in compiled().into_iter().skip(1) {
        let (out, path) = forward(kind);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !available[kind] {
            assert!(
                !out.status.success() && !path.exists(),
                "{kind} has no device but forward ran"
            );
            assert!(
                stderr.contains("error: ") && !stderr.contains("panicked"),
                "{kind}: {stderr}"
            );
            continue;
        }
        assert!(out.status.success(), "{kind}: {stderr}");
        let got = npz_f32(&path);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{kind}: output names"
        );
        for (key, w) in &want {
            let g = &got[key];
            assert_eq!(g.shape(), w.shape(), "{kind}/{key}: shape");
            let scale = w.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let diff = g
                .iter()
                .zip(w.iter())
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                diff <= WIRING_RTOL * scale,
                "{kind}/{key}: max |Δ| {diff:e} vs scale {scale:e}"
            );
        }
    }
}

/// `aam-rs unifrac --gpu X` on the demo: where X is compiled in and sees a
/// device, the weighted matrix of the CPU path within 1e-5 (wgpu computes in
/// single precision); otherwise an error that names why, and no file.
#[test]
fn unifrac_on_each_gpu_backend_matches_the_cpu_or_says_why_not() {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/demo");
    let (table, tree) = (demo.join("demo.biom"), demo.join("tree.nwk"));
    let tmp = tempfile::tempdir().unwrap();
    let run = |gpu: Option<&str>, out: &Path| {
        let mut args = vec![
            "unifrac",
            "--table",
            table.to_str().unwrap(),
            "--tree",
            tree.to_str().unwrap(),
            "--method",
            "weighted_normalized",
            "--output",
            out.to_str().unwrap(),
        ];
        if let Some(gpu) = gpu {
            args.extend(["--gpu", gpu]);
        }
        aam_rs(&args)
    };
    let cpu = tmp.path().join("cpu.tsv");
    assert!(run(None, &cpu).status.success());
    let read = |p: &Path| aam_data::DistanceMatrix::read(p, &aam_data::MatrixIds::Auto).unwrap();
    let want = read(&cpu);
    assert_eq!(want.len(), 64);
    let available = available();
    for gpu in ["wgpu", "cuda", "rocm"] {
        let out = tmp.path().join(format!("{gpu}.tsv"));
        let o = run(Some(gpu), &out);
        let stderr = String::from_utf8_lossy(&o.stderr);
        let why = if !compiled().contains(&gpu) {
            Some("built without")
        } else if !available[gpu] {
            Some("cannot run here")
        } else {
            None
        };
        if let Some(why) = why {
            assert!(
                !o.status.success() && stderr.contains(why),
                "{gpu}: {stderr}"
            );
            assert!(!out.exists(), "{gpu}: wrote a file");
            continue;
        }
        assert!(o.status.success(), "{gpu}: {stderr}");
        let got = read(&out);
        assert_eq!(got.ids(), want.ids(), "{gpu}");
        for i in 0..want.len() {
            for j in 0..want.len() {
                // (A NaN fails too.)
                let d = (got.get(i, j) - want.get(i, j)).abs();
                assert!(d <= 1e-5, "{gpu}: ({i}, {j}) |gpu - cpu| = {d:e}");
            }
        }
    }
}

/// `aam-rs compile-kernels` (the `--compile-workers` helper of `pretrain`):
/// on every compiled backend with a device it runs the dense problems it
/// reads (a layer's forward and its backward's halves, as helpers get them) and
/// exits 0 at the end of its input; a malformed line is an error naming the
/// line, never a panic.
#[test]
fn compile_kernels_runs_its_problems_and_names_a_bad_line() {
    use std::io::Write;
    let helper = |kind: &str, input: &str| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_aam-rs"))
            .args(["compile-kernels", "--backend", kind])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starts");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let available = available();
    for kind in compiled() {
        if !available[kind] {
            continue;
        }
        let out = helper(
            kind,
            "300 64 256 f32 1 1 0 0 0\n300 64 256 f32 1 0 1 0 0\n300 64 256 f32 1 0 0 1 1\n",
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{kind}: {stderr}");
        let out = helper(
            kind,
            "300 64 256 f32 1 1 0 0 0\n300 64 wide f32 1 0 0 1 1\n",
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && stderr.contains("stdin line 2: outputs `wide`")
                && !stderr.contains("panicked"),
            "{kind}: {stderr}"
        );
    }
}
