//! `.npy` and `.npz` distance matrices. The first byte chooses the
//! container and how many sample IDs the caller supplies, so inputs reach the
//! shape, ID and value checks rather than stopping at a missing sidecar file.
#![no_main]
use aam_data::{DistanceMatrix, MatrixIds};
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, file)) = data.split_first() else {
        return;
    };
    let path = if selector & 0x80 == 0 { "fuzz.npy" } else { "fuzz.npz" };
    let ids = MatrixIds::TableOrder((0..(selector & 0x7f)).map(|i| format!("s{i}")).collect());
    if let Ok(matrix) = DistanceMatrix::from_bytes(file.to_vec(), Path::new(path), &ids) {
        let n = matrix.len();
        let rows: Vec<usize> = (0..n).collect();
        let mut block = Vec::new();
        matrix.block_into(&rows, &mut block);
        assert_eq!(block.len(), n * n);
    }
});
