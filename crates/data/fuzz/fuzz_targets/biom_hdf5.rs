//! BIOM 2.x (HDF5) tables: any bytes after the HDF5 signature give a table
//! or an error, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::Path;

/// The 8-byte HDF5 superblock signature at offset 0.
const SIGNATURE: &[u8; 8] = b"\x89HDF\r\n\x1a\n";

fuzz_target!(|data: &[u8]| {
    // Keep every input on the HDF5 path: restore the signature the mutator
    // may have broken, so the fuzzer's time goes into the HDF5 reader.
    let mut bytes = data.to_vec();
    if bytes.len() < SIGNATURE.len() {
        bytes.resize(SIGNATURE.len(), 0);
    }
    bytes[..SIGNATURE.len()].copy_from_slice(SIGNATURE);
    if let Ok(table) = aam_data::BiomTable::from_bytes(&bytes, Path::new("fuzz.biom")) {
        let _ = table.sample_totals();
        let _ = table.observation_totals();
        for s in 0..table.n_samples() {
            let _ = table.sample(s).len();
        }
    }
});
