//! §1.5 `ASVEncoder`: the nucleotide-level transformer. Each ASV slot is a row
//! of `L = max_bp + 1` tokens (START, then A/C/G/T = 1..4, 0 = padding); it is
//! embedded, encoded and attention-pooled into one D-vector per ASV.
//!
//! Only ASV slots with at least one non-padding token are encoded (the
//! reference gathers them the same way); empty slots get exactly zero hidden
//! states. That is also the ASV level's answer to padding: samples have ~50-700
//! real ASVs out of `token_limit` slots, so most rows are never computed.
//! Which slots those are comes with the input ([`AsvTokens`]) when the caller
//! built the batch on the host, as training does (which then uploads only
//! those rows); otherwise the encoder reads the ids back from the device once
//! per forward pass. The nucleotide logits stay packed ([`Nucleotides`]): the
//! loss scores the filled rows only, and the reference's `[B, S, L, V]` is
//! made on request.

use aam_kernels::{unpack_rows, AttentionBackend, RowSlots};
use burn::nn::Embedding;
use burn::prelude::*;
use burn::tensor::{DType, Distribution};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::attention::AttnImplementation;
use crate::embedding::{token_embedding, PositionEmbedding, PositionEmbeddingConfig};
use crate::nn::{Activation, Linear, LinearConfig};
use crate::output::AsvTokens;
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
    /// ASVs per chunk through the encoder at inference; None or 0 = all at
    /// once. Training always runs all at once (see `encode_rows`).
    /// Default: None.
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
    /// The nucleotide head's logits, when requested and the head exists.
    pub nucleotides: Option<Nucleotides<B>>,
}

/// The masked-nucleotide task's outputs for the filled ASV slots of a batch,
/// packed: one row per filled slot, in slot order.
///
/// The loss and the accuracy read these rows directly ([`Nucleotides::tokens`]
/// are their targets). The padding slots would add nothing to either (no
/// position of theirs is scored) but ~95% of the size at the default shape,
/// so their logits are only made for a caller that asks for the reference's
/// `[B, S, L, V]` ([`Nucleotides::unpacked_logits`]).
#[derive(Debug, Clone)]
pub struct Nucleotides<B: Backend> {
    /// Logits `[M, L, V]`.
    pub logits: Tensor<B, 3>,
    /// The uncorrupted ids `[M, L]`: the targets.
    pub tokens: Tensor<B, 2, Int>,
    /// The positions overwritten with MASK `[M, L]`, when masking ran.
    pub mask_indices: Option<Tensor<B, 2, Bool>>,
    /// `[1, L·V]`: an empty slot's logits at every position (the head's bias,
    /// what running its zero hidden state gives).
    empty_slot: Tensor<B, 2>,
    /// Where each row goes among the `B·S` slots.
    slots: RowSlots,
    /// `[B, S, L, V]`.
    shape: [usize; 4],
}

impl<B: AttentionBackend> Nucleotides<B> {
    /// The reference's `nuc_predictions [B, S, L, V]`.
    pub fn unpacked_logits(&self) -> Tensor<B, 4> {
        let [m, length, vocab] = self.logits.dims();
        unpack_rows(
            self.logits.clone().reshape([m, length * vocab]),
            self.empty_slot.clone(),
            &self.slots,
        )
        .reshape(self.shape)
    }

    /// The reference's `mask_indices [B, S, L]` (empty slots: none masked).
    pub fn unpacked_mask_indices(&self) -> Option<Tensor<B, 3, Bool>> {
        let [b, s, length, _] = self.shape;
        self.mask_indices.as_ref().map(|mask| {
            let device = mask.device();
            unpack_rows(
                mask.clone().float(),
                Tensor::zeros([1, length], &device),
                &self.slots,
            )
            .reshape([b, s, length])
            .greater_elem(0.5)
        })
    }
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

impl<B: AttentionBackend> AsvEncoder<B> {
    /// # Shapes
    /// - tokens: `[B, S, L]`
    /// - asv_embeddings: `[B, S, D]`; nucleotides: `[M, L, V]` for the M filled slots
    pub fn forward(
        &self,
        tokens: impl Into<AsvTokens<B>>,
        return_nucleotides: bool,
    ) -> AsvEncoderOutput<B> {
        let tokens = tokens.into();
        let [batch, slots, length] = tokens.dims();
        let device = tokens.device();
        // 1. one row per filled ASV slot
        let (rows, non_empty) = tokens.into_filled_rows();
        if B::ad_enabled(&device) {
            // The dense layers' row counts (tokens, ASV slots, samples), for a
            // program that compiles their kernels ahead (`aam_kernels::announce_rows`).
            // Their types: the transformer layers' under mixed precision, and
            // the model's own (embeddings, pooling, heads).
            let [n, length] = rows.dims();
            let model = <B::FloatElem as burn::tensor::Element>::dtype();
            let dtypes: Vec<DType> = crate::precision::compute_dtype()
                .into_iter()
                .chain([model])
                .collect();
            aam_kernels::announce_rows(&[n * length, batch * slots, batch], &dtypes);
        }
        // 2. masked-nucleotide corruption, training only
        let corrupt = B::ad_enabled(&device) && self.mask_ratio > 0.0 && return_nucleotides;
        let (corrupted, mask_indices) = if corrupt {
            let chosen = self.choose_masked(rows.clone());
            (
                rows.clone().mask_fill(chosen.clone(), MASK_TOKEN),
                Some(chosen),
            )
        } else {
            (rows.clone(), None)
        };
        // 3. valid = token > 0 (START and MASK count)
        let valid = corrupted.clone().greater_elem(0);
        // 4-7. encode, predict nucleotides and pool
        let packed = self.encode_rows(corrupted, valid, return_nucleotides);
        let d = packed.pooled.dims()[1];
        let row_slots = RowSlots::new(batch * slots, non_empty);
        // Empty slots: a zero hidden state pools to the norm's β and gives the
        // head's bias at every position, exactly what running them would give;
        // their gradients still reach β and the bias.
        let asv_embeddings = unpack_rows(
            packed.pooled,
            self.attention_pooling.norm.bias.val().reshape([1, d]),
            &row_slots,
        )
        .reshape([batch, slots, d]);
        let nucleotides = packed.nuc_logits.map(|logits| {
            let head = self.nucleotide_head.as_ref().expect("nucleotide head");
            let vocab = logits.dims()[2];
            let bias = match &head.bias {
                Some(bias) => bias.val().reshape([1, 1, vocab]),
                None => Tensor::zeros([1, 1, vocab], &device),
            };
            Nucleotides {
                logits,
                tokens: rows,
                mask_indices,
                empty_slot: bias.expand([1, length, vocab]).reshape([1, length * vocab]),
                slots: row_slots,
                shape: [batch, slots, length, vocab],
            }
        });
        AsvEncoderOutput {
            asv_embeddings,
            nucleotides,
        }
    }

    /// Runs the transformer, the nucleotide head and the pooling on the
    /// filled slots' rows `[M, L]`, in chunks of `asv_chunk_size`. Padding
    /// slots are most of a batch (samples have ~50-700 real ASVs out of
    /// `token_limit` slots), so no per-position tensor is ever made for them.
    fn encode_rows(
        &self,
        rows: Tensor<B, 2, Int>,
        valid: Tensor<B, 2, Bool>,
        return_nucleotides: bool,
    ) -> PackedRows<B> {
        let [n, length] = rows.dims();
        let device = rows.device();
        let head = self.nucleotide_head.as_ref().filter(|_| return_nucleotides);
        // Chunks bound memory only where each chunk's activations are freed
        // before the next runs (inference: validation, predict). In training
        // every chunk's activations are kept for the backward pass anyway, so
        // chunks would save nothing and multiply the launches (H100, reference
        // batch: 325 → 277 ms a step at the same live peak; docs/performance.md).
        let chunk = match self.asv_chunk_size {
            Some(c) if !B::ad_enabled(&device) => c,
            _ => n,
        }
        .max(1);
        let mut pooled = Vec::new();
        let mut logits = Vec::new();
        for start in (0..n).step_by(chunk) {
            let (rows, valid) = if chunk >= n {
                (rows.clone(), valid.clone())
            } else {
                let size = chunk.min(n - start);
                (
                    rows.clone().narrow(0, start, size),
                    valid.clone().narrow(0, start, size),
                )
            };
            let hidden = self.encode(rows, valid.clone());
            if let Some(head) = head {
                logits.push(head.forward(hidden.clone()));
            }
            pooled.push(self.attention_pooling.forward(hidden, Some(valid)));
        }
        let d = self.token_embedding.weight.dims()[1];
        PackedRows {
            pooled: cat_or_empty(pooled, [0, d], &device),
            nuc_logits: head.map(|head| {
                let vocab = head.weight.dims()[0];
                cat_or_empty(logits, [0, length, vocab], &device)
            }),
        }
    }

    /// token + position embedding, then the transformer with the padding mask.
    fn encode(&self, rows: Tensor<B, 2, Int>, valid: Tensor<B, 2, Bool>) -> Tensor<B, 3> {
        let x = self.position_embedding.forward(self.embed_tokens(rows));
        self.transformer.forward(x, Some(valid.bool_not()))
    }

    /// The token lookup, as a one-hot matrix times the table. Same values as
    /// `Embedding::forward`, but its gradient is a matmul: Burn's embedding
    /// backward is a `select_add` whose CubeCL kernel runs one thread per
    /// column of the table (128) over all N·L tokens (~300k a batch) in
    /// series. With the row packing above, the H100's step on the reference
    /// batch took 283 ms this way against 380 with `Embedding::forward`
    /// (2026-11-23, `docs/performance.md`).
    ///
    /// # Shapes
    /// - rows: `[N, L]` → `[N, L, D]`
    fn embed_tokens(&self, rows: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [n, length] = rows.dims();
        let table = self.token_embedding.weight.val();
        let [vocab, d] = table.dims();
        let classes = Tensor::<B, 1, Int>::arange(0..vocab as i64, &rows.device())
            .reshape([1, 1, vocab])
            .expand([n, length, vocab]);
        let one_hot = rows
            .reshape([n, length, 1])
            .expand([n, length, vocab])
            .equal(classes)
            .float();
        // `dense` for its backward: the table's gradient sums over all N·L
        // rows, which it does in parts (see `aam_kernels::dense`).
        aam_kernels::dense(
            one_hot.reshape([n * length, vocab]),
            table.transpose(),
            None,
        )
        .reshape([n, length, d])
    }

    /// Picks the positions to overwrite with MASK: only A/C/G/T (1..4).
    fn choose_masked(&self, rows: Tensor<B, 2, Int>) -> Tensor<B, 2, Bool> {
        let [n, length] = rows.dims();
        let device = rows.device();
        let eligible = rows
            .clone()
            .greater_elem(0)
            .bool_and(rows.lower_elem(START_TOKEN));
        match self.mask_strategy {
            // Where the backend has the seeded dropout kernel, the draw is its
            // mask over ones (dropped: masked), seeded from this thread's
            // counter: the backend's generator is one per process, and
            // data-parallel replicas draw on their own threads at once.
            MaskStrategy::Random if self.mask_ratio >= 1.0 => eligible,
            MaskStrategy::Random if aam_kernels::seeded_dropout_runs::<B>() => {
                let dropped = aam_kernels::dropout(
                    Tensor::<B, 2>::ones([n, length], &device),
                    aam_kernels::AttentionDropout {
                        prob: self.mask_ratio,
                        seed: crate::nn::next_dropout_seed(),
                    },
                )
                .equal_elem(0.0);
                eligible.bool_and(dropped)
            }
            MaskStrategy::Random => {
                let draw = Tensor::<B, 2>::random([n, length], Distribution::Default, &device);
                eligible.bool_and(draw.lower_elem(self.mask_ratio))
            }
            MaskStrategy::Span => {
                // Uniform draws on the host, seeded from this thread's mask
                // counter (as the seeded masks above).
                let mut rng = ChaCha8Rng::seed_from_u64(u64::from(crate::nn::next_dropout_seed()));
                let draws: Vec<f32> = (0..n * SPAN_ATTEMPTS * 2).map(|_| rng.random()).collect();
                let eligible_host = crate::nn::bool_vec(eligible);
                let chosen = span_mask(&eligible_host, length, self.mask_ratio, &draws);
                Tensor::from_data(TensorData::new(chosen, [n, length]), &device)
            }
        }
    }
}

/// The filled slots' results, packed.
struct PackedRows<B: Backend> {
    /// `[M, D]` for the M non-empty slots.
    pooled: Tensor<B, 2>,
    /// `[M, L, V]`, when the head ran.
    nuc_logits: Option<Tensor<B, 3>>,
}

/// `Tensor::cat` that accepts no parts (a batch of only empty slots).
fn cat_or_empty<B: Backend, const D: usize>(
    parts: Vec<Tensor<B, D>>,
    empty: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    if parts.is_empty() {
        Tensor::zeros(empty, device)
    } else {
        Tensor::cat(parts, 0)
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
    for (row, (elig, out)) in eligible
        .chunks(length)
        .zip(chosen.chunks_mut(length))
        .enumerate()
    {
        let positions: Vec<usize> = (0..length).filter(|&i| elig[i]).collect();
        let target = (positions.len() as f64 * ratio).floor() as usize;
        let mut masked = 0;
        for attempt in 0..SPAN_ATTEMPTS {
            if masked >= target {
                break;
            }
            let u = &draws[(row * SPAN_ATTEMPTS + attempt) * 2..][..2];
            let span = 3 + ((u[0] * 3.0) as usize).min(2);
            let start =
                positions[((u[1] * positions.len() as f32) as usize).min(positions.len() - 1)];
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

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};

    type Cpu = NdArray<f32>;
    type Train = Autodiff<Cpu>;

    /// 16 ASVs `[2, 8, 60]` of 60 tokens: START, 50 random nucleotides, 9
    /// padding; and one interior 0. The slots in `empty` are all 0.
    fn token_values(empty: &[usize]) -> Vec<i64> {
        let mut values = Vec::new();
        for row in 0..16i64 {
            values.push(START_TOKEN);
            values.extend((0..50).map(|i| 1 + (row * 7 + i * 13) % 4));
            values.extend([0; 9]);
        }
        values[5] = 0;
        for &slot in empty {
            values[60 * slot..60 * (slot + 1)].fill(0);
        }
        values
    }

    fn tokens<B: Backend>(device: &B::Device) -> Tensor<B, 3, Int> {
        Tensor::from_data(TensorData::new(token_values(&[]), [2, 8, 60]), device)
    }

    fn encoder<B: Backend>(strategy: MaskStrategy, device: &B::Device) -> AsvEncoder<B> {
        AsvEncoderConfig::new()
            .with_embedding_dim(16)
            .with_num_layers(1)
            .with_max_bp(59)
            .with_predict_nucleotides(true)
            .with_mask_ratio(0.3)
            .with_mask_strategy(strategy)
            .init(device)
    }

    #[test]
    fn random_masking_touches_only_nucleotides_at_the_ratio() {
        let device = Default::default();
        Train::seed(&device, 7);
        let enc = encoder::<Train>(MaskStrategy::Random, &device);
        let tokens = tokens::<Train>(&device);
        let mask = enc
            .forward(tokens.clone(), true)
            .nucleotides
            .and_then(|n| n.mask_indices)
            .expect("masking ran");
        let mask = crate::nn::bool_vec(mask);
        let toks = tokens.into_data().convert::<i64>().to_vec::<i64>().unwrap();
        let eligible = toks.iter().filter(|&&t| (1..=4).contains(&t)).count();
        for (m, t) in mask.iter().zip(&toks) {
            assert!(
                !m || (1..=4).contains(t),
                "masked a non-nucleotide token {t}"
            );
        }
        let ratio = mask.iter().filter(|&&m| m).count() as f64 / eligible as f64;
        assert!((ratio - 0.3).abs() < 0.05, "mask ratio {ratio}");
    }

    #[test]
    fn span_masking_makes_runs_of_three_to_five_at_the_target_count() {
        let length = 40;
        let eligible: Vec<bool> = (0..200 * length)
            .map(|i| i % length != 0 && i % length < 35)
            .collect();
        // deterministic pseudo-uniform draws
        let draws: Vec<f32> = (0..200 * SPAN_ATTEMPTS * 2)
            .map(|i| (i as f32 * 0.618_034) % 1.0)
            .collect();
        let chosen = span_mask(&eligible, length, 0.25, &draws);
        for (row_c, row_e) in chosen.chunks(length).zip(eligible.chunks(length)) {
            let n_eligible = row_e.iter().filter(|&&e| e).count();
            let masked = row_c.iter().filter(|&&c| c).count();
            assert_eq!(masked, (n_eligible as f64 * 0.25).floor() as usize);
            assert!(
                row_c.iter().zip(row_e).all(|(c, e)| !c || *e),
                "masked an ineligible position"
            );
        }
        // Span lengths: u0 picks 3 + floor(3·u0). The first attempt starts at 0;
        // every later one starts at 50 and re-covers the same span.
        let one_row = vec![true; 100];
        for (u0, span) in [(0.0f32, 3usize), (0.4, 4), (0.99, 5)] {
            let mut draws: Vec<f32> = (0..SPAN_ATTEMPTS).flat_map(|_| [0.0, 0.5]).collect();
            draws[0] = u0;
            draws[1] = 0.0;
            let chosen = span_mask(&one_row, 100, 0.5, &draws);
            let first_run = chosen.iter().take_while(|&&c| c).count();
            assert_eq!(first_run, span, "u0 = {u0}");
        }
    }

    #[test]
    fn no_masking_in_eval_or_without_nucleotides() {
        let device = Default::default();
        let enc = encoder::<Cpu>(MaskStrategy::Span, &device);
        assert!(
            enc.forward(tokens::<Cpu>(&device), true)
                .nucleotides
                .expect("nucleotides requested")
                .mask_indices
                .is_none(),
            "eval backend must not mask"
        );
        let train = encoder::<Train>(MaskStrategy::Random, &device);
        assert!(train
            .forward(tokens::<Train>(&device), false)
            .nucleotides
            .is_none());
    }

    #[test]
    fn empty_slots_are_skipped_and_chunking_changes_nothing() {
        let device = Default::default();
        let enc = encoder::<Cpu>(MaskStrategy::Random, &device);
        let values = token_values(&[3]); // slot 3 of sample 0 empty
        let tokens =
            Tensor::<Cpu, 3, Int>::from_data(TensorData::new(values.clone(), [2, 8, 60]), &device);
        let whole = enc.forward(tokens.clone(), true);
        // The caller's list of non-empty slots (no read-back) gives the same.
        let known = AsvTokens::with_host_ids(tokens.clone(), &values);
        let slots = known.non_empty().unwrap().to_vec();
        assert_eq!(slots.len(), 15, "16 slots, one empty");
        assert!(!slots.contains(&3), "slot 3 is empty");
        assert_eq!(
            enc.forward(known, true).asv_embeddings.into_data(),
            whole.asv_embeddings.clone().into_data()
        );
        let chunked = AsvEncoder {
            asv_chunk_size: Some(3),
            ..enc.clone()
        }
        .forward(tokens, true);
        whole
            .asv_embeddings
            .clone()
            .into_data()
            .assert_approx_eq::<f32>(
                &chunked.asv_embeddings.into_data(),
                burn::tensor::Tolerance::default(),
            );
        // The empty slot pools to the norm's β and its logits are the head's bias.
        // Only the filled rows are in the packed logits.
        let nucleotides = whole.nucleotides.unwrap();
        assert_eq!(nucleotides.logits.dims(), [15, 60, 7]);
        let logits = nucleotides
            .unpacked_logits()
            .narrow(0, 0, 1)
            .narrow(1, 3, 1)
            .reshape([60, 7]);
        let bias = enc
            .nucleotide_head
            .as_ref()
            .unwrap()
            .bias
            .as_ref()
            .unwrap()
            .val()
            .unsqueeze::<2>()
            .expand([60, 7]);
        logits
            .into_data()
            .assert_approx_eq::<f32>(&bias.into_data(), burn::tensor::Tolerance::default());
    }

    /// Only the filled rows uploaded (`AsvTokens::from_host`): the same
    /// embeddings, logits and targets as the whole `[B, S, L]` ids.
    #[test]
    fn filled_rows_from_the_host_equal_the_whole_ids() {
        let device = Default::default();
        let enc = encoder::<Cpu>(MaskStrategy::Random, &device);
        let values = token_values(&[3, 12, 13]);
        let host: Vec<u8> = values.iter().map(|&t| t as u8).collect();
        let whole = enc.forward(
            Tensor::<Cpu, 3, Int>::from_data(TensorData::new(values.clone(), [2, 8, 60]), &device),
            true,
        );
        let packed_tokens = AsvTokens::<Cpu>::from_host(&host, [2, 8, 60], &device);
        let mask = crate::nn::bool_vec(packed_tokens.slot_mask());
        assert_eq!(mask.iter().filter(|&&m| m).count(), 13);
        assert!(!mask[3] && !mask[12] && !mask[13] && mask[14]);
        let packed = enc.forward(packed_tokens, true);
        packed.asv_embeddings.into_data().assert_approx_eq::<f32>(
            &whole.asv_embeddings.into_data(),
            burn::tensor::Tolerance::default(),
        );
        let (a, b) = (packed.nucleotides.unwrap(), whole.nucleotides.unwrap());
        assert_eq!(a.tokens.dims(), [13, 60]);
        assert_eq!(a.tokens.to_data(), b.tokens.to_data());
        a.unpacked_logits().into_data().assert_approx_eq::<f32>(
            &b.unpacked_logits().into_data(),
            burn::tensor::Tolerance::default(),
        );
    }
}
