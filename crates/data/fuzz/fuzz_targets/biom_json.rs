//! BIOM 1.0 (JSON) tables: any bytes give a table or an error, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    if let Ok(table) = aam_data::BiomTable::from_bytes(data, Path::new("fuzz.biom")) {
        // Walk what a run reads, so a table that parses but is inconsistent
        // (indices out of range, ragged columns) is caught here too.
        let _ = table.sample_totals();
        let _ = table.observation_totals();
        for s in 0..table.n_samples() {
            let _ = table.sample(s).len();
        }
    }
});
