//! One forward entry point for either model class, with outputs named as the
//! reference's output dict. This is what `aam-rs forward` writes and what the
//! parity tests compare.

use std::collections::BTreeMap;

use aam_kernels::AttentionBackend;
use burn::prelude::*;

use crate::nn::bool_vec;

/// A batch's ASV token ids `[B, S, L]` (0 = padding), as the model reads them.
///
/// The ASV encoder runs only the slots that hold an ASV (most of a batch is
/// padding: samples have ~50-700 real ASVs out of `token_limit` slots). Three
/// ways in, cheapest last:
/// - a tensor alone (`into()`): the encoder finds the filled slots by reading
///   the ids back from the device, a wait for everything queued before it;
/// - [`AsvTokens::with_host_ids`]: the ids with the same ids on the host,
///   from which the filled slots are found without a read-back;
/// - [`AsvTokens::from_host`]: only the filled slots' rows `[M, L]` go to the
///   device, with the slot mask built on the host. Training uses this: at the
///   default shape it uploads ~0.25 MB instead of 5 MB and spares the host the
///   widening of 1.2 M ids every step, and nothing on the device ever touches
///   the padding slots' tokens.
#[derive(Debug, Clone)]
pub struct AsvTokens<B: Backend> {
    /// `[B, S, L]`.
    shape: [usize; 3],
    ids: SlotIds<B>,
}

#[derive(Debug, Clone)]
enum SlotIds<B: Backend> {
    /// Every slot's ids `[B, S, L]`; the filled slots when known.
    Dense {
        ids: Tensor<B, 3, Int>,
        non_empty: Option<Vec<i64>>,
    },
    /// The filled slots' ids `[M, L]` in slot order, and the slot mask `[B, S]`.
    Packed {
        rows: Tensor<B, 2, Int>,
        non_empty: Vec<i64>,
        slot_mask: Tensor<B, 2, Bool>,
    },
}

/// The flat indices `b·S + s` of the slots of `host_ids` (row-major, rows of
/// `length`) that hold a non-zero id.
fn filled_slots<T: Copy + Default + PartialEq>(host_ids: &[T], length: usize) -> Vec<i64> {
    let empty = T::default();
    host_ids
        .chunks(length.max(1))
        .enumerate()
        .filter(|(_, slot)| slot.iter().any(|&t| t != empty))
        .map(|(i, _)| i as i64)
        .collect()
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
        let shape = ids.dims();
        assert_eq!(
            host_ids.len(),
            shape.iter().product::<usize>(),
            "host ids of another shape"
        );
        let non_empty = filled_slots(host_ids, shape[2]);
        Self {
            shape,
            ids: SlotIds::Dense {
                ids,
                non_empty: Some(non_empty),
            },
        }
    }

    /// Host ids `[B, S, L]` (row-major) as the filled slots' rows on
    /// `device`, built in the device's integer type (Burn widens other types
    /// element by element), and the slot mask.
    ///
    /// # Panics
    /// If `host_ids` is not `B·S·L` long.
    pub fn from_host(host_ids: &[u8], shape: [usize; 3], device: &B::Device) -> Self {
        let [b, s, length] = shape;
        assert_eq!(host_ids.len(), b * s * length, "host ids of another shape");
        let non_empty = filled_slots(host_ids, length);
        let rows = non_empty
            .iter()
            .flat_map(|&slot| &host_ids[slot as usize * length..][..length]);
        let rows_shape = [non_empty.len(), length];
        let data = match burn::tensor::DType::from(
            burn::tensor::get_device_settings::<B>(device).int_dtype,
        ) {
            burn::tensor::DType::I32 => {
                TensorData::new(rows.map(|&t| i32::from(t)).collect::<Vec<_>>(), rows_shape)
            }
            burn::tensor::DType::I64 => {
                TensorData::new(rows.map(|&t| i64::from(t)).collect::<Vec<_>>(), rows_shape)
            }
            _ => TensorData::new(rows.copied().collect::<Vec<_>>(), rows_shape),
        };
        let mut mask = vec![false; b * s];
        for &slot in &non_empty {
            mask[slot as usize] = true;
        }
        Self {
            shape,
            ids: SlotIds::Packed {
                rows: Tensor::from_data(data, device),
                slot_mask: Tensor::from_data(TensorData::new(mask, [b, s]), device),
                non_empty,
            },
        }
    }

    /// `[B, S, L]`.
    pub fn dims(&self) -> [usize; 3] {
        self.shape
    }

    /// The device the ids are on.
    pub fn device(&self) -> B::Device {
        match &self.ids {
            SlotIds::Dense { ids, .. } => ids.device(),
            SlotIds::Packed { rows, .. } => rows.device(),
        }
    }

    /// The ids `[B, S, L]`, where the input holds all of them.
    pub fn ids(&self) -> Option<&Tensor<B, 3, Int>> {
        match &self.ids {
            SlotIds::Dense { ids, .. } => Some(ids),
            SlotIds::Packed { .. } => None,
        }
    }

    /// The filled slots as flat indices `b·S + s`, ascending, where known
    /// without reading the device.
    pub fn non_empty(&self) -> Option<&[i64]> {
        match &self.ids {
            SlotIds::Dense { non_empty, .. } => non_empty.as_deref(),
            SlotIds::Packed { non_empty, .. } => Some(non_empty),
        }
    }

    /// `[B, S]`: true where a slot holds an ASV (any non-zero id), the
    /// reference's `asv_mask`.
    pub fn slot_mask(&self) -> Tensor<B, 2, Bool> {
        let [b, s, _] = self.shape;
        match &self.ids {
            SlotIds::Dense { ids, .. } => ids.clone().greater_elem(0).any_dim(2).reshape([b, s]),
            SlotIds::Packed { slot_mask, .. } => slot_mask.clone(),
        }
    }

    /// The filled slots' ids `[M, L]` in slot order and their slots. A dense
    /// input without the list reads its ids back to find them (a sync).
    pub fn into_filled_rows(self) -> (Tensor<B, 2, Int>, Vec<i64>) {
        let [b, s, length] = self.shape;
        match self.ids {
            SlotIds::Packed {
                rows, non_empty, ..
            } => (rows, non_empty),
            SlotIds::Dense { ids, non_empty } => {
                let all = ids.reshape([b * s, length]);
                let non_empty = non_empty.unwrap_or_else(|| {
                    bool_vec(all.clone().greater_elem(0).any_dim(1))
                        .into_iter()
                        .enumerate()
                        .filter_map(|(i, keep)| keep.then_some(i as i64))
                        .collect()
                });
                let rows = if non_empty.len() == b * s {
                    all
                } else {
                    let device = all.device();
                    let index = Tensor::<B, 1, Int>::from_data(
                        TensorData::new(non_empty.clone(), [non_empty.len()]),
                        &device,
                    );
                    all.select(0, index)
                };
                (rows, non_empty)
            }
        }
    }
}

impl<B: Backend> From<Tensor<B, 3, Int>> for AsvTokens<B> {
    fn from(ids: Tensor<B, 3, Int>) -> Self {
        Self {
            shape: ids.dims(),
            ids: SlotIds::Dense {
                ids,
                non_empty: None,
            },
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
