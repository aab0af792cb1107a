//! §1.5 `ASVEncoder`: the nucleotide-level transformer. Each ASV slot is a row
//! of `L = max_bp + 1` tokens (START, then A/C/G/T = 1..4, 0 = padding); it is
//! embedded, encoded and attention-pooled into one D-vector per ASV.
//!
//! Only ASV slots with at least one non-padding token are encoded (the
//! reference gathers them the same way); empty slots get exactly zero hidden
//! states. That is also the ASV level's answer to padding: samples have ~50-700
//! real ASVs out of `token_limit` slots, so most rows are never computed.

use burn::nn::Embedding;
use burn::prelude::*;
use burn::tensor::{Distribution, IndexingUpdateOp};
use serde::{Deserialize, Serialize};

use crate::attention::AttnImplementation;
use crate::embedding::{token_embedding, PositionEmbedding, PositionEmbeddingConfig};
use crate::nn::{Activation, Linear, LinearConfig};
use crate::pooling::{AttentionPooling, AttentionPoolingConfig};
use crate::transformer::{TransformerEncoder, TransformerEncoderConfig};

/// The MASK token written by the masked-nucleotide corruption (never by the tokenizer).
pub const MASK_TOKEN: i64 = 6;
/// The START token the tokenizer prepends to every ASV.
pub const START_TOKEN: i64 = 5;

/// How nucleotides are chosen for masking (§1.5 step 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum MaskStrategy {
    /// Each A/C/G/T position independently with probability `mask_ratio`.
    #[default]
    Random,
    /// Spans of 3-5 positions until `floor(n_eligible · mask_ratio)` are masked.
    Span,
}

/// Configuration of [`AsvEncoder`]. Defaults are the reference class defaults (§1.5).
#[derive(Config, Debug)]
pub struct AsvEncoderConfig {
    /// Vocabulary V. Default: 7.
    #[config(default = 7)]
    pub vocab_size: usize,
    /// Model width D. Default: 128.
    #[config(default = 128)]
    pub embedding_dim: usize,
    /// Longest ASV in nucleotides; L = max_bp + 1. Default: 150.
    #[config(default = 150)]
    pub max_bp: usize,
    /// Transformer layers. Default: 2.
    #[config(default = 2)]
    pub num_layers: usize,
    /// Attention heads. Default: 4.
    #[config(default = 4)]
    pub num_heads: usize,
    /// Feed-forward width. Default: None (4·D).
    pub intermediate_size: Option<usize>,
    /// Dropout. Default: 0.1.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Activation. Default: gelu.
    #[config(default = "Activation::Gelu")]
    pub activation: Activation,
    /// Whether the nucleotide head exists. Default: false.
    #[config(default = false)]
    pub predict_nucleotides: bool,
    /// ASV slots per chunk (per sample); None or 0 = all at once. Default: None.
    pub asv_chunk_size: Option<usize>,
    /// Attention implementation. Default: auto.
    #[config(default = "AttnImplementation::Auto")]
    pub attn_implementation: AttnImplementation,
    /// Fraction of nucleotides masked while training. Default: 0.0.
    #[config(default = 0.0)]
    pub mask_ratio: f64,
    /// Masking strategy. Default: random.
    #[config(default = "MaskStrategy::Random")]
    pub mask_strategy: MaskStrategy,
}

/// `ASVEncoder`; fields in state-dict order.
#[derive(Module, Debug)]
pub struct AsvEncoder<B: Backend> {
    /// `token_embedding.weight [V, D]`
    pub token_embedding: Embedding<B>,
    /// `position_embedding.position_embedding.weight [max_bp+1, D]`
    pub position_embedding: PositionEmbedding<B>,
    /// `transformer.*`
    pub transformer: TransformerEncoder<B>,
    /// `attention_pooling.*`
    pub attention_pooling: AttentionPooling<B>,
    /// `nucleotide_head [V, D]`, only with `predict_nucleotides`.
    pub nucleotide_head: Option<Linear<B>>,
    asv_chunk_size: Option<usize>,
    mask_ratio: f64,
    #[module(skip)]
    mask_strategy: MaskStrategy,
}

/// What [`AsvEncoder::forward`] returns.
#[derive(Debug, Clone)]
pub struct AsvEncoderOutput<B: Backend> {
    /// Pooled ASV embeddings `[B, S, D]` (empty slots hold the pooling norm's β).
    pub asv_embeddings: Tensor<B, 3>,
    /// Nucleotide logits `[B, S, L, V]`, when requested and the head exists.
    pub nuc_logits: Option<Tensor<B, 4>>,
    /// Which positions were masked `[B, S, L]`, when masking ran.
    pub mask_indices: Option<Tensor<B, 3, Bool>>,
}

impl AsvEncoderConfig {
    /// The transformer stack's configuration.
    pub fn transformer(&self) -> TransformerEncoderConfig {
        TransformerEncoderConfig::new(self.num_layers, self.num_heads, self.embedding_dim)
            .with_intermediate_size(self.intermediate_size)
            .with_dropout(self.dropout)
            .with_activation(self.activation)
            .with_attn_implementation(self.attn_implementation)
    }

    /// Builds the encoder.
    pub fn init<B: Backend>(&self, device: &B::Device) -> AsvEncoder<B> {
        let d = self.embedding_dim;
        AsvEncoder {
            token_embedding: token_embedding(self.vocab_size, d, device),
            position_embedding: PositionEmbeddingConfig::new(self.max_bp + 1, d).init(device),
            transformer: self.transformer().init(device),
            attention_pooling: AttentionPoolingConfig::new(d).init(device),
            nucleotide_head: self
                .predict_nucleotides
                .then(|| LinearConfig::new(d, self.vocab_size).init(device)),
            asv_chunk_size: self.asv_chunk_size.filter(|&c| c > 0),
            mask_ratio: self.mask_ratio,
            mask_strategy: self.mask_strategy,
        }
    }
}

impl<B: Backend> AsvEncoder<B> {
    /// # Shapes
    /// - tokens: `[B, S, L]`
    /// - asv_embeddings: `[B, S, D]`; nuc_logits: `[B, S, L, V]`; mask_indices: `[B, S, L]`
    pub fn forward(&self, tokens: Tensor<B, 3, Int>, return_nucleotides: bool) -> AsvEncoderOutput<B> {
        let [batch, slots, length] = tokens.dims();
        let device = tokens.device();
        // 1. one row per ASV slot
        let rows = tokens.reshape([batch * slots, length]);
        // 2. masked-nucleotide corruption, training only
        let corrupt = B::ad_enabled(&device) && self.mask_ratio > 0.0 && return_nucleotides;
        let (rows, mask_indices) = if corrupt {
            let chosen = self.choose_masked(rows.clone());
            (rows.mask_fill(chosen.clone(), MASK_TOKEN), Some(chosen))
        } else {
            (rows, None)
        };
        // 3. valid = token > 0 (START and MASK count)
        let valid = rows.clone().greater_elem(0);
        // 4-5. encode the non-empty rows; empty rows stay exactly zero
        let hidden = self.encode_non_empty(rows, valid.clone());
        let d = hidden.dims()[2];
        // 6. nucleotide logits at every position (empty rows give the bias)
        let nuc_logits = match (&self.nucleotide_head, return_nucleotides) {
            (Some(head), true) => {
                let logits = head.forward(hidden.clone());
                let vocab = logits.dims()[2];
                Some(logits.reshape([batch, slots, length, vocab]))
            }
            _ => None,
        };
        // 7. pool each ASV
        let asv_embeddings = self
            .attention_pooling
            .forward(hidden, Some(valid))
            .reshape([batch, slots, d]);
        AsvEncoderOutput {
            asv_embeddings,
            nuc_logits,
            mask_indices: mask_indices.map(|m| m.reshape([batch, slots, length])),
        }
    }

    /// Runs the transformer on the rows that hold a token, in chunks, and
    /// scatters the results into a zero tensor of all rows.
    fn encode_non_empty(&self, rows: Tensor<B, 2, Int>, valid: Tensor<B, 2, Bool>) -> Tensor<B, 3> {
        let [n, length] = rows.dims();
        let device = rows.device();
        let d = self.token_embedding.weight.dims()[1];
        let non_empty: Vec<i64> = bool_vec(valid.clone().any_dim(1))
            .into_iter()
            .enumerate()
            .filter_map(|(i, keep)| keep.then_some(i as i64))
            .collect();
        if non_empty.len() == n && self.asv_chunk_size.is_none() {
            return self.encode(rows, valid);
        }
        let mut hidden = Tensor::<B, 3>::zeros([n, length, d], &device);
        let chunk = self.asv_chunk_size.unwrap_or(n.max(1));
        for ids in non_empty.chunks(chunk) {
            let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(ids.to_vec(), [ids.len()]), &device);
            let encoded = self.encode(rows.clone().select(0, idx.clone()), valid.clone().select(0, idx.clone()));
            hidden = hidden.select_assign(0, idx, encoded, IndexingUpdateOp::Add);
        }
        hidden
    }

    /// token + position embedding, then the transformer with the padding mask.
    fn encode(&self, rows: Tensor<B, 2, Int>, valid: Tensor<B, 2, Bool>) -> Tensor<B, 3> {
        let x = self.position_embedding.forward(self.token_embedding.forward(rows));
        self.transformer.forward(x, Some(valid.bool_not()))
    }

    /// Picks the positions to overwrite with MASK: only A/C/G/T (1..4).
    fn choose_masked(&self, rows: Tensor<B, 2, Int>) -> Tensor<B, 2, Bool> {
        let [n, length] = rows.dims();
        let device = rows.device();
        let eligible = rows.clone().greater_elem(0).bool_and(rows.lower_elem(START_TOKEN));
        match self.mask_strategy {
            MaskStrategy::Random => {
                let draw = Tensor::<B, 2>::random([n, length], Distribution::Default, &device);
                eligible.bool_and(draw.lower_elem(self.mask_ratio))
            }
            MaskStrategy::Span => {
                // Uniform draws come from the backend's seeded generator, so runs
                // stay reproducible under `B::seed`.
                let draws = Tensor::<B, 3>::random([n, SPAN_ATTEMPTS, 2], Distribution::Default, &device)
                    .into_data()
                    .convert::<f32>()
                    .to_vec::<f32>()
                    .expect("f32 data");
                let eligible_host = bool_vec(eligible);
                let chosen = span_mask(&eligible_host, length, self.mask_ratio, &draws);
                Tensor::from_data(TensorData::new(chosen, [n, length]), &device)
            }
        }
    }
}

/// Attempts per row of the span strategy (the reference's limit).
const SPAN_ATTEMPTS: usize = 100;

/// The span strategy of §1.5 step 2 on host data: per row, up to 100 attempts
/// draw a span length in {3,4,5} and a start among the eligible positions,
/// then walk `start..start+len`, masking eligible, not-yet-masked positions
/// until `floor(n_eligible · ratio)` are masked. Non-eligible positions in the
/// walk are skipped but use up span length.
///
/// `draws` holds `[rows, 100, 2]` uniforms in [0, 1).
pub fn span_mask(eligible: &[bool], length: usize, ratio: f64, draws: &[f32]) -> Vec<bool> {
    let mut chosen = vec![false; eligible.len()];
    for (row, (elig, out)) in eligible.chunks(length).zip(chosen.chunks_mut(length)).enumerate() {
        let positions: Vec<usize> = (0..length).filter(|&i| elig[i]).collect();
        let target = (positions.len() as f64 * ratio).floor() as usize;
        let mut masked = 0;
        for attempt in 0..SPAN_ATTEMPTS {
            if masked >= target {
                break;
            }
            let u = &draws[(row * SPAN_ATTEMPTS + attempt) * 2..][..2];
            let span = 3 + ((u[0] * 3.0) as usize).min(2);
            let start = positions[((u[1] * positions.len() as f32) as usize).min(positions.len() - 1)];
            for pos in start..(start + span).min(length) {
                if masked >= target {
                    break;
                }
                if elig[pos] && !out[pos] {
                    out[pos] = true;
                    masked += 1;
                }
            }
        }
    }
    chosen
}

/// A bool tensor's values on the host.
pub(crate) fn bool_vec<B: Backend, const D: usize>(t: Tensor<B, D, Bool>) -> Vec<bool> {
    t.into_data().convert::<bool>().to_vec::<bool>().expect("bool data")
}
