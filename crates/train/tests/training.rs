//! Training on the bundled demo data (CPU), as one test binary (each test
//! binary links the model and the training loop again):
//! - `resume`: a resumed run ends with the uninterrupted run's weights, bitwise;
//! - `slots`: a batch on its filled ASV slots trains as on all of them;
//! - `data_parallel`: replicas on shards of the batch train as one device.

/// Burn's backend RNG is process-global: runs in parallel test threads would
/// draw from each other's stream, so every test here that seeds it and
/// draws from it holds this lock while it does.
static ONE_RUN_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds [`ONE_RUN_AT_A_TIME`] (a panic in another test leaves it usable).
fn one_run_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_RUN_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

#[path = "data_parallel.rs"]
mod data_parallel;
#[path = "resume.rs"]
mod resume;
#[path = "slots.rs"]
mod slots;
