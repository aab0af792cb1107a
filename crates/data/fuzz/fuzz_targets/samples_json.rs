//! The request body of `aam-rs serve` (`/embed`, `/predict`): any bytes give
//! samples (and their metadata) or an error, never a panic; parsed samples go through the checks
//! a request gets before it is queued (`Dataset::from_samples`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(document) = aam_data::parse_samples_json(data) {
        let metadata = document.metadata.map(std::sync::Arc::new);
        let _ = aam_data::Dataset::from_samples(&document.samples, 150, metadata);
    }
});
