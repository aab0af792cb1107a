//! One forward entry point for either model class, with outputs named as the
//! reference's output dict. This is what `aam-rs forward` writes and what the
//! parity tests compare.

use std::collections::BTreeMap;

use aam_kernels::AttentionBackend;
use burn::prelude::*;

use crate::import::AamModel;
use crate::sequence_predictor::TargetPrediction;

/// ASV token ids `[B, S, L]` (0 = padding), with the slots that hold an
/// ASV when the caller knows them.
///
/// The ASV encoder runs only the slots that hold an ASV (most of a batch is
/// padding). Without the list it reads the ids back from the device to find
/// them: a wait for everything queued before, which stalls a GPU training
/// step. A caller that built the batch on the host passes the list
/// ([`AsvTokens::with_host_ids`]); a tensor alone converts with `into()`.
#[derive(Debug, Clone)]
pub struct AsvTokens<B: Backend> {
    /// The ids `[B, S, L]`.
    pub ids: Tensor<B, 3, Int>,
    /// The slots with a non-zero id, as flat indices `b·S + s`, ascending;
    /// `None`: found from `ids` on the device.
    pub non_empty: Option<Vec<i64>>,
}

impl<B: Backend> AsvTokens<B> {
    /// The ids with the non-empty slots found in `host_ids`, the same ids
    /// on the host (row-major `[B, S, L]`).
    ///
    /// # Panics
    /// If `host_ids` is not as long as `ids`.
    pub fn with_host_ids<T: Copy + Default + PartialEq>(
        ids: Tensor<B, 3, Int>,
        host_ids: &[T],
    ) -> Self {
        let [b, s, length] = ids.dims();
        assert_eq!(host_ids.len(), b * s * length, "host ids of another shape");
        let empty = T::default();
        let non_empty = host_ids
            .chunks(length.max(1))
            .enumerate()
            .filter(|(_, slot)| slot.iter().any(|&t| t != empty))
            .map(|(i, _)| i as i64)
            .collect();
        Self {
            ids,
            non_empty: Some(non_empty),
        }
    }
}

impl<B: Backend> AsvTokens<B> {
    /// `[B, S]`: true where a slot holds an ASV (any non-zero id), the
    /// reference's `asv_mask`.
    pub fn slot_mask(&self) -> Tensor<B, 2, Bool> {
        let [b, s, _] = self.ids.dims();
        self.ids.clone().greater_elem(0).any_dim(2).reshape([b, s])
    }
}

impl<B: Backend> From<Tensor<B, 3, Int>> for AsvTokens<B> {
    fn from(ids: Tensor<B, 3, Int>) -> Self {
        Self {
            ids,
            non_empty: None,
        }
    }
}

/// A model's inputs.
#[derive(Debug, Clone)]
pub struct ModelInput<B: Backend> {
    /// Tokens `[B, S, L]`.
    pub tokens: AsvTokens<B>,
    /// Counts `[B, S, 1]` (needed with a count embedding).
    pub counts: Option<Tensor<B, 3>>,
    /// Categorical ids, column → `[B]` (predictor only).
    pub categorical_ids: Option<BTreeMap<String, Tensor<B, 1, Int>>>,
}

/// One named output tensor.
#[derive(Debug, Clone)]
pub enum OutputTensor<B: Backend> {
    /// Rank-2 float.
    F2(Tensor<B, 2>),
    /// Rank-3 float.
    F3(Tensor<B, 3>),
    /// Rank-4 float.
    F4(Tensor<B, 4>),
    /// Rank-3 bool (`mask_indices`).
    Bool3(Tensor<B, 3, Bool>),
}

impl<B: AttentionBackend> OutputTensor<B> {
    /// Shape.
    pub fn shape(&self) -> Vec<usize> {
        match self {
            Self::F2(t) => t.dims().to_vec(),
            Self::F3(t) => t.dims().to_vec(),
            Self::F4(t) => t.dims().to_vec(),
            Self::Bool3(t) => t.dims().to_vec(),
        }
    }

    /// Host data.
    pub fn to_data(&self) -> TensorData {
        match self {
            Self::F2(t) => t.to_data(),
            Self::F3(t) => t.to_data(),
            Self::F4(t) => t.to_data(),
            Self::Bool3(t) => t.to_data(),
        }
    }

    /// `Σ self ⊙ weights` for float outputs (a scalar test function); None for bool.
    pub fn weighted_sum(&self, weights: &[f32]) -> Option<Tensor<B, 1>> {
        fn sum<B: Backend, const D: usize>(t: &Tensor<B, D>, w: &[f32]) -> Tensor<B, 1> {
            let w = Tensor::<B, D>::from_data(TensorData::new(w.to_vec(), t.dims()), &t.device());
            (t.clone() * w).sum()
        }
        match self {
            Self::F2(t) => Some(sum(t, weights)),
            Self::F3(t) => Some(sum(t, weights)),
            Self::F4(t) => Some(sum(t, weights)),
            Self::Bool3(_) => None,
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
                if let Some(t) = o.nuc_predictions {
                    out.push(("nuc_predictions", F4(t)));
                }
                if let Some(t) = o.mask_indices {
                    out.push(("mask_indices", Bool3(t)));
                }
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
                push2(&mut out, "base_prediction", o.base_prediction);
                push2(&mut out, "unifrac_pred", o.unifrac_pred);
                push2(&mut out, "faith_pred", o.faith_pred);
                push2(&mut out, "tax_pred", o.tax_pred);
                if let Some(t) = o.nuc_predictions {
                    out.push(("nuc_predictions", F4(t)));
                }
                if let Some(t) = o.mask_indices {
                    out.push(("mask_indices", Bool3(t)));
                }
            }
        }
        out
    }
}
