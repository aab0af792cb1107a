//! `--auto-batch-size`: the largest training batch whose step fits in a
//! fraction of the device's memory, measured on the device (reference §4.7).
//!
//! The reference binary-searches even sizes in [2, 256], catching CUDA's
//! out-of-memory error on each failed try. A failed allocation is not an
//! error to recover from on every backend here, so this search avoids asking
//! for more than it expects to fit: it runs one forward and backward pass of
//! the run's model and losses at batch sizes 2, 4, 8, ..., reading after
//! each how many bytes the backend's memory pool holds (emptied of unused
//! pages before each try), and stops doubling at a reading over the cap
//! (`max_memory_fraction` of the device) or where the line through the last
//! two readings, plus 10%, passes it. It then bisects between the largest
//! size under the cap and the smallest over it, skipping sizes that the
//! readings around them already put over. The pool grows in pages of up to
//! a quarter of the device, so a try may pass the cap by up to a page: on an
//! H200 with the reference's default model, 92.0 GiB at batch 184 and 118.2
//! at 186 (`benches/results/2026-11-30_h200_auto_batch_size.txt`). The
//! reference's default cap, 0.8, leaves room for that; a cap near 1 may run
//! out of device memory during the search.
//!
//! Each try's batch holds the training samples with the most ASVs, so that
//! no training batch of that size fills more slots (and needs more memory)
//! than the probe did. The pool's bytes are an upper bound of what the step
//! needed (the pool keeps what it allocated, rounded to its pages), so the
//! answer errs on the safe side. The optimiser's two moments per parameter,
//! not allocated by a forward and backward pass, are added to each reading.

use std::cmp::Reverse;
use std::sync::Arc;

use aam_data::{BatchConfig, BatchLoader};
use aam_models::{autocast, AamModel, AttentionBackend, ModelConfig};
use burn::tensor::backend::AutodiffBackend;

use crate::config::RunConfig;
use crate::error::{Result, TrainError};
use crate::run::{batch_tensors, predict_batch, Slots, TrainData};

/// The smallest and largest sizes searched (the reference's bounds).
pub const SIZES: (usize, usize) = (2, 256);

/// One measured batch size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trial {
    /// Samples in the batch.
    pub batch_size: usize,
    /// Bytes the step needs: the memory pool after it, plus the optimiser
    /// moments.
    pub bytes: u64,
}

/// What the search found.
#[derive(Clone, Debug, PartialEq)]
pub struct Found {
    /// The largest measured size under the cap.
    pub batch_size: usize,
    /// The cap in bytes (`max_memory_fraction` of the device's memory).
    pub cap: u64,
    /// Every size tried, in order.
    pub trials: Vec<Trial>,
}

/// The largest even batch size in [2, 256] (and at most the training
/// samples) whose training step of `model` (the run's, on `device`) needs at
/// most `max_memory_fraction` of `total_bytes`; see the module doc. The
/// steps leave the model's weights as they were.
///
/// Fails where the backend reports no memory pool (the CPU backends), and
/// where even a batch of 2 needs more than the cap.
pub fn largest_batch<AB>(
    model: &AamModel<AB>,
    model_config: &ModelConfig,
    run: &RunConfig,
    data: &TrainData,
    device: &AB::Device,
    total_bytes: u64,
    max_memory_fraction: f64,
) -> Result<Found>
where
    AB: AutodiffBackend + AttentionBackend,
    AB::InnerBackend: AttentionBackend,
{
    if !(max_memory_fraction > 0.0 && max_memory_fraction <= 1.0) {
        return Err(TrainError::arg(
            "max-memory-fraction",
            format!("must lie in (0, 1], got {max_memory_fraction}"),
        ));
    }
    let cap = (total_bytes as f64 * max_memory_fraction) as u64;
    let largest = SIZES.1.min(data.train.len() / 2 * 2);
    if largest < SIZES.0 {
        return Err(TrainError::arg(
            "auto-batch-size",
            format!(
                "{} training samples are too few to search a batch size",
                data.train.len()
            ),
        ));
    }
    // The training samples with the most ASVs first.
    let mut heaviest = data.train.clone();
    heaviest.sort_by_key(|&s| Reverse(data.dataset.sample(s).0.len()));
    heaviest.truncate(largest);

    let parameters: u64 = model
        .state_dict_shapes(model_config)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() as u64)
        .sum();
    // AdamW's two f32 moments per parameter.
    let moments = 2 * 4 * parameters;
    let classifier = matches!(model_config, ModelConfig::SequencePredictor(c) if c.is_classifier);
    let slots = Slots::for_model(model_config, run.all_slots);
    let transforms = Arc::new(data.info.transforms.clone());
    let measure = |batch_size: usize| -> Result<Trial> {
        // The pool keeps what earlier tries allocated; free it, so the
        // reading is this size's alone.
        AB::memory_cleanup(device);
        let mut config = BatchConfig::validation(batch_size, run.token_limit, run.seed);
        config.asv_sampling = run.asv_sampling;
        let loader = BatchLoader::new(
            data.dataset.clone(),
            heaviest[..batch_size].to_vec(),
            transforms.clone(),
            config,
        )?;
        let batch = loader.batch(0, 0)?;
        let (input, targets) = batch_tensors::<AB>(&batch, device, classifier, slots);
        let predictions = {
            let _autocast = autocast(run.mixed_precision);
            predict_batch(model, input, run.loss.nuc_penalty > 0.0)
        };
        let parts = run.loss.forward(&predictions, &targets)?;
        let grads = parts.total.backward();
        drop(grads);
        AB::sync(device).map_err(|e| {
            TrainError::arg(
                "auto-batch-size",
                format!("synchronising the device: {e:?}"),
            )
        })?;
        let pool = <AB::InnerBackend as aam_models::RuntimeOps>::memory_reserved(device)
            .ok_or_else(|| {
                TrainError::arg(
                "auto-batch-size",
                "this backend reports no device memory pool (the CPU backends); give --batch-size",
            )
            })?;
        let trial = Trial {
            batch_size,
            bytes: pool + moments,
        };
        tracing::info!(
            "batch size {batch_size}: {:.2} GiB of the {:.2} GiB cap",
            gib(trial.bytes),
            gib(cap)
        );
        Ok(trial)
    };

    let mut trials: Vec<Trial> = Vec::new();
    // Doubling while the readings stay under the cap and the line through
    // the last two, with a margin, expects the next size under it too.
    let mut size = SIZES.0;
    loop {
        let trial = measure(size)?;
        trials.push(trial);
        if trial.bytes > cap || size == largest {
            break;
        }
        let next = (size * 2).min(largest);
        if expected(&trials, next).is_some_and(|bytes| bytes as f64 * MARGIN > cap as f64) {
            break;
        }
        size = next;
    }
    let fits = |t: &&Trial| t.bytes <= cap;
    let Some(mut low) = trials.iter().filter(fits).map(|t| t.batch_size).max() else {
        return Err(TrainError::arg(
            "max-memory-fraction",
            format!(
                "a batch of {} needs {:.2} GiB, more than {max_memory_fraction} of the device's {:.2} GiB",
                SIZES.0,
                gib(trials[0].bytes),
                gib(total_bytes)
            ),
        ));
    };
    // Bisection between the largest size under the cap and the smallest
    // over it (measured, or expected past the largest measured), skipping
    // sizes the readings around them put over the cap.
    let mut high = trials
        .iter()
        .filter(|t| t.bytes > cap)
        .map(|t| t.batch_size)
        .min()
        .unwrap_or(if low == largest { largest } else { largest + 2 });
    while high - low > 2 {
        let mid = (low + high) / 4 * 2;
        if expected(&trials, mid).is_some_and(|bytes| bytes > cap) {
            high = mid;
            continue;
        }
        let trial = measure(mid)?;
        trials.push(trial);
        if trial.bytes <= cap {
            low = mid;
        } else {
            high = mid;
        }
    }
    AB::memory_cleanup(device);
    Ok(Found {
        batch_size: low,
        cap,
        trials,
    })
}

/// Readings are extrapolated with this margin before a larger size is tried.
const MARGIN: f64 = 1.1;

/// The bytes expected at `size`: on the line through the measured sizes
/// around it, or beyond the largest one, through the two largest (never
/// falling). `None` with fewer than two readings.
fn expected(trials: &[Trial], size: usize) -> Option<u64> {
    let mut sorted: Vec<&Trial> = trials.iter().collect();
    sorted.sort_by_key(|t| t.batch_size);
    sorted.dedup_by_key(|t| t.batch_size);
    if sorted.len() < 2 {
        return None;
    }
    let upper = sorted
        .iter()
        .position(|t| t.batch_size >= size)
        .unwrap_or(sorted.len() - 1)
        .max(1);
    let (a, b) = (sorted[upper - 1], sorted[upper]);
    let slope = (b.bytes as f64 - a.bytes as f64).max(0.0) / (b.batch_size - a.batch_size) as f64;
    Some((a.bytes as f64 + slope * (size as f64 - a.batch_size as f64)).max(0.0) as u64)
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_are_interpolated_and_extrapolated() {
        let t = |batch_size, bytes| Trial { batch_size, bytes };
        assert_eq!(expected(&[t(2, 100)], 4), None);
        // Beyond the largest: the line through the last two.
        assert_eq!(expected(&[t(2, 100), t(4, 140)], 8), Some(220));
        // Between two readings: the line through them.
        assert_eq!(expected(&[t(2, 100), t(8, 400), t(4, 140)], 6), Some(270));
        // A pool that did not grow gives a flat line, never a falling one.
        assert_eq!(expected(&[t(2, 100), t(4, 100), t(8, 90)], 16), Some(100));
    }
}
