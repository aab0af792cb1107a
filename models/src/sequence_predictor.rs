//! §1.8 `SequencePredictor`: the fine-tuning model. It reads the base model's
//! sample-transformer output (`base_embeddings`), predicts per-ASV counts, and
//! predicts a metadata target through a transformer, pooling, optional
//! categorical fusion and a head.

use std::collections::BTreeMap;

use aam_kernels::AttentionBackend;
use burn::module::{Initializer, Param};
use burn::nn::{Dropout, DropoutConfig, Embedding, EmbeddingConfig};
use burn::prelude::*;
use burn::tensor::activation;
use serde::{Deserialize, Serialize};

use crate::asv_encoder::Nucleotides;
use crate::categorical::{CategoricalEmbedDim, CategoricalEmbedder, CategoricalEmbedderConfig};
use crate::fusion::{
    CrossAttentionFusion, CrossAttentionFusionConfig, Gmu, GmuConfig, PerceiverFusion,
    PerceiverFusionConfig,
};
use crate::nn::{
    softplus, Activation, LayerNorm, LayerNormConfig, Linear, LinearConfig, LinearInit,
};
use crate::output::AsvTokens;
use crate::pooling::{AttentionPooling, AttentionPoolingConfig};
use crate::sequence_encoder::{SequenceEncoder, SequenceEncoderConfig};
use crate::transformer::{TransformerEncoder, TransformerEncoderConfig};
use crate::ModelError;

/// How categorical metadata is fused with the sample embeddings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum CategoricalFusion {
    /// `categorical_projection([se ‖ cat])` at every slot.
    #[default]
    #[serde(rename = "concat")]
    Concat,
    /// `se + categorical_projection(cat)`.
    #[serde(rename = "add")]
    Add,
    /// Gated multimodal unit after pooling.
    #[serde(rename = "gmu")]
    Gmu,
    /// Slots attend to a metadata token before the target encoder.
    #[serde(rename = "cross-attention")]
    CrossAttention,
    /// Perceiver latents replace target encoder and pooling.
    #[serde(rename = "perceiver")]
    Perceiver,
}

/// The final transform of a point prediction (`output_activation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OutputActivation {
    /// Identity.
    #[default]
    None,
    /// `relu`.
    Relu,
    /// `softplus(β=1, threshold=20)`.
    Softplus,
    /// `exp`.
    Exp,
}

/// Configuration of [`SequencePredictor`]; defaults as the reference (§1.8).
#[derive(Config, Debug)]
pub struct SequencePredictorConfig {
    /// The base model.
    pub base: SequenceEncoderConfig,
    /// Count-encoder layers. Default: 2.
    #[config(default = 2)]
    pub count_num_layers: usize,
    /// Count-encoder heads. Default: 4.
    #[config(default = 4)]
    pub count_num_heads: usize,
    /// Count-encoder feed-forward width. Default: None (4·D).
    pub count_intermediate_size: Option<usize>,
    /// Count-encoder dropout. Default: 0.1.
    #[config(default = 0.1)]
    pub count_dropout: f64,
    /// Count-encoder activation. Default: gelu.
    #[config(default = "Activation::Gelu")]
    pub count_activation: Activation,
    /// Target-encoder layers. Default: 2.
    #[config(default = 2)]
    pub target_num_layers: usize,
    /// Target-encoder heads. Default: 4.
    #[config(default = 4)]
    pub target_num_heads: usize,
    /// Target-encoder feed-forward width. Default: None (4·D).
    pub target_intermediate_size: Option<usize>,
    /// Target-encoder dropout. Default: 0.1.
    #[config(default = 0.1)]
    pub target_dropout: f64,
    /// Target-encoder activation. Default: gelu.
    #[config(default = "Activation::Gelu")]
    pub target_activation: Activation,
    /// Outputs per sample (classes for a classifier). Default: 1.
    #[config(default = 1)]
    pub out_dim: usize,
    /// Log-softmax classifier. Default: false.
    #[config(default = false)]
    pub is_classifier: bool,
    /// Base model excluded from training. Default: false.
    #[config(default = false)]
    pub freeze_base: bool,
    /// LayerNorm after target pooling. Default: true.
    #[config(default = true)]
    pub target_layer_norm: bool,
    /// Sigmoid on the output. Default: false.
    #[config(default = false)]
    pub bounded_targets: bool,
    /// Learned `output_scale`/`output_bias`. Default: false.
    #[config(default = false)]
    pub learnable_output_scale: bool,
    /// Output activation. Default: none.
    #[config(default = "OutputActivation::None")]
    pub output_activation: OutputActivation,
    /// Categorical columns → cardinality. Default: None.
    pub categorical_cardinalities: Option<BTreeMap<String, usize>>,
    /// Categorical embedding width(s). Default: 16.
    #[config(default = "CategoricalEmbedDim::Uniform(16)")]
    pub categorical_embed_dim: CategoricalEmbedDim,
    /// Fusion strategy. Default: concat.
    #[config(default = "CategoricalFusion::Concat")]
    pub categorical_fusion: CategoricalFusion,
    /// Dropout on categorical embeddings. Default: 0.1.
    #[config(default = 0.1)]
    pub categorical_dropout: f64,
    /// Hidden widths of an MLP head. Default: None (linear head).
    pub regressor_hidden_dims: Option<Vec<usize>>,
    /// Dropout between MLP layers. Default: 0.0.
    #[config(default = 0.0)]
    pub regressor_dropout: f64,
    /// `skip(x) + mlp(x)` head. Default: false.
    #[config(default = false)]
    pub residual_regression_head: bool,
    /// Columns with per-category output scale and bias. Default: None.
    pub conditional_scaling_columns: Option<Vec<String>>,
    /// Cross-attention / perceiver heads. Default: 8.
    #[config(default = 8)]
    pub cross_attn_heads: usize,
    /// Perceiver latents. Default: 64.
    #[config(default = 64)]
    pub perceiver_num_latents: usize,
    /// Perceiver self-attention layers. Default: 2.
    #[config(default = 2)]
    pub perceiver_num_layers: usize,
    /// Quantiles per output. Default: None.
    pub num_quantiles: Option<usize>,
    /// Count encoder and head. Default: true.
    #[config(default = true)]
    pub count_prediction: bool,
}

impl SequencePredictorConfig {
    /// Model width D.
    pub fn embedding_dim(&self) -> usize {
        self.base.embedding_dim()
    }

    /// The reference's construction-time checks (§1.8 "Validation").
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad =
            |field: &'static str, reason: String| Err(ModelError::InvalidConfig { field, reason });
        if self.output_activation != OutputActivation::None && self.bounded_targets {
            return bad(
                "output_activation",
                "is incompatible with bounded_targets".into(),
            );
        }
        if self.output_activation != OutputActivation::None && self.is_classifier {
            return bad(
                "output_activation",
                "is incompatible with is_classifier".into(),
            );
        }
        if let Some(q) = self.num_quantiles {
            if self.is_classifier {
                return bad("num_quantiles", "is incompatible with is_classifier".into());
            }
            if q < 1 {
                return bad("num_quantiles", format!("must be ≥ 1, got {q}"));
            }
        }
        let hidden = self.regressor_hidden_dims.as_deref().unwrap_or(&[]);
        if self.residual_regression_head && hidden.is_empty() {
            return bad(
                "residual_regression_head",
                "needs non-empty regressor_hidden_dims".into(),
            );
        }
        if hidden.contains(&0) {
            return bad(
                "regressor_hidden_dims",
                format!("must be positive, got {hidden:?}"),
            );
        }
        if let Some(columns) = &self.conditional_scaling_columns {
            let Some(cards) = &self.categorical_cardinalities else {
                return bad(
                    "conditional_scaling_columns",
                    "needs categorical_cardinalities".into(),
                );
            };
            if let Some(missing) = columns.iter().find(|c| !cards.contains_key(*c)) {
                return bad(
                    "conditional_scaling_columns",
                    format!("column '{missing}' is not categorical"),
                );
            }
        }
        let d = self.embedding_dim();
        let fusion_heads = matches!(
            self.categorical_fusion,
            CategoricalFusion::CrossAttention | CategoricalFusion::Perceiver
        );
        if self.categorical_cardinalities.is_some()
            && fusion_heads
            && d % self.cross_attn_heads != 0
        {
            return bad(
                "cross_attn_heads",
                format!(
                    "{} does not divide embedding_dim {d}",
                    self.cross_attn_heads
                ),
            );
        }
        Ok(())
    }

    fn categorical_embedder(&self) -> Option<CategoricalEmbedderConfig> {
        self.categorical_cardinalities.as_ref().map(|cards| {
            CategoricalEmbedderConfig::new(cards.clone())
                .with_embed_dim(self.categorical_embed_dim.clone())
                .with_dropout(self.categorical_dropout)
        })
    }

    fn stack(
        &self,
        layers: usize,
        heads: usize,
        ff: Option<usize>,
        p: f64,
        act: Activation,
    ) -> TransformerEncoderConfig {
        TransformerEncoderConfig::new(layers, heads, self.embedding_dim())
            .with_intermediate_size(ff)
            .with_dropout(p)
            .with_activation(act)
            .with_attn_implementation(self.base.sample.asv.attn_implementation)
    }

    /// Builds the predictor.
    ///
    /// # Panics
    /// If [`Self::validate`] fails; call it first on user-provided configs.
    pub fn init<B: Backend>(&self, device: &B::Device) -> SequencePredictor<B> {
        if let Err(e) = self.validate() {
            panic!("{e}");
        }
        let d = self.embedding_dim();
        let xavier = |i, o| {
            LinearConfig::new(i, o)
                .with_init(LinearInit::XavierZeroBias)
                .init(device)
        };
        let embedder = self.categorical_embedder();
        let c = embedder.as_ref().map(|e| e.total_dim()).unwrap_or(0);
        let fusion = embedder.as_ref().map(|_| self.categorical_fusion);
        let mut base_model = self.base.init(device);
        if self.freeze_base {
            base_model = base_model.no_grad();
        }
        let scaling = |init: Initializer| -> Vec<Embedding<B>> {
            let cards = self.categorical_cardinalities.clone().unwrap_or_default();
            self.conditional_scaling_columns
                .iter()
                .flatten()
                .map(|col| {
                    EmbeddingConfig::new(cards[col], self.out_dim)
                        .with_initializer(init.clone())
                        .init(device)
                })
                .collect()
        };
        SequencePredictor {
            output_scale: self
                .learnable_output_scale
                .then(|| Initializer::Ones.init([self.out_dim], device)),
            output_bias: self
                .learnable_output_scale
                .then(|| Initializer::Zeros.init([self.out_dim], device)),
            base_model,
            count_encoder: self.count_prediction.then(|| {
                self.stack(
                    self.count_num_layers,
                    self.count_num_heads,
                    self.count_intermediate_size,
                    self.count_dropout,
                    self.count_activation,
                )
                .init(device)
            }),
            count_head: self.count_prediction.then(|| xavier(d, 1)),
            target_encoder: self
                .stack(
                    self.target_num_layers,
                    self.target_num_heads,
                    self.target_intermediate_size,
                    self.target_dropout,
                    self.target_activation,
                )
                .init(device),
            target_pooling: AttentionPoolingConfig::new(d).init(device),
            target_norm: self
                .target_layer_norm
                .then(|| LayerNormConfig::new(d).init(device)),
            target_head: TargetHeadConfig {
                d_input: d,
                d_output: self.out_dim * self.num_quantiles.unwrap_or(1),
                hidden_dims: self.regressor_hidden_dims.clone().unwrap_or_default(),
                dropout: self.regressor_dropout,
                residual: self.residual_regression_head,
            }
            .init(device),
            categorical_embedder: embedder.as_ref().map(|e| e.init(device)),
            categorical_projection: match fusion {
                Some(CategoricalFusion::Concat) => Some(xavier(d + c, d)),
                Some(CategoricalFusion::Add) => Some(xavier(c, d)),
                _ => None,
            },
            gmu: (fusion == Some(CategoricalFusion::Gmu))
                .then(|| GmuConfig::new(d, c).init(device)),
            cross_attn_fusion: (fusion == Some(CategoricalFusion::CrossAttention)).then(|| {
                CrossAttentionFusionConfig::new(d, c)
                    .with_num_heads(self.cross_attn_heads)
                    .with_dropout(self.categorical_dropout)
                    .with_attn_implementation(self.base.sample.asv.attn_implementation)
                    .init(device)
            }),
            perceiver_fusion: (fusion == Some(CategoricalFusion::Perceiver)).then(|| {
                PerceiverFusionConfig::new(d, c)
                    .with_num_latents(self.perceiver_num_latents)
                    .with_num_layers(self.perceiver_num_layers)
                    .with_num_heads(self.cross_attn_heads)
                    .with_dropout(self.categorical_dropout)
                    .with_attn_implementation(self.base.sample.asv.attn_implementation)
                    .init(device)
            }),
            output_scales: scaling(Initializer::Ones),
            output_biases: scaling(Initializer::Zeros),
            scaling_columns: self.conditional_scaling_columns.clone().unwrap_or_default(),
            fusion,
            is_classifier: self.is_classifier,
            bounded_targets: self.bounded_targets,
            quantiles: self.num_quantiles,
            output_activation: self.output_activation,
        }
    }
}

/// Configuration of [`TargetHead`].
#[derive(Debug, Clone)]
pub struct TargetHeadConfig {
    /// Input width D.
    pub d_input: usize,
    /// Output width (out_dim · quantiles).
    pub d_output: usize,
    /// MLP hidden widths; empty = one Linear.
    pub hidden_dims: Vec<usize>,
    /// Dropout after each hidden ReLU (0 = none).
    pub dropout: f64,
    /// `skip(x) + mlp(x)`.
    pub residual: bool,
}

/// `target_head`: a Linear, an MLP (`nn.Sequential` of Linear, ReLU, Dropout),
/// or the residual `skip + mlp`. Xavier weights, zero biases.
#[derive(Module, Debug)]
pub struct TargetHead<B: Backend> {
    /// The plain Linear head (`target_head.weight`).
    pub linear: Option<Linear<B>>,
    /// Residual branch (`target_head.skip`).
    pub skip: Option<Linear<B>>,
    /// MLP layers (`target_head.<k>` or `target_head.mlp.<k>`, k = 2i or 3i).
    pub mlp: Vec<Linear<B>>,
    dropout: Dropout,
}

impl TargetHeadConfig {
    /// Builds the head.
    pub fn init<B: Backend>(&self, device: &B::Device) -> TargetHead<B> {
        let xavier = |i, o| {
            LinearConfig::new(i, o)
                .with_init(LinearInit::XavierZeroBias)
                .init(device)
        };
        let widths: Vec<usize> = std::iter::once(self.d_input)
            .chain(self.hidden_dims.iter().copied())
            .chain(std::iter::once(self.d_output))
            .collect();
        let mlp: Vec<Linear<B>> = if self.hidden_dims.is_empty() {
            Vec::new()
        } else {
            widths.windows(2).map(|w| xavier(w[0], w[1])).collect()
        };
        TargetHead {
            linear: self
                .hidden_dims
                .is_empty()
                .then(|| xavier(self.d_input, self.d_output)),
            skip: self.residual.then(|| xavier(self.d_input, self.d_output)),
            mlp,
            dropout: DropoutConfig::new(self.dropout).init(),
        }
    }
}

impl<B: AttentionBackend> TargetHead<B> {
    /// # Shapes
    /// - x: `[B, D]` → `[B, d_output]`
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        if let Some(linear) = &self.linear {
            return linear.forward(x);
        }
        let last = self.mlp.len() - 1;
        let mlp = self
            .mlp
            .iter()
            .enumerate()
            .fold(x.clone(), |h, (i, layer)| {
                let h = layer.forward(h);
                if i == last {
                    h
                } else {
                    self.dropout.forward(activation::relu(h))
                }
            });
        match &self.skip {
            Some(skip) => skip.forward(x) + mlp,
            None => mlp,
        }
    }
}

/// `SequencePredictor`; fields in state-dict order.
#[derive(Module, Debug)]
pub struct SequencePredictor<B: Backend> {
    /// `output_scale [out_dim]` (learnable_output_scale).
    pub output_scale: Option<Param<Tensor<B, 1>>>,
    /// `output_bias [out_dim]` (learnable_output_scale).
    pub output_bias: Option<Param<Tensor<B, 1>>>,
    /// `base_model.*`
    pub base_model: SequenceEncoder<B>,
    /// `count_encoder.*`
    pub count_encoder: Option<TransformerEncoder<B>>,
    /// `count_head [1, D]`
    pub count_head: Option<Linear<B>>,
    /// `target_encoder.*`
    pub target_encoder: TransformerEncoder<B>,
    /// `target_pooling.*`
    pub target_pooling: AttentionPooling<B>,
    /// `target_norm`
    pub target_norm: Option<LayerNorm<B>>,
    /// `target_head.*`
    pub target_head: TargetHead<B>,
    /// `categorical_embedder.embeddings.<col>`
    pub categorical_embedder: Option<CategoricalEmbedder<B>>,
    /// `categorical_projection` (concat `[D, D+C]`, add `[D, C]`)
    pub categorical_projection: Option<Linear<B>>,
    /// `gmu.*`
    pub gmu: Option<Gmu<B>>,
    /// `cross_attn_fusion.*`
    pub cross_attn_fusion: Option<CrossAttentionFusion<B>>,
    /// `perceiver_fusion.*`
    pub perceiver_fusion: Option<PerceiverFusion<B>>,
    /// `output_scales.<col>.weight [card, out_dim]`, in `scaling_columns` order.
    pub output_scales: Vec<Embedding<B>>,
    /// `output_biases.<col>.weight [card, out_dim]`, in `scaling_columns` order.
    pub output_biases: Vec<Embedding<B>>,
    #[module(skip)]
    scaling_columns: Vec<String>,
    #[module(skip)]
    fusion: Option<CategoricalFusion>,
    is_classifier: bool,
    bounded_targets: bool,
    quantiles: Option<usize>,
    #[module(skip)]
    output_activation: OutputActivation,
}

/// The target prediction: point values, or quantiles.
#[derive(Debug, Clone)]
pub enum TargetPrediction<B: Backend> {
    /// `[B, out_dim]` after every output transform.
    Point(Tensor<B, 2>),
    /// `[B, out_dim, Q]`, raw (no output transforms).
    Quantiles(Tensor<B, 3>),
}

/// What [`SequencePredictor::forward`] returns.
#[derive(Debug, Clone)]
pub struct PredictorOutput<B: Backend> {
    /// The target prediction.
    pub target_prediction: TargetPrediction<B>,
    /// Sample-transformer output `[B, S, D]` (`base_embeddings`).
    pub base_embeddings: Tensor<B, 3>,
    /// `[B, S, 1]` in (0, 1), at every slot.
    pub count_prediction: Option<Tensor<B, 3>>,
    /// GMU gate `[B, D]`.
    pub gmu_gate: Option<Tensor<B, 2>>,
    /// `[B, H, S, 1]`.
    pub cross_attn_weights: Option<Tensor<B, 4>>,
    /// `[B, H, latents, S+1]`.
    pub perceiver_attn_weights: Option<Tensor<B, 4>>,
    /// The base model's pooled embedding `[B, D]` (unifrac base).
    pub embeddings: Option<Tensor<B, 2>>,
    /// Non-unifrac base head output. The reference returns it only with
    /// `return_nucleotides`, which makes a faith_pd base loss silently zero
    /// without the nucleotide loss (§3.2); here it is always set, and
    /// [`AamModel::forward_named`](crate::AamModel::forward_named) keeps the
    /// reference's output keys.
    pub base_prediction: Option<Tensor<B, 2>>,
    /// Combined base outputs (always set, as `base_prediction`).
    pub unifrac_pred: Option<Tensor<B, 2>>,
    /// Combined base outputs (always set, as `base_prediction`).
    pub faith_pred: Option<Tensor<B, 2>>,
    /// Combined base outputs (always set, as `base_prediction`).
    pub tax_pred: Option<Tensor<B, 2>>,
    /// The filled slots' nucleotide logits (the reference's `nuc_predictions`
    /// and `mask_indices`, packed).
    pub nucleotides: Option<Nucleotides<B>>,
}

impl<B: AttentionBackend> SequencePredictor<B> {
    /// # Shapes
    /// - tokens: `[B, S, L]`; counts: `[B, S, 1]`; categorical_ids: column → `[B]`
    /// - see [`PredictorOutput`]
    pub fn forward(
        &self,
        tokens: impl Into<AsvTokens<B>>,
        counts: Option<Tensor<B, 3>>,
        categorical_ids: Option<&BTreeMap<String, Tensor<B, 1, Int>>>,
        return_nucleotides: bool,
    ) -> PredictorOutput<B> {
        // 1. asv_mask
        let tokens = tokens.into();
        let b = tokens.dims()[0];
        let valid = tokens.slot_mask();
        let padding = valid.clone().bool_not();
        // 2. base model; se = sample-transformer output
        let base = self.base_model.forward(tokens, counts, return_nucleotides);
        let se = base.sample_embeddings.clone();
        // 3. count path
        let count_prediction = match (&self.count_encoder, &self.count_head) {
            (Some(encoder), Some(head)) => Some(activation::sigmoid(
                head.forward(encoder.forward(se.clone(), Some(padding.clone()))),
            )),
            _ => None,
        };
        // 4. target path, by fusion
        let ids = categorical_ids.filter(|ids| !ids.is_empty());
        let cat = match (&self.categorical_embedder, ids) {
            (Some(embedder), Some(ids)) => Some(embedder.forward(ids)),
            _ => None,
        };
        let mut cross_attn_weights = None;
        let mut perceiver_attn_weights = None;
        let pooled = match (&cat, &self.cross_attn_fusion, &self.perceiver_fusion) {
            (Some(cat), _, Some(perceiver)) => {
                let (t, w) = perceiver.forward(se.clone(), cat.clone());
                perceiver_attn_weights = Some(w);
                t
            }
            (Some(cat), Some(cross), _) => {
                let (x, w) = cross.forward(se.clone(), cat.clone());
                cross_attn_weights = Some(w);
                self.encode_and_pool(x, padding, valid)
            }
            _ => {
                let x = self.fuse_per_slot(se.clone(), cat.clone());
                self.encode_and_pool(x, padding, valid)
            }
        };
        // 5. target norm
        let mut t = match &self.target_norm {
            Some(norm) => norm.forward(pooled),
            None => pooled,
        };
        // 6. GMU
        let mut gmu_gate = None;
        if let (Some(gmu), Some(cat)) = (&self.gmu, &cat) {
            let (fused, gate) = gmu.forward(t, cat.clone());
            t = fused;
            gmu_gate = Some(gate);
        }
        // 7-8. head and output transforms
        let y = self.target_head.forward(t);
        let target_prediction = match self.quantiles {
            Some(q) => {
                let out_dim = y.dims()[1] / q;
                TargetPrediction::Quantiles(y.reshape([b, out_dim, q]))
            }
            None => TargetPrediction::Point(self.transform_output(y, ids)),
        };
        PredictorOutput {
            target_prediction,
            base_embeddings: se,
            count_prediction,
            gmu_gate,
            cross_attn_weights,
            perceiver_attn_weights,
            embeddings: base.embeddings,
            base_prediction: base.base_prediction,
            unifrac_pred: base.unifrac_pred,
            faith_pred: base.faith_pred,
            tax_pred: base.tax_pred,
            nucleotides: base.nucleotides,
        }
    }

    /// Concat/add fusion at every slot (padded slots included, as the reference).
    fn fuse_per_slot(&self, se: Tensor<B, 3>, cat: Option<Tensor<B, 2>>) -> Tensor<B, 3> {
        let (Some(cat), Some(projection)) = (cat, &self.categorical_projection) else {
            return se;
        };
        let [b, s, _] = se.dims();
        let c = cat.dims()[1];
        let cat = cat.reshape([b, 1, c]).expand([b, s, c]);
        match self.fusion {
            Some(CategoricalFusion::Add) => se + projection.forward(cat),
            _ => projection.forward(Tensor::cat(vec![se, cat], 2)),
        }
    }

    fn encode_and_pool(
        &self,
        x: Tensor<B, 3>,
        padding: Tensor<B, 2, Bool>,
        valid: Tensor<B, 2, Bool>,
    ) -> Tensor<B, 2> {
        let encoded = self.target_encoder.forward(x, Some(padding));
        self.target_pooling.forward(encoded, Some(valid))
    }

    /// §1.8 step 8: conditional scaling, learnable scale, then one activation.
    fn transform_output(
        &self,
        mut y: Tensor<B, 2>,
        ids: Option<&BTreeMap<String, Tensor<B, 1, Int>>>,
    ) -> Tensor<B, 2> {
        if let Some(ids) = ids {
            for ((column, scales), biases) in self
                .scaling_columns
                .iter()
                .zip(&self.output_scales)
                .zip(&self.output_biases)
            {
                if let Some(col_ids) = ids.get(column) {
                    let [b] = col_ids.dims();
                    let col_ids = col_ids.clone().reshape([b, 1]);
                    let scale = scales.forward(col_ids.clone()).reshape([b, y.dims()[1]]);
                    let bias = biases.forward(col_ids).reshape([b, y.dims()[1]]);
                    y = y * scale + bias;
                }
            }
        }
        if let (Some(scale), Some(bias)) = (&self.output_scale, &self.output_bias) {
            y = y * scale.val().unsqueeze() + bias.val().unsqueeze();
        }
        if self.is_classifier {
            activation::log_softmax(y, 1)
        } else if self.bounded_targets {
            activation::sigmoid(y)
        } else {
            match self.output_activation {
                OutputActivation::None => y,
                OutputActivation::Relu => activation::relu(y),
                OutputActivation::Softplus => softplus(y),
                OutputActivation::Exp => y.exp(),
            }
        }
    }
}
