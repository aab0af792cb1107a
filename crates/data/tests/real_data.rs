//! Every table, matrix and metadata file in `../shared/data`, checked against
//! numbers computed independently with the `biom-format` 2.1.18, h5py, numpy
//! and pandas Python packages (the expected values are committed here, not the
//! tools; the script is `tests/expected_numbers.py`).
//!
//! The data folder is read relative to the workspace root; when it is absent
//! (a checkout without `../shared`) each test prints a note and returns.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use aam_data::tokenize::tokenize;
use aam_data::{
    BatchConfig, BatchLoader, BiomTable, Dataset, DistanceMatrix, Error, MatrixIds, Metadata,
    MissingPolicy, TargetTransform, Transforms,
};

fn data_dir() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!("note: {} is absent; skipping this test", dir.display());
        None
    }
}

macro_rules! data {
    () => {
        match data_dir() {
            Some(d) => d,
            None => return,
        }
    };
}

fn demo_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("demo")
}

/// What biom-format reports for a table.
struct Expected {
    samples: usize,
    observations: usize,
    nnz: usize,
    total: f64,
    first_sample: &'static str,
    last_sample: &'static str,
    first_observation: &'static str,
    last_observation: &'static str,
    first_sums: [f64; 3],
    last_sum: f64,
    first_observation_sum: f64,
    first_asvs_per_sample: [usize; 3],
}

fn check(table: &BiomTable, e: &Expected) {
    let name = table.source().display().to_string();
    assert_eq!(table.n_samples(), e.samples, "{name}");
    assert_eq!(table.n_observations(), e.observations, "{name}");
    assert_eq!(table.nnz(), e.nnz, "{name}");
    assert!(
        (table.total() - e.total).abs() <= 1e-9 * e.total,
        "{name}: total {} vs {}",
        table.total(),
        e.total
    );
    assert_eq!(table.sample_ids()[0], e.first_sample, "{name}");
    assert_eq!(table.sample_ids()[e.samples - 1], e.last_sample, "{name}");
    assert_eq!(table.observation_ids()[0], e.first_observation, "{name}");
    assert_eq!(
        table.observation_ids()[e.observations - 1],
        e.last_observation,
        "{name}"
    );
    let sums = table.sample_totals();
    for (k, (sum, expected)) in sums.iter().zip(e.first_sums).enumerate() {
        assert!(
            (sum - expected).abs() <= 1e-9 * expected,
            "{name}: sample {k} sum {sum} vs {expected}"
        );
        assert_eq!(
            table.sample(k).len(),
            e.first_asvs_per_sample[k],
            "{name}: sample {k}"
        );
    }
    assert!(
        (sums[e.samples - 1] - e.last_sum).abs() <= 1e-9 * e.last_sum,
        "{name}"
    );
    let obs0 = table.observation_totals()[0];
    assert!(
        (obs0 - e.first_observation_sum).abs() <= 1e-9 * e.first_observation_sum,
        "{name}: {obs0}"
    );
}

const ORAL: Expected = Expected {
    samples: 2537,
    observations: 5574,
    nnz: 133_957,
    total: 2_537_000.0,
    first_sample: "11052.3.20.13.rk.t",
    last_sample: "10317.000048361",
    first_observation: "TACGGAAGGTTCAGGCGTTATCCGGATTTATTGGGTTTAAAGGGAGCGTAGGCTGGAGATTAAGTGTGTTGTGAAATGTAGACGCTCAACGTCTGACTTG",
    last_observation: "TACGTAGGTGGCAAGCGTTGTCCGGAATTATTGGGCGTAAAGGGCTCGCAGGCGGTTTCTTAAGTCTGATGTGAAAGCCCCCGGCTCAACCGGGGAGGGT",
    first_sums: [1000.0, 1000.0, 1000.0],
    last_sum: 1000.0,
    first_observation_sum: 8.0,
    first_asvs_per_sample: [46, 33, 45],
};

#[test]
fn oral2550_table_matches_biom_format() {
    let d = data!();
    let t = BiomTable::read(d.join("oral2550/oral_2550.biom")).unwrap();
    check(&t, &ORAL);
    assert!(t.is_integer());
    assert!(t.observation_ids().iter().all(|s| s.len() == 100));
}

#[test]
fn halfvarson_table_matches_biom_format() {
    let d = data!();
    let t = BiomTable::read(d.join("halfvarson-ibd1629/table.biom")).unwrap();
    check(
        &t,
        &Expected {
            samples: 681,
            observations: 7589,
            nnz: 117_183,
            total: 153_084_386.0,
            first_sample: "1629.SubjectIBD026",
            last_sample: "1629.SubjectIBD249",
            first_observation: "ACGGAGGGTGCAAGCGTTAATCGGAATTACTGGGCGTAAAGCGCACGCAGGCGGTTTGTTAAGTCAGATGTGAAATCCCCGGGCTCAACC",
            last_observation: "ACCTAGGTCCCGAGCGTTATCCGGATTTATTGGGCGTAAAGCGAGCGCAGGCGGTTAGATAAGTCTGAAGTTAAAGGCTGTGGCTTAACC",
            first_sums: [233_791.0, 298_303.0, 126_745.0],
            last_sum: 325_935.0,
            first_observation_sum: 7_623_424.0,
            first_asvs_per_sample: [109, 135, 121],
        },
    );
    let totals = t.sample_totals();
    assert_eq!(totals.iter().copied().fold(f64::INFINITY, f64::min), 2.0);
    assert_eq!(totals.iter().copied().fold(0.0, f64::max), 1_356_239.0);
}

#[test]
fn multiomics_75k_asvs_matches_biom_format() {
    let d = data!();
    let t = BiomTable::read(d.join("multiomics10333-16S/16S-table.biom")).unwrap();
    check(
        &t,
        &Expected {
            samples: 226,
            observations: 75_755,
            nnz: 211_076,
            total: 11_071_547.0,
            first_sample: "10333.Che.1.kitc",
            last_sample: "10333.Pue.776.livi",
            first_observation: "AAAAATGATACGTAGTCTCTATTTACCGTGTTAAGTCAATGGGTGATTAGAAACCCGGGTAGTCCGGCTGACTGACTGTCGTCCTAAATATCTCGTATGC",
            last_observation: "TTTTTGTATTTTTAGTAGAGACGGGGTTTCACCATGTTGGTCAGGCTGGTCTTGACCTCTTGACCTCATGATCCACCCGCCTTGGCCTCCCAAAGTGCTG",
            first_sums: [53_221.0, 78_224.0, 15_370.0],
            last_sum: 64_070.0,
            first_observation_sum: 2.0,
            first_asvs_per_sample: [351, 799, 417],
        },
    );
}

const MOVING_PICTURES: Expected = Expected {
    samples: 34,
    observations: 759,
    nnz: 2290,
    total: 157_298.0,
    first_sample: "L1S105",
    last_sample: "L6S93",
    first_observation: "4b5eeb300368260019c1fbc7a3c718fc",
    last_observation: "1830c14ead81ad012f1db0e12f8ab6a4",
    first_sums: [7865.0, 7245.0, 8270.0],
    last_sum: 7025.0,
    first_observation_sum: 11_497.0,
    first_asvs_per_sample: [62, 61, 82],
};

#[test]
fn moving_pictures_json_and_hdf5_agree() {
    let d = data!();
    let h5 = BiomTable::read(d.join("moving-pictures/table.biom")).unwrap();
    let json = BiomTable::read(d.join("moving-pictures/table.v100-json.biom")).unwrap();
    check(&h5, &MOVING_PICTURES);
    check(&json, &MOVING_PICTURES);
    assert_eq!(h5.sample_ids(), json.sample_ids());
    assert_eq!(h5.observation_ids(), json.observation_ids());
    for s in 0..h5.n_samples() {
        assert_eq!(h5.sample(s).observations, json.sample(s).observations);
        assert_eq!(h5.sample(s).counts, json.sample(s).counts);
    }
}

#[test]
fn biom_format_fixtures() {
    let d = data!();
    let f = d.join("fixtures/biom-format");
    let small = Expected {
        samples: 6,
        observations: 5,
        nnz: 15,
        total: 27.0,
        first_sample: "Sample1",
        last_sample: "Sample6",
        first_observation: "GG_OTU_1",
        last_observation: "GG_OTU_5",
        first_sums: [7.0, 3.0, 4.0],
        last_sum: 4.0,
        first_observation_sum: 1.0,
        first_asvs_per_sample: [2, 3, 4],
    };
    let mut tables = Vec::new();
    for name in [
        "min_sparse_otu_table.biom",
        "min_sparse_otu_table_hdf5.biom",
        "rich_sparse_otu_table.biom",
        "rich_sparse_otu_table_hdf5.biom",
        "rich_sparse_otu_table_hdf5_group_metadata.biom",
        "test_data__test_grp_metadata.biom",
    ] {
        let t = BiomTable::read(f.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        check(&t, &small);
        tables.push(t);
    }
    for t in &tables[1..] {
        for s in 0..6 {
            assert_eq!(t.sample(s).observations, tables[0].sample(s).observations);
            assert_eq!(t.sample(s).counts, tables[0].sample(s).counts);
        }
    }

    // Non-integer counts: read exactly, refused by rarefaction.
    let t = BiomTable::read(f.join("test_data__edgecase_issue_952.biom")).unwrap();
    check(
        &t,
        &Expected {
            samples: 148,
            observations: 10,
            nnz: 1478,
            total: 441_025.125_614_967_43,
            first_sample: "10A1-P1.mzML",
            last_sample: "blank.mzML",
            first_observation: "4064",
            last_observation: "30163",
            first_sums: [2219.64341, 2172.6573111, 1616.5077113000002],
            last_sum: 686.9531949299999,
            first_observation_sum: 46_249.241_618_999_99,
            first_asvs_per_sample: [10, 10, 10],
        },
    );
    assert!(!t.is_integer());
    let err = t.rarefy(500, 1).unwrap_err();
    assert!(matches!(err, Error::NonIntegerCount { .. }), "{err}");
    assert!(err.to_string().contains("10A1-P1.mzML"), "{err}");

    // The 0 x 0 table (float64 ids) is a correct empty table.
    let t = BiomTable::read(f.join("test_data__empty.biom")).unwrap();
    assert_eq!((t.n_samples(), t.n_observations(), t.nnz()), (0, 0, 0));
    assert!(t.is_empty());
    let err = Dataset::builder(&t).build().unwrap_err();
    assert!(
        err.to_string().contains("test_data__empty.biom") && err.to_string().contains("no sample"),
        "{err}"
    );

    // The 0-byte file: a clear error naming it.
    let err = BiomTable::read(f.join("test_data__no-contents.biom")).unwrap_err();
    assert!(matches!(err, Error::EmptyFile { .. }), "{err}");
    assert!(
        err.to_string().contains("test_data__no-contents.biom"),
        "{err}"
    );

    // A missing file.
    let err = BiomTable::read(f.join("does-not-exist.biom")).unwrap_err();
    assert!(
        matches!(err, Error::Io { .. }) && err.to_string().contains("does-not-exist.biom"),
        "{err}"
    );
}

#[test]
fn unifrac_fixture_tables() {
    let d = data!();
    let t = BiomTable::read(d.join("fixtures/crawford/crawford.biom")).unwrap();
    check(
        &t,
        &Expected {
            samples: 9,
            observations: 365,
            nnz: 557,
            total: 1085.0,
            first_sample: "10084.PC.481",
            last_sample: "10084.PC.634",
            first_observation: "197790",
            last_observation: "186526",
            first_sums: [130.0, 137.0, 124.0],
            last_sum: 116.0,
            first_observation_sum: 5.0,
            first_asvs_per_sample: [74, 50, 71],
        },
    );
    let t = BiomTable::read(d.join("fixtures/qiime-191-tt/otu-table.biom")).unwrap();
    check(
        &t,
        &Expected {
            samples: 8,
            observations: 10,
            nnz: 26,
            total: 176.0,
            first_sample: "f2",
            last_sample: "t2",
            first_observation: "295053",
            last_observation: "None8",
            first_sums: [22.0, 22.0, 22.0],
            last_sum: 22.0,
            first_observation_sum: 82.0,
            first_asvs_per_sample: [3, 2, 2],
        },
    );
    for (name, obs, nnz, total, sums) in [
        ("e1", 5, 7, 10.0, [2.0, 5.0, 3.0]),
        ("e2", 4, 6, 8.0, [3.0, 2.0, 3.0]),
    ] {
        let t = BiomTable::read(d.join(format!("fixtures/unifrac-tests/{name}.biom"))).unwrap();
        assert_eq!(
            (t.n_samples(), t.n_observations(), t.nnz()),
            (3, obs, nnz),
            "{name}"
        );
        assert_eq!(t.total(), total);
        assert_eq!(t.sample_totals(), sums.to_vec());
        assert_eq!(t.sample_ids(), &["A", "B", "C"]);
    }
}

#[test]
fn rarefaction_on_real_tables() {
    let d = data!();
    let t = BiomTable::read(d.join("halfvarson-ibd1629/table.biom")).unwrap();
    let r = t.rarefy(1000, 42).unwrap();
    // biom-format: 65 samples have fewer than 1000 reads.
    assert_eq!(r.dropped.len(), 65);
    assert_eq!(r.table.n_samples(), 616);
    let totals = t.sample_totals();
    let index = t.sample_index();
    for id in &r.dropped {
        assert!(totals[index[id.as_str()]] < 1000.0, "{id}");
    }
    for (s, total) in r.table.sample_totals().into_iter().enumerate() {
        assert_eq!(total, 1000.0, "{}", r.table.sample_ids()[s]);
    }
    // Every count is at most the original count of the same ASV in the same sample.
    let original_obs: std::collections::HashMap<&str, usize> = t
        .observation_ids()
        .iter()
        .enumerate()
        .map(|(i, s)| (s.as_str(), i))
        .collect();
    for s in 0..r.table.n_samples() {
        let orig = t.sample(index[r.table.sample_ids()[s].as_str()]);
        let rs = r.table.sample(s);
        for (&o, &c) in rs.observations.iter().zip(rs.counts) {
            let k = original_obs[r.table.observation_ids()[o as usize].as_str()];
            let pos = orig
                .observations
                .binary_search(&(k as u32))
                .expect("drawn ASV was in the sample");
            assert!(c <= orig.counts[pos]);
        }
    }
    // No observation is zero everywhere.
    assert!(r.table.observation_totals().iter().all(|&v| v > 0.0));
    // Seeded.
    assert_eq!(t.rarefy(1000, 42).unwrap().table, r.table);
    assert_ne!(t.rarefy(1000, 43).unwrap().table, r.table);

    // oral2550 is already at 1,000 reads per sample: rarefying to 1,000 keeps it as is.
    let oral = BiomTable::read(d.join("oral2550/oral_2550.biom")).unwrap();
    let same = oral.rarefy(1000, 7).unwrap();
    assert!(same.dropped.is_empty());
    assert_eq!(same.table, oral);
    let half = oral.rarefy(500, 7).unwrap();
    assert_eq!(half.table.n_samples(), 2537);
    assert!(half.table.sample_totals().iter().all(|&v| v == 500.0));

    // multiomics at 10,000: biom-format drops 1 sample.
    let mo = BiomTable::read(d.join("multiomics10333-16S/16S-table.biom")).unwrap();
    assert_eq!(mo.rarefy(10_000, 1).unwrap().dropped.len(), 1);
}

#[test]
fn oral2550_matrices_match_h5py_and_numpy() {
    let d = data!();
    let uw =
        DistanceMatrix::read(d.join("oral2550/unifrac.unweighted.h5"), &MatrixIds::Auto).unwrap();
    assert_eq!(uw.len(), 2537);
    assert_eq!(uw.ids()[0], "11052.3.20.13.rk.t");
    assert_eq!(uw.ids()[2536], "10317.000048361");
    // h5py: matrix[0,1], matrix[5,100], matrix[2536,17] (fp32, exact).
    assert_eq!(uw.get(0, 1), 0.447_921_037_673_950_2_f64 as f32);
    assert_eq!(uw.get(5, 100), 0.466_669_797_897_338_87_f64 as f32);
    assert_eq!(uw.get(2536, 17), 0.601_083_219_051_361_1_f64 as f32);
    let sum: f64 = (0..2537)
        .flat_map(|i| (0..2537).map(move |j| (i, j)))
        .map(|(i, j)| uw.get(i, j) as f64)
        .sum();
    assert!((sum - 2_944_744.722_511_109).abs() < 1e-3, "{sum}");

    // The .npy has no IDs: found in unifrac.sample_ids.txt by the sidecar rule.
    let w = DistanceMatrix::read(
        d.join("oral2550/unifrac.weighted_normalized.npy"),
        &MatrixIds::Auto,
    )
    .unwrap();
    assert_eq!(w.len(), 2537);
    assert_eq!(
        w.distance("11052.3.20.13.rk.t", "10317.000003639"),
        Some(0.184_472_158_551_216_13_f64 as f32)
    );
    assert_eq!(
        w.distance("10317.000003995", "11052.12.7.13.rk.t"),
        Some(0.281_857_639_551_162_7_f64 as f32)
    );
}

#[test]
fn qiime191_tiny_test_ssu_matrices_match_the_qiime_expected_ones() {
    let d = data!();
    let f = d.join("fixtures/qiime-191-tt");
    for (ssu, qiime) in [
        ("unifrac.unweighted.h5", "unweighted_unifrac_dm.txt"),
        (
            "unifrac.weighted_normalized.h5",
            "weighted_normalized_unifrac_dm.txt",
        ),
    ] {
        let a = DistanceMatrix::read(f.join(ssu), &MatrixIds::Auto).unwrap();
        let b = DistanceMatrix::read(f.join(qiime), &MatrixIds::Auto).unwrap();
        assert_eq!(a.ids(), &["f2", "f1", "f3", "f4", "p2", "p1", "t1", "t2"]);
        assert_eq!(b.len(), 9, "QIIME's matrix also holds not16S.1");
        for x in a.ids() {
            for y in a.ids() {
                let (u, v) = (a.distance(x, y).unwrap(), b.distance(x, y).unwrap());
                // numpy: max |ssu - QIIME| = 1.15e-8; f32 storage adds < 6e-8.
                assert!((u - v).abs() < 1e-7, "{ssu}: d({x},{y}) {u} vs {v}");
            }
        }
        // The matrix is also readable as .npy with its sidecar IDs, and agrees.
        let c = DistanceMatrix::read(f.join(ssu.replace(".h5", ".npy")), &MatrixIds::Auto).unwrap();
        for x in a.ids() {
            for y in a.ids() {
                assert_eq!(a.distance(x, y), c.distance(x, y));
            }
        }
    }
}

#[test]
fn moving_pictures_and_crawford_matrices() {
    let d = data!();
    for name in ["unifrac.unweighted", "unifrac.weighted_normalized"] {
        let h5 = DistanceMatrix::read(
            d.join(format!("moving-pictures/{name}.h5")),
            &MatrixIds::Auto,
        )
        .unwrap();
        let npy = DistanceMatrix::read(
            d.join(format!("moving-pictures/{name}.npy")),
            &MatrixIds::Auto,
        )
        .unwrap();
        assert_eq!(h5.ids(), npy.ids());
        assert_eq!(h5.ids()[..3], ["L1S105", "L1S140", "L1S208"]);
        for i in 0..h5.len() {
            for j in 0..h5.len() {
                assert_eq!(h5.get(i, j), npy.get(i, j));
            }
        }
    }
    let h5 = DistanceMatrix::read(
        d.join("moving-pictures/unifrac.unweighted.h5"),
        &MatrixIds::Auto,
    )
    .unwrap();
    assert_eq!(h5.get(0, 1), 0.519_618_863_565_803_7_f64 as f32);
    let c = DistanceMatrix::read(
        d.join("fixtures/crawford/unifrac.unweighted.h5"),
        &MatrixIds::Auto,
    )
    .unwrap();
    assert_eq!(
        c.distance("10084.PC.481", "10084.PC.634"),
        Some(0.736_060_528_204_182_9_f64 as f32)
    );
}

/// The matrix lists the samples in another order than the table: batches must
/// still carry d(a, b) for exactly the batch's samples, looked up by ID.
#[test]
fn unifrac_blocks_follow_sample_ids_not_positions() {
    let d = data!();
    let table = BiomTable::read(d.join("oral2550/oral_2550.biom")).unwrap();
    // Reverse the table's sample order; the matrix stays in ssu (original) order.
    let reversed: Vec<usize> = (0..table.n_samples()).rev().collect();
    let table = table.select_samples(&reversed);
    assert_eq!(table.sample_ids()[0], "10317.000048361");
    let matrix = Arc::new(
        DistanceMatrix::read(d.join("oral2550/unifrac.unweighted.h5"), &MatrixIds::Auto).unwrap(),
    );
    let ds = Arc::new(
        Dataset::builder(&table)
            .unifrac(matrix.clone(), MissingPolicy::Error)
            .build()
            .unwrap(),
    );
    let loader = BatchLoader::new(
        ds.clone(),
        (0..ds.len()).collect(),
        Arc::default(),
        BatchConfig::train(16, 64, 5),
    )
    .unwrap();
    let mut checked = 0;
    for (k, batch) in loader.epoch(0).enumerate().take(40) {
        let batch = batch.unwrap();
        let u = batch.unifrac.as_ref().unwrap();
        let b = batch.batch_size();
        for i in 0..b {
            for j in 0..b {
                let expected = matrix
                    .distance(&batch.sample_ids[i], &batch.sample_ids[j])
                    .unwrap();
                assert_eq!(u[i * b + j], expected, "batch {k} ({i},{j})");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 40 * 16 * 16);
    // And a value computed by h5py for a named pair, through a hand-made batch.
    let a = ds.position("11052.3.20.13.rk.t").unwrap();
    let b = ds.position("10317.000003639").unwrap();
    let pair = BatchLoader::new(
        ds.clone(),
        vec![a, b],
        Arc::default(),
        BatchConfig::validation(2, 64, 0),
    )
    .unwrap();
    let batch = pair.batch(0, 0).unwrap();
    assert_eq!(
        batch.sample_ids,
        vec!["11052.3.20.13.rk.t", "10317.000003639"],
        "validation keeps the given order"
    );
    assert_eq!(
        batch.unifrac.unwrap()[1],
        0.447_921_037_673_950_2_f64 as f32
    );
}

#[test]
fn a_matrix_from_another_study_is_an_error_naming_missing_ids() {
    let d = data!();
    let table = BiomTable::read(d.join("moving-pictures/table.biom")).unwrap();
    let other = d.join("fixtures/qiime-191-tt/unifrac.unweighted.h5");
    let matrix = Arc::new(DistanceMatrix::read(&other, &MatrixIds::Auto).unwrap());
    let err = Dataset::builder(&table)
        .unifrac(matrix.clone(), MissingPolicy::Error)
        .build()
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::SamplesMissingFromMatrix { count: 34, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("qiime-191-tt/unifrac.unweighted.h5")
            && msg.contains("\"L1S105\"")
            && msg.contains("(and 24 more)"),
        "{msg}"
    );
    let err = Dataset::builder(&table)
        .unifrac(matrix, MissingPolicy::Drop)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("no sample is left"), "{err}");

    // A partial matrix (the 64-sample demo) against the full oral2550 table.
    let oral = BiomTable::read(d.join("oral2550/oral_2550.biom")).unwrap();
    let demo = Arc::new(
        DistanceMatrix::read(demo_dir().join("unifrac.unweighted.h5"), &MatrixIds::Auto).unwrap(),
    );
    let err = Dataset::builder(&oral)
        .unifrac(demo.clone(), MissingPolicy::Error)
        .build()
        .unwrap_err();
    assert!(
        matches!(err, Error::SamplesMissingFromMatrix { count: 2473, .. }),
        "{err}"
    );
    let ds = Dataset::builder(&oral)
        .unifrac(demo, MissingPolicy::Drop)
        .build()
        .unwrap();
    assert_eq!(ds.len(), 64);
}

#[test]
fn metadata_files() {
    let d = data!();
    let m = Metadata::read(d.join("oral2550/oral_2550_map.txt")).unwrap();
    assert_eq!(
        (m.len(), m.id_column(), m.columns().len()),
        (2537, "#SampleID", 2)
    );
    let age = m.numeric("age").unwrap();
    assert!(age.iter().all(Option::is_some));
    let age: Vec<f64> = age.into_iter().flatten().collect();
    assert_eq!(age.iter().copied().fold(f64::INFINITY, f64::min), 18.0);
    assert_eq!(age.iter().copied().fold(0.0, f64::max), 85.0);
    let mean = age.iter().sum::<f64>() / age.len() as f64;
    assert!((mean - 32.077_229_010_642_49).abs() < 1e-9, "{mean}");
    assert_eq!(
        m.value(
            m.row("11052.3.20.13.rk.t").unwrap(),
            m.column("age").unwrap()
        ),
        Some("36.0")
    );

    // halfvarson: Qiita missing-value terms are missing values, not errors.
    let h = Metadata::read(d.join("halfvarson-ibd1629/sample-metadata.tsv")).unwrap();
    assert_eq!(
        (h.len(), h.columns().len(), h.sample_ids()[0].as_str()),
        (683, 51, "1629.SubjectIBD425")
    );
    let cal: Vec<f64> = h
        .numeric("calprotectin")
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(cal.len(), 663);
    assert!((cal.iter().sum::<f64>() - 234_349.7).abs() < 1e-6);
    let bmi: Vec<f64> = h.numeric("bmi").unwrap().into_iter().flatten().collect();
    assert_eq!((bmi.len(), bmi.iter().sum::<f64>()), (618, 15_989.0));

    // multiomics: a decimal comma is an error naming sample, column and line.
    let mo = Metadata::read(d.join("multiomics10333-16S/metadata.tsv")).unwrap();
    assert_eq!((mo.len(), mo.id_column()), (226, "sample_name"));
    let err = mo.numeric("temp").unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::NonNumericTarget { line: 121, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("metadata.tsv:121")
            && msg.contains("10333.Pue.737.bedr")
            && msg.contains("\"temp\"")
            && msg.contains("\"26,9\""),
        "{msg}"
    );
    let elevation: Vec<f64> = mo
        .numeric("elevation")
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    assert!((elevation.iter().sum::<f64>() - 30_614.4).abs() < 1e-6);
    let host_age = mo.numeric("host_age ").unwrap();
    assert!(
        host_age.iter().all(Option::is_none),
        "'not provided' everywhere"
    );

    // moving pictures: the #q2:types directive is not a sample.
    let mp = Metadata::read(d.join("moving-pictures/sample-metadata.tsv")).unwrap();
    assert_eq!((mp.len(), mp.sample_ids()[0].as_str()), (34, "L1S8"));
    let days: f64 = mp
        .numeric("DaysSinceExperimentStart")
        .unwrap()
        .into_iter()
        .flatten()
        .sum();
    assert_eq!(days, 3416.0);
    let enc = aam_data::CategoricalEncoder::fit(&mp, &["BodySite"], mp.sample_ids()).unwrap();
    assert_eq!(enc.cardinalities(), vec![5]);
    assert_eq!(enc.decode(0, 1), Some("gut"));
    assert_eq!(enc.decode(0, 4), Some("tongue"));
}

#[test]
fn demo_dataset_end_to_end() {
    let demo = demo_dir();
    let table = BiomTable::read(demo.join("demo.biom")).unwrap();
    assert_eq!(
        (table.n_samples(), table.n_observations(), table.total()),
        (64, 534, 64_000.0)
    );
    assert_eq!(
        table.sample_ids()[..2],
        ["10317.000031067", "11052.10.3.13.rk.t"]
    );
    assert_eq!(table.sample_ids()[63], "10317.000007100");
    let metadata = Arc::new(Metadata::read(demo.join("demo_map.txt")).unwrap());
    // Both matrices are stored in orders other than the table's.
    let uw = Arc::new(
        DistanceMatrix::read(demo.join("unifrac.unweighted.h5"), &MatrixIds::Auto).unwrap(),
    );
    let w = DistanceMatrix::read(
        demo.join("unifrac.weighted_normalized.npy"),
        &MatrixIds::Auto,
    )
    .unwrap();
    assert_eq!(uw.ids()[..2], ["10317.000002532", "10317.000003351"]);
    assert_ne!(uw.ids(), table.sample_ids());
    assert_eq!(w.ids()[0], table.sample_ids()[63]);
    if let Some(d) = data_dir() {
        let full_uw =
            DistanceMatrix::read(d.join("oral2550/unifrac.unweighted.h5"), &MatrixIds::Auto)
                .unwrap();
        let full_w = DistanceMatrix::read(
            d.join("oral2550/unifrac.weighted_normalized.npy"),
            &MatrixIds::Auto,
        )
        .unwrap();
        for a in table.sample_ids() {
            for b in table.sample_ids() {
                assert_eq!(uw.distance(a, b), full_uw.distance(a, b));
                assert_eq!(w.distance(a, b), full_w.distance(a, b));
            }
        }
    }

    let table = table.rarefy(1000, 1).unwrap().table;
    let ds = Arc::new(
        Dataset::builder(&table)
            .unifrac(uw.clone(), MissingPolicy::Error)
            .metadata(metadata)
            .target("age", MissingPolicy::Error)
            .build()
            .unwrap(),
    );
    let split = ds.split(0.25, 3).unwrap();
    assert_eq!((split.train.len(), split.validation.len()), (48, 16));
    let transforms = Arc::new(Transforms {
        target: Some(
            ds.fit_target_normalizer(TargetTransform::MinMax, &[], &split.train)
                .unwrap(),
        ),
        ..Default::default()
    });
    let train = BatchLoader::new(
        ds.clone(),
        split.train.clone(),
        transforms.clone(),
        BatchConfig::train(8, 64, 3),
    )
    .unwrap();
    let val = BatchLoader::new(
        ds.clone(),
        split.validation.clone(),
        transforms.clone(),
        BatchConfig::validation(6, 64, 3),
    )
    .unwrap();
    assert_eq!(train.num_batches(), 6);
    assert_eq!(
        val.num_batches(),
        3,
        "16 = 6 + 6 + 4: the last partial batch is kept"
    );
    let norm = transforms.target.as_ref().unwrap();
    for batch in train.epoch(0).chain(val.epoch(0)) {
        let batch = batch.unwrap();
        let [b, s, l] = batch.tokens_shape();
        assert_eq!((s, l), (64, 151));
        assert_eq!(batch.tokens.len(), b * s * l);
        assert_eq!(batch.counts.len(), b * s);
        let targets = batch.targets.as_ref().unwrap();
        for (i, id) in batch.sample_ids.iter().enumerate() {
            // Every slot holds START + the ASV's first 150 bases, in table row order.
            let (asvs, counts) = ds.sample(ds.position(id).unwrap());
            let first = tokenize(&ds.asv_ids()[asvs[0] as usize], 150);
            assert_eq!(&batch.tokens[i * s * l..i * s * l + l], first.as_slice());
            let n = asvs.len().min(s);
            assert_eq!(&batch.counts[i * s..i * s + n], &counts[..n]);
            assert!(batch.counts[i * s + n..(i + 1) * s]
                .iter()
                .all(|&c| c == 0.0));
            let age = ds.targets().unwrap()[ds.position(id).unwrap()];
            assert!(
                (norm.denormalize(targets[i] as f64, None) - age).abs() < 1e-4,
                "{id}"
            );
            let u = batch.unifrac.as_ref().unwrap();
            for (j, other) in batch.sample_ids.iter().enumerate() {
                assert_eq!(u[i * b + j], uw.distance(id, other).unwrap());
            }
        }
    }
}
