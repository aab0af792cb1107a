//! §1.6 `SampleSequenceEncoder`: ASV embeddings of one sample → (optional count
//! embedding) → sample position embedding → the ASV-set transformer.

use aam_kernels::AttentionBackend;
use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::asv_encoder::Nucleotides;
use crate::asv_encoder::{AsvEncoder, AsvEncoderConfig};
use crate::embedding::{PositionEmbedding, PositionEmbeddingConfig};
use crate::nn::{Activation, Linear, LinearConfig};
use crate::output::AsvTokens;
use crate::transformer::{TransformerEncoder, TransformerEncoderConfig};

/// How per-ASV read counts enter the sample encoder (§1.6 step 5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum CountEmbeddingMethod {
    /// `asv + count_embed(ln(c+1))`
    #[default]
    Add,
    /// `count_proj([asv ‖ count_embed(ln(c+1))])`
    Concat,
    /// `asv·(1+scale) + shift`, `[scale ‖ shift] = count_film(ln(c+1))`
    Film,
}

/// Configuration of [`SampleSequenceEncoder`]; defaults as the reference (§1.6).
#[derive(Config, Debug)]
pub struct SampleSequenceEncoderConfig {
    /// The nucleotide-level encoder.
    pub asv: AsvEncoderConfig,
    /// ASV slots S per sample. Default: 1024.
    #[config(default = 1024)]
    pub token_limit: usize,
    /// Sample-transformer layers. Default: 2.
    #[config(default = 2)]
    pub sample_num_layers: usize,
    /// Sample-transformer heads. Default: 4.
    #[config(default = 4)]
    pub sample_num_heads: usize,
    /// Sample-transformer feed-forward width. Default: None (4·D).
    pub sample_intermediate_size: Option<usize>,
    /// Sample-transformer dropout. Default: 0.1.
    #[config(default = 0.1)]
    pub sample_dropout: f64,
    /// Sample-transformer activation. Default: gelu.
    #[config(default = "Activation::Gelu")]
    pub sample_activation: Activation,
    /// Whether counts are embedded. Default: false.
    #[config(default = false)]
    pub count_embedding: bool,
    /// How counts are embedded. Default: add.
    #[config(default = "CountEmbeddingMethod::Add")]
    pub count_embedding_method: CountEmbeddingMethod,
}

/// `SampleSequenceEncoder`; fields in state-dict order.
#[derive(Module, Debug)]
pub struct SampleSequenceEncoder<B: Backend> {
    /// `asv_encoder.*`
    pub asv_encoder: AsvEncoder<B>,
    /// `sample_position_embedding.position_embedding.weight [token_limit+5, D]`
    pub sample_position_embedding: PositionEmbedding<B>,
    /// `sample_transformer.*`
    pub sample_transformer: TransformerEncoder<B>,
    /// `count_embed` Linear(1→D) (add, concat).
    pub count_embed: Option<Linear<B>>,
    /// `count_proj` Linear(2D→D) (concat).
    pub count_proj: Option<Linear<B>>,
    /// `count_film` Linear(1→2D) (film).
    pub count_film: Option<Linear<B>>,
}

/// What [`SampleSequenceEncoder::forward`] returns.
#[derive(Debug, Clone)]
pub struct SampleEncoderOutput<B: Backend> {
    /// `[B, S, D]`, padded slots exactly 0.
    pub sample_embeddings: Tensor<B, 3>,
    /// The filled slots' nucleotide logits, when requested.
    pub nucleotides: Option<Nucleotides<B>>,
}

impl SampleSequenceEncoderConfig {
    /// The sample-transformer's configuration.
    pub fn sample_transformer(&self) -> TransformerEncoderConfig {
        TransformerEncoderConfig::new(
            self.sample_num_layers,
            self.sample_num_heads,
            self.asv.embedding_dim,
        )
        .with_intermediate_size(self.sample_intermediate_size)
        .with_dropout(self.sample_dropout)
        .with_activation(self.sample_activation)
        .with_attn_implementation(self.asv.attn_implementation)
    }

    /// Builds the encoder.
    pub fn init<B: Backend>(&self, device: &B::Device) -> SampleSequenceEncoder<B> {
        let d = self.asv.embedding_dim;
        let method = self.count_embedding.then_some(self.count_embedding_method);
        let linear = |i, o| LinearConfig::new(i, o).init(device);
        SampleSequenceEncoder {
            asv_encoder: self.asv.init(device),
            sample_position_embedding: PositionEmbeddingConfig::new(self.token_limit + 5, d)
                .init(device),
            sample_transformer: self.sample_transformer().init(device),
            count_embed: matches!(
                method,
                Some(CountEmbeddingMethod::Add | CountEmbeddingMethod::Concat)
            )
            .then(|| linear(1, d)),
            count_proj: matches!(method, Some(CountEmbeddingMethod::Concat))
                .then(|| linear(2 * d, d)),
            count_film: matches!(method, Some(CountEmbeddingMethod::Film))
                .then(|| linear(1, 2 * d)),
        }
    }
}

impl<B: AttentionBackend> SampleSequenceEncoder<B> {
    /// Whether this encoder needs counts.
    pub fn uses_counts(&self) -> bool {
        self.count_embed.is_some() || self.count_film.is_some()
    }

    /// # Shapes
    /// - tokens: `[B, S, L]`; counts: `[B, S, 1]` (required iff count embedding is on)
    /// - sample_embeddings: `[B, S, D]`
    ///
    /// # Panics
    /// If the count embedding is on and `counts` is None (the reference raises).
    pub fn forward(
        &self,
        tokens: impl Into<AsvTokens<B>>,
        counts: Option<Tensor<B, 3>>,
        return_nucleotides: bool,
    ) -> SampleEncoderOutput<B> {
        // 2. asv_mask: a slot is valid iff it holds a non-zero token
        let tokens = tokens.into();
        let [b, s, _] = tokens.dims();
        let asv_valid = tokens.slot_mask().reshape([b, s, 1]);
        let asv_mask = asv_valid.clone().float();
        // 3-4. ASV embeddings, empty slots zeroed
        let asv_out = self.asv_encoder.forward(tokens, return_nucleotides);
        let mut asv = asv_out.asv_embeddings * asv_mask.clone();
        // 5. count embedding
        if self.uses_counts() {
            let counts = counts.expect("count embedding is enabled: counts are required");
            let c = counts.log1p();
            asv = self.embed_counts(asv, c) * asv_mask.clone();
        }
        // 6-7. + sample positions, then the ASV-set transformer
        let asv = self.sample_position_embedding.forward(asv);
        let padding = asv_valid.reshape([b, s]).bool_not();
        let hidden = self.sample_transformer.forward(asv, Some(padding));
        // 8. padded slots exactly 0
        SampleEncoderOutput {
            sample_embeddings: hidden * asv_mask,
            nucleotides: asv_out.nucleotides,
        }
    }

    fn embed_counts(&self, asv: Tensor<B, 3>, c: Tensor<B, 3>) -> Tensor<B, 3> {
        if let Some(film) = &self.count_film {
            let d = asv.dims()[2];
            let scale_shift = film.forward(c);
            let scale = scale_shift.clone().narrow(2, 0, d);
            let shift = scale_shift.narrow(2, d, d);
            return asv * (scale + 1.0) + shift;
        }
        let embed = self
            .count_embed
            .as_ref()
            .expect("count embedding")
            .forward(c);
        match &self.count_proj {
            Some(proj) => proj.forward(Tensor::cat(vec![asv, embed], 2)),
            None => asv + embed,
        }
    }
}
