//! Metadata TSV files: any bytes give a table or an error, never a panic;
//! every column of a parsed table can be asked for numeric targets.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    if let Ok(metadata) = aam_data::Metadata::from_bytes(data, Path::new("fuzz_map.tsv")) {
        for column in metadata.columns().to_vec() {
            let _ = metadata.numeric(&column);
        }
    }
});
