//! Text distance matrices (`.csv` with an ID header row and column; `.tsv`
//! as `ssu`/QIIME write them). The first byte picks the delimiter.
#![no_main]
use aam_data::{DistanceMatrix, MatrixIds};
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, file)) = data.split_first() else {
        return;
    };
    let path = if selector & 1 == 0 { "fuzz.csv" } else { "fuzz.tsv" };
    if let Ok(matrix) = DistanceMatrix::from_bytes(file.to_vec(), Path::new(path), &MatrixIds::Auto) {
        let n = matrix.len();
        assert_eq!(matrix.ids().len(), n);
        for (i, id) in matrix.ids().iter().enumerate() {
            assert_eq!(matrix.position(id), Some(i));
        }
    }
});
