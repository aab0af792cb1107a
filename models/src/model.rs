//! The model as a value: [`ModelConfig`] (every architecture field of either
//! class, enough to rebuild it; what `config.json` and checkpoints store) and
//! [`AamModel`] (the pre-trainable `SequenceEncoder` or the fine-tuning
//! `SequencePredictor`), with what every caller needs of a whole model: fresh
//! weights, the torch-named state dict in and out, gradients by torch key,
//! and one forward pass with the reference's output names
//! ([`AamModel::forward_named`]).
//!
//! Parameter names are the reference's state-dict keys; where Burn has no
//! equivalent container, [`ModelConfig::torch_key`] is the rename table (see
//! [`crate::import`] for the list).

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use aam_kernels::AttentionBackend;
use burn::module::ParamId;
use burn::prelude::*;
use burn::tensor::TensorData;
use burn_store::{ModuleSnapshot, TensorSnapshot};
use serde::{Deserialize, Serialize};

use crate::asv_encoder::Nucleotides;
use crate::error::{ImportError, ModelError};
use crate::output::{ModelInput, OutputTensor};
use crate::sequence_encoder::{SequenceEncoder, SequenceEncoderConfig};
use crate::sequence_predictor::{SequencePredictor, SequencePredictorConfig, TargetPrediction};

/// Every architecture field of a model: enough to rebuild it from nothing.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "class")]
pub enum ModelConfig {
    /// The pre-trainable base model (§1.7).
    SequenceEncoder(SequenceEncoderConfig),
    /// The fine-tuning model (§1.8).
    SequencePredictor(SequencePredictorConfig),
}

impl ModelConfig {
    /// Builds the model with fresh weights.
    ///
    /// Every weight is drawn here, in module order, from the backend's RNG
    /// as it stands (Burn would otherwise draw each on its first use).
    pub fn init<B: Backend>(&self, device: &B::Device) -> Result<AamModel<B>, ModelError> {
        let model = match self {
            ModelConfig::SequenceEncoder(c) => AamModel::SequenceEncoder(c.init(device)),
            ModelConfig::SequencePredictor(c) => {
                c.validate()?;
                AamModel::SequencePredictor(c.init(device))
            }
        };
        model.materialize();
        Ok(model)
    }

    /// The base model's configuration.
    pub fn base(&self) -> &SequenceEncoderConfig {
        match self {
            ModelConfig::SequenceEncoder(c) => c,
            ModelConfig::SequencePredictor(c) => &c.base,
        }
    }

    /// Whether the model computes the same for every filled ASV slot and
    /// every sample when empty slots after each sample's last filled one are
    /// dropped: true when every sample-level stack masks empty slots (the
    /// transformers' key padding mask, the masked poolings, the count loss),
    /// so a batch can run on its largest sample's slots instead of
    /// `token_limit`. False with perceiver fusion, whose latents attend over
    /// every slot, padding included, as in the reference.
    pub fn empty_slots_are_masked(&self) -> bool {
        match self {
            ModelConfig::SequenceEncoder(_) => true,
            ModelConfig::SequencePredictor(c) => {
                c.categorical_fusion != crate::sequence_predictor::CategoricalFusion::Perceiver
            }
        }
    }

    /// The torch state-dict key of a Burn parameter path (the rename table).
    pub fn torch_key(&self, burn_path: &str) -> String {
        match self {
            ModelConfig::SequenceEncoder(_) => burn_path.to_string(),
            ModelConfig::SequencePredictor(c) => predictor_torch_key(c, burn_path),
        }
    }
}

fn predictor_torch_key(c: &SequencePredictorConfig, path: &str) -> String {
    let parts: Vec<&str> = path.split('.').collect();
    let column = |list: Vec<String>, i: &str| list[i.parse::<usize>().expect("index")].clone();
    match parts.as_slice() {
        ["target_head", "linear", rest @ ..] => format!("target_head.{}", rest.join(".")),
        ["target_head", "mlp", i, rest @ ..] => {
            let stride = if c.regressor_dropout > 0.0 { 3 } else { 2 };
            let k = i.parse::<usize>().expect("index") * stride;
            if c.residual_regression_head {
                format!("target_head.mlp.{k}.{}", rest.join("."))
            } else {
                format!("target_head.{k}.{}", rest.join("."))
            }
        }
        ["categorical_embedder", "embeddings", i, rest @ ..] => {
            let cols = c
                .categorical_cardinalities
                .clone()
                .unwrap_or_default()
                .into_keys()
                .collect();
            format!(
                "categorical_embedder.embeddings.{}.{}",
                column(cols, i),
                rest.join(".")
            )
        }
        [dict @ ("output_scales" | "output_biases"), i, rest @ ..] => {
            let cols = c.conditional_scaling_columns.clone().unwrap_or_default();
            format!("{dict}.{}.{}", column(cols, i), rest.join("."))
        }
        _ => path.to_string(),
    }
}

/// An AAM model of either class.
#[derive(Debug)]
pub enum AamModel<B: Backend> {
    /// A [`SequenceEncoder`].
    SequenceEncoder(SequenceEncoder<B>),
    /// A [`SequencePredictor`].
    SequencePredictor(SequencePredictor<B>),
}

/// One tensor of a state dict: shape and f32 values (row-major).
#[derive(Debug, Clone)]
pub struct StateTensor {
    /// Shape.
    pub shape: Vec<usize>,
    /// Values.
    pub values: Vec<f32>,
}

impl<B: Backend> AamModel<B> {
    fn snapshots(&self) -> Vec<TensorSnapshot> {
        match self {
            AamModel::SequenceEncoder(m) => m.collect(None, None, false),
            AamModel::SequencePredictor(m) => m.collect(None, None, false),
        }
    }

    /// `(torch key, shape)` of every parameter, in module order.
    pub fn state_dict_shapes(&self, config: &ModelConfig) -> Vec<(String, Vec<usize>)> {
        self.snapshots()
            .iter()
            .map(|s| (config.torch_key(&s.full_path()), s.shape.to_vec()))
            .collect()
    }

    /// The weights as a torch-named state dict.
    pub fn state_dict(&self, config: &ModelConfig) -> Vec<(String, StateTensor)> {
        self.snapshots()
            .iter()
            .map(|s| {
                let data = s.to_data().expect("in-memory tensor").convert::<f32>();
                let values = data.to_vec::<f32>().expect("f32 data");
                (
                    config.torch_key(&s.full_path()),
                    StateTensor {
                        shape: s.shape.to_vec(),
                        values,
                    },
                )
            })
            .collect()
    }

    /// Replaces every weight by the torch-named tensors in `state`; any
    /// unknown, missing or mis-shaped tensor is an error naming it.
    pub fn load_state_dict(
        &mut self,
        config: &ModelConfig,
        state: HashMap<String, StateTensor>,
        source: &Path,
    ) -> Result<(), ImportError> {
        let expected: Vec<(String, String, Vec<usize>)> = self
            .snapshots()
            .iter()
            .map(|s| {
                (
                    config.torch_key(&s.full_path()),
                    s.full_path(),
                    s.shape.to_vec(),
                )
            })
            .collect();
        let expected_keys: BTreeSet<&str> = expected.iter().map(|(k, _, _)| k.as_str()).collect();
        let mut unknown: Vec<String> = state
            .keys()
            .filter(|k| !expected_keys.contains(k.as_str()))
            .cloned()
            .collect();
        unknown.sort();
        let mut missing = Vec::new();
        let mut misshaped = Vec::new();
        for (key, _, shape) in &expected {
            match state.get(key) {
                None => missing.push(key.clone()),
                Some(t) if &t.shape != shape => {
                    misshaped.push((key.clone(), t.shape.clone(), shape.clone()))
                }
                Some(_) => {}
            }
        }
        if !(unknown.is_empty() && missing.is_empty() && misshaped.is_empty()) {
            return Err(ImportError::Mismatch {
                path: source.to_path_buf(),
                unknown,
                missing,
                misshaped,
            });
        }
        let mut state = state;
        let snapshots = expected
            .into_iter()
            .map(|(key, burn_path, shape)| {
                let t = state.remove(&key).expect("checked above");
                TensorSnapshot::from_data(
                    TensorData::new(t.values, shape),
                    burn_path.split('.').map(str::to_string).collect(),
                    Vec::new(),
                    ParamId::new(),
                )
            })
            .collect();
        let result = match self {
            AamModel::SequenceEncoder(m) => m.apply(snapshots, None, None, false),
            AamModel::SequencePredictor(m) => m.apply(snapshots, None, None, false),
        };
        if !result.errors.is_empty() || !result.missing.is_empty() {
            return Err(ImportError::Format {
                path: source.to_path_buf(),
                reason: format!(
                    "applying weights failed: {:?} {:?}",
                    result.errors, result.missing
                ),
            });
        }
        Ok(())
    }
}

impl ModelConfig {
    /// The same architecture with every dropout at 0 and masking off: the
    /// configuration under which training-mode gradients are deterministic.
    /// (Load weights into it with [`AamModel::with_weights_of`]: the torch key
    /// table depends on `regressor_dropout`, the module structure does not.)
    pub fn without_dropout(&self) -> ModelConfig {
        let strip_base = |b: &SequenceEncoderConfig| {
            let mut b = b.clone();
            b.sample.asv.dropout = 0.0;
            b.sample.asv.mask_ratio = 0.0;
            b.sample.sample_dropout = 0.0;
            b.encoder_dropout = 0.0;
            b
        };
        match self {
            ModelConfig::SequenceEncoder(b) => ModelConfig::SequenceEncoder(strip_base(b)),
            ModelConfig::SequencePredictor(c) => {
                let mut c = c.clone();
                c.base = strip_base(&c.base);
                c.count_dropout = 0.0;
                c.target_dropout = 0.0;
                c.categorical_dropout = 0.0;
                c.regressor_dropout = 0.0;
                ModelConfig::SequencePredictor(c)
            }
        }
    }
}

impl<B: Backend> AamModel<B> {
    /// The base model: the whole of a `SequenceEncoder`, a predictor's
    /// `base_model` (whose pooled output is the sample embedding).
    pub fn base(&self) -> &SequenceEncoder<B> {
        match self {
            AamModel::SequenceEncoder(m) => m,
            AamModel::SequencePredictor(m) => &m.base_model,
        }
    }

    /// A copy of this model on `device` whose parameters are tensors of their
    /// own (under autodiff: leaves of a separate graph), for a data-parallel
    /// replica.
    pub fn replica(&self, device: &B::Device) -> AamModel<B> {
        // A copy of a parameter not drawn yet would draw values of its own.
        self.materialize();
        match self {
            AamModel::SequenceEncoder(m) => AamModel::SequenceEncoder(m.clone().fork(device)),
            AamModel::SequencePredictor(m) => AamModel::SequencePredictor(m.clone().fork(device)),
        }
    }

    /// Draws every parameter that is still lazily initialised.
    fn materialize(&self) {
        struct Draw;
        impl<B: Backend> burn::module::ModuleVisitor<B> for Draw {
            fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
                let _ = param.val();
            }
        }
        match self {
            AamModel::SequenceEncoder(m) => m.visit(&mut Draw),
            AamModel::SequencePredictor(m) => m.visit(&mut Draw),
        }
    }

    /// This model's structure with the weights of `other` (same architecture).
    ///
    /// # Panics
    /// If the two models are of different classes.
    pub fn with_weights_of(self, other: AamModel<B>) -> AamModel<B> {
        match (self, other) {
            (AamModel::SequenceEncoder(m), AamModel::SequenceEncoder(o)) => {
                AamModel::SequenceEncoder(m.load_record(o.into_record()))
            }
            (AamModel::SequencePredictor(m), AamModel::SequencePredictor(o)) => {
                AamModel::SequencePredictor(m.load_record(o.into_record()))
            }
            _ => panic!("with_weights_of: model classes differ"),
        }
    }

    /// Every parameter's gradient in `grads`, by torch key (None where the
    /// parameter took no part in the computation).
    pub fn named_gradients(
        &self,
        config: &ModelConfig,
        grads: &<B as burn::tensor::backend::AutodiffBackend>::Gradients,
    ) -> Vec<(String, Option<TensorData>)>
    where
        B: burn::tensor::backend::AutodiffBackend,
    {
        struct GradCollector<'a, B: burn::tensor::backend::AutodiffBackend> {
            grads: &'a B::Gradients,
            path: Vec<String>,
            out: Vec<(String, Option<TensorData>)>,
        }
        impl<B: burn::tensor::backend::AutodiffBackend> burn::module::ModuleVisitor<B>
            for GradCollector<'_, B>
        {
            fn enter_module(&mut self, name: &str, _container_type: &str) {
                self.path.push(name.to_string());
            }
            fn exit_module(&mut self, _name: &str, _container_type: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
                let grad = param.val().grad(self.grads).map(|g| g.into_data());
                self.out.push((self.path.join("."), grad));
            }
        }
        let mut collector = GradCollector::<B> {
            grads,
            path: Vec::new(),
            out: Vec::new(),
        };
        match self {
            AamModel::SequenceEncoder(m) => m.visit(&mut collector),
            AamModel::SequencePredictor(m) => m.visit(&mut collector),
        }
        collector
            .out
            .into_iter()
            .map(|(path, g)| (config.torch_key(&path), g))
            .collect()
    }
}

/// `nuc_predictions` and `mask_indices` as the reference gives them, `[B, S, …]`.
fn push_nucleotides<B: AttentionBackend>(
    out: &mut Vec<(&'static str, OutputTensor<B>)>,
    nucleotides: Option<Nucleotides<B>>,
) {
    if let Some(n) = nucleotides {
        out.push(("nuc_predictions", OutputTensor::F4(n.unpacked_logits())));
        if let Some(mask) = n.unpacked_mask_indices() {
            out.push(("mask_indices", OutputTensor::Bool3(mask)));
        }
    }
}

impl<B: AttentionBackend> AamModel<B> {
    /// Runs the model and returns every output it has, named as the
    /// reference's output dict (with `return_sample_embeddings=True`).
    pub fn forward_named(
        &self,
        input: ModelInput<B>,
        return_nucleotides: bool,
    ) -> Vec<(&'static str, OutputTensor<B>)> {
        use OutputTensor::*;
        let mut out: Vec<(&'static str, OutputTensor<B>)> = Vec::new();
        let push2 = |out: &mut Vec<_>, name, t: Option<Tensor<B, 2>>| {
            if let Some(t) = t {
                out.push((name, F2(t)));
            }
        };
        match self {
            AamModel::SequenceEncoder(m) => {
                let o = m.forward(input.tokens, input.counts, return_nucleotides);
                push2(&mut out, "embeddings", o.embeddings);
                push2(&mut out, "base_prediction", o.base_prediction);
                push2(&mut out, "unifrac_pred", o.unifrac_pred);
                push2(&mut out, "faith_pred", o.faith_pred);
                push2(&mut out, "tax_pred", o.tax_pred);
                out.push(("sample_embeddings", F3(o.sample_embeddings)));
                push_nucleotides(&mut out, o.nucleotides);
            }
            AamModel::SequencePredictor(m) => {
                let o = m.forward(
                    input.tokens,
                    input.counts,
                    input.categorical_ids.as_ref(),
                    return_nucleotides,
                );
                out.push((
                    "target_prediction",
                    match o.target_prediction {
                        TargetPrediction::Point(t) => F2(t),
                        TargetPrediction::Quantiles(t) => F3(t),
                    },
                ));
                out.push(("base_embeddings", F3(o.base_embeddings)));
                if let Some(t) = o.count_prediction {
                    out.push(("count_prediction", F3(t)));
                }
                push2(&mut out, "gmu_gate", o.gmu_gate);
                if let Some(t) = o.cross_attn_weights {
                    out.push(("cross_attn_weights", F4(t)));
                }
                if let Some(t) = o.perceiver_attn_weights {
                    out.push(("perceiver_attn_weights", F4(t)));
                }
                push2(&mut out, "embeddings", o.embeddings);
                // The reference's predictor returns the base heads only
                // with nucleotides.
                let with_nucleotides = |x: Option<Tensor<B, 2>>| x.filter(|_| return_nucleotides);
                push2(
                    &mut out,
                    "base_prediction",
                    with_nucleotides(o.base_prediction),
                );
                push2(&mut out, "unifrac_pred", with_nucleotides(o.unifrac_pred));
                push2(&mut out, "faith_pred", with_nucleotides(o.faith_pred));
                push2(&mut out, "tax_pred", with_nucleotides(o.tax_pred));
                push_nucleotides(&mut out, o.nucleotides);
            }
        }
        out
    }
}
