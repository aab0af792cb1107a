//! End to end through the binary on the bundled demo (64 oral2550 samples,
//! 1,000 reads each): `aam-rs pretrain`, `train` and `predict` with tiny
//! models (a few seconds per run on two cores), checking what they write —
//! metrics, checkpoints, sample lists, predictions in original units — and
//! that bad inputs fail with messages naming the flag or file at fault.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn demo(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../data/demo")
        .join(name)
}

fn s(p: &Path) -> String {
    p.to_str().expect("UTF-8 path").to_string()
}

fn aam_rs(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_aam-rs"))
        .args(args)
        .env("AAM_LOG", "info")
        .output()
        .expect("runs aam-rs")
}

/// Runs and asserts success; returns stderr (the log).
fn run_ok(args: &[String]) -> String {
    let out = aam_rs(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "aam-rs {} failed ({}):\n{stderr}",
        args.join(" "),
        out.status
    );
    stderr
}

/// Runs and asserts failure; returns stderr.
fn run_err(args: &[String]) -> String {
    let out = aam_rs(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "aam-rs {} should have failed:\n{stderr}",
        args.join(" ")
    );
    assert_ne!(out.status.code(), Some(0));
    stderr
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|a| a.to_string()).collect()
}

/// Inputs and a tiny model: 16 wide, 1 layer, 32 ASVs of 60 bp per sample.
fn tiny(command: &str, out: &Path, epochs: usize) -> Vec<String> {
    let mut a = args(&[command, "--table"]);
    a.push(s(&demo("demo.biom")));
    a.push("--unifrac-matrix".into());
    a.push(s(&demo("unifrac.unweighted.h5")));
    a.extend(args(&[
        "--rarefy-depth",
        "1000",
        "--test-size",
        "0.25",
        "--embedding-dim",
        "16",
        "--attention-heads",
        "2",
        "--attention-layers",
        "1",
        "--token-limit",
        "32",
        "--max-bp",
        "60",
        "--batch-size",
        "8",
        "--num-workers",
        "1",
        "--warmup-steps",
        "2",
        "--lr",
        "1e-3",
    ]));
    a.extend([
        "--epochs".into(),
        epochs.to_string(),
        "--output-dir".into(),
        s(out),
    ]);
    a
}

/// `tiny("train", ...)` predicting `column` of `metadata`.
/// The demo's metadata with an `age_group` column (`young` below `cut`
/// years, else `old`), written to `dir/labelled_map.txt`; returns the path
/// and each sample's group.
fn age_group_map(dir: &Path, cut: f64) -> (PathBuf, BTreeMap<String, String>) {
    let map = dir.join("labelled_map.txt");
    let text = std::fs::read_to_string(demo("demo_map.txt")).unwrap();
    let mut lines = text.lines();
    let mut labelled = format!("{}\tage_group\n", lines.next().unwrap());
    let mut groups = BTreeMap::new();
    for line in lines.filter(|l| !l.is_empty()) {
        let cells: Vec<&str> = line.split('\t').collect();
        let group = if cells[2].parse::<f64>().unwrap() < cut {
            "young"
        } else {
            "old"
        };
        groups.insert(cells[0].to_string(), group.to_string());
        labelled.push_str(&format!("{line}\t{group}\n"));
    }
    std::fs::write(&map, labelled).unwrap();
    (map, groups)
}

fn tiny_train(out: &Path, epochs: usize, metadata: &Path, column: &str) -> Vec<String> {
    let mut a = tiny("train", out, epochs);
    a.extend([
        "--metadata".into(),
        s(metadata),
        "--metadata-column".into(),
        column.into(),
    ]);
    a
}

fn predict(model: &Path, output: &Path) -> String {
    let mut a = args(&["predict", "--model"]);
    a.extend([
        s(model),
        "--table".into(),
        s(&demo("demo.biom")),
        "--output".into(),
        s(output),
    ]);
    run_ok(&a)
}

/// metrics.csv: the header and one map per row (empty cells are NaN).
fn metrics(dir: &Path) -> (Vec<String>, Vec<BTreeMap<String, f64>>) {
    let text = std::fs::read_to_string(dir.join("metrics.csv")).expect("metrics.csv");
    let mut lines = text.lines();
    let header: Vec<String> = lines
        .next()
        .expect("header")
        .split(',')
        .map(str::to_string)
        .collect();
    let rows = lines
        .map(|l| {
            let cells: Vec<&str> = l.split(',').collect();
            assert_eq!(cells.len(), header.len(), "metrics.csv row {l:?}");
            header
                .iter()
                .zip(cells)
                .map(|(k, v)| {
                    (
                        k.clone(),
                        if v.is_empty() {
                            f64::NAN
                        } else {
                            v.parse().unwrap_or_else(|_| panic!("{k}={v:?}"))
                        },
                    )
                })
                .collect()
        })
        .collect();
    (header, rows)
}

/// A TSV as (header, rows of cells).
fn tsv(path: &Path) -> (Vec<String>, Vec<Vec<String>>) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines();
    let header = lines
        .next()
        .expect("header")
        .split('\t')
        .map(str::to_string)
        .collect();
    (
        header,
        lines
            .map(|l| l.split('\t').map(str::to_string).collect())
            .collect(),
    )
}

fn ids_file(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

/// The demo table's sample IDs, read independently of the CLI.
fn demo_ids() -> BTreeSet<String> {
    let ids: BTreeSet<String> = aam_data::BiomTable::read(demo("demo.biom"))
        .unwrap()
        .sample_ids()
        .iter()
        .cloned()
        .collect();
    assert_eq!(ids.len(), 64);
    ids
}

/// Asserts the train/validation lists partition the 64 demo samples; returns (train, validation).
fn assert_partition(train: &Path, val: &Path) -> (Vec<String>, Vec<String>) {
    let (t, v) = (ids_file(train), ids_file(val));
    let (ts, vs): (BTreeSet<_>, BTreeSet<_>) =
        (t.iter().cloned().collect(), v.iter().cloned().collect());
    assert_eq!(ts.len(), t.len(), "duplicate IDs in {}", train.display());
    assert_eq!(vs.len(), v.len(), "duplicate IDs in {}", val.display());
    assert!(
        ts.is_disjoint(&vs),
        "train and validation overlap: {:?}",
        ts.intersection(&vs).collect::<Vec<_>>()
    );
    assert!(!vs.is_empty(), "empty validation set");
    assert_eq!(
        &ts | &vs,
        demo_ids(),
        "train ∪ validation is not the demo's 64 samples"
    );
    assert_eq!(v.len(), 16, "test size 0.25 of 64");
    (t, v)
}

/// The metadata column of each sample (the demo map has `#SampleID` first).
fn metadata_column(path: &Path, column: &str) -> BTreeMap<String, String> {
    let (header, rows) = tsv(path);
    let k = header
        .iter()
        .position(|h| h == column)
        .unwrap_or_else(|| panic!("no column {column}"));
    rows.into_iter()
        .map(|r| (r[0].clone(), r[k].clone()))
        .collect()
}

/// A checkpoint's tensor names (its safetensors header) and its `aam_checkpoint` metadata.
fn checkpoint_header(path: &Path) -> (BTreeSet<String>, Value) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let names = header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    let meta = serde_json::from_str(
        header["__metadata__"]["aam_checkpoint"]
            .as_str()
            .expect("aam_checkpoint metadata"),
    )
    .unwrap();
    (names, meta)
}

/// The tensor part of a checkpoint (everything after the header).
fn checkpoint_tensors(path: &Path) -> Vec<u8> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    bytes[8 + n..].to_vec()
}

fn non_empty(path: &Path) {
    let len = std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .len();
    assert!(len > 0, "{} is empty", path.display());
}

/// Parses `sample_id\tprediction` rows of `predict` as numbers.
fn numeric_predictions(path: &Path) -> BTreeMap<String, f64> {
    let (header, rows) = tsv(path);
    assert_eq!(header, ["sample_id", "prediction"], "{}", path.display());
    let map: BTreeMap<String, f64> = rows
        .iter()
        .map(|r| {
            assert_eq!(r.len(), 2, "{r:?}");
            (
                r[0].clone(),
                r[1].parse::<f64>()
                    .unwrap_or_else(|_| panic!("prediction {:?}", r[1])),
            )
        })
        .collect();
    assert_eq!(
        map.len(),
        rows.len(),
        "duplicate sample IDs in {}",
        path.display()
    );
    map
}

#[test]
fn pretrain_loss_falls() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("pre");
    run_ok(&tiny("pretrain", &out, 3));

    let (header, rows) = metrics(&out);
    for col in [
        "epoch",
        "step",
        "lr",
        "samples_per_sec",
        "seconds",
        "train_total_loss",
        "train_unifrac_loss",
        "train_nuc_loss",
        "val_total_loss",
        "val_unifrac_loss",
    ] {
        assert!(
            header.iter().any(|h| h == col),
            "metrics.csv lacks {col}: {header:?}"
        );
    }
    assert_eq!(rows.len(), 3, "one row per epoch");
    for (e, row) in rows.iter().enumerate() {
        assert_eq!(row["epoch"], e as f64);
        for (k, v) in row {
            assert!(v.is_finite(), "epoch {e}: {k} = {v}");
        }
    }
    // 48 training samples in batches of 8: 6 optimiser steps per epoch.
    assert_eq!(
        rows.iter().map(|r| r["step"]).collect::<Vec<_>>(),
        [6.0, 12.0, 18.0]
    );
    let (first, last) = (rows[0]["train_total_loss"], rows[2]["train_total_loss"]);
    assert!(
        last < first,
        "train_total_loss did not fall: {first} -> {last}"
    );

    for f in [
        "checkpoints/best.safetensors",
        "checkpoints/last.safetensors",
        "plots/loss.png",
    ] {
        non_empty(&out.join(f));
    }
    let (_, meta) = checkpoint_header(&out.join("checkpoints/last.safetensors"));
    assert_eq!(meta["progress"]["epochs_done"], 3);
    assert_partition(
        &out.join("train_sample_ids.txt"),
        &out.join("val_sample_ids.txt"),
    );
}

#[test]
fn pretrain_from_a_tree_learns_as_from_the_ssu_matrix() {
    // The demo's matrix is the study's `ssu` matrix; --tree computes it from
    // the table and the study's tree (sheared to the demo's ASVs) instead.
    let tree = demo("tree.nwk");
    let tmp = tempfile::tempdir().unwrap();
    let (from_matrix, from_tree) = (tmp.path().join("matrix"), tmp.path().join("tree"));
    run_ok(&tiny("pretrain", &from_matrix, 2));
    let with_tree = |out: &Path, epochs: usize| {
        let mut a = tiny("pretrain", out, epochs);
        let at = a.iter().position(|x| x == "--unifrac-matrix").unwrap();
        a[at] = "--tree".into();
        a[at + 1] = s(&tree);
        a
    };
    let log = run_ok(&with_tree(&from_tree, 2));
    assert!(
        log.contains("unweighted UniFrac distances of 64 samples"),
        "{log}"
    );
    let cached: Vec<_> = std::fs::read_dir(&from_tree)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|n| n.starts_with("unifrac-unweighted-") && n.ends_with(".h5"))
        .collect();
    assert_eq!(cached.len(), 1, "one cached matrix in the run folder");
    let ((_, a), (_, b)) = (metrics(&from_matrix), metrics(&from_tree));
    for (ra, rb) in a.iter().zip(&b) {
        for key in [
            "train_total_loss",
            "train_unifrac_loss",
            "val_total_loss",
            "val_unifrac_loss",
        ] {
            let (x, y) = (ra[key], rb[key]);
            assert!(
                (x - y).abs() <= 1e-4 * x.abs().max(1e-3),
                "{key}: {x} vs {y}"
            );
        }
    }
    // A second run on the same inputs reads the matrix back.
    let log = run_ok(&with_tree(&from_tree, 1));
    assert!(log.contains("computed by an earlier run"), "{log}");
    // --unifrac-gpu wgpu: the matrix in single precision on lavapipe, cached
    // under a key of its own, and the same losses; a GPU backend not
    // compiled in is refused by name.
    let from_gpu = tmp.path().join("gpu");
    let on_gpu = |gpu: &str| {
        let mut a = with_tree(&from_gpu, 2);
        a.extend(["--unifrac-gpu".into(), gpu.into()]);
        a
    };
    if cfg!(feature = "wgpu") {
        let log = run_ok(&on_gpu("wgpu"));
        assert!(
            log.contains("unweighted UniFrac distances of 64 samples") && log.contains("on Wgpu"),
            "{log}"
        );
        let cached = |dir: &Path| -> PathBuf {
            let found: Vec<_> = std::fs::read_dir(dir)
                .unwrap()
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    let n = p.file_name().unwrap().to_string_lossy();
                    n.starts_with("unifrac-unweighted-") && n.ends_with(".h5")
                })
                .collect();
            assert_eq!(found.len(), 1, "{found:?}");
            found[0].clone()
        };
        let (gpu_file, cpu_file) = (cached(&from_gpu), cached(&from_tree));
        assert_ne!(
            gpu_file.file_name(),
            cpu_file.file_name(),
            "f32 cached apart"
        );
        let read =
            |p: &Path| aam_data::DistanceMatrix::read(p, &aam_data::MatrixIds::Auto).unwrap();
        let (g, c) = (read(&gpu_file), read(&cpu_file));
        assert_eq!(g.ids(), c.ids());
        for i in 0..c.len() {
            for j in 0..c.len() {
                let d = (g.get(i, j) - c.get(i, j)).abs();
                assert!(d <= 1e-5, "({i}, {j}): {d:e}");
            }
        }
        // `b`: the CPU's two epochs, before the one-epoch rerun above.
        for (ra, rb) in b.iter().zip(&metrics(&from_gpu).1) {
            for key in ["train_total_loss", "val_total_loss"] {
                let (x, y) = (ra[key], rb[key]);
                assert!(
                    (x - y).abs() <= 1e-4 * x.abs().max(1e-3),
                    "{key}: {x} vs {y}"
                );
            }
        }
    }
    if !cfg!(feature = "cuda") {
        let err = run_err(&on_gpu("cuda"));
        assert!(
            err.contains("--unifrac-gpu cuda") && err.contains("built without the `cuda` feature"),
            "{err}"
        );
    }
    // A table observation missing from the tree is named.
    let small = tmp.path().join("small.nwk");
    std::fs::write(&small, "(a:1,b:2);").unwrap();
    let mut a = with_tree(&tmp.path().join("bad"), 1);
    let at = a.iter().position(|x| x == "--tree").unwrap();
    a[at + 1] = s(&small);
    let err = run_err(&a);
    assert!(
        err.contains("--tree") && err.contains("not tips of the tree") && err.contains("small.nwk"),
        "{err}"
    );
}

/// Faith's PD of the demo's samples by `faithpd` (Debian's unifrac-tools,
/// the reference implementation) on the demo table (already at 1,000 reads,
/// so rarefying it at 1,000 keeps it) and the study's tree.
fn faithpd_oracle(out: &Path) -> BTreeMap<String, f64> {
    let status = Command::new("faithpd")
        .args([
            "-i",
            &s(&demo("demo.biom")),
            "-t",
            &s(&demo("tree.nwk")),
            "-o",
            &s(out),
        ])
        .status()
        .unwrap_or_else(|e| {
            panic!("cannot run faithpd ({e}): apt-get install unifrac-tools (.ci/run installs it)")
        });
    assert!(status.success(), "faithpd failed");
    let (header, rows) = tsv(out);
    assert_eq!(header, ["#SampleID", "faith_pd"]);
    rows.iter()
        .map(|r| (r[0].clone(), r[1].parse().unwrap()))
        .collect()
}

#[test]
fn faith_pd_pretraining_learns_the_faithpd_values() {
    let tmp = tempfile::tempdir().unwrap();
    let faith = tmp.path().join("faith_pd.tsv");
    let oracle = faithpd_oracle(&faith);
    assert_eq!(oracle.len(), 64);
    let with_metric = |mut a: Vec<String>, source: &str, path: &Path| {
        let at = a.iter().position(|x| x == "--unifrac-matrix").unwrap();
        a[at] = source.into();
        a[at + 1] = s(path);
        a.extend(args(&["--unifrac-metric", "faith_pd"]));
        a
    };
    let (from_file, from_tree) = (tmp.path().join("file"), tmp.path().join("tree"));
    run_ok(&with_metric(
        tiny("pretrain", &from_file, 4),
        "--unifrac-matrix",
        &faith,
    ));
    let log = run_ok(&with_metric(
        tiny("pretrain", &from_tree, 4),
        "--tree",
        &demo("tree.nwk"),
    ));
    assert!(log.contains("Faith's PD of 64 samples"), "{log}");

    // The loss falls, and validation reports the PD's regression metrics.
    let (header, rows) = metrics(&from_file);
    for col in [
        "train_unifrac_loss",
        "val_unifrac_loss",
        "val_mae",
        "val_r2",
    ] {
        assert!(
            header.iter().any(|h| h == col),
            "metrics.csv lacks {col}: {header:?}"
        );
    }
    let (first, last) = (rows[0]["train_unifrac_loss"], rows[3]["train_unifrac_loss"]);
    assert!(
        first > 1.0 && last < first,
        "Faith's PD loss did not fall: {first} -> {last}"
    );
    assert!(rows[3]["val_mae"] < rows[0]["val_mae"], "{rows:?}");
    // The PD computed from --tree is faithpd's: the same run, loss for loss.
    let (_, tree_rows) = metrics(&from_tree);
    for (a, b) in rows.iter().zip(&tree_rows) {
        for key in ["train_unifrac_loss", "val_unifrac_loss", "val_mae"] {
            let (x, y) = (a[key], b[key]);
            assert!(
                (x - y).abs() <= 1e-4 * x.abs().max(1e-3),
                "{key}: {x} vs {y}"
            );
        }
    }
    // val_predictions.tsv holds each validation sample's predicted and true PD.
    let (header, val) = tsv(&from_file.join("val_predictions.tsv"));
    assert_eq!(header, ["sample_id", "prediction", "actual"]);
    assert_eq!(val.len(), 16);
    for row in &val {
        let actual: f64 = row[2].parse().unwrap();
        assert!((actual - oracle[&row[0]]).abs() < 1e-4, "{row:?}");
        assert!(row[1].parse::<f64>().unwrap().is_finite());
    }
    // A one-output head, as the reference's pretrain builds.
    let (names, meta) = checkpoint_header(&from_file.join("checkpoints/best.safetensors"));
    assert!(names.contains("model.output_head.weight"), "no output_head");
    assert_eq!(meta["model"]["base_output_dim"], 1, "{meta}");

    // Fine-tuning keeps the Faith's PD head and its loss, also without the
    // nucleotide loss (the reference's base loss is 0 there, §8 item 13).
    let encoder = from_file.join("checkpoints/best.safetensors");
    let tuned = tmp.path().join("tuned");
    let mut a = tiny_train(&tuned, 1, &demo("demo_map.txt"), "age");
    a = with_metric(a, "--unifrac-matrix", &faith);
    a.extend(["--pretrained-encoder".into(), s(&encoder)]);
    a.extend(args(&["--nuc-penalty", "0"]));
    run_ok(&a);
    let (_, rows) = metrics(&tuned);
    let base = rows[0]["train_unifrac_loss"];
    assert!(base.is_finite() && base > 0.0, "{rows:?}");
    // A Faith's PD encoder fine-tuned against UniFrac distances is refused.
    let mut a = tiny_train(
        &tmp.path().join("mismatch"),
        1,
        &demo("demo_map.txt"),
        "age",
    );
    a.extend(["--pretrained-encoder".into(), s(&encoder)]);
    let err = run_err(&a);
    assert!(
        err.contains("--unifrac-metric faith_pd") && err.contains("Faith's PD"),
        "{err}"
    );
}

#[test]
fn pretrain_train_predict_workflow() {
    let tmp = tempfile::tempdir().unwrap();
    let (pre, tr) = (tmp.path().join("pre"), tmp.path().join("train"));
    run_ok(&tiny("pretrain", &pre, 2));
    // The reference's file names, in PyTorch's format: the plain state dict
    // converts as a reference one does; the trainer checkpoint is what the
    // reference's README passes to --pretrained-encoder.
    non_empty(&pre.join("pretrained_encoder.pt"));
    run_ok(&args(&[
        "convert",
        "--from",
        &s(&pre.join("pretrained_encoder.pt")),
        "--out",
        &s(&tmp.path().join("encoder")),
        "--attention-heads",
        "2",
    ]));
    let encoder = pre.join("checkpoints/best_model.pt");
    let mut a = tiny_train(&tr, 2, &demo("demo_map.txt"), "age");
    a.extend(["--pretrained-encoder".into(), s(&encoder)]);
    let log = run_ok(&a);
    assert!(
        log.contains("of the pre-trained encoder"),
        "no encoder loaded:\n{log}"
    );

    let (_, rows) = metrics(&tr);
    assert_eq!(rows.len(), 2);
    for row in &rows {
        for k in ["train_target_loss", "val_target_loss", "val_mae", "val_r2"] {
            assert!(row[k].is_finite(), "{k} = {}", row[k]);
        }
    }
    non_empty(&tr.join("plots/val_predictions.png"));
    let (_, val_ids) = assert_partition(&tr.join("train_samples.txt"), &tr.join("val_samples.txt"));

    // Validation predictions: original units, actual = the metadata's ages.
    let ages = metadata_column(&demo("demo_map.txt"), "age");
    let (header, vrows) = tsv(&tr.join("val_predictions.tsv"));
    assert_eq!(header, ["sample_id", "prediction", "actual"]);
    assert_eq!(
        vrows.iter().map(|r| r[0].clone()).collect::<BTreeSet<_>>(),
        val_ids.iter().cloned().collect()
    );
    let mut val_pred = BTreeMap::new();
    for r in &vrows {
        let actual: f64 = r[2].parse().unwrap();
        let want: f64 = ages[&r[0]].parse().unwrap();
        assert!(
            (actual - want).abs() < 1e-9,
            "{}: actual {actual}, metadata age {want}",
            r[0]
        );
        val_pred.insert(r[0].clone(), r[1].parse::<f64>().unwrap());
    }

    // predict: every demo sample, in years.
    let preds_path = tmp.path().join("preds.tsv");
    predict(&tr.join("checkpoints/best.safetensors"), &preds_path);
    let preds = numeric_predictions(&preds_path);
    assert_eq!(preds.keys().cloned().collect::<BTreeSet<_>>(), demo_ids());
    assert!(preds.values().all(|v| v.is_finite()), "{preds:?}");
    assert!(
        !preds.values().all(|v| (0.0..=1.0).contains(v)),
        "predictions look min-max normalised: {preds:?}"
    );
    let mean = preds.values().sum::<f64>() / preds.len() as f64;
    assert!(
        (5.0..=120.0).contains(&mean),
        "mean prediction {mean} is no plausible age in years"
    );
    // The best checkpoint predicts its validation samples as the run did.
    for (id, v) in &val_pred {
        let p = preds[id];
        assert!(
            (p - v).abs() <= 1e-4 * v.abs().max(1.0),
            "{id}: predict {p}, val_predictions.tsv {v}"
        );
    }
    // Its PyTorch copy predicts the same, in years.
    let from_pt = tmp.path().join("preds_pt.tsv");
    predict(&tr.join("checkpoints/best_model.pt"), &from_pt);
    assert_eq!(numeric_predictions(&from_pt), preds);
    non_empty(&tr.join("final_model.pt"));
}

/// The bytes of tensor `name` of a safetensors file.
fn tensor_bytes(path: &Path, name: &str) -> Vec<u8> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let view = file
        .tensor(name)
        .unwrap_or_else(|e| panic!("{}: {name}: {e}", path.display()));
    view.data().to_vec()
}

fn reference_fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/reference")
        .join(case)
        .join("state_dict.pt")
}

/// Reference checkpoints (`.pt` trainer checkpoints the reference itself
/// wrote) are taken where aam-rs takes a checkpoint: `--pretrained-encoder`
/// fine-tunes from one, `predict --model` predicts with one, giving what
/// the `convert`ed model gives.
#[test]
fn reference_checkpoints_fine_tune_and_predict() {
    let tmp = tempfile::tempdir().unwrap();
    // A reference SequenceEncoder: D 32, 2 layers of 4 heads, 150 bp, 6 slots.
    let encoder = reference_fixture("encoder_unifrac");
    let converted = tmp.path().join("encoder");
    run_ok(&args(&[
        "convert",
        "--from",
        &s(&encoder),
        "--out",
        &s(&converted),
    ]));
    let tr = tmp.path().join("train");
    let mut a = tiny_train(&tr, 1, &demo("demo_map.txt"), "age");
    for (flag, value) in [
        ("--embedding-dim", "32"),
        ("--attention-layers", "2"),
        ("--attention-heads", "4"),
        ("--max-bp", "150"),
        ("--token-limit", "6"),
    ] {
        a = with(a, flag, value);
    }
    a.extend([
        "--freeze-base".into(),
        "--pretrained-encoder".into(),
        s(&encoder),
    ]);
    let log = run_ok(&a);
    assert!(
        log.contains("loaded 89 tensors of the pre-trained encoder"),
        "{log}"
    );
    // The base stays the reference's weights (--freeze-base), as converted.
    let best = tr.join("checkpoints/best.safetensors");
    for key in [
        "sample_encoder.asv_encoder.token_embedding.weight",
        "encoder_transformer.encoder.layers.1.linear2.weight",
        "attention_pooling.query.weight",
    ] {
        assert_eq!(
            tensor_bytes(&best, &format!("model.base_model.{key}")),
            tensor_bytes(&converted.join("model.safetensors"), key),
            "{key}"
        );
    }
    // A mismatched architecture is named, not panicked on.
    let err = run_err(&with(a.clone(), "--max-bp", "60"));
    assert!(err.contains("--max-bp 150 --token-limit 6"), "{err}");

    // A reference predictor predicts as its converted model does.
    let predictor = reference_fixture("predictor_default");
    let converted = tmp.path().join("predictor");
    run_ok(&args(&[
        "convert",
        "--from",
        &s(&predictor),
        "--out",
        &s(&converted),
    ]));
    let (from_pt, from_dir) = (tmp.path().join("pt.tsv"), tmp.path().join("dir.tsv"));
    predict(&predictor, &from_pt);
    predict(&converted, &from_dir);
    let (pt, dir) = (
        numeric_predictions(&from_pt),
        numeric_predictions(&from_dir),
    );
    assert_eq!(pt.keys().cloned().collect::<BTreeSet<_>>(), demo_ids());
    assert_eq!(pt, dir);
    assert!(pt.values().all(|v| v.is_finite()));
}

/// The reference's options, one per line of
/// `tests/fixtures/reference-cli-options.tsv` (every option of its `pretrain`,
/// `train`, `predict` and `rf-baseline`, from its click definitions).
fn reference_options() -> Vec<[String; 4]> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/reference-cli-options.tsv");
    std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let c: Vec<&str> = l.split('\t').collect();
            assert_eq!(c.len(), 4, "{l:?}");
            [c[0], c[1], c[2], c[3]].map(str::to_string)
        })
        .collect()
}

/// Every option of the reference's four commands is accepted: passed alone
/// (with the command's required options, the table a missing file), it
/// gets past the parser and the option checks to the missing table.
#[test]
fn every_reference_option_is_accepted() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = s(&tmp.path().join("absent.biom"));
    let file = s(&tmp.path().join("absent.txt"));
    let out = s(&tmp.path().join("out"));
    let required = |command: &str| -> Vec<(&'static str, String)> {
        match command {
            "pretrain" => vec![
                ("--table", missing.clone()),
                ("--unifrac-matrix", file.clone()),
                ("--output-dir", out.clone()),
            ],
            "train" => vec![
                ("--table", missing.clone()),
                ("--unifrac-matrix", file.clone()),
                ("--output-dir", out.clone()),
                ("--metadata", file.clone()),
                ("--metadata-column", "age".into()),
            ],
            "predict" => vec![
                ("--model", file.clone()),
                ("--table", missing.clone()),
                ("--output", file.clone()),
            ],
            "rf-baseline" => vec![
                ("--table", missing.clone()),
                ("--metadata", file.clone()),
                ("--metadata-column", "age".into()),
                ("--train-samples", file.clone()),
                ("--val-samples", file.clone()),
                ("--output", file.clone()),
            ],
            other => panic!("unknown command {other}"),
        }
    };
    let options = reference_options();
    let count = |c: &str| options.iter().filter(|o| o[0] == c).count();
    assert_eq!(
        [
            count("pretrain"),
            count("train"),
            count("predict"),
            count("rf-baseline")
        ],
        [60, 101, 11, 11]
    );
    let mut rejected = Vec::new();
    for [command, option, kind, example] in &options {
        let base = required(command);
        let mut a = vec![command.clone()];
        for (flag, value) in &base {
            if flag != option {
                a.extend([flag.to_string(), value.clone()]);
            }
        }
        // As in the reference, the sharded checkpoint needs --fsdp.
        if option == "--fsdp-sharded-checkpoint" {
            a.push("--fsdp".into());
        }
        a.push(option.clone());
        if kind == "value" {
            a.push(if example == "PATH" {
                base.iter()
                    .find(|(f, _)| f == option)
                    .map_or(file.clone(), |(_, v)| v.clone())
            } else {
                example.clone()
            });
        }
        let out = aam_rs(&a);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let ok = match option.as_str() {
            "--help" => out.status.success() && stdout.contains("Usage:"),
            "--categorical-help" => out.status.success() && stdout.contains("--categorical-fusion"),
            // A checkpoint that is not there is reported before the data.
            "--resume-from" => out.status.code() == Some(1) && stderr.contains("--resume-from"),
            // A device this build lacks is named; the build has the CPU.
            _ => {
                out.status.code() == Some(1)
                    && (stderr.contains("--table") || stderr.contains("absent.biom"))
                    && !stderr.contains("Usage:")
            }
        };
        if !ok {
            rejected.push(format!("aam-rs {}\n{stderr}", a.join(" ")));
        }
    }
    assert!(
        rejected.is_empty(),
        "{} reference option(s) rejected:\n{}",
        rejected.len(),
        rejected.join("\n")
    );
}

/// Reference options end to end on the demo: the ones that map onto aam-rs's
/// change the run (device, effective batch size, legacy target flags,
/// per-output losses, passes), the others are noted in training.log; the
/// run writes TensorBoard events with the reference's tags, and the RF
/// baseline runs on its split.
#[test]
fn reference_options_run_end_to_end() {
    let tmp = tempfile::tempdir().unwrap();
    let pre = tmp.path().join("pre");
    let mut a = tiny("pretrain", &pre, 2);
    a.extend(args(&[
        "--device",
        "cpu",
        "--attn-implementation",
        "mem_efficient",
        "--auto-batch-size",
        "--max-memory-fraction",
        "0.6",
        "--target-effective-batch-size",
        "16",
        "--compile-model",
        "--tf32",
        "--use-expandable-segments",
        "--no-sequence-cache",
        "--sync-batchnorm",
        "--no-count-embedding",
        "--count-penalty",
        "0.5",
        "--no-gradient-checkpointing",
    ]));
    run_ok(&a);
    let log = std::fs::read_to_string(pre.join("training.log")).unwrap();
    for note in [
        "--attn-implementation mem_efficient: PyTorch's SDPA kernels are not used here",
        "--target-effective-batch-size 16: 2 batch(es) of 8 per optimiser step",
        "--auto-batch-size: the ndarray backend reports no device memory to fill (the search runs on CUDA and ROCm devices); training with --batch-size 8",
        "--compile-model:",
        "--tf32:",
        "--use-expandable-segments:",
        "--no-sequence-cache:",
        "--sync-batchnorm:",
        "model: ",
    ] {
        assert!(log.contains(note), "training.log lacks {note:?}:\n{log}");
    }
    // 48 training samples, batches of 8, 2 per step: 3 steps an epoch.
    let (_, rows) = metrics(&pre);
    assert_eq!(
        rows.iter().map(|r| r["step"]).collect::<Vec<_>>(),
        [3.0, 6.0]
    );
    // TensorBoard: the reference's epoch tags, and a loss per step.
    let events: Vec<PathBuf> = std::fs::read_dir(pre.join("tensorboard"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    let scalars = aam_train::tensorboard::read_scalars(&events[0]).unwrap();
    let at = |tag: &str| -> Vec<(u64, f32)> {
        scalars
            .iter()
            .filter(|(_, t, _)| t == tag)
            .map(|(s, _, v)| (*s, *v))
            .collect()
    };
    for tag in [
        "train/total_loss",
        "train/unifrac_loss",
        "train/nuc_loss",
        "val/total_loss",
        "val/nuc_accuracy",
        "val/mae",
        "train/learning_rate",
        "perf/samples_per_sec",
    ] {
        assert_eq!(
            at(tag).iter().map(|p| p.0).collect::<Vec<_>>(),
            [1, 2],
            "{tag}"
        );
    }
    let epoch_loss = at("train/total_loss");
    assert!((epoch_loss[0].1 as f64 - rows[0]["train_total_loss"]).abs() < 1e-4);
    assert_eq!(
        at("step/total_loss")
            .iter()
            .map(|p| p.0)
            .collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6]
    );
    // Pretraining's validation pairs and plots.
    let (header, pairs) = tsv(&pre.join("val_unifrac.tsv"));
    assert_eq!(header, ["sample_a", "sample_b", "unifrac", "predicted"]);
    assert_eq!(pairs.len(), 2 * 28, "two validation batches of 8");
    for plot in ["loss", "nuc_accuracy", "val_unifrac"] {
        non_empty(&pre.join(format!("plots/{plot}.png")));
    }

    // train: legacy target flags, per-output losses, positive forms.
    let tr = tmp.path().join("train");
    let mut a = tiny_train(&tr, 1, &demo("demo_map.txt"), "age");
    a.extend(args(&[
        "--log-transform-targets",
        "--normalize-targets",
        "--loss-config",
        r#"{"age": "mse"}"#,
        "--out-dim",
        "1",
        "--count-prediction",
        "--target-layer-norm",
        "--cross-attn-heads",
        "4",
        "--perceiver-num-latents",
        "8",
        "--perceiver-num-layers",
        "1",
        "--asv-sampling",
        "random",
    ]));
    a.extend([
        "--pretrained-encoder".into(),
        s(&pre.join("checkpoints/best.safetensors")),
    ]);
    let log = run_ok(&a);
    assert!(
        log.contains("legacy target flags: --target-transform log-minmax"),
        "{log}"
    );
    let (_, meta) = checkpoint_header(&tr.join("checkpoints/best.safetensors"));
    assert_eq!(
        meta["data"]["transforms"]["target"]["transform"],
        "log-minmax"
    );
    assert_eq!(
        meta["run"]["loss"]["column_losses"],
        serde_json::json!(["mse"])
    );
    assert_eq!(meta["model"]["bounded_targets"], true);
    assert_eq!(meta["model"]["cross_attn_heads"], 4);
    let err = run_err(&with(a.clone(), "--out-dim", "2"));
    assert!(
        err.contains("--out-dim 2: a regressor of one column (age) has 1 output"),
        "{err}"
    );
    let err = run_err(&with(a.clone(), "--loss-config", r#"{"5": "mse"}"#));
    assert!(err.contains("--loss-config: key \"5\""), "{err}");

    // Categorical inputs with loss weights, conditional output scaling and
    // validation averaged over random ASV draws.
    let (map, _) = age_group_map(tmp.path(), 40.0);
    let passes = |n: &str, dir: &Path| {
        let mut a = tiny_train(dir, 1, &map, "age");
        a.extend(args(&[
            "--categorical-columns",
            "age_group",
            "--conditional-output-scaling",
            "age_group",
            "--categorical-loss-weights",
            "auto",
            "--asv-sampling",
            "random",
            "--val-prediction-passes",
            n,
        ]));
        a
    };
    let (one, three) = (tmp.path().join("one"), tmp.path().join("three"));
    let log = run_ok(&passes("1", &one));
    assert!(
        log.contains("target loss weights by age_group: old "),
        "{log}"
    );
    run_ok(&passes("3", &three));
    let (_, meta) = checkpoint_header(&three.join("checkpoints/best.safetensors"));
    let weights = &meta["data"]["transforms"]["loss_weights"];
    assert_eq!(weights["column"], "age_group");
    let (w_old, w_young) = (
        weights["weights"]["old"].as_f64().unwrap(),
        weights["weights"]["young"].as_f64().unwrap(),
    );
    assert!(w_old > 1.0 && w_young < 1.0, "{weights}");
    assert_eq!(
        meta["model"]["conditional_scaling_columns"],
        serde_json::json!(["age_group"])
    );
    assert_eq!(meta["run"]["val_prediction_passes"], 3);
    // The same training and first validation pass: the same losses; the
    // averaged predictions differ from the single pass's.
    let ((_, r1), (_, r3)) = (metrics(&one), metrics(&three));
    assert_eq!(r1[0]["train_total_loss"], r3[0]["train_total_loss"]);
    assert_eq!(r1[0]["val_total_loss"], r3[0]["val_total_loss"]);
    let (_, p1) = tsv(&one.join("val_predictions.tsv"));
    let (_, p3) = tsv(&three.join("val_predictions.tsv"));
    assert_eq!(p1.len(), p3.len());
    assert_ne!(p1, p3);
    let mae = p3
        .iter()
        .map(|r| (r[1].parse::<f64>().unwrap() - r[2].parse::<f64>().unwrap()).abs())
        .sum::<f64>()
        / p3.len() as f64;
    assert!(
        (mae - r3[0]["val_mae"]).abs() < 1e-9 * mae.max(1.0),
        "{mae} vs {}",
        r3[0]["val_mae"]
    );

    // predict: passes over random ASV draws, with their spread.
    let model = tr.join("checkpoints/best.safetensors");
    let out = tmp.path().join("passes.tsv");
    let mut p = args(&[
        "predict",
        "--model",
        &s(&model),
        "--table",
        &s(&demo("demo.biom")),
    ]);
    p.extend(args(&[
        "--output",
        &s(&out),
        "--device",
        "cpu",
        "--no-sequence-cache",
    ]));
    p.extend(args(&[
        "--asv-sampling",
        "random",
        "--prediction-passes",
        "4",
        "--output-variance",
    ]));
    run_ok(&p);
    let (header, rows) = tsv(&out);
    assert_eq!(header, ["sample_id", "prediction", "prediction_std"]);
    assert_eq!(rows.len(), 64);
    let std: Vec<f64> = rows.iter().map(|r| r[2].parse().unwrap()).collect();
    assert!(std.iter().all(|v| v.is_finite() && *v >= 0.0), "{std:?}");
    // Samples with more ASVs than the 32 slots vary between draws.
    assert!(std.iter().any(|v| *v > 0.0), "{std:?}");
    // Without random sampling the passes would agree: one runs, spread 0.
    let log = run_ok(&with(p.clone(), "--asv-sampling", "abundance"));
    assert!(log.contains("running one"), "{log}");
    let (_, rows) = tsv(&out);
    assert!(rows.iter().all(|r| r[2] == "0"), "{rows:?}");

    // rf-baseline on the run's split, as in the reference's workflow.
    let rf = tmp.path().join("rf/predictions.tsv");
    let mut r = args(&["rf-baseline", "--table", &s(&demo("demo.biom"))]);
    r.extend(args(&[
        "--metadata",
        &s(&demo("demo_map.txt")),
        "--metadata-column",
        "age",
    ]));
    r.extend(args(&[
        "--train-samples",
        &s(&tr.join("train_samples.txt")),
    ]));
    r.extend(args(&["--val-samples", &s(&tr.join("val_samples.txt"))]));
    r.extend(args(&[
        "--output",
        &s(&rf),
        "--n-estimators",
        "50",
        "--n-jobs",
        "2",
    ]));
    let out = aam_rs(&r);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    for metric in ["R²: ", "MAE: ", "RMSE: "] {
        assert!(stdout.contains(metric), "{stdout}");
    }
    let (header, rows) = tsv(&rf);
    assert_eq!(header, ["sample_id", "actual", "predicted"]);
    assert_eq!(
        rows.iter().map(|r| r[0].clone()).collect::<BTreeSet<_>>(),
        ids_file(&tr.join("val_samples.txt")).into_iter().collect()
    );
    let ages = metadata_column(&demo("demo_map.txt"), "age");
    for r in &rows {
        assert_eq!(
            r[1].parse::<f64>().unwrap(),
            ages[&r[0]].parse::<f64>().unwrap()
        );
        let p: f64 = r[2].parse().unwrap();
        assert!((18.0..=85.0).contains(&p), "{r:?}");
    }
    non_empty(&rf.with_extension("png"));
}

#[test]
fn classifier_trains_and_predicts_labels() {
    let tmp = tempfile::tempdir().unwrap();
    // demo_map has no categorical column: label ages (balanced at 30: 33 young, 31 old).
    let (map, labels) = age_group_map(tmp.path(), 30.0);
    let classes: BTreeSet<String> = labels.values().cloned().collect();
    assert_eq!(classes.len(), 2);

    let out = tmp.path().join("clf");
    let mut a = tiny_train(&out, 2, &map, "age_group");
    a.push("--classifier".into());
    run_ok(&a);

    let (header, rows) = metrics(&out);
    for col in ["val_accuracy", "val_f1"] {
        assert!(
            header.iter().any(|h| h == col),
            "metrics.csv lacks {col}: {header:?}"
        );
        for r in &rows {
            assert!((0.0..=1.0).contains(&r[col]), "{col} = {}", r[col]);
        }
    }
    assert!(rows
        .iter()
        .all(|r| r["val_total_loss"].is_finite() && r["train_target_loss"].is_finite()));
    let (_, meta) = checkpoint_header(&out.join("checkpoints/best.safetensors"));
    assert_eq!(
        meta["data"]["class_labels"],
        serde_json::json!(["old", "young"])
    );
    non_empty(&out.join("plots/confusion_matrix.png"));

    // Validation rows: labels, with the truth as in the metadata.
    let (header, vrows) = tsv(&out.join("val_predictions.tsv"));
    assert_eq!(header, ["sample_id", "prediction", "actual"]);
    assert_eq!(vrows.len(), 16);
    let mut val_pred = BTreeMap::new();
    for r in &vrows {
        assert!(classes.contains(&r[1]), "prediction {:?}", r[1]);
        assert_eq!(r[2], labels[&r[0]], "{}: actual label", r[0]);
        val_pred.insert(r[0].clone(), r[1].clone());
    }

    let preds_path = tmp.path().join("labels.tsv");
    predict(&out.join("checkpoints/best.safetensors"), &preds_path);
    let (header, prows) = tsv(&preds_path);
    assert_eq!(header, ["sample_id", "prediction"]);
    assert_eq!(
        prows.iter().map(|r| r[0].clone()).collect::<BTreeSet<_>>(),
        demo_ids()
    );
    assert_eq!(prows.len(), 64);
    for r in &prows {
        assert!(
            classes.contains(&r[1]),
            "{}: prediction {:?} is not a label",
            r[0],
            r[1]
        );
        if let Some(v) = val_pred.get(&r[0]) {
            assert_eq!(&r[1], v, "{}: predict vs val_predictions.tsv", r[0]);
        }
    }
}

#[test]
fn count_embedding_trains_and_validates() {
    let tmp = tempfile::tempdir().unwrap();
    // Pre-training with counts (the reference crashed in validation here).
    let pre = tmp.path().join("pre");
    let mut a = tiny("pretrain", &pre, 1);
    a.push("--count-embedding".into());
    run_ok(&a);
    let (_, rows) = metrics(&pre);
    assert_eq!(rows.len(), 1);
    for k in ["val_total_loss", "val_unifrac_loss", "val_nuc_loss"] {
        assert!(
            rows[0].get(k).is_some_and(|v| v.is_finite()),
            "{k}: {:?}",
            rows[0].get(k)
        );
    }
    let (names, meta) = checkpoint_header(&pre.join("checkpoints/last.safetensors"));
    assert_eq!(meta["model"]["sample"]["count_embedding"], true);
    assert!(
        names.contains("model.sample_encoder.count_embed.weight"),
        "{names:?}"
    );

    // Training with FiLM counts, then predicting (counts enter there too).
    let tr = tmp.path().join("train");
    let mut a = tiny_train(&tr, 1, &demo("demo_map.txt"), "age");
    a.extend(args(&[
        "--count-embedding",
        "--count-embedding-method",
        "film",
    ]));
    run_ok(&a);
    let (_, rows) = metrics(&tr);
    for k in [
        "val_total_loss",
        "val_target_loss",
        "val_mae",
        "val_count_loss",
    ] {
        assert!(
            rows[0].get(k).is_some_and(|v| v.is_finite()),
            "{k}: {:?}",
            rows[0].get(k)
        );
    }
    let (names, _) = checkpoint_header(&tr.join("checkpoints/best.safetensors"));
    assert!(
        names.contains("model.base_model.sample_encoder.count_film.weight"),
        "{names:?}"
    );
    let preds_path = tmp.path().join("preds.tsv");
    predict(&tr.join("checkpoints/best.safetensors"), &preds_path);
    let preds = numeric_predictions(&preds_path);
    assert_eq!(preds.len(), 64);
    assert!(preds.values().all(|v| v.is_finite()));
}

#[test]
fn bad_input_names_the_flag() {
    let tmp = tempfile::tempdir().unwrap();

    // An odd batch: named as the flag, before anything is written.
    for command in ["pretrain", "train"] {
        let out = tmp.path().join(format!("odd_{command}"));
        let mut a = if command == "train" {
            tiny_train(&out, 1, &demo("demo_map.txt"), "age")
        } else {
            tiny(command, &out, 1)
        };
        let k = a.iter().position(|x| x == "--batch-size").unwrap();
        a[k + 1] = "7".into();
        let stderr = run_err(&a);
        assert!(
            stderr.contains("--batch-size") && stderr.contains('7'),
            "{command}: {stderr}"
        );
        assert!(
            !out.exists(),
            "{command}: wrote {} before failing",
            out.display()
        );
    }

    // Data parallel: a device the backend does not have; a global batch that
    // does not split into even shards, one per replica.
    let dp = |extra: &[&str]| {
        let mut a = tiny("pretrain", &tmp.path().join("dp"), 1);
        a.extend(args(extra));
        a
    };
    let stderr = run_err(&dp(&["--devices", "0,1"]));
    assert!(
        stderr.contains("--devices 1") && stderr.contains("ndarray"),
        "{stderr}"
    );
    let stderr = run_err(&dp(&["--devices", "0,0,0"]));
    assert!(
        stderr.contains("batch-size") && stderr.contains("3 even shards"),
        "{stderr}"
    );
    let stderr = run_err(&dp(&["--devices", "zero"]));
    assert!(
        stderr.contains("--devices") && stderr.contains("zero"),
        "{stderr}"
    );
    // Two replicas on the one CPU device, pairs within each shard.
    let log = run_ok(&dp(&["--devices", "0,0", "--unifrac-pairs", "local"]));
    assert!(
        log.contains("data parallel: 2 replicas") && log.contains("4 samples each"),
        "{log}"
    );
    assert_eq!(metrics(&tmp.path().join("dp")).1.len(), 1);
    // Processes: process 0 names the process that did not come; a rank is
    // needed.
    let rendezvous = local_rendezvous();
    let stderr = run_err(&dp(&[
        "--world-size",
        "2",
        "--rank",
        "0",
        "--rendezvous",
        &rendezvous,
        "--rendezvous-timeout",
        "1",
    ]));
    assert!(
        stderr.contains("--rendezvous") && stderr.contains("process 1 did not come"),
        "{stderr}"
    );
    let stderr = run_err(&dp(&["--world-size", "2", "--rendezvous", "127.0.0.1:1"]));
    assert!(stderr.contains("--rank"), "{stderr}");

    // A missing table: the path, once.
    let mut a = tiny("pretrain", &tmp.path().join("missing"), 1);
    let missing = tmp.path().join("no_such_table.biom");
    a[2] = s(&missing);
    let stderr = run_err(&a);
    assert!(
        stderr.contains(&s(&missing)) && stderr.contains("--table"),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("No such file").count(),
        1,
        "cause repeated: {stderr}"
    );

    // A metadata column that is not there.
    let stderr = run_err(&tiny_train(
        &tmp.path().join("nocol"),
        1,
        &demo("demo_map.txt"),
        "agee",
    ));
    assert!(
        stderr.contains("agee") && stderr.contains("demo_map.txt"),
        "{stderr}"
    );

    // A checkpoint cut to half its length.
    let pre = tmp.path().join("pre");
    run_ok(&tiny("pretrain", &pre, 1));
    let half = tmp.path().join("half.safetensors");
    let bytes = std::fs::read(pre.join("checkpoints/last.safetensors")).unwrap();
    std::fs::write(&half, &bytes[..bytes.len() / 2]).unwrap();
    let mut a = tiny("pretrain", &tmp.path().join("resumed"), 1);
    a.extend(["--resume-from".into(), s(&half)]);
    let stderr = run_err(&a);
    assert!(
        stderr.contains(&s(&half)) && stderr.contains("--resume-from"),
        "{stderr}"
    );
    assert!(
        stderr.contains("cut short") || stderr.contains("incomplete"),
        "{stderr}"
    );
    let mut a = args(&["predict", "--model"]);
    a.extend([
        s(&half),
        "--table".into(),
        s(&demo("demo.biom")),
        "--output".into(),
        s(&tmp.path().join("p.tsv")),
    ]);
    let stderr = run_err(&a);
    assert!(
        stderr.contains(&s(&half))
            && (stderr.contains("cut short") || stderr.contains("incomplete")),
        "{stderr}"
    );
    assert!(!tmp.path().join("p.tsv").exists());

    // A pre-trained encoder of another --max-bp; predict on a pretrain checkpoint.
    let encoder = pre.join("checkpoints/best.safetensors");
    let mut a = tiny_train(
        &tmp.path().join("mismatch"),
        1,
        &demo("demo_map.txt"),
        "age",
    );
    let k = a.iter().position(|x| x == "--max-bp").unwrap();
    a[k + 1] = "50".into();
    a.extend(["--pretrained-encoder".into(), s(&encoder)]);
    let stderr = run_err(&a);
    assert!(
        stderr.contains("--max-bp") && stderr.contains(&s(&encoder)),
        "{stderr}"
    );
    let mut a = args(&["predict", "--model"]);
    a.extend([
        s(&encoder),
        "--table".into(),
        s(&demo("demo.biom")),
        "--output".into(),
        s(&tmp.path().join("p.tsv")),
    ]);
    let stderr = run_err(&a);
    assert!(
        stderr.contains("pretrain") && stderr.contains("prediction head"),
        "{stderr}"
    );
}

#[test]
fn resume_continues_the_run() {
    let tmp = tempfile::tempdir().unwrap();

    // A finished run resumed elsewhere: nothing to do, nothing written.
    let (a_dir, b_dir) = (tmp.path().join("a"), tmp.path().join("b"));
    run_ok(&tiny("pretrain", &a_dir, 2));
    let mut a = tiny("pretrain", &b_dir, 2);
    a.extend([
        "--resume-from".into(),
        s(&a_dir.join("checkpoints/last.safetensors")),
    ]);
    let log = run_ok(&a);
    assert!(log.contains("already complete"), "{log}");
    assert!(
        !b_dir.join("metrics.csv").exists() && !b_dir.join("checkpoints").exists(),
        "a finished run trained on"
    );

    // A run resumed from a mid-run checkpoint (a best epoch before the last)
    // into another directory ends as the uninterrupted run did, bit for bit.
    // The best epoch depends on the trajectory: try seeds until one is mid-run.
    let mut found = None;
    for seed in [2, 3, 4, 5, 6] {
        let full = tmp.path().join(format!("full{seed}"));
        let mut a = tiny_train(&full, 3, &demo("demo_map.txt"), "age");
        a.extend(args(&["--best-metric", "mae", "--seed"]));
        a.push(seed.to_string());
        run_ok(&a);
        let (_, meta) = checkpoint_header(&full.join("checkpoints/best.safetensors"));
        if meta["progress"]["epochs_done"].as_u64().unwrap() < 3 {
            found = Some(full);
            break;
        }
    }
    let full = found.expect("no seed gave a best epoch before the last");
    let best = full.join("checkpoints/best.safetensors");
    let (_, meta) = checkpoint_header(&best);
    let done = meta["progress"]["epochs_done"].as_u64().unwrap() as usize;

    let resumed = tmp.path().join("resumed");
    // Flags other than the data's come from the checkpoint (here: defaults).
    let mut a = tiny_train(&resumed, 3, &demo("demo_map.txt"), "age");
    a.extend(["--resume-from".into(), s(&best)]);
    let log = run_ok(&a);
    assert!(log.contains(&format!("after epoch {done}")), "{log}");

    assert_same_run(&full, &resumed, 3);
    // The new directory has the run's best model even though no later epoch improved.
    assert!(
        std::fs::read(resumed.join("checkpoints/best.safetensors")).unwrap()
            == std::fs::read(&best).unwrap()
    );
}

/// Two finished runs of `epochs` epochs agree bit for bit: every metric of
/// every epoch in `metrics.csv` (the resumed one holds the whole history),
/// and the final weights and optimiser state.
fn assert_same_run(full: &Path, resumed: &Path, epochs: usize) {
    let (h_full, r_full) = metrics(full);
    let (h_res, r_res) = metrics(resumed);
    assert_eq!(h_full, h_res);
    assert_eq!(r_res.len(), epochs, "metrics.csv of {}", resumed.display());
    for (e, (x, y)) in r_full.iter().zip(&r_res).enumerate() {
        for k in &h_full {
            if k != "seconds" && k != "samples_per_sec" {
                assert_eq!(
                    x[k].to_bits(),
                    y[k].to_bits(),
                    "epoch {e}: {k} {} vs {}",
                    x[k],
                    y[k]
                );
            }
        }
    }
    assert!(
        checkpoint_tensors(&full.join("checkpoints/last.safetensors"))
            == checkpoint_tensors(&resumed.join("checkpoints/last.safetensors")),
        "the resumed run's final weights and optimiser state differ from the uninterrupted run's"
    );
}

/// A running `aam-rs` whose stderr lines arrive on a channel.
struct Running {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Running {
    fn start(args: &[String]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_aam-rs"))
            .args(args)
            .env("AAM_LOG", "info")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("runs aam-rs");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                let _ = tx.send(line);
            }
        });
        Self { child, lines }
    }

    /// Waits for a stderr line containing `text`; false if the process ended first.
    fn wait_for(&self, text: &str) -> bool {
        self.lines.iter().any(|l| l.contains(text))
    }

    /// Sends `signal` (a name `kill` takes).
    fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("runs kill")
            .success();
        assert!(ok, "kill -{signal} failed");
    }

    /// Exit status and the rest of stderr.
    fn finish(mut self) -> (std::process::ExitStatus, String) {
        let status = self.child.wait().unwrap();
        (status, self.lines.iter().collect::<Vec<_>>().join("\n"))
    }
}

/// Killed with SIGKILL at moments drawn from a fixed seed, some of them
/// while a checkpoint is being written, and restarted each time with the
/// same command and `--resume-from auto`, a pre-training ends with the
/// weights, optimiser state and metrics of the run never killed, bit for
/// bit. SIGUSR1 and SIGTERM stop it at a step with exit status 75 and a
/// checkpoint there, and it resumes from that step the same way.
#[test]
fn killed_and_resumed_runs_end_as_the_uninterrupted_one() {
    // On disk, not a tmpfs: a checkpoint write (ending in fsync) takes long
    // enough to be caught in the act.
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let run = |dir: &Path| {
        let mut a = tiny("pretrain", dir, 3);
        a.extend(args(&[
            "--checkpoint-every-steps",
            "1",
            "--resume-from",
            "auto",
        ]));
        a
    };
    let full = tmp.path().join("full");
    run_ok(&run(&full));

    let killed = tmp.path().join("killed");
    let checkpoints = killed.join("checkpoints");
    let writing = || {
        std::fs::read_dir(&checkpoints)
            .map(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().contains(".tmp"))
            })
            .unwrap_or(false)
    };
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let (mut kills, mut during_writes) = (0, 0);
    loop {
        let mut p = Running::start(&run(&killed));
        assert!(p.wait_for("parameters"), "aam-rs ended before training");
        // Every other start is killed as soon as a checkpoint write is seen,
        // the others after a random 0-2 s.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let at = std::time::Instant::now() + std::time::Duration::from_millis(rng % 2000);
        let mut caught = false;
        while p.child.try_wait().unwrap().is_none() {
            let now = std::time::Instant::now();
            if kills % 2 == 1 && writing() {
                caught = true;
                break;
            }
            if (kills % 2 == 0 && now >= at) || now >= deadline {
                break;
            }
        }
        if kills >= 8 || p.child.try_wait().unwrap().is_some() {
            let (status, log) = p.finish();
            assert!(status.success(), "the last start failed ({status}):\n{log}");
            break;
        }
        p.child.kill().unwrap();
        p.child.wait().unwrap();
        kills += 1;
        if caught && writing() {
            during_writes += 1;
        }
    }
    eprintln!("{kills} kills, {during_writes} during a checkpoint write");
    assert!(kills >= 4, "only {kills} kills landed before the run ended");
    assert!(
        during_writes >= 1,
        "no kill landed during a checkpoint write"
    );
    assert_same_run(&full, &killed, 3);
    assert!(!writing(), "a temporary file of a cut write was left");

    // Signals: a checkpoint at the next step and exit status 75.
    let signalled = tmp.path().join("signalled");
    for signal in ["USR1", "TERM"] {
        let p = Running::start(&run(&signalled));
        assert!(p.wait_for("parameters"));
        p.signal(signal);
        let (status, log) = p.finish();
        assert_eq!(status.code(), Some(75), "after SIG{signal}:\n{log}");
        assert!(
            log.contains(&format!("stopped by SIG{signal} at step")),
            "{log}"
        );
    }
    let log = run_ok(&run(&signalled));
    assert!(log.contains("resuming from"), "{log}");
    assert_same_run(&full, &signalled, 3);
}

/// The disk filling up while a checkpoint is written: the run stops with an
/// error naming the file and the cause, the previous checkpoint is intact
/// and no temporary file is left; resumed on a disk with room, the run ends
/// as the one never stopped. The disk is a 300 KiB tmpfs (room for one
/// 172 KB checkpoint, not for its successor beside it) mounted in a private
/// mount namespace, which needs root (CI runs as root).
#[test]
fn a_full_disk_during_a_checkpoint_write_keeps_the_previous_checkpoint() {
    let root = Command::new("id").arg("-u").output().unwrap().stdout == b"0\n";
    if !root {
        eprintln!("skipped: mounting a tmpfs needs root");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (mnt, saved) = (tmp.path().join("mnt"), tmp.path().join("saved"));
    std::fs::create_dir(&mnt).unwrap();
    let mut a = tiny("pretrain", &mnt.join("run"), 3);
    a.extend(args(&["--checkpoint-every-steps", "1"]));
    let script = r#"mnt=$1; saved=$2; shift 2
mount -t tmpfs -o size=300k tmpfs "$mnt" || exit 99
"$@"; status=$?
cp -r "$mnt/run" "$saved"
exit $status"#;
    let out = Command::new("unshare")
        .args(["-m", "sh", "-c", script, "sh"])
        .arg(&mnt)
        .arg(&saved)
        .arg(env!("CARGO_BIN_EXE_aam-rs"))
        .args(&a)
        .output()
        .expect("runs unshare");
    let log = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(99), "no tmpfs: {log}");
    assert!(
        !out.status.success(),
        "the run ended on a full disk:\n{log}"
    );
    assert!(log.contains("No space left on device"), "{log}");
    assert!(log.contains("checkpoints/last.safetensors"), "{log}");
    let names: Vec<String> = std::fs::read_dir(saved.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["last.safetensors"], "a temporary file was left");
    let (_, meta) = checkpoint_header(&saved.join("checkpoints/last.safetensors"));
    assert_eq!(
        meta["progress"]["global_step"], 1,
        "the first step's checkpoint"
    );

    let full = tmp.path().join("full");
    run_ok(&tiny("pretrain", &full, 3));
    let mut a = tiny("pretrain", &saved, 3);
    a.extend(args(&["--resume-from", "auto"]));
    let log = run_ok(&a);
    assert!(log.contains("at batch 1 of epoch 1 (step 1)"), "{log}");
    assert_same_run(&full, &saved, 3);
}

/// `args` with the value of `flag` replaced (or the flag added).
fn with(mut a: Vec<String>, flag: &str, value: &str) -> Vec<String> {
    match a.iter().position(|x| x == flag) {
        Some(i) => a[i + 1] = value.to_string(),
        None => a.extend([flag.to_string(), value.to_string()]),
    }
    a
}

/// The demo table with its observation IDs (the ASV sequences) renamed by
/// `rename(index, id)`, written as BIOM 2.1 to `path`.
fn demo_renamed(path: &Path, rename: impl Fn(usize, &str) -> String) {
    let t = aam_data::BiomTable::read(demo("demo.biom")).unwrap();
    let (mut obs, mut samples, mut counts) = (Vec::new(), Vec::new(), Vec::new());
    for j in 0..t.n_samples() {
        let c = t.sample(j);
        obs.extend_from_slice(c.observations);
        samples.extend(std::iter::repeat_n(j as u32, c.len()));
        counts.extend_from_slice(c.counts);
    }
    let ids = t
        .observation_ids()
        .iter()
        .enumerate()
        .map(|(i, id)| rename(i, id))
        .collect();
    aam_data::BiomTable::from_triplets(path, t.sample_ids().to_vec(), ids, &obs, &samples, &counts)
        .unwrap()
        .write_hdf5(path)
        .unwrap();
}

/// A lsmat distance matrix over `ids` with `d(i, j)` (the diagonal as given).
fn lsmat(path: &Path, ids: &[String], d: impl Fn(usize, usize) -> String) {
    let mut text = format!("\t{}\n", ids.join("\t"));
    for (i, id) in ids.iter().enumerate() {
        let row: Vec<String> = (0..ids.len()).map(|j| d(i, j)).collect();
        text += &format!("{id}\t{}\n", row.join("\t"));
    }
    std::fs::write(path, text).unwrap();
}

/// Every kind of bad input a user meets (docs/reliability.md lists them with
/// their messages): the command exits 1 (2 for a flag clap refuses), never
/// panics, and names the file, line, sample or flag at fault.
#[test]
fn bad_inputs_fail_with_a_message_naming_the_cause() {
    let tmp = tempfile::tempdir().unwrap();
    let t = |name: &str| tmp.path().join(name);
    let out = t("out");
    let pre = || tiny("pretrain", &out, 1);
    let train = || tiny_train(&out, 1, &demo("demo_map.txt"), "age");
    let demo_ids: Vec<String> = std::fs::read_to_string(demo("unifrac.sample_ids.txt"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let n = demo_ids.len();

    // Tables.
    let bytes = std::fs::read(demo("demo.biom")).unwrap();
    std::fs::write(t("cut.biom"), &bytes[..bytes.len() / 3]).unwrap();
    std::fs::write(t("garbage.biom"), b"hello, world\n").unwrap();
    std::fs::write(t("empty.biom"), b"").unwrap();
    demo_renamed(&t("hashes.biom"), |i, _| {
        format!("{:032x}", (i as u128 + 1) * 0x9e37_79b9_7f4a_7c15)
    });
    // Matrices.
    let others: Vec<String> = (0..5).map(|i| format!("other.{i}")).collect();
    lsmat(&t("other.tsv"), &others, |i, j| {
        if i == j {
            "0".into()
        } else {
            "0.5".into()
        }
    });
    let plain = |i: usize, j: usize| {
        if i == j {
            "0".to_string()
        } else {
            "0.5".to_string()
        }
    };
    lsmat(&t("nan.tsv"), &demo_ids, |i, j| {
        if (i, j) == (3, 5) || (i, j) == (5, 3) {
            "nan".into()
        } else {
            plain(i, j)
        }
    });
    lsmat(&t("asym.tsv"), &demo_ids, |i, j| {
        if i < j {
            "0.6".into()
        } else {
            plain(i, j)
        }
    });
    let mut dup = demo_ids.clone();
    dup[1] = dup[0].clone();
    lsmat(&t("dup.tsv"), &dup, plain);
    let square = std::fs::read_to_string(t("asym.tsv")).unwrap();
    let rows: Vec<&str> = square.lines().collect();
    std::fs::write(t("nonsquare.tsv"), rows[..n].join("\n") + "\n").unwrap();
    // Metadata.
    let map = std::fs::read_to_string(demo("demo_map.txt")).unwrap();
    let lines: Vec<&str> = map.lines().collect();
    std::fs::write(t("dup_map.txt"), format!("{map}{}\n", lines[1])).unwrap();
    let age = lines[0].split('\t').position(|c| c == "age").unwrap();
    let mut cells: Vec<String> = lines[5].split('\t').map(str::to_string).collect();
    cells[age] = "forty".into();
    let mut text_age: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    text_age[5] = cells.join("\t");
    std::fs::write(t("text_age.txt"), text_age.join("\n") + "\n").unwrap();
    // Checkpoints: a pretrain one, cut, another format, another program's safetensors.
    let pre_dir = t("pre");
    run_ok(&tiny("pretrain", &pre_dir, 1));
    let ckpt = pre_dir.join("checkpoints/last.safetensors");
    let bytes = std::fs::read(&ckpt).unwrap();
    std::fs::write(t("cut.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    std::fs::write(t("text.safetensors"), b"not a checkpoint\n").unwrap();
    let header = br#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    let mut foreign = (header.len() as u64).to_le_bytes().to_vec();
    foreign.extend_from_slice(header);
    foreign.extend_from_slice(&[0; 8]);
    std::fs::write(t("foreign.safetensors"), foreign).unwrap();
    std::fs::write(t("a_file"), b"").unwrap();
    let predict = |model: &Path| {
        let mut a = args(&["predict", "--model"]);
        a.extend([s(model), "--table".into(), s(&demo("demo.biom"))]);
        a.extend(["--output".into(), s(&t("p.tsv"))]);
        a
    };
    let st = |name: &str| s(&t(name));

    let cases: Vec<(&str, Vec<String>, Vec<String>)> = vec![
        (
            "missing table",
            with(pre(), "--table", &st("nope.biom")),
            vec!["--table".into(), st("nope.biom")],
        ),
        (
            "truncated table",
            with(pre(), "--table", &st("cut.biom")),
            vec!["--table".into(), st("cut.biom"), "EOF".into()],
        ),
        (
            "garbage table",
            with(pre(), "--table", &st("garbage.biom")),
            vec![st("garbage.biom"), "neither BIOM 2.x".into()],
        ),
        (
            "empty table",
            with(pre(), "--table", &st("empty.biom")),
            vec![st("empty.biom"), "empty".into()],
        ),
        (
            "observation IDs that are not sequences",
            with(pre(), "--table", &st("hashes.biom")),
            vec![
                "table".into(),
                st("hashes.biom"),
                "not nucleotide sequences".into(),
            ],
        ),
        (
            "a UniFrac matrix of another study",
            with(pre(), "--unifrac-matrix", &st("other.tsv")),
            vec![
                "--unifrac-matrix".into(),
                st("other.tsv"),
                "none is in it".into(),
            ],
        ),
        (
            "NaN in the matrix",
            with(pre(), "--unifrac-matrix", &st("nan.tsv")),
            vec![
                "--unifrac-matrix".into(),
                st("nan.tsv"),
                "NaN".into(),
                demo_ids[3].clone(),
            ],
        ),
        (
            "a matrix that is not square",
            with(pre(), "--unifrac-matrix", &st("nonsquare.tsv")),
            vec![st("nonsquare.tsv"), "not square".into()],
        ),
        (
            "an asymmetric matrix",
            with(pre(), "--unifrac-matrix", &st("asym.tsv")),
            vec![st("asym.tsv"), "not symmetric".into()],
        ),
        (
            "duplicate sample IDs in the matrix",
            with(pre(), "--unifrac-matrix", &st("dup.tsv")),
            vec![st("dup.tsv"), "duplicate".into(), demo_ids[0].clone()],
        ),
        (
            "duplicate sample IDs in the metadata",
            with(train(), "--metadata", &st("dup_map.txt")),
            vec![
                "--metadata".into(),
                format!("{}:{}", st("dup_map.txt"), lines.len() + 1),
                "already appeared on line 2".into(),
            ],
        ),
        (
            "a non-numeric target",
            with(train(), "--metadata", &st("text_age.txt")),
            vec![
                format!("{}:6", st("text_age.txt")),
                "\"forty\"".into(),
                "age".into(),
            ],
        ),
        (
            "a missing metadata column",
            with(train(), "--metadata-column", "agee"),
            vec!["agee".into()],
        ),
        (
            "an odd batch",
            with(pre(), "--batch-size", "7"),
            vec!["--batch-size".into(), "7".into()],
        ),
        (
            "a batch larger than the training samples",
            with(pre(), "--batch-size", "1000"),
            vec![
                "--batch-size".into(),
                "1000".into(),
                "training samples".into(),
            ],
        ),
        (
            "a rarefaction depth above every sample",
            with(pre(), "--rarefy-depth", "100000000"),
            vec!["--rarefy-depth".into(), "leaves no sample".into()],
        ),
        (
            "a truncated checkpoint",
            with(pre(), "--resume-from", &st("cut.safetensors")),
            vec![
                "--resume-from".into(),
                st("cut.safetensors"),
                "cut short".into(),
            ],
        ),
        (
            "a file that is not a checkpoint",
            predict(&t("text.safetensors")),
            vec!["--model".into(), st("text.safetensors")],
        ),
        (
            "another program's safetensors",
            with(pre(), "--resume-from", &st("foreign.safetensors")),
            vec![
                st("foreign.safetensors"),
                "not an aam-rs training checkpoint".into(),
            ],
        ),
        (
            "a pretrain checkpoint given to predict",
            predict(&ckpt),
            vec![s(&ckpt), "prediction head".into()],
        ),
        (
            "a learning rate of 0",
            with(pre(), "--lr", "0"),
            vec!["--lr".into(), "> 0".into()],
        ),
        (
            "a negative learning rate",
            with(pre(), "--lr", "-1"),
            vec!["--lr".into(), "-1".into()],
        ),
        (
            "zero epochs",
            with(pre(), "--epochs", "0"),
            vec!["--epochs".into()],
        ),
        (
            "negative epochs",
            with(pre(), "--epochs", "-2"),
            vec!["--epochs".into(), "-2".into()],
        ),
        (
            "an output folder that cannot be made",
            with(pre(), "--output-dir", &format!("{}/sub", st("a_file"))),
            vec![
                "--output-dir".into(),
                st("a_file"),
                "Not a directory".into(),
            ],
        ),
    ];
    for (what, a, wanted) in &cases {
        let o = aam_rs(a);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(
            matches!(o.status.code(), Some(1 | 2)),
            "{what}: exit {:?}\n{stderr}",
            o.status
        );
        assert!(!stderr.contains("panicked"), "{what}: a panic\n{stderr}");
        for w in wanted {
            assert!(
                stderr.contains(w.as_str()),
                "{what}: {w:?} not in\n{stderr}"
            );
        }
        let message = stderr
            .lines()
            .find(|l| l.starts_with("error"))
            .unwrap_or_default();
        eprintln!("{what}\t{}", message.replace(&s(tmp.path()), "<dir>"));
    }

    // Rules rather than errors (as the reference): characters other than
    // A/C/G/T read as padding, sequences longer than --max-bp cut; both said.
    demo_renamed(&t("n.biom"), |i, id| {
        if i % 10 == 0 {
            format!("N{}", &id[1..])
        } else {
            id.to_string()
        }
    });
    let log = run_ok(&with(pre(), "--table", &st("n.biom")));
    assert!(log.contains("characters other than A/C/G/T"), "{log}");
    assert!(log.contains("longer than --max-bp 60"), "{log}");
}

/// Gradient checkpointing recomputes instead of storing; the run it trains is
/// the same run (losses and weights), and `--no-gradient-checkpointing` after
/// it turns it off again.
#[test]
fn gradient_checkpointing_trains_the_same_model() {
    let tmp = tempfile::tempdir().unwrap();
    let plain = tmp.path().join("plain");
    let ckpt = tmp.path().join("ckpt");
    let off_again = tmp.path().join("off");
    run_ok(&tiny("pretrain", &plain, 2));
    let mut a = tiny("pretrain", &ckpt, 2);
    a.push("--gradient-checkpointing".into());
    let log = run_ok(&a);
    assert!(log.contains("gradient checkpointing"), "{log}");
    let mut a = tiny("pretrain", &off_again, 1);
    a.extend(args(&[
        "--gradient-checkpointing",
        "--no-gradient-checkpointing",
    ]));
    assert!(!run_ok(&a).contains("gradient checkpointing"));

    let (_, want) = metrics(&plain);
    let (_, got) = metrics(&ckpt);
    for (w, g) in want.iter().zip(&got) {
        for key in ["train_total_loss", "val_total_loss", "val_nuc_accuracy"] {
            let (w, g) = (w[key], g[key]);
            assert!(
                (w - g).abs() <= 1e-6 * w.abs().max(1.0),
                "{key}: {w} without, {g} with checkpointing"
            );
        }
    }
    let weights = |dir: &Path| std::fs::read(dir.join("checkpoints/last.safetensors")).unwrap();
    let (w, g) = (weights(&plain), weights(&ckpt));
    let tensors = |bytes: &[u8]| {
        safetensors::SafeTensors::deserialize(bytes)
            .unwrap()
            .tensors()
            .into_iter()
            .filter(|(name, _)| name.starts_with("model."))
            .map(|(name, view)| (name, view.data().to_vec()))
            .collect::<BTreeMap<_, _>>()
    };
    let (w, g) = (tensors(&w), tensors(&g));
    assert!(w.len() > 10, "{} tensors", w.len());
    for (name, bytes) in &w {
        let other = &g[name];
        let max_diff = bytes
            .chunks(4)
            .zip(other.chunks(4))
            .map(|(a, b)| {
                let a = f32::from_le_bytes(a.try_into().unwrap());
                let b = f32::from_le_bytes(b.try_into().unwrap());
                (a - b).abs()
            })
            .fold(0f32, f32::max);
        assert!(max_diff <= 1e-6, "{name}: differs by {max_diff}");
    }
}

/// `tiny` with dropout and masking off (a data-parallel run then takes
/// the same steps however its replicas are spread), and `extra` flags.
fn tiny_deterministic(out: &Path, epochs: usize, extra: &[&str]) -> Vec<String> {
    let mut a = tiny("pretrain", out, epochs);
    a.extend(args(&["--dropout", "0", "--nuc-mask-ratio", "0"]));
    a.extend(args(extra));
    a
}

/// `127.0.0.1:<a free port>`, for a rendezvous.
fn local_rendezvous() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("127.0.0.1:{}", listener.local_addr().unwrap().port())
}

/// A run of two processes of one replica each on the CPU backend, meeting
/// on a free port of localhost: process 0 and process 1, started.
fn two_processes(out: &Path, epochs: usize, extra: &[&str]) -> (Running, Running) {
    let rendezvous = local_rendezvous();
    let rank = |r: &str| {
        let mut flags = vec![
            "--devices",
            "0",
            "--world-size",
            "2",
            "--rank",
            r,
            "--rendezvous",
            &rendezvous,
            "--rendezvous-timeout",
            "60",
        ];
        flags.extend(extra);
        Running::start(&tiny_deterministic(out, epochs, &flags))
    };
    (rank("0"), rank("1"))
}

/// Data parallel across processes on a backend without NCCL (ndarray:
/// the host sums, crossing processes with burn-collective): two processes
/// of one replica each, meeting on localhost, take the steps of one process
/// with two replicas on the same global batch (dropout and masking off);
/// only process 0 writes.
#[test]
fn two_processes_train_as_two_replicas_in_one() {
    let tmp = tempfile::tempdir().unwrap();
    let (threads, procs) = (tmp.path().join("threads"), tmp.path().join("procs"));
    run_ok(&tiny_deterministic(&threads, 2, &["--devices", "0,0"]));
    let (zero, one) = two_processes(&procs, 2, &[]);
    let ((s0, log), (s1, other_log)) = (zero.finish(), one.finish());
    assert!(s0.success(), "process 0 failed:\n{log}");
    assert!(s1.success(), "process 1 failed:\n{other_log}");
    assert!(log.contains("burn-collective"), "{log}");

    let (_, want) = metrics(&threads);
    let (_, got) = metrics(&procs);
    assert_eq!(want.len(), 2);
    assert_eq!(want.len(), got.len());
    for (w, g) in want.iter().zip(&got) {
        for key in ["train_total_loss", "train_unifrac_loss", "val_total_loss"] {
            let (w, g) = (w[key], g[key]);
            assert!(
                (w - g).abs() <= 1e-5 * w.abs().max(1.0),
                "{key}: {w} with two replicas, {g} with two processes"
            );
        }
    }
    let tensors = |dir: &Path| {
        let bytes = std::fs::read(dir.join("checkpoints/last.safetensors")).unwrap();
        safetensors::SafeTensors::deserialize(&bytes)
            .unwrap()
            .tensors()
            .into_iter()
            .filter(|(name, _)| name.starts_with("model."))
            .map(|(name, view)| {
                let values: Vec<f32> = view
                    .data()
                    .chunks(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                (name, values)
            })
            .collect::<BTreeMap<_, _>>()
    };
    let (w, g) = (tensors(&threads), tensors(&procs));
    assert!(w.len() > 10, "{} tensors", w.len());
    assert_eq!(w.len(), g.len());
    for (name, values) in &w {
        let scale = values.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        let diff = values
            .iter()
            .zip(&g[name])
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff <= 1e-5 * scale,
            "{name}: differs by {diff} (largest value {scale})"
        );
    }
}

/// Two CPU processes stop together: SIGUSR1 to process 1 alone stops both
/// at the same step with status 75 and one checkpoint, from which both
/// resume to the end, ending as two replicas in one process do. A process
/// killed mid-run is named by the other, which exits instead of waiting in
/// the next sum forever.
#[test]
fn processes_stop_together_and_a_lost_one_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let resumable = ["--checkpoint-every-steps", "1", "--resume-from", "auto"];
    let pair = |out: &Path, epochs: usize| two_processes(out, epochs, &resumable);
    let epochs = 12;
    let threads = tmp.path().join("threads");
    run_ok(&tiny_deterministic(&threads, epochs, &["--devices", "0,0"]));

    let procs = tmp.path().join("procs");
    let (zero, one) = pair(&procs, epochs);
    assert!(one.wait_for("process 1 of 2"), "process 1 did not join");
    one.signal("USR1");
    let ((s0, log0), (s1, log1)) = (zero.finish(), one.finish());
    assert_eq!(s1.code(), Some(75), "process 1 after SIGUSR1:\n{log1}");
    assert_eq!(
        s0.code(),
        Some(75),
        "process 0 after process 1's SIGUSR1:\n{log0}"
    );
    assert!(procs.join("checkpoints/last.safetensors").is_file());
    // Both resume from process 0's checkpoint and end as two replicas in one process.
    let (zero, one) = pair(&procs, epochs);
    let ((s0, log0), (s1, log1)) = (zero.finish(), one.finish());
    assert!(s0.success() && s1.success(), "resumed:\n{log0}\n{log1}");
    assert!(log0.contains("resum"), "{log0}");
    let (_, want) = metrics(&threads);
    let (_, got) = metrics(&procs);
    assert_eq!(want.len(), got.len());
    for (w, g) in want.iter().zip(&got) {
        let (w, g) = (w["train_total_loss"], g["train_total_loss"]);
        assert!((w - g).abs() <= 1e-5 * w.abs().max(1.0), "{w} against {g}");
    }

    // Process 1 killed: process 0 names it and exits.
    let lost = tmp.path().join("lost");
    let (zero, mut one) = pair(&lost, 1000);
    assert!(one.wait_for("process 1 of 2"), "process 1 did not join");
    std::thread::sleep(std::time::Duration::from_millis(500));
    one.child.kill().unwrap();
    one.child.wait().unwrap();
    let started = std::time::Instant::now();
    let (status, log) = zero.finish();
    assert_eq!(status.code(), Some(1), "{log}");
    // Named by the links (`process 1 of the run stopped`), or by the sum
    // that met the lost process first.
    assert!(
        log.contains("process 1 of the run stopped")
            || log.contains("another process of the run stopped"),
        "{log}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
}

/// `--memory-profile` on a backend that reports device memory (wgpu, on
/// lavapipe in CI) writes the in-use bytes after each phase of the step; on
/// one that does not (ndarray) it says so and the run goes on.
#[test]
fn memory_profile_reports_phases_or_says_why_not() {
    let tmp = tempfile::tempdir().unwrap();
    let cpu = tmp.path().join("cpu");
    let mut a = tiny("pretrain", &cpu, 1);
    a.push("--memory-profile".into());
    let log = run_ok(&a);
    assert!(log.contains("does not report device memory"), "{log}");
    assert!(!cpu.join("memory_profile.csv").exists());

    #[cfg(feature = "wgpu")]
    {
        let gpu = tmp.path().join("wgpu");
        let mut a = tiny("pretrain", &gpu, 1);
        a.extend(args(&["--memory-profile", "--backend", "wgpu"]));
        let log = run_ok(&a);
        assert!(log.contains("memory, epoch 1: peak in use"), "{log}");
        let text = std::fs::read_to_string(gpu.join("memory_profile.csv")).unwrap();
        let mut lines = text.lines();
        assert_eq!(
            lines.next(),
            Some("epoch,phase,in_use_mib,pool_reserved_mib")
        );
        let rows: BTreeMap<String, (f64, f64)> = lines
            .map(|l| {
                let c: Vec<&str> = l.split(',').collect();
                assert_eq!(c[0], "1", "{l}");
                (
                    c[1].to_string(),
                    (c[2].parse().unwrap(), c[3].parse().unwrap()),
                )
            })
            .collect();
        for phase in ["upload", "forward", "loss", "backward", "optimizer"] {
            let (in_use, reserved) = rows[phase];
            assert!(
                in_use > 0.0 && in_use <= reserved,
                "{phase}: {in_use} of {reserved}"
            );
        }
    }
}

/// `--mixed-precision`: a backend without the type (ndarray) is refused,
/// naming the flag; on wgpu (lavapipe in CI) fp16 pretrains with loss scaling,
/// and the loss falls as in f32.
#[test]
fn mixed_precision_trains_or_names_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let mut a = tiny("pretrain", &tmp.path().join("cpu"), 1);
    a.extend(args(&["--mixed-precision", "bf16"]));
    let err = run_err(&a);
    assert!(
        err.contains("--mixed-precision bf16") && err.contains("ndarray"),
        "{err}"
    );

    #[cfg(feature = "wgpu")]
    {
        let out = tmp.path().join("fp16");
        let mut a = tiny("pretrain", &out, 3);
        a.extend(args(&["--backend", "wgpu", "--mixed-precision", "fp16"]));
        run_ok(&a);
        let (_, rows) = metrics(&out);
        for row in &rows {
            for (k, v) in row {
                assert!(v.is_finite(), "{k} = {v}");
            }
        }
        let (first, last) = (rows[0]["train_total_loss"], rows[2]["train_total_loss"]);
        assert!(last < first, "fp16: train_total_loss {first} -> {last}");
        let (_, meta) = checkpoint_header(&out.join("checkpoints/last.safetensors"));
        assert_eq!(meta["run"]["mixed_precision"], "fp16");
        let scale = meta["progress"]["loss_scaler"]["scale"].as_f64().unwrap();
        assert!(scale >= 1.0 && scale <= 65_536.0, "loss scale {scale}");
    }
}

/// A BIOM 1.0 JSON table of (sample, [(sequence, count)]).
fn json_table(path: &Path, samples: &[(&str, &[(&str, f64)])]) {
    let mut rows: Vec<&str> = Vec::new();
    let mut data = Vec::new();
    for (j, (_, reads)) in samples.iter().enumerate() {
        for (seq, count) in reads.iter() {
            let i = rows.iter().position(|r| r == seq).unwrap_or_else(|| {
                rows.push(seq);
                rows.len() - 1
            });
            data.push(serde_json::json!([i, j, count]));
        }
    }
    let table = serde_json::json!({
        "id": "t", "format": "Biological Observation Matrix 1.0.0", "type": "OTU table",
        "matrix_type": "sparse", "matrix_element_type": "float",
        "shape": [rows.len(), samples.len()],
        "rows": rows.iter().map(|r| serde_json::json!({"id": r, "metadata": null})).collect::<Vec<_>>(),
        "columns": samples.iter().map(|(id, _)| serde_json::json!({"id": id, "metadata": null})).collect::<Vec<_>>(),
        "data": data,
    });
    std::fs::write(path, table.to_string()).unwrap();
}

/// `embed`: one row per sample in `.tsv` and `.npy` (the same numbers),
/// ASV embeddings on request, the library's example program agreeing with
/// the CLI, and bad input named.
#[test]
fn embed_writes_sample_embeddings() {
    let tmp = tempfile::tempdir().unwrap();
    let pre = tmp.path().join("pre");
    run_ok(&tiny("pretrain", &pre, 1));
    let model = pre.join("checkpoints/best.safetensors");
    let embed = |output: &Path, extra: &[String]| {
        let mut a = args(&["embed", "--model"]);
        a.extend([
            s(&model),
            "--table".into(),
            s(&demo("demo.biom")),
            "--output".into(),
            s(output),
        ]);
        a.extend(extra.iter().cloned());
        a
    };
    let (tsv_path, npy_path, asv_path) = (
        tmp.path().join("e.tsv"),
        tmp.path().join("e.npy"),
        tmp.path().join("asv.tsv"),
    );
    run_ok(&embed(&tsv_path, &["--asv-output".into(), s(&asv_path)]));
    let (header, rows) = tsv(&tsv_path);
    assert_eq!(header.len(), 17, "sample_id + 16 dimensions: {header:?}");
    assert_eq!(
        (header[0].as_str(), header[16].as_str()),
        ("sample_id", "dim_15")
    );
    assert_eq!(rows.len(), 64, "every demo sample");
    let table: BTreeMap<String, Vec<f32>> = rows
        .iter()
        .map(|r| {
            (
                r[0].clone(),
                r[1..].iter().map(|v| v.parse().unwrap()).collect(),
            )
        })
        .collect();
    assert_eq!(table.len(), 64, "sample IDs are distinct");
    assert!(table.values().flatten().all(|v| v.is_finite()));
    let first = &rows[0][1..];
    assert!(
        rows.iter().any(|r| &r[1..] != first),
        "every sample embeds the same"
    );

    run_ok(&embed(&npy_path, &[]));
    let ids = ids_file(&tmp.path().join("e.npy.ids.txt"));
    let array: ndarray::Array2<f32> = ndarray_npy::read_npy(&npy_path).unwrap();
    assert_eq!(array.dim(), (64, 16));
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(
            array.row(i).to_vec(),
            table[id],
            "{id}: .npy and .tsv differ"
        );
    }

    // ASV embeddings: a row per (sample, ASV) kept in a slot, at most 32 per sample.
    let (header, asv_rows) = tsv(&asv_path);
    assert_eq!(&header[..2], ["sample_id", "sequence"]);
    assert_eq!(header.len(), 18);
    let mut per_sample: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &asv_rows {
        *per_sample.entry(&r[0]).or_default() += 1;
        assert!(r[1].chars().all(|c| "ACGT".contains(c)), "{}", r[1]);
    }
    assert_eq!(per_sample.len(), 64);
    assert!(
        per_sample.values().all(|&n| (1..=32).contains(&n)),
        "{per_sample:?}"
    );

    // The library's example: nearest samples from its own embeddings equal
    // those of the CLI's.
    let example = Path::new(env!("CARGO_BIN_EXE_aam-rs"))
        .parent()
        .unwrap()
        .join("examples/embed_samples");
    assert!(
        example.exists(),
        "{} is missing: `cargo test --workspace` builds it (or cargo build -p aam-infer --example embed_samples)",
        example.display()
    );
    let out = Command::new(&example)
        .args([s(&model), s(&demo("demo.biom"))])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8(out.stdout).unwrap();
    assert_eq!(printed.lines().count(), 64);
    let distance = |a: &[f32], b: &[f32]| -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y) * (x - y))
            .sum::<f32>()
            .sqrt()
    };
    for line in printed.lines() {
        let cells: Vec<&str> = line.split('\t').collect();
        let (id, nearest) = (cells[0], cells[1]);
        let d = distance(&table[id], &table[nearest]);
        let best = table
            .iter()
            .filter(|(other, _)| other.as_str() != id)
            .map(|(_, e)| distance(&table[id], e))
            .fold(f32::INFINITY, f32::min);
        assert!(
            d <= best + 1e-5,
            "{id}: the example's nearest {nearest} is at {d}, the CLI's at {best}"
        );
    }

    // Bad input names the file, sample or character.
    let stderr = run_err(&embed(&tmp.path().join("e.parquet"), &[]));
    assert!(
        stderr.contains("--output") && stderr.contains(".tsv or .npy"),
        "{stderr}"
    );
    let bad = tmp.path().join("bad.json");
    json_table(
        &bad,
        &[
            ("ok", &[("ACGTACGT", 1000.0)]),
            ("S7", &[("ACGTXCGT", 1000.0)]),
        ],
    );
    let mut a = args(&["embed", "--model"]);
    a.extend([
        s(&model),
        "--table".into(),
        s(&bad),
        "--output".into(),
        s(&tmp.path().join("b.tsv")),
    ]);
    let stderr = run_err(&a);
    assert!(
        stderr.contains("\"S7\"") && stderr.contains("'X'") && stderr.contains("position 4"),
        "{stderr}"
    );
    json_table(&bad, &[("shallow", &[("ACGTACGT", 10.0)])]);
    let stderr = run_err(&a);
    assert!(
        stderr.contains("1000 reads") && stderr.contains("--no-rarefy"),
        "{stderr}"
    );
    assert!(!tmp.path().join("b.tsv").exists());
    a.push("--no-rarefy".into());
    run_ok(&a);
    assert_eq!(tsv(&tmp.path().join("b.tsv")).1.len(), 1);
}

/// One HTTP/1.1 request on a fresh connection: (status, body).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connects");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("a response head");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status");
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = rest;
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            rest = &tail[n + 2..];
        }
        out
    } else {
        rest.to_string()
    };
    (status, body)
}

/// The request body of `samples`, each sample's ASVs in table order: as a
/// JSON object (`{"TACG": 12, ...}`, written by hand because serde_json's
/// map sorts its keys) or, `pairs`, as `[["TACG", 12], ...]`.
fn request_json(samples: &[aam_data::SampleReads], pairs: bool) -> String {
    let samples: Vec<String> = samples
        .iter()
        .map(|s| {
            let reads: Vec<String> = s
                .reads
                .iter()
                .map(|(seq, n)| match pairs {
                    true => format!("[\"{seq}\", {n}]"),
                    false => format!("\"{seq}\": {n}"),
                })
                .collect();
            let counts = match pairs {
                true => format!("[{}]", reads.join(", ")),
                false => format!("{{{}}}", reads.join(", ")),
            };
            format!(
                "{{\"id\": {}, \"counts\": {counts}}}",
                Value::from(s.id.clone())
            )
        })
        .collect();
    format!("{{\"samples\": [{}]}}", samples.join(", "))
}

/// A model with a categorical input (`age_group`, with conditional output
/// scaling) served: `/predict` with each sample's metadata in the request
/// equals `aam-rs predict --metadata`; without it, 422 naming the column;
/// `/embed` needs none.
#[test]
fn serve_predicts_from_the_requests_metadata() {
    let tmp = tempfile::tempdir().unwrap();
    let (map, groups) = age_group_map(tmp.path(), 40.0);
    let tr = tmp.path().join("train");
    let mut a = tiny_train(&tr, 1, &map, "age");
    a.extend(args(&[
        "--categorical-columns",
        "age_group",
        "--conditional-output-scaling",
        "age_group",
    ]));
    run_ok(&a);
    let model = tr.join("checkpoints/best.safetensors");
    let predict_tsv = tmp.path().join("p.tsv");
    let mut a = args(&["predict", "--model"]);
    a.extend([
        s(&model),
        "--table".into(),
        s(&demo("demo.biom")),
        "--metadata".into(),
        s(&map),
        "--output".into(),
        s(&predict_tsv),
    ]);
    run_ok(&a);
    let cli = numeric_predictions(&predict_tsv);

    let (server, addr, _) = start_server(&model, &[]);
    let table = aam_data::BiomTable::read(demo("demo.biom")).unwrap();
    let samples = aam_data::SampleReads::from_table(&table);
    let with_metadata = |chunk: &[aam_data::SampleReads]| -> String {
        // Counts as pairs: a `Value`'s objects sort their keys, and the
        // ASVs' order is their slot order.
        let mut body: Value = serde_json::from_str(&request_json(chunk, true)).unwrap();
        for (sample, s) in body["samples"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .zip(chunk)
        {
            sample["metadata"] = serde_json::json!({"age_group": groups[&s.id]});
        }
        body.to_string()
    };
    for chunk in samples.chunks(16) {
        predictions_equal(&addr, &with_metadata(chunk), &cli);
    }
    let (status, body) = http(
        &addr,
        "POST",
        "/predict",
        &request_json(&samples[..4], false),
    );
    assert_eq!(status, 422, "{body}");
    assert!(body.contains("age_group"), "{body}");
    let (status, body) = http(&addr, "POST", "/embed", &request_json(&samples[..4], false));
    assert_eq!(status, 200, "{body}");
    drop(server);
}

/// `POST /predict` with `body` answers 200, each prediction within 1e-6 of
/// `cli`'s (`aam-rs predict`'s) for its sample.
fn predictions_equal(addr: &str, body: &str, cli: &BTreeMap<String, f64>) {
    let (status, body) = http(addr, "POST", "/predict", body);
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    for p in answer["predictions"].as_array().unwrap() {
        let id = p["id"].as_str().unwrap();
        let served = p["prediction"].as_f64().unwrap();
        assert!(
            (served - cli[id]).abs() <= 1e-6 * served.abs().max(1.0),
            "{id}: served {served}, aam-rs predict {}",
            cli[id]
        );
    }
}

/// Kills the server when a test fails before stopping it.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `aam-rs serve --model model` with `extra` flags on a free local port, once
/// `/health` answers 200: the process, its address, and a thread that
/// returns its log when it exits.
fn start_server(model: &Path, extra: &[&str]) -> (Server, String, std::thread::JoinHandle<String>) {
    use std::io::BufRead;
    let mut server = Server(
        Command::new(env!("CARGO_BIN_EXE_aam-rs"))
            .args(["serve", "--model", &s(model), "--port", "0"])
            .args(extra)
            .env("AAM_LOG", "info")
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("starts aam-rs serve"),
    );
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = server.0.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if let Some(at) = line.find("listening on http://") {
                let addr = line[at + 20..]
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .to_string();
                let _ = tx.send(addr);
            }
            lines.push(line);
        }
        lines.join("\n")
    });
    let addr = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the server logs its address");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while http(&addr, "GET", "/health", "").0 != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "/health never became 200"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    (server, addr, log)
}

/// `aam-rs serve` on a free local port: `/health`, `/info`, `/metrics`;
/// `/embed` and `/predict` equal `aam-rs embed` and `predict`; a load test
/// of 320 requests from 32 clients, a tenth malformed or oversized, gets
/// 200 for every good one, 422 or 413 for every bad one, nothing else; with
/// one request allowed in flight, 16 at once get 200 or 429, some of each;
/// SIGTERM ends it cleanly.
#[test]
fn serve_answers_like_the_cli() {
    let tmp = tempfile::tempdir().unwrap();
    let tr = tmp.path().join("train");
    run_ok(&tiny_train(&tr, 1, &demo("demo_map.txt"), "age"));
    let model = tr.join("checkpoints/best.safetensors");
    let (embed_tsv, predict_tsv) = (tmp.path().join("e.tsv"), tmp.path().join("p.tsv"));
    let mut a = args(&["embed", "--model"]);
    a.extend([
        s(&model),
        "--table".into(),
        s(&demo("demo.biom")),
        "--output".into(),
        s(&embed_tsv),
    ]);
    run_ok(&a);
    predict(&model, &predict_tsv);

    let (mut server, addr, log) = start_server(
        &model,
        &[
            "--max-request-samples",
            "16",
            "--max-concurrent-requests",
            "64",
        ],
    );
    let (status, body) = http(&addr, "GET", "/info", "");
    assert_eq!(status, 200);
    let info: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(info["info"]["kind"], "regressor", "{info}");
    assert_eq!(info["info"]["embedding_dim"], 16);
    assert_eq!(info["sha256"].as_str().unwrap().len(), 64);
    assert_eq!(info["limits"]["max_request_samples"], 16);

    // The CLI's numbers, by the service.
    let table = aam_data::BiomTable::read(demo("demo.biom")).unwrap();
    let samples = aam_data::SampleReads::from_table(&table);
    let (_, rows) = tsv(&embed_tsv);
    let cli_embeddings: BTreeMap<String, Vec<f64>> = rows
        .iter()
        .map(|r| {
            (
                r[0].clone(),
                r[1..].iter().map(|v| v.parse().unwrap()).collect(),
            )
        })
        .collect();
    let cli_predictions = numeric_predictions(&predict_tsv);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * a.abs().max(1.0);
    for (k, chunk) in samples.chunks(7).enumerate() {
        let (status, body) = http(&addr, "POST", "/embed", &request_json(chunk, k % 2 == 1));
        assert_eq!(status, 200, "{body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(answer["dim"], 16);
        for e in answer["embeddings"].as_array().unwrap() {
            let id = e["id"].as_str().unwrap();
            let served: Vec<f64> = e["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            let cli = &cli_embeddings[id];
            assert!(
                served.iter().zip(cli).all(|(a, b)| close(*a, *b)),
                "{id}: served {served:?}, aam-rs embed {cli:?}"
            );
        }
        predictions_equal(&addr, &request_json(chunk, k % 2 == 0), &cli_predictions);
    }

    // Load: 32 clients x 10 requests; every tenth request is bad.
    let samples = std::sync::Arc::new(samples);
    let clients: Vec<_> = (0..32)
        .map(|c| {
            let (addr, samples) = (addr.clone(), samples.clone());
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                for r in 0..10 {
                    let k = c * 10 + r;
                    let (route, body, expected) = match (k % 10, k / 10 % 3) {
                        (0, 0) => ("/embed", "{\"samples\": [{\"id\": ".to_string(), 422),
                        (0, 1) => (
                            "/predict",
                            "{\"samples\":[{\"id\":\"x\",\"counts\":{\"ACGU!\":1000}}]}"
                                .to_string(),
                            422,
                        ),
                        (0, _) => ("/embed", request_json(&samples[..17], false), 413),
                        _ => {
                            let start = k % 60;
                            let route = if k % 2 == 0 { "/embed" } else { "/predict" };
                            (
                                route,
                                request_json(&samples[start..start + 1 + k % 4], k % 3 == 0),
                                200,
                            )
                        }
                    };
                    let (status, answer) = http(&addr, "POST", route, &body);
                    seen.push((route, status, expected, answer));
                }
                seen
            })
        })
        .collect();
    let mut counts: BTreeMap<(&str, u16), usize> = BTreeMap::new();
    for client in clients {
        for (route, status, expected, answer) in client.join().unwrap() {
            assert_eq!(status, expected, "{route}: {answer}");
            *counts.entry((route, status)).or_default() += 1;
        }
    }
    assert_eq!(counts.values().sum::<usize>(), 320);
    assert_eq!(
        http(&addr, "GET", "/health", "").0,
        200,
        "healthy after the load"
    );
    let (status, metrics) = http(&addr, "GET", "/metrics", "");
    assert_eq!(status, 200);
    for ((route, status), n) in &counts {
        let line = format!("aam_requests_total{{route=\"{route}\",status=\"{status}\"}} ");
        let total: usize = metrics
            .lines()
            .find_map(|l| l.strip_prefix(&line))
            .unwrap_or_else(|| panic!("no {line} in /metrics:\n{metrics}"))
            .parse()
            .unwrap();
        // The comparison requests above count too.
        assert!(total >= *n, "{line}{total} < {n}");
    }
    assert!(metrics.contains("aam_batch_samples_count"), "{metrics}");
    assert!(!metrics.contains("status=\"5"), "{metrics}");

    // Busy: one request in flight at most; 16 clients at once, each with
    // 16 samples, get 200 or 429 (with its message), some of each.
    // It warms up on every batch shape first, as on a GPU: the model's one
    // slot count (32) at 1-64 samples and full batches of 2-64 samples.
    let (busy, busy_addr, busy_log) = start_server(
        &model,
        &[
            "--max-request-samples",
            "16",
            "--max-concurrent-requests",
            "1",
            "--max-batch-asvs",
            "2048",
            "--warm-up",
            "shapes",
        ],
    );
    let start = std::sync::Arc::new(std::sync::Barrier::new(16));
    let clients: Vec<_> = (0..16)
        .map(|c| {
            let (addr, samples, start) = (busy_addr.clone(), samples.clone(), start.clone());
            std::thread::spawn(move || {
                let body = request_json(&samples[c..c + 16], false);
                start.wait();
                http(&addr, "POST", "/embed", &body)
            })
        })
        .collect();
    let mut statuses = BTreeMap::new();
    for client in clients {
        let (status, answer) = client.join().unwrap();
        assert!(status == 200 || status == 429, "{status}: {answer}");
        if status == 429 {
            assert!(answer.contains("--max-concurrent-requests"), "{answer}");
        }
        *statuses.entry(status).or_insert(0) += 1;
    }
    assert!(
        statuses.contains_key(&200) && statuses.contains_key(&429),
        "16 requests at once with one allowed in flight: {statuses:?}"
    );
    assert_eq!(http(&busy_addr, "GET", "/health", "").0, 200);
    drop(busy);
    let busy_log = busy_log.join().unwrap();
    assert!(busy_log.contains("13 warm-up batches"), "{busy_log}");

    // SIGTERM: a clean exit.
    let killed = Command::new("kill")
        .args(["-TERM", &server.0.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = server.0.wait().unwrap();
    let log = log.join().unwrap();
    assert!(status.success(), "serve exited with {status}:\n{log}");
    assert!(log.contains("shutting down"), "{log}");
}

/// A run's processes take their ranks from the flags, else from SLURM's
/// variables when the job has several tasks; the rendezvous defaults to the
/// job's first node.
#[test]
fn processes_take_their_ranks_from_the_flags_or_slurm() {
    use aam_cli::args::{first_slurm_host, ParallelArgs};
    use clap::Parser;

    assert_eq!(first_slurm_host("node7").as_deref(), Some("node7"));
    assert_eq!(
        first_slurm_host("gpu[03-04,07],cpu1").as_deref(),
        Some("gpu03")
    );
    assert_eq!(first_slurm_host("a1,b[2-3]").as_deref(), Some("a1"));
    assert_eq!(first_slurm_host(""), None);

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        parallel: ParallelArgs,
    }
    let world = |flags: &[&str], env: &[(&str, &str)]| {
        let mut argv = vec!["aam-rs"];
        argv.extend(flags);
        let parsed = Flags::try_parse_from(argv).unwrap();
        let env: BTreeMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        parsed.parallel.world(|k| env.get(k).cloned())
    };
    let slurm = [
        ("SLURM_NTASKS", "4"),
        ("SLURM_PROCID", "2"),
        ("SLURM_JOB_NODELIST", "gpu[03-04]"),
        ("SLURM_JOB_ID", "123456"),
    ];
    let w = world(&[], &slurm).unwrap();
    assert_eq!((w.rank, w.size), (2, 4));
    assert_eq!(w.rendezvous, "gpu03:23456");
    // Flags win; --world-size 1 opts out of SLURM's tasks.
    let w = world(&["--rank", "1", "--rendezvous", "head:1234"], &slurm).unwrap();
    assert_eq!((w.rank, w.size, w.rendezvous.as_str()), (1, 4, "head:1234"));
    assert_eq!(world(&["--world-size", "1"], &slurm).unwrap().size, 1);
    // No SLURM, no flags: one process.
    assert_eq!(world(&[], &[]).unwrap().size, 1);
    // A rank outside the run, a run without a rendezvous.
    let err = world(
        &["--world-size", "2", "--rank", "2", "--rendezvous", "h:1"],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("rank") && err.contains('2'), "{err}");
    let err = world(&["--world-size", "2", "--rank", "1"], &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("--rendezvous"), "{err}");
    let err = world(&[], &[("SLURM_NTASKS", "two")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("SLURM_NTASKS"), "{err}");
}
