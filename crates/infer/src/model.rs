//! [`Model`]: a trained model on a device, and what it does with samples.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use aam_data::{
    rarefy_sample, slot_asvs, AsvSampling, Batch, BatchConfig, BatchLoader, Dataset, Metadata,
    SampleReads, Transforms,
};
use aam_models::import::{is_torch_checkpoint, load_model, ImportHints};
use aam_models::model::{AamModel, ModelConfig};
use aam_models::sequence_predictor::TargetPrediction;
use aam_models::AttentionBackend;
use aam_train::checkpoint::{read_checkpoint, DataInfo};
use aam_train::run::{batch_tensors, predict_batch, Slots, SLOT_MULTIPLE};
use burn::prelude::*;
use serde::Serialize;

use crate::error::{InferError, Result};

/// What a model does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// A `pretrain` model: sample embeddings only.
    Encoder,
    /// A `train` model of a numeric target (point values or quantiles).
    Regressor,
    /// A `train` model of a class.
    Classifier,
}

/// A loaded model's description: what it expects and what it returns.
#[derive(Debug, Clone, Serialize)]
pub struct ModelInfo {
    /// The checkpoint file or model folder it was loaded from.
    pub source: PathBuf,
    /// What it does.
    pub kind: ModelKind,
    /// D, the width of a sample embedding.
    pub embedding_dim: usize,
    /// Bases read per ASV (longer sequences are cut, as in training).
    pub max_bp: usize,
    /// ASV slots per sample; a sample with more ASVs keeps `asv_sampling`'s choice.
    pub token_limit: usize,
    /// Which ASVs a sample with more than `token_limit` keeps (`random`
    /// models keep the most abundant at inference, so that a sample's
    /// result does not depend on its batch).
    pub asv_sampling: AsvSampling,
    /// The training rarefaction depth, applied to samples unless turned off.
    pub rarefy_depth: Option<usize>,
    /// The metadata column predicted.
    pub target_column: Option<String>,
    /// Outputs per sample (1 for one target).
    pub outputs: usize,
    /// Class labels (classifiers), index = class.
    pub class_labels: Option<Vec<String>>,
    /// Quantile levels (quantile regressors).
    pub quantiles: Option<Vec<f64>>,
    /// The metadata columns its predictions read: categorical inputs and the
    /// columns of a per-category target normalisation (embeddings read none).
    pub metadata_columns: Vec<String>,
    /// Whether predictions come back in the target's original units: true
    /// for checkpoints (they keep the normalisation statistics), false for
    /// a `convert` folder (the model's normalised scale).
    pub original_units: bool,
}

/// Samples checked, rarefied and tokenised for one model
/// ([`ModelInfo::prepare`]), ready for its device.
#[derive(Debug, Clone)]
pub struct Prepared {
    dataset: Arc<Dataset>,
    dropped: Vec<String>,
    predicting: bool,
}

impl Prepared {
    /// The samples kept, in order.
    pub fn ids(&self) -> &[String] {
        self.dataset.sample_ids()
    }

    /// Samples left out: fewer reads than the rarefaction depth.
    pub fn dropped(&self) -> &[String] {
        &self.dropped
    }
}

impl ModelInfo {
    /// The host's part of [`Model::embed`] (`predicting` false) and
    /// [`Model::predict`]: checks `samples`, rarefies them to the model's
    /// depth and tokenises them. Needs no model or device, so it can run on
    /// another thread than the model's (a service can prepare its next batch
    /// while the device runs the current one); [`Model::embed_prepared`] /
    /// [`Model::predict_prepared`] finish it.
    pub fn prepare(
        &self,
        samples: &[SampleReads],
        options: &Options,
        predicting: bool,
    ) -> Result<Prepared> {
        check_options(self, samples, options, predicting)?;
        let mut dropped = Vec::new();
        let kept: Vec<SampleReads> = match self.rarefy_depth.filter(|_| options.rarefy) {
            None => samples.to_vec(),
            Some(depth) => {
                let mut kept = Vec::with_capacity(samples.len());
                for sample in samples {
                    let (sequences, counts): (Vec<&str>, Vec<f64>) =
                        sample.reads.iter().map(|(s, c)| (s.as_str(), *c)).unzip();
                    match rarefy_sample(
                        &sample.id,
                        &sequences,
                        &counts,
                        depth as u64,
                        options.seed,
                    )? {
                        Some(drawn) => kept.push(SampleReads {
                            id: sample.id.clone(),
                            reads: sequences
                                .iter()
                                .zip(drawn)
                                .map(|(s, n)| (s.to_string(), n))
                                .collect(),
                        }),
                        None => dropped.push(sample.id.clone()),
                    }
                }
                if kept.is_empty() && !samples.is_empty() {
                    return Err(InferError::AllTooShallow {
                        depth,
                        dropped: dropped.len(),
                    });
                }
                kept
            }
        };
        let dataset = Dataset::from_samples(&kept, self.max_bp, options.metadata.clone())?;
        Ok(Prepared {
            dataset: Arc::new(dataset),
            dropped,
            predicting,
        })
    }

    /// Checks `samples` as [`Model::predict`] (`predicting`) or
    /// [`Model::embed`] would, without a model or device, and strictly: a
    /// sample too shallow for the rarefaction depth is an error here (they
    /// would leave it out). A service checks each request with it before
    /// queueing it.
    pub fn check(
        &self,
        samples: &[SampleReads],
        options: &Options,
        predicting: bool,
    ) -> Result<()> {
        check_options(self, samples, options, predicting)?;
        Dataset::from_samples(samples, self.max_bp, options.metadata.clone())?;
        if let Some(depth) = self.rarefy_depth.filter(|_| options.rarefy) {
            for sample in samples {
                let reads: f64 = sample.reads.iter().map(|r| r.1).sum();
                if reads < depth as f64 {
                    return Err(InferError::TooShallow {
                        sample: sample.id.clone(),
                        reads,
                        depth,
                    });
                }
            }
        }
        Ok(())
    }
}

/// How samples are prepared and batched.
#[derive(Debug, Clone)]
pub struct Options {
    /// Samples per device batch.
    pub batch_size: usize,
    /// Rarefy each sample to the training depth (as `aam-rs predict` does);
    /// samples with fewer reads are left out and listed.
    pub rarefy: bool,
    /// Seed of the rarefaction (a sample's draw depends only on its reads,
    /// ID and this seed).
    pub seed: u64,
    /// The samples' metadata, for models that read categorical columns.
    pub metadata: Option<Arc<Metadata>>,
    /// Reject sequences longer than this (None: cut them to `max_bp`, as
    /// training did).
    pub max_sequence_length: Option<usize>,
    /// Also return each sample's ASV embeddings ([`Model::embed`] only).
    pub asv_embeddings: bool,
    /// Which ASVs fill the slots of a sample with more than the model's
    /// `token_limit` (None: the training rule, `random` read as `abundance`).
    /// `random` draws anew in each of [`Options::passes`].
    pub asv_sampling: Option<AsvSampling>,
    /// Predictions averaged over this many passes ([`Model::predict`] only;
    /// ≥ 1), each with its own random ASV draw: only `random` sampling makes
    /// passes differ. With more than one, [`Predictions::std`] holds the
    /// spread.
    pub passes: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            batch_size: 8,
            rarefy: true,
            seed: 42,
            metadata: None,
            max_sequence_length: None,
            asv_embeddings: false,
            asv_sampling: None,
            passes: 1,
        }
    }
}

/// One ASV's embedding in one sample.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AsvEmbedding {
    /// The ASV's sequence.
    pub sequence: String,
    /// Its embedding, D values.
    pub values: Vec<f32>,
}

/// Sample embeddings: row `i` of `values` (`[ids.len(), dim]`, row-major)
/// belongs to `ids[i]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Embeddings {
    /// The embedded samples, in the order given.
    pub ids: Vec<String>,
    /// D.
    pub dim: usize,
    /// `[n, D]`, row-major.
    pub values: Vec<f32>,
    /// Per sample, its ASVs' embeddings in slot order (when asked for).
    pub asvs: Option<Vec<Vec<AsvEmbedding>>>,
    /// Samples left out: fewer reads than the rarefaction depth.
    pub dropped: Vec<String>,
}

impl Embeddings {
    /// The embedding of the `i`-th sample.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.values[i * self.dim..(i + 1) * self.dim]
    }
}

/// One sample's prediction, in the target's original units.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Prediction {
    /// A numeric target: one value per output.
    Values(Vec<f64>),
    /// A quantile regressor: per output, one value per quantile level.
    Quantiles(Vec<Vec<f64>>),
    /// A classifier: the most probable class and every class's probability.
    Class {
        /// The class label.
        label: String,
        /// Probabilities, index = class (see [`ModelInfo::class_labels`]).
        probabilities: Vec<f64>,
    },
}

/// Predictions of samples, in the order given.
#[derive(Debug, Clone, PartialEq)]
pub struct Predictions {
    /// The predicted samples.
    pub ids: Vec<String>,
    /// Their predictions (the mean over [`Options::passes`]).
    pub values: Vec<Prediction>,
    /// With more than one pass, per sample the population standard
    /// deviation over passes of each value (flattened as the values: one
    /// per output, per output and quantile, or per class probability).
    pub std: Option<Vec<Vec<f64>>>,
    /// Samples left out: fewer reads than the rarefaction depth.
    pub dropped: Vec<String>,
}

/// A trained model on a device.
pub struct Model<B: AttentionBackend> {
    model: AamModel<B>,
    config: ModelConfig,
    data: Option<DataInfo>,
    info: ModelInfo,
    all_slots: bool,
    device: B::Device,
}

impl<B: AttentionBackend> Model<B> {
    /// Loads a checkpoint of `aam-rs pretrain` or `train` (a `.safetensors`
    /// file, or the `best_model.pt` exported beside it), a model folder of
    /// `aam-rs convert`, or a reference PyTorch checkpoint (`.pt`, converted
    /// on the fly with the reference's defaults for what its tensors do not
    /// record; [`Model::load_with`] sets them), onto `device`.
    pub fn load(path: impl AsRef<Path>, device: &B::Device) -> Result<Self> {
        Self::load_with(path, &ImportHints::default(), device)
    }

    /// [`Model::load`], with `hints` for a reference checkpoint's
    /// architecture fields that no tensor records (attention heads,
    /// activations, classifier or not, ...).
    pub fn load_with(
        path: impl AsRef<Path>,
        hints: &ImportHints,
        device: &B::Device,
    ) -> Result<Self> {
        let path = path.as_ref();
        // A `best_model.pt` that aam-rs exported carries its checkpoint's metadata.
        let exported = if is_torch_checkpoint(path) {
            aam_train::torch::read_trainer_checkpoint(path)?
        } else {
            None
        };
        let (config, model, data, token_limit, asv_sampling, quantiles, all_slots) =
            if exported.is_none() && (path.is_dir() || is_torch_checkpoint(path)) {
                let (config, model) = load_model::<B>(path, hints, device)?;
                let token_limit = config.base().sample.token_limit;
                (
                    config,
                    model,
                    None,
                    token_limit,
                    AsvSampling::First,
                    None,
                    false,
                )
            } else {
                let ckpt = match exported {
                    Some(ckpt) => ckpt,
                    None => read_checkpoint(path)?,
                };
                let model = ckpt.model::<B>(device)?;
                let run = ckpt.meta.run;
                (
                    ckpt.meta.model,
                    model,
                    Some(ckpt.meta.data),
                    run.token_limit,
                    run.asv_sampling,
                    run.loss.quantiles,
                    run.all_slots,
                )
            };
        let asv_sampling = match asv_sampling {
            AsvSampling::Random => AsvSampling::Abundance,
            other => other,
        };
        let (kind, outputs) = match &config {
            ModelConfig::SequenceEncoder(_) => (ModelKind::Encoder, 0),
            ModelConfig::SequencePredictor(c) if c.is_classifier => {
                (ModelKind::Classifier, c.out_dim)
            }
            ModelConfig::SequencePredictor(c) => (ModelKind::Regressor, c.out_dim),
        };
        let transforms = data.as_ref().map(|d| &d.transforms);
        let info = ModelInfo {
            source: path.to_path_buf(),
            kind,
            embedding_dim: config.base().embedding_dim(),
            max_bp: config.base().sample.asv.max_bp,
            token_limit,
            asv_sampling,
            rarefy_depth: data.as_ref().and_then(|d| d.rarefy_depth),
            target_column: data.as_ref().and_then(|d| d.target_column.clone()),
            outputs,
            class_labels: data.as_ref().and_then(|d| d.class_labels.clone()),
            quantiles: quantiles.filter(|_| kind == ModelKind::Regressor),
            metadata_columns: transforms.map_or_else(Vec::new, |t| {
                let mut columns: Vec<String> = t
                    .categorical
                    .as_ref()
                    .map(|c| c.column_names().to_vec())
                    .unwrap_or_default();
                let by_category = t.target.as_ref().and_then(|n| n.category.as_ref());
                for column in by_category.map_or(&[][..], |c| &c.columns[..]) {
                    if !columns.contains(column) {
                        columns.push(column.clone());
                    }
                }
                columns
            }),
            original_units: data.is_some(),
        };
        Ok(Model {
            model,
            config,
            data,
            info,
            all_slots,
            device: device.clone(),
        })
    }

    /// What the model expects and returns.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Its architecture.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The device it runs on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// The ASV slots per sample a batch can take on the device, smallest
    /// first: the batch's fullest sample's ASVs rounded up to a multiple of
    /// 32 (at most `token_limit`) where the model masks empty slots, else
    /// `token_limit` alone. Each is a shape the sample level's kernels are
    /// compiled for; a service warms them up before it says it is ready.
    pub fn slot_counts(&self) -> Vec<usize> {
        let limit = self.info.token_limit;
        match Slots::for_model(&self.config, self.all_slots) {
            Slots::TokenLimit => vec![limit],
            Slots::Filled => (1..=limit.div_ceil(SLOT_MULTIPLE))
                .map(|k| (k * SLOT_MULTIPLE).min(limit))
                .collect(),
        }
    }

    /// Sample embeddings (the pooled embedding of the base model: for a
    /// UniFrac-pretrained model, the space whose distances the UniFrac loss
    /// fitted), and each sample's ASV embeddings when `options` asks.
    pub fn embed(&self, samples: &[SampleReads], options: &Options) -> Result<Embeddings> {
        self.embed_prepared(self.info.prepare(samples, options, false)?, options)
    }

    /// [`Model::embed`] of samples prepared by [`ModelInfo::prepare`] (with
    /// the same `options`).
    pub fn embed_prepared(&self, prepared: Prepared, options: &Options) -> Result<Embeddings> {
        let Prepared {
            dataset, dropped, ..
        } = prepared;
        let d = self.info.embedding_dim;
        let mut values = vec![0f32; dataset.len() * d];
        let mut asvs = options
            .asv_embeddings
            .then(|| vec![Vec::new(); dataset.len()]);
        self.run_batches(&dataset, options, 0, |batch, input| {
            let (pooled, per_slot) = self.model.base().embed(input.tokens, input.counts);
            let pooled = to_f32(pooled.into_data());
            for (i, &pos) in batch.positions.iter().enumerate() {
                values[pos * d..(pos + 1) * d].copy_from_slice(&pooled[i * d..(i + 1) * d]);
            }
            if let Some(asvs) = asvs.as_mut() {
                let [_, s, _] = per_slot.dims();
                let per_slot = to_f32(per_slot.into_data());
                for (i, &pos) in batch.positions.iter().enumerate() {
                    let (ids, counts) = dataset.sample(pos);
                    let sampling = options.asv_sampling.unwrap_or(self.info.asv_sampling);
                    let chosen = slot_asvs(counts, self.info.token_limit, sampling)
                        .expect("embeddings never sample ASVs at random (check_options)");
                    asvs[pos] = chosen
                        .iter()
                        .enumerate()
                        .map(|(slot, &a)| AsvEmbedding {
                            sequence: dataset.asv_ids()[ids[a] as usize].clone(),
                            values: per_slot[(i * s + slot) * d..][..d].to_vec(),
                        })
                        .collect();
                }
            }
            Ok(())
        })?;
        Ok(Embeddings {
            ids: dataset.sample_ids().to_vec(),
            dim: d,
            values,
            asvs,
            dropped,
        })
    }

    /// Predictions in the target's original units (the normalisation of
    /// training undone); an error for a `pretrain` model.
    pub fn predict(&self, samples: &[SampleReads], options: &Options) -> Result<Predictions> {
        if self.info.kind == ModelKind::Encoder {
            return Err(InferError::NoTargetHead {
                path: self.info.source.clone(),
            });
        }
        self.predict_prepared(self.info.prepare(samples, options, true)?, options)
    }

    /// [`Model::predict`] of samples prepared by [`ModelInfo::prepare`] with
    /// `predicting` (and the same `options`).
    pub fn predict_prepared(&self, prepared: Prepared, options: &Options) -> Result<Predictions> {
        if self.info.kind == ModelKind::Encoder {
            return Err(InferError::NoTargetHead {
                path: self.info.source.clone(),
            });
        }
        if !prepared.predicting {
            return Err(InferError::InvalidOption {
                option: "prepared",
                reason: "these samples were prepared for embeddings (`predicting` false): their metadata was not checked".into(),
            });
        }
        let Prepared {
            dataset, dropped, ..
        } = prepared;
        let target = self
            .data
            .as_ref()
            .and_then(|d| d.transforms.target.as_ref());
        let key_columns: Vec<usize> =
            match (target.and_then(|t| t.category.as_ref()), dataset.metadata()) {
                (Some(cat), Some((meta, _))) => cat
                    .columns
                    .iter()
                    .map(|c| meta.column(c))
                    .collect::<Result<_, _>>()?,
                _ => Vec::new(),
            };
        let passes = options.passes;
        if passes == 0 {
            return Err(InferError::InvalidOption {
                option: "passes",
                reason: "must be ≥ 1".into(),
            });
        }
        // Per pass, per sample: the flat values (original units, or class
        // probabilities).
        let mut each_pass: Vec<Vec<Vec<f64>>> = Vec::with_capacity(passes);
        for pass in 0..passes {
            let mut rows = vec![Vec::new(); dataset.len()];
            self.run_batches(&dataset, options, pass as u64, |batch, input| {
                let b = batch.batch_size();
                let predicted = predict_batch(&self.model, input, false)
                    .target
                    .expect("a predictor returns its target");
                let (flat, width) = match predicted {
                    TargetPrediction::Point(p) => {
                        let w = p.dims()[1];
                        (to_f32(p.into_data()), w)
                    }
                    TargetPrediction::Quantiles(p) => {
                        let [_, out, q] = p.dims();
                        (to_f32(p.reshape([b, out * q]).into_data()), out * q)
                    }
                };
                for (i, &pos) in batch.positions.iter().enumerate() {
                    let row = &flat[i * width..(i + 1) * width];
                    rows[pos] = if self.info.kind == ModelKind::Classifier {
                        // The head returns log-probabilities.
                        row.iter().map(|&x| (x as f64).exp()).collect()
                    } else {
                        let key = dataset
                            .metadata()
                            .filter(|_| !key_columns.is_empty())
                            .and_then(|(meta, rows)| {
                                rows[pos].map(|r| meta.category_key(r, &key_columns))
                            });
                        row.iter()
                            .map(|&x| match target {
                                Some(n) => n.denormalize(x as f64, key.as_deref()),
                                None => x as f64,
                            })
                            .collect()
                    };
                }
                Ok(())
            })?;
            each_pass.push(rows);
        }
        let n = passes as f64;
        let mean: Vec<Vec<f64>> = (0..dataset.len())
            .map(|pos| {
                let width = each_pass[0][pos].len();
                (0..width)
                    .map(|k| each_pass.iter().map(|p| p[pos][k]).sum::<f64>() / n)
                    .collect()
            })
            .collect();
        let std = (passes > 1).then(|| {
            mean.iter()
                .enumerate()
                .map(|(pos, m)| {
                    m.iter()
                        .enumerate()
                        .map(|(k, mu)| {
                            let var = each_pass
                                .iter()
                                .map(|p| (p[pos][k] - mu).powi(2))
                                .sum::<f64>()
                                / n;
                            var.sqrt()
                        })
                        .collect()
                })
                .collect()
        });
        let values = mean
            .into_iter()
            .map(|row| {
                if self.info.kind == ModelKind::Classifier {
                    let class = row
                        .iter()
                        .enumerate()
                        .max_by(|a, b| a.1.total_cmp(b.1))
                        .map_or(0, |(c, _)| c);
                    let label = self
                        .info
                        .class_labels
                        .as_ref()
                        .and_then(|l| l.get(class).cloned())
                        .unwrap_or_else(|| class.to_string());
                    Prediction::Class {
                        label,
                        probabilities: row,
                    }
                } else {
                    match &self.info.quantiles {
                        Some(levels) => Prediction::Quantiles(
                            row.chunks(levels.len()).map(<[f64]>::to_vec).collect(),
                        ),
                        None => Prediction::Values(row),
                    }
                }
            })
            .collect();
        Ok(Predictions {
            ids: dataset.sample_ids().to_vec(),
            values,
            std,
            dropped,
        })
    }

    /// Runs `each` on the model input of every batch of `dataset`, in order.
    fn run_batches(
        &self,
        dataset: &Arc<Dataset>,
        options: &Options,
        pass: u64,
        mut each: impl FnMut(&Batch, aam_models::output::ModelInput<B>) -> Result<()>,
    ) -> Result<()> {
        // Targets are not read at inference: no target transform on batches;
        // without metadata (embeddings), no categorical ids either.
        let mut transforms: Transforms = self
            .data
            .as_ref()
            .map(|d| d.transforms.clone())
            .unwrap_or_default();
        transforms.target = None;
        if dataset.metadata().is_none() {
            transforms.categorical = None;
        }
        let transforms = Arc::new(transforms);
        let mut config =
            BatchConfig::validation(options.batch_size, self.info.token_limit, options.seed);
        config.require_even = false;
        config.asv_sampling = options.asv_sampling.unwrap_or(self.info.asv_sampling);
        config.workers = 1;
        config.prefetch = 2;
        let loader = BatchLoader::new(
            dataset.clone(),
            (0..dataset.len()).collect(),
            transforms,
            config,
        )?;
        let slots = Slots::for_model(&self.config, self.all_slots);
        for batch in loader.epoch(pass) {
            let batch = batch?;
            let (input, _) = batch_tensors::<B>(
                &batch,
                &self.device,
                self.info.kind == ModelKind::Classifier,
                slots,
            );
            each(&batch, input)?;
        }
        Ok(())
    }
}

/// The checks of `samples` that need no dataset: options, sequences, and
/// metadata where the model's categorical columns are read (`predicting`;
/// embeddings come from the base model, which reads none).
fn check_options(
    info: &ModelInfo,
    samples: &[SampleReads],
    options: &Options,
    predicting: bool,
) -> Result<()> {
    if options.batch_size == 0 {
        return Err(InferError::InvalidOption {
            option: "batch_size",
            reason: "must be ≥ 1".into(),
        });
    }
    for sample in samples {
        for (sequence, _) in &sample.reads {
            check_sequence(&sample.id, sequence, options.max_sequence_length)?;
        }
    }
    if !predicting && options.asv_sampling == Some(AsvSampling::Random) {
        return Err(InferError::InvalidOption {
            option: "asv_sampling",
            reason: "embeddings take a deterministic choice of ASVs (first or abundance); random is for averaged predictions".into(),
        });
    }
    if predicting && !info.metadata_columns.is_empty() && options.metadata.is_none() {
        return Err(InferError::MetadataRequired {
            columns: info.metadata_columns.clone(),
        });
    }
    Ok(())
}

/// Every character a nucleotide code (IUPAC letters either case, `-`, `.`;
/// A/C/G/T become tokens, the others the padding token, as in training),
/// and the length within `limit`.
fn check_sequence(sample: &str, sequence: &str, limit: Option<usize>) -> Result<()> {
    let short = || sequence.chars().take(40).collect::<String>();
    if let Some((position, character)) = sequence.chars().enumerate().find(|(_, c)| {
        !matches!(
            c.to_ascii_uppercase(),
            'A' | 'C'
                | 'G'
                | 'T'
                | 'U'
                | 'R'
                | 'Y'
                | 'S'
                | 'W'
                | 'K'
                | 'M'
                | 'B'
                | 'D'
                | 'H'
                | 'V'
                | 'N'
                | '-'
                | '.'
        )
    }) {
        return Err(InferError::InvalidBase {
            sample: sample.to_string(),
            asv: short(),
            character,
            position,
        });
    }
    match limit {
        Some(limit) if sequence.len() > limit => Err(InferError::SequenceTooLong {
            sample: sample.to_string(),
            asv: short(),
            length: sequence.len(),
            limit,
        }),
        _ => Ok(()),
    }
}

fn to_f32(data: TensorData) -> Vec<f32> {
    data.convert::<f32>()
        .to_vec::<f32>()
        .expect("float tensor data converts to f32")
}
