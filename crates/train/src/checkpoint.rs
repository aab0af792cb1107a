//! Checkpoints: one safetensors file per checkpoint, written atomically.
//!
//! The file holds `model.<torch key>` (the weights, torch names and layouts),
//! `optim.<torch key>.<exp_avg|exp_avg_sq|momentum_buffer>` (optimiser
//! moments) and, in the safetensors header's metadata under
//! `aam_checkpoint`, a JSON [`CheckpointMeta`]: the full model config, the
//! run configuration, data transforms (normalisation statistics,
//! categorical mappings, class labels), the split, scheduler state, step
//! counters, best-so-far and the metric history. `predict` needs nothing
//! else; `--resume-from` continues the run bit for bit on the CPU.
//!
//! A safetensors header records every tensor's byte range, so a file cut
//! short is detected on reading (the check names the file).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use aam_data::write_atomic;
use aam_data::Transforms;
use aam_models::model::{AamModel, ModelConfig, StateTensor};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::config::RunConfig;
use crate::error::{Result, TrainError};
use crate::metrics::Means;
use crate::optim::LossScaler;
use crate::schedule::Scheduler;

/// The metadata key holding [`CheckpointMeta`].
pub const META_KEY: &str = "aam_checkpoint";
/// The checkpoint format version written.
pub const FORMAT_VERSION: u32 = 1;

/// Where the data came from and how it was prepared; enough to prepare new
/// data the same way (`predict`) and to check a resumed run uses the same.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataInfo {
    /// Fitted transforms (target/count normalisation, categorical encoder).
    pub transforms: Transforms,
    /// Class labels, index = class (classifiers).
    pub class_labels: Option<Vec<String>>,
    /// Bases kept per ASV.
    pub max_bp: usize,
    /// The metadata column predicted (train).
    pub target_column: Option<String>,
    /// Rarefaction depth applied to tables (None: not rarefied).
    pub rarefy_depth: Option<usize>,
    /// Free-form description of the inputs (paths, for the record).
    pub sources: BTreeMap<String, String>,
    /// Training sample IDs.
    pub train_ids: Vec<String>,
    /// Validation sample IDs.
    pub validation_ids: Vec<String>,
}

/// The best value of the monitored metric so far.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Best {
    /// Metric name (`val_loss`, `r2`, ...).
    pub metric: String,
    /// Its value.
    pub value: f64,
    /// The epoch it was reached (0-based).
    pub epoch: usize,
}

/// One epoch's results.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochRecord {
    /// Epoch (0-based).
    pub epoch: usize,
    /// Optimiser steps after it.
    pub step: u64,
    /// Learning rate at its end.
    pub lr: f64,
    /// Training means (`total_loss`, `unifrac_loss`, ...).
    #[serde(deserialize_with = "nan_from_null")]
    pub train: BTreeMap<String, f64>,
    /// Validation losses and metrics (NaN where undefined, e.g. a validation
    /// loss that overflowed).
    #[serde(deserialize_with = "nan_from_null")]
    pub validation: BTreeMap<String, f64>,
    /// Training samples per second.
    pub samples_per_sec: f64,
    /// Wall-clock seconds.
    pub seconds: f64,
}

/// JSON has no NaN: serde_json writes a NaN value as `null`; read back as NaN.
pub(crate) fn nan_from_null<'de, D>(d: D) -> std::result::Result<BTreeMap<String, f64>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let map = BTreeMap::<String, Option<f64>>::deserialize(d)?;
    Ok(map
        .into_iter()
        .map(|(k, v)| (k, v.unwrap_or(f64::NAN)))
        .collect())
}

/// Counters and history of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// Completed epochs.
    pub epochs_done: usize,
    /// Optimiser steps taken.
    pub global_step: u64,
    /// Forward/backward passes taken (RNG streams derive from it).
    pub micro_step: u64,
    /// Best so far.
    pub best: Option<Best>,
    /// Epochs without improvement.
    pub bad_epochs: usize,
    /// Every completed epoch.
    pub history: Vec<EpochRecord>,
    /// fp16 mixed precision's loss scale (absent otherwise).
    #[serde(default)]
    pub loss_scaler: Option<LossScaler>,
    /// Where the run stands inside an epoch, for a checkpoint written at an
    /// optimiser step before the epoch's end (`--checkpoint-every-steps`, or
    /// a signal); None at an epoch's end.
    #[serde(default)]
    pub in_epoch: Option<EpochPosition>,
}

/// A run's place inside an unfinished epoch: with the weights, optimiser
/// and schedule of the same step, enough to go on as if never stopped
/// (batches are built from `(seed, epoch, batch)`, random draws from
/// `(seed, micro_step)`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochPosition {
    /// The epoch under way (0-based; equals `epochs_done`).
    pub epoch: usize,
    /// Its training batches done (every one ended with an optimiser step).
    pub batches_done: usize,
    /// Its training samples so far.
    pub samples: usize,
    /// Learning rate of its last optimiser step.
    pub lr: f64,
    /// Running sums of its training means.
    pub means: Means,
    /// Its batches skipped for non-finite values (`--skip-nonfinite-batches`).
    #[serde(default)]
    pub skipped: usize,
}

/// Everything in a checkpoint besides tensors.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// [`FORMAT_VERSION`].
    pub format: u32,
    /// `aam-rs <version>`.
    pub producer: String,
    /// The architecture.
    pub model: ModelConfig,
    /// The run configuration.
    pub run: RunConfig,
    /// The data preparation.
    pub data: DataInfo,
    /// Counters and history.
    pub progress: Progress,
    /// The learning-rate schedule.
    pub scheduler: Scheduler,
    /// Optimiser step count per parameter (torch key).
    pub optimizer_steps: BTreeMap<String, u64>,
}

/// A checkpoint read back: metadata, weights and optimiser tensors.
#[derive(Debug)]
pub struct Checkpoint {
    /// The file it came from.
    pub path: PathBuf,
    /// Metadata.
    pub meta: CheckpointMeta,
    /// Weights by torch key.
    pub model: HashMap<String, StateTensor>,
    /// Optimiser tensors by full name (`optim.…`).
    pub optimizer: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
}

fn le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Writes a checkpoint atomically (temporary file, fsync, rename).
pub fn write_checkpoint<B: Backend>(
    path: &Path,
    meta: &CheckpointMeta,
    model: &AamModel<B>,
    optimizer: Vec<(String, TensorData)>,
) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
    }
    let mut named: Vec<(String, Vec<usize>, Vec<u8>)> = model
        .state_dict(&meta.model)
        .into_iter()
        .map(|(k, t)| (format!("model.{k}"), t.shape, le_bytes(&t.values)))
        .collect();
    for (k, data) in optimizer {
        let shape = data.shape.to_vec();
        let values = data
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("f32 optimiser state");
        named.push((k, shape, le_bytes(&values)));
    }
    let views = named
        .iter()
        .map(|(k, shape, bytes)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .expect("shape matches data");
            (k.clone(), view)
        })
        .collect::<Vec<_>>();
    let json = serde_json::to_string(meta).expect("checkpoint metadata serialises");
    let metadata = HashMap::from([
        (META_KEY.to_string(), json),
        ("format".to_string(), "pt".to_string()),
    ]);
    let bytes =
        safetensors::serialize(views, Some(metadata)).map_err(|e| TrainError::Checkpoint {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    write_atomic(path, &bytes)?;
    Ok(())
}

/// Reads a checkpoint; a truncated, corrupt or foreign file is an error
/// naming the file and what is wrong.
pub fn read_checkpoint(path: &Path) -> Result<Checkpoint> {
    let bad = |reason: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| TrainError::io(path, e))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| {
        bad(format!(
            "not a readable safetensors file ({e}); was it cut short or is it another format?"
        ))
    })?;
    let json = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get(META_KEY))
        .ok_or_else(|| bad(format!("no `{META_KEY}` metadata: not an aam-rs training checkpoint (for a model directory from `aam-rs convert`, use the directory)")))?;
    let meta: CheckpointMeta = serde_json::from_str(json)
        .map_err(|e| bad(format!("its metadata does not parse ({e})")))?;
    if meta.format != FORMAT_VERSION {
        return Err(bad(format!(
            "format version {} (this aam-rs reads {FORMAT_VERSION})",
            meta.format
        )));
    }
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        bad(format!(
            "the tensor data is incomplete or corrupt ({e}); the file was probably cut short"
        ))
    })?;
    let mut model = HashMap::new();
    let mut optimizer = BTreeMap::new();
    for (name, view) in file.tensors() {
        if view.dtype() != safetensors::Dtype::F32 {
            return Err(bad(format!(
                "tensor {name} has dtype {:?}, expected F32",
                view.dtype()
            )));
        }
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let shape = view.shape().to_vec();
        if let Some(key) = name.strip_prefix("model.") {
            model.insert(key.to_string(), StateTensor { shape, values });
        } else if name.starts_with("optim.") {
            optimizer.insert(name, (shape, values));
        } else {
            return Err(bad(format!("unexpected tensor {name}")));
        }
    }
    Ok(Checkpoint {
        path: path.to_path_buf(),
        meta,
        model,
        optimizer,
    })
}

impl Checkpoint {
    /// Builds the model and loads the weights.
    pub fn model<B: Backend>(&self, device: &B::Device) -> Result<AamModel<B>> {
        let mut model = self.meta.model.init::<B>(device)?;
        model.load_state_dict(&self.meta.model, self.model.clone(), &self.path)?;
        Ok(model)
    }
}
