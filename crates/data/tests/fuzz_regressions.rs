//! Inputs found by the fuzz targets (`crates/data/fuzz`) that crash an
//! unguarded reader: each must give an error that names the file.
//!
//! Files in `tests/fixtures/fuzz/` are named `<target>-<what>.<ext>`; the
//! target says which reader the bytes go to, as in the fuzz target.

use std::path::Path;

use aam_data::BiomTable;

fn fixture(name: &str) -> (Vec<u8>, std::path::PathBuf) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/fuzz")
        .join(name);
    (std::fs::read(&path).unwrap(), path)
}

/// A vlen-string dataset whose chunked layout declares 2^62 bytes of fill
/// value: an unguarded HDF5 parser allocates it and the process aborts.
#[test]
fn hdf5_dataset_larger_than_the_file_is_an_error_not_an_abort() {
    let (bytes, path) = fixture("biom_hdf5-vlen-fill-exabytes.biom");
    let err = BiomTable::from_bytes(&bytes, &path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("biom_hdf5-vlen-fill-exabytes.biom"), "{err}");
    assert!(
        err.contains("more than a") && err.contains("file can hold"),
        "{err}"
    );
}

/// Every kept input is rejected cleanly by its reader.
#[test]
fn every_kept_fuzz_input_is_an_error() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fuzz");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let bytes = std::fs::read(&path).unwrap();
        let result = match name.split('-').next().unwrap() {
            "biom_json" | "biom_hdf5" => BiomTable::from_bytes(&bytes, &path).map(|_| ()),
            other => panic!("{name}: no reader for fuzz target {other}"),
        };
        assert!(result.is_err(), "{name} parsed");
    }
}
