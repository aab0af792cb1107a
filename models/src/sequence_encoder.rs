//! §1.7 `SequenceEncoder`: the pre-trainable base model. The sample encoder's
//! output goes through one more transformer and attention pooling into one
//! embedding per sample, followed by a head chosen by `encoder_type`.

use aam_kernels::AttentionBackend;
use burn::prelude::*;
use burn::tensor::activation;
use serde::{Deserialize, Serialize};

use crate::asv_encoder::Nucleotides;
use crate::nn::{Activation, Linear, LinearConfig, LinearInit};
use crate::output::AsvTokens;
use crate::pooling::{AttentionPooling, AttentionPoolingConfig};
use crate::sample_encoder::{
    SampleEncoderOutput, SampleSequenceEncoder, SampleSequenceEncoderConfig,
};
use crate::transformer::{TransformerEncoder, TransformerEncoderConfig};

/// What the base model is pre-trained to predict.
///
/// DEVIATION(§1.7): the reference accepts any string and treats unknown ones
/// like `taxonomy`; here an unknown type is a deserialisation error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EncoderType {
    /// Pooled embeddings only; the loss turns them into UniFrac distances.
    #[default]
    Unifrac,
    /// `output_head` Linear(D→base_output_dim).
    Taxonomy,
    /// `output_head` Linear(D→base_output_dim).
    FaithPd,
    /// `uni_ff` [2], `faith_ff` [1], `tax_ff` [7].
    Combined,
}

/// Configuration of [`SequenceEncoder`]; defaults as the reference (§1.7).
#[derive(Config, Debug)]
pub struct SequenceEncoderConfig {
    /// The sample encoder (and, inside it, the ASV encoder).
    pub sample: SampleSequenceEncoderConfig,
    /// Encoder-transformer layers. Default: 2.
    #[config(default = 2)]
    pub encoder_num_layers: usize,
    /// Encoder-transformer heads. Default: 4.
    #[config(default = 4)]
    pub encoder_num_heads: usize,
    /// Encoder-transformer feed-forward width. Default: None (4·D).
    pub encoder_intermediate_size: Option<usize>,
    /// Encoder-transformer dropout. Default: 0.1.
    #[config(default = 0.1)]
    pub encoder_dropout: f64,
    /// Encoder-transformer activation. Default: gelu.
    #[config(default = "Activation::Gelu")]
    pub encoder_activation: Activation,
    /// Width of `output_head` (taxonomy, faith_pd). Default: None (→ D).
    pub base_output_dim: Option<usize>,
    /// Head type. Default: unifrac.
    #[config(default = "EncoderType::Unifrac")]
    pub encoder_type: EncoderType,
}

/// `SequenceEncoder`; fields in state-dict order.
#[derive(Module, Debug)]
pub struct SequenceEncoder<B: Backend> {
    /// `sample_encoder.*`
    pub sample_encoder: SampleSequenceEncoder<B>,
    /// `encoder_transformer.*`
    pub encoder_transformer: TransformerEncoder<B>,
    /// `attention_pooling.*`
    pub attention_pooling: AttentionPooling<B>,
    /// `output_head [base_output_dim, D]` (taxonomy, faith_pd).
    pub output_head: Option<Linear<B>>,
    /// `uni_ff [2, D]` (combined).
    pub uni_ff: Option<Linear<B>>,
    /// `faith_ff [1, D]` (combined).
    pub faith_ff: Option<Linear<B>>,
    /// `tax_ff [7, D]` (combined).
    pub tax_ff: Option<Linear<B>>,
}

/// What [`SequenceEncoder::forward`] returns; which fields are set depends on
/// `encoder_type` and on whether nucleotides were requested.
#[derive(Debug, Clone)]
pub struct SequenceEncoderOutput<B: Backend> {
    /// Sample-transformer output `[B, S, D]` (padded slots 0).
    pub sample_embeddings: Tensor<B, 3>,
    /// Pooled embedding `[B, D]` (unifrac).
    pub embeddings: Option<Tensor<B, 2>>,
    /// `output_head(pooled)` `[B, base_output_dim]` (taxonomy, faith_pd).
    pub base_prediction: Option<Tensor<B, 2>>,
    /// `sigmoid(uni_ff(pooled))` `[B, 2]` (combined).
    pub unifrac_pred: Option<Tensor<B, 2>>,
    /// `faith_ff(pooled)` `[B, 1]` (combined).
    pub faith_pred: Option<Tensor<B, 2>>,
    /// `tax_ff(pooled)` `[B, 7]` (combined).
    pub tax_pred: Option<Tensor<B, 2>>,
    /// The filled slots' nucleotide logits (the reference's `nuc_predictions`
    /// and `mask_indices`, packed).
    pub nucleotides: Option<Nucleotides<B>>,
}

impl SequenceEncoderConfig {
    /// Model width D.
    pub fn embedding_dim(&self) -> usize {
        self.sample.asv.embedding_dim
    }

    /// The encoder-transformer's configuration.
    pub fn encoder_transformer(&self) -> TransformerEncoderConfig {
        TransformerEncoderConfig::new(
            self.encoder_num_layers,
            self.encoder_num_heads,
            self.embedding_dim(),
        )
        .with_intermediate_size(self.encoder_intermediate_size)
        .with_dropout(self.encoder_dropout)
        .with_activation(self.encoder_activation)
        .with_attn_implementation(self.sample.asv.attn_implementation)
    }

    /// Builds the base model.
    pub fn init<B: Backend>(&self, device: &B::Device) -> SequenceEncoder<B> {
        let d = self.embedding_dim();
        let combined = self.encoder_type == EncoderType::Combined;
        let mut uni_ff = combined.then(|| {
            LinearConfig::new(d, 2)
                .with_init(LinearInit::XavierZeroBias)
                .init(device)
        });
        if let Some(uni) = uni_ff.as_mut() {
            // The reference initialises this bias to 0.85.
            uni.bias = Some(burn::module::Initializer::Constant { value: 0.85 }.init([2], device));
        }
        SequenceEncoder {
            sample_encoder: self.sample.init(device),
            encoder_transformer: self.encoder_transformer().init(device),
            attention_pooling: AttentionPoolingConfig::new(d).init(device),
            output_head: matches!(
                self.encoder_type,
                EncoderType::Taxonomy | EncoderType::FaithPd
            )
            .then(|| LinearConfig::new(d, self.base_output_dim.unwrap_or(d)).init(device)),
            uni_ff,
            faith_ff: combined.then(|| LinearConfig::new(d, 1).init(device)),
            tax_ff: combined.then(|| LinearConfig::new(d, 7).init(device)),
        }
    }
}

impl<B: AttentionBackend> SequenceEncoder<B> {
    /// Sample embeddings, whatever the encoder type: the pooled embedding
    /// `[B, D]` (the one the UniFrac loss compares, for a `unifrac` model)
    /// and the ASV embeddings `[B, S, D]` (the sample transformer's output
    /// per slot, 0 at empty slots). Eval-mode use: no nucleotide masking.
    pub fn embed(
        &self,
        tokens: impl Into<AsvTokens<B>>,
        counts: Option<Tensor<B, 3>>,
    ) -> (Tensor<B, 2>, Tensor<B, 3>) {
        let (sample, pooled) = self.encode(tokens.into(), counts, false);
        (pooled, sample.sample_embeddings)
    }

    /// Steps 1-4 of [`Self::forward`]: the sample encoder's output and the
    /// pooled embedding.
    fn encode(
        &self,
        tokens: AsvTokens<B>,
        counts: Option<Tensor<B, 3>>,
        return_nucleotides: bool,
    ) -> (SampleEncoderOutput<B>, Tensor<B, 2>) {
        // 1. asv_mask
        let valid = tokens.slot_mask();
        // 2. sample encoder
        let sample = self
            .sample_encoder
            .forward(tokens, counts, return_nucleotides);
        // 3. encoder transformer (no extra position embedding)
        let encoded = self.encoder_transformer.forward(
            sample.sample_embeddings.clone(),
            Some(valid.clone().bool_not()),
        );
        // 4. pool
        let pooled = self.attention_pooling.forward(encoded, Some(valid));
        (sample, pooled)
    }

    /// # Shapes
    /// - tokens: `[B, S, L]`; counts: `[B, S, 1]`
    /// - see [`SequenceEncoderOutput`]
    pub fn forward(
        &self,
        tokens: impl Into<AsvTokens<B>>,
        counts: Option<Tensor<B, 3>>,
        return_nucleotides: bool,
    ) -> SequenceEncoderOutput<B> {
        let (sample, pooled) = self.encode(tokens.into(), counts, return_nucleotides);
        // 5. heads by type
        let mut out = SequenceEncoderOutput {
            sample_embeddings: sample.sample_embeddings,
            embeddings: None,
            base_prediction: None,
            unifrac_pred: None,
            faith_pred: None,
            tax_pred: None,
            nucleotides: sample.nucleotides,
        };
        if let Some(head) = &self.output_head {
            out.base_prediction = Some(head.forward(pooled));
        } else if let (Some(uni), Some(faith), Some(tax)) =
            (&self.uni_ff, &self.faith_ff, &self.tax_ff)
        {
            out.unifrac_pred = Some(activation::sigmoid(uni.forward(pooled.clone())));
            out.faith_pred = Some(faith.forward(pooled.clone()));
            out.tax_pred = Some(tax.forward(pooled));
        } else {
            out.embeddings = Some(pooled);
        }
        out
    }
}
