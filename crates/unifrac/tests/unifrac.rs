//! aam-unifrac against `ssu` and `faithpd` (Debian's `unifrac-tools`, the
//! oracle; `.ci/run` installs it) on the bundled demo (64 oral2550 samples
//! and their sheared tree; always) and on the real data and fixtures of
//! `../shared/data` (when the checkout has them beside it), and the
//! properties every distance must have.

use std::path::{Path, PathBuf};
use std::process::Command;

use aam_data::BiomTable;
use aam_unifrac::{faith_pd, unifrac, Distances, Error, Method, Options, Tree};

/// `../shared/data` (the real data beside the repository), or None with a
/// note when this checkout has none: the tests on it then check nothing, and
/// the demo's tests below still run.
fn shared() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!("note: {} is absent; skipping this test", dir.display());
        None
    }
}

/// The bundled demo: 64 oral2550 samples and the oral2550 tree sheared to their ASVs.
fn demo(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../data/demo")
        .join(name)
}

/// A table, its tree, and whether it has an empty sample to drop (qiime-191-tt's
/// all-zero sample is already removed from the committed table).
const SETS: [(&str, &str, bool); 5] = [
    (
        "fixtures/crawford/crawford.biom",
        "fixtures/crawford/crawford.tre",
        false,
    ),
    (
        "fixtures/qiime-191-tt/otu-table.biom",
        "fixtures/qiime-191-tt/tree.nwk",
        false,
    ),
    (
        "fixtures/unifrac-tests/e1.biom",
        "fixtures/unifrac-tests/t1.newick",
        false,
    ),
    (
        "fixtures/unifrac-tests/e2.biom",
        "fixtures/unifrac-tests/t2.newick",
        false,
    ),
    (
        "moving-pictures/table.biom",
        "moving-pictures/rooted-tree.nwk",
        false,
    ),
];

fn oracle_missing(tool: &str, e: std::io::Error) -> ! {
    panic!("cannot run {tool} ({e}): the oracle comes from Debian's unifrac-tools (apt-get install unifrac-tools; .ci/run installs it)")
}

/// Run `ssu` in fp64 (or fp32) and read its HDF5 matrix: IDs and values.
fn ssu(
    table: &Path,
    tree: &Path,
    method: Method,
    vaw: bool,
    fp32: bool,
) -> (Vec<String>, Vec<f64>) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ssu.h5");
    let precision = if fp32 { "fp32" } else { "fp64" };
    let mut cmd = Command::new("ssu");
    cmd.env("OMP_NUM_THREADS", "2")
        .env("UNIFRAC_USE_GPU", "N")
        .arg("-i")
        .arg(table)
        .arg("-t")
        .arg(tree)
        .args(["-m", &format!("{}_{precision}", method.name())])
        .arg("-o")
        .arg(&out)
        .args(["--format", &format!("hdf5_{precision}"), "--pcoa", "0"]);
    if let Method::Generalized { alpha } = method {
        cmd.args(["-a", &alpha.to_string()]);
    }
    if vaw {
        cmd.arg("--vaw");
    }
    let output = cmd.output().unwrap_or_else(|e| oracle_missing("ssu", e));
    assert!(
        output.status.success(),
        "ssu failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    read_h5(&out)
}

fn read_h5(path: &Path) -> (Vec<String>, Vec<f64>) {
    let file = hdf5_pure::File::from_bytes(std::fs::read(path).unwrap()).unwrap();
    let ids = file.dataset("order").unwrap().read_string().unwrap();
    let values = file.dataset("matrix").unwrap().read_f64().unwrap();
    (ids, values)
}

/// The largest |ours − theirs| over the samples both have (by ID).
fn max_diff(ours: &Distances, ids: &[String], theirs: &[f64]) -> f64 {
    let n = ids.len();
    let at: Vec<Option<usize>> = ids
        .iter()
        .map(|id| ours.ids().iter().position(|x| x == id))
        .collect();
    let mut worst = 0.0f64;
    let mut compared = 0;
    for i in 0..n {
        for j in 0..n {
            if let (Some(a), Some(b)) = (at[i], at[j]) {
                let t = theirs[i * n + j];
                if t.is_nan() {
                    continue;
                }
                // A NaN of ours where `ssu` has a value is the worst difference.
                let d = (ours.get(a, b) - t).abs();
                worst = if d.is_nan() {
                    f64::INFINITY
                } else {
                    worst.max(d)
                };
                compared += 1;
            }
        }
    }
    assert_eq!(
        compared,
        ours.len() * ours.len(),
        "every pair of ours is compared"
    );
    worst
}

fn options(method: Method, vaw: bool, drop_empty: bool) -> Options {
    Options {
        variance_adjusted: vaw,
        threads: 2,
        drop_empty,
        ..Options::new(method)
    }
}

/// The matrix of `table` over `tree` with `options` (progress not shown).
fn run(table: &BiomTable, tree: &Tree, options: &Options) -> Distances {
    unifrac(table, tree, options, &mut |_, _| {}).unwrap().0
}

const METHODS: [Method; 5] = [
    Method::Unweighted,
    Method::WeightedNormalized,
    Method::WeightedUnnormalized,
    Method::Generalized { alpha: 0.5 },
    Method::Generalized { alpha: 1.0 },
];

/// Every method, plain and variance adjusted, against `ssu` in fp64.
fn matches_ssu(table_path: &Path, tree_path: &Path, has_empty: bool) {
    let table = BiomTable::read(table_path).unwrap();
    let tree = Tree::read(tree_path).unwrap();
    for method in METHODS {
        for vaw in [false, true] {
            let (ours, report) = unifrac(
                &table,
                &tree,
                &options(method, vaw, has_empty),
                &mut |_, _| {},
            )
            .unwrap();
            assert_eq!(report.dropped_samples.len(), has_empty as usize);
            let (ids, theirs) = ssu(table_path, tree_path, method, vaw, false);
            let diff = max_diff(&ours, &ids, &theirs);
            assert!(
                diff <= 1e-9,
                "{} {method:?} vaw={vaw}: max |aam-rs - ssu| = {diff:e}",
                table_path.display()
            );
        }
    }
}

#[test]
fn every_method_matches_ssu_on_the_demo() {
    matches_ssu(&demo("demo.biom"), &demo("tree.nwk"), false);
}

#[test]
fn every_method_matches_ssu_on_every_fixture() {
    let Some(root) = shared() else { return };
    for (table_path, tree_path, has_empty) in SETS {
        matches_ssu(&root.join(table_path), &root.join(tree_path), has_empty);
    }
}

#[test]
fn single_precision_output_matches_ssu_fp32_and_reads_back() {
    let (table_path, tree_path) = (demo("demo.biom"), demo("tree.nwk"));
    let table = BiomTable::read(&table_path).unwrap();
    let tree = Tree::read(&tree_path).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for method in [Method::Unweighted, Method::WeightedNormalized] {
        let ours = run(&table, &tree, &options(method, false, false));
        let path = dir.path().join("ours.h5");
        ours.write(&path, true).unwrap();
        let (ids, values) = read_h5(&path);
        assert_eq!(ids, ours.ids());
        let back = aam_data::DistanceMatrix::read(&path, &aam_data::MatrixIds::Auto).unwrap();
        assert_eq!(back.ids(), ours.ids());
        let (sids, theirs) = ssu(&table_path, &tree_path, method, false, true);
        let diff = max_diff(&ours, &sids, &theirs);
        assert!(diff <= 1e-5, "{method:?} fp32: {diff:e}");
        let written: f64 = values
            .iter()
            .zip(ours.values())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(written <= 1e-6, "fp32 file vs fp64 values: {written:e}");
        // And the TSV (lsmat) reads back through aam-data too.
        let tsv = dir.path().join("ours.tsv");
        ours.write(&tsv, false).unwrap();
        let back = aam_data::DistanceMatrix::read(&tsv, &aam_data::MatrixIds::Auto).unwrap();
        assert_eq!(back.ids(), ours.ids());
        assert!((back.get(0, 1) as f64 - ours.get(0, 1)).abs() < 1e-6);
    }
}

#[test]
fn oral2550_matches_ssu() {
    let Some(root) = shared() else { return };
    let (table_path, tree_path) = (
        root.join("oral2550/oral_2550.biom"),
        root.join("oral2550/tree.fasttree-midpoint.nwk"),
    );
    let table = BiomTable::read(&table_path).unwrap();
    let tree = Tree::read(&tree_path).unwrap();
    for method in [Method::Unweighted, Method::WeightedNormalized] {
        let ours = run(&table, &tree, &options(method, false, false));
        assert_eq!(ours.len(), table.n_samples());
        let (ids, theirs) = ssu(&table_path, &tree_path, method, false, false);
        let diff = max_diff(&ours, &ids, &theirs);
        assert!(diff <= 1e-9, "oral2550 {method:?}: {diff:e}");
    }
}

#[test]
fn faith_pd_matches_faithpd() {
    let mut sets = vec![(demo("demo.biom"), demo("tree.nwk"), false)];
    if let Some(root) = shared() {
        sets.extend(SETS.map(|(t, n, e)| (root.join(t), root.join(n), e)));
    }
    for (table_path, tree_path, has_empty) in sets {
        let table = BiomTable::read(&table_path).unwrap();
        let tree = Tree::read(&tree_path).unwrap();
        let (ours, _) = faith_pd(
            &table,
            &tree,
            &options(Method::Unweighted, false, has_empty),
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("faith.tsv");
        let status = Command::new("faithpd")
            .arg("-i")
            .arg(&table_path)
            .arg("-t")
            .arg(&tree_path)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap_or_else(|e| oracle_missing("faithpd", e));
        assert!(status.status.success());
        let text = std::fs::read_to_string(&out).unwrap();
        let mut compared = 0;
        for line in text.lines().skip(1) {
            let (id, v) = line.split_once('\t').unwrap();
            let v: f64 = v.parse().unwrap();
            let i = ours.ids.iter().position(|x| x == id).unwrap();
            assert!(
                (ours.values[i] - v).abs() <= 1e-9,
                "{id}: {} vs {v}",
                ours.values[i]
            );
            compared += 1;
        }
        assert_eq!(compared, ours.ids.len(), "{}", table_path.display());
    }
}

/// The demo table and its tree.
fn demo_inputs() -> (BiomTable, Tree) {
    (
        BiomTable::read(demo("demo.biom")).unwrap(),
        Tree::read(demo("tree.nwk")).unwrap(),
    )
}

#[test]
fn distances_are_symmetric_zero_on_the_diagonal_and_zero_between_identical_samples() {
    let (table, tree) = demo_inputs();
    // Samples 0 and 1 twice over, under new IDs: identical count vectors.
    let doubled = table.select_samples(&[0, 1, 2]);
    let mut obs = Vec::new();
    let mut samples = Vec::new();
    let mut counts = Vec::new();
    for (s, source) in [0usize, 1, 2, 0, 1].into_iter().enumerate() {
        let c = doubled.sample(source);
        for (&o, &v) in c.observations.iter().zip(c.counts) {
            obs.push(o);
            samples.push(s as u32);
            // Scaled copies have the same proportions: weighted distances 0 too.
            counts.push(if s >= 3 { v * 3.0 } else { v });
        }
    }
    let ids = ["a", "b", "c", "a2", "b2"].map(String::from).to_vec();
    let t = BiomTable::from_triplets(
        "t.biom",
        ids,
        doubled.observation_ids().to_vec(),
        &obs,
        &samples,
        &counts,
    )
    .unwrap();
    for method in METHODS {
        let d = run(&t, &tree, &options(method, false, false));
        for i in 0..5 {
            assert_eq!(d.get(i, i), 0.0);
            for j in 0..5 {
                assert_eq!(d.get(i, j), d.get(j, i));
            }
        }
        assert_eq!(d.get(0, 3), 0.0, "{method:?}");
        assert_eq!(d.get(1, 4), 0.0, "{method:?}");
        assert!(d.get(0, 1) > 0.0);
    }
}

#[test]
fn distances_do_not_depend_on_sample_order_children_order_or_threads() {
    let (table, tree) = demo_inputs();
    let n = table.n_samples();
    let perm: Vec<usize> = (0..n).rev().collect();
    let shuffled = table.select_samples(&perm);
    let mirrored = Tree::parse(tree.to_newick(true).as_bytes(), Path::new("mirrored.nwk")).unwrap();
    for method in METHODS {
        let base = run(&table, &tree, &options(method, false, false));
        let mut one = options(method, false, false);
        one.threads = 1;
        let single = run(&shuffled, &mirrored, &one);
        for i in 0..n {
            for j in 0..n {
                let (a, b) = (base.get(i, j), single.get(n - 1 - i, n - 1 - j));
                assert!((a - b).abs() <= 1e-12, "{method:?} ({i},{j}): {a} vs {b}");
            }
        }
    }
}

#[test]
fn a_tree_of_one_tip_gives_zero_distances() {
    let tree = Tree::parse(b"(x:1.5);", Path::new("one.nwk")).unwrap();
    let t = BiomTable::from_triplets(
        "one.biom",
        vec!["s1".into(), "s2".into()],
        vec!["x".into()],
        &[0, 0],
        &[0, 1],
        &[3.0, 7.0],
    )
    .unwrap();
    for method in METHODS {
        let d = run(&t, &tree, &options(method, false, false));
        assert_eq!(d.values(), &[0.0; 4], "{method:?}");
    }
    let (pd, _) = faith_pd(&t, &tree, &Options::new(Method::Unweighted)).unwrap();
    assert_eq!(pd.values, [1.5, 1.5]);
}

#[test]
fn empty_samples_and_missing_tips_are_named_or_dropped_on_request() {
    let tree = Tree::parse(b"((x:1,y:2):1,z:3);", Path::new("t.nwk")).unwrap();
    let ids = vec!["s1".to_string(), "s2".into(), "s3".into()];
    // s3 has no counts; "w" is not a tip.
    let t = BiomTable::from_triplets(
        "t.biom",
        ids,
        vec!["x".into(), "y".into(), "z".into(), "w".into()],
        &[0, 2, 1, 3],
        &[0, 0, 1, 1],
        &[1.0, 2.0, 5.0, 4.0],
    )
    .unwrap();
    let strict = Options::new(Method::Unweighted);
    let err = unifrac(&t, &tree, &strict, &mut |_, _| {}).unwrap_err();
    assert!(matches!(err, Error::MissingTips { .. }), "{err}");
    assert!(err.to_string().contains(": \"w\""), "{err}");
    assert!(err.to_string().contains("--drop-missing"), "{err}");
    let lenient = Options {
        drop_missing: true,
        ..strict.clone()
    };
    let err = unifrac(&t, &tree, &lenient, &mut |_, _| {}).unwrap_err();
    assert!(
        matches!(err, Error::EmptySamples { .. }) && err.to_string().contains("s3"),
        "{err}"
    );
    let both = Options {
        drop_empty: true,
        ..lenient
    };
    let (d, report) = unifrac(&t, &tree, &both, &mut |_, _| {}).unwrap();
    assert_eq!(d.ids(), ["s1", "s2"]);
    assert_eq!(report.dropped_samples, ["s3"]);
    assert_eq!(report.dropped_observations, ["w"]);
    // s1 = {x, z}, s2 = {y}: they share only the (x,y) branch (1) of a union of 7.
    assert_eq!(d.get(0, 1), 6.0 / 7.0);
    let bad_alpha = Options::new(Method::Generalized { alpha: 1.5 });
    assert!(unifrac(&t, &tree, &bad_alpha, &mut |_, _| {})
        .unwrap_err()
        .to_string()
        .contains("--alpha"));
}

/// The GPU path on wgpu (Mesa's lavapipe in CI), which computes in single
/// precision: every method `ssu` has, within 1e-5 of its fp32 output, on the
/// demo and every fixture, plain and variance adjusted (and oral2550's 2,537
/// samples, unweighted, where the shared data is present).
#[cfg(feature = "wgpu")]
#[test]
fn the_gpu_path_matches_ssu_fp32_on_wgpu() {
    use aam_unifrac::{unifrac_on_gpu, Gpu};
    let mut sets = vec![(demo("demo.biom"), demo("tree.nwk"), false, &METHODS[..])];
    if let Some(root) = shared() {
        for (table, tree, has_empty) in SETS {
            sets.push((root.join(table), root.join(tree), has_empty, &METHODS[..]));
        }
        sets.push((
            root.join("oral2550/oral_2550.biom"),
            root.join("oral2550/tree.fasttree-midpoint.nwk"),
            false,
            &METHODS[..1],
        ));
    }
    for (table_path, tree_path, has_empty, methods) in sets {
        let table = BiomTable::read(&table_path).unwrap();
        let tree = Tree::read(&tree_path).unwrap();
        // oral2550 (one method) is there for its size, plain only.
        let adjusted: &[bool] = if methods.len() > 1 {
            &[false, true]
        } else {
            &[false]
        };
        for (&method, &vaw) in methods
            .iter()
            .flat_map(|m| adjusted.iter().map(move |v| (m, v)))
        {
            let options = options(method, vaw, has_empty);
            let start = std::time::Instant::now();
            let (ours, report) =
                unifrac_on_gpu(&table, &tree, &options, Gpu::Wgpu, &mut |_, _| {}).unwrap();
            let seconds = start.elapsed().as_secs_f64();
            assert_eq!(report.dropped_samples.len(), has_empty as usize);
            let (ids, theirs) = ssu(&table_path, &tree_path, method, vaw, true);
            let diff = max_diff(&ours, &ids, &theirs);
            eprintln!(
                "{} {method:?} vaw={vaw}: {} samples in {seconds:.2} s, max |gpu - ssu fp32| = {diff:e}",
                table_path.display(),
                ours.len()
            );
            assert!(
                diff <= 1e-5,
                "{} {method:?} vaw={vaw}: max |gpu - ssu fp32| = {diff:e}",
                table_path.display()
            );
        }
    }
}
