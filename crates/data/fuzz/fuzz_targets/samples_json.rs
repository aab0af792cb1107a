//! The request body of `aam-rs serve` (`/embed`, `/predict`): any bytes give
//! samples or an error, never a panic; parsed samples go through the checks
//! a request gets before it is queued (`Dataset::from_samples`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(samples) = aam_data::parse_samples_json(data) {
        let _ = aam_data::Dataset::from_samples(&samples, 150, None);
    }
});
