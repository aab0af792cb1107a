//! Data-parallel training in one process: one replica of the model per entry
//! of `--devices`, each running its shard of the global batch.
//!
//! **The step.** The global batch of `--batch-size` samples is cut into `N`
//! consecutive shards ([`Batch::shards`]). Replica `r` runs the forward pass
//! of shard `r` on its device. Each replica then offers the others ([`Offer`])
//! its sample embeddings `[B/N, D]` and the count of its scored nucleotide
//! positions. Each replica's backward pass starts from *its share of the
//! global batch's loss* ([`Shares`]), so that the replicas' gradients summed
//! ([`all_reduce`]) are the gradient of the loss of the whole batch on one
//! device. Every replica then takes the same optimiser step on the same
//! summed gradients, which keeps the replicas identical.
//!
//! The replicas run one after another on the training thread (every forward
//! pass, then every backward pass, then every optimiser step). Kernel
//! launches are asynchronous, so replicas on different GPUs compute at the
//! same time, but their host work adds up. No tensor crosses a thread:
//! Burn 0.21's fusion streams are per thread and lose track of tensors used
//! on another (measured: a panic in `burn-fusion`'s stream ordering).
//!
//! **Shares.** Each loss term is a mean with its own denominator: samples
//! (target loss), class weights (class-weighted NLL), filled ASV slots
//! (count loss), scored nucleotide positions (nucleotide loss), sample pairs
//! (UniFrac). A replica's term is its own mean times its share of the
//! denominator: `mean_r · n_r / Σ n`. The denominators known on the host
//! come from the shard's batch; the nucleotide positions (drawn by masking on
//! the device) come with the offers.
//!
//! **UniFrac pairs** ([`UnifracPairs`]). `global`: every replica computes the
//! UniFrac loss over all `B(B−1)/2` pairs of the global batch, from the
//! gathered embeddings in which only its own rows carry gradient: its
//! backward pass yields exactly its rows' part of the gradient, and the sum
//! over replicas is the full gradient (the reference's DataParallel loss,
//! and its FSDP pretraining loss with every pair kept). `local`: pairs
//! within a shard only, the reference's DDP (and masked FSDP) loss: the mean
//! of squared errors over the pairs inside the shards.
//!
//! **Collectives.** Gradients are summed on the first replica's device and
//! the sum copied back to each device, gradient by gradient (a move between
//! devices that Burn's `to_device` performs: on CUDA, CubeCL 0.10 moves it
//! with an NCCL send and receive; on the other runtimes through the host;
//! nothing at all for replicas sharing one device). The sum runs in rank
//! order, so a run repeats bit for bit.

use std::collections::BTreeMap;

use aam_data::Batch;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::loss::{BaseLoss, LossConfig, LossParts};
use crate::optim::GradientBuffer;

/// Which sample pairs enter the UniFrac loss of a data-parallel step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnifracPairs {
    /// Every pair of the global batch (the single-device loss).
    #[default]
    Global,
    /// Pairs within each replica's shard (the reference's DDP loss).
    Local,
}

/// Checks that a global batch of `batch_size` samples splits into
/// `replicas` shards of the same, even size (the UniFrac loss compares
/// pairs within a shard in `local` mode; `global` keeps the rule so that a
/// run can switch).
pub fn check_shards(batch_size: usize, replicas: usize) -> Result<()> {
    if replicas == 0 {
        return Err(TrainError::arg("devices", "names no device"));
    }
    if batch_size % replicas != 0 || (batch_size / replicas) % 2 == 1 {
        return Err(TrainError::arg(
            "batch-size",
            format!(
                "the global batch of {batch_size} samples does not split into {replicas} even \
                 shards, one per --devices entry: use a multiple of {}",
                2 * replicas
            ),
        ));
    }
    Ok(())
}

/// A replica's share of each loss term's denominator, known on the host
/// from the shards' batches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shares {
    /// Samples: `b_r / B` (regression targets, non-UniFrac base losses).
    pub samples: f64,
    /// Class weights of the shard's labels over the batch's (a
    /// class-weighted NLL); `samples` without class weights.
    pub classes: f64,
    /// Filled ASV slots (count loss).
    pub slots: f64,
    /// Sample pairs within the shard over the pairs within all shards
    /// (`local` UniFrac).
    pub pairs: f64,
}

impl Shares {
    /// The whole batch on one device.
    pub const WHOLE: Shares = Shares {
        samples: 1.0,
        classes: 1.0,
        slots: 1.0,
        pairs: 1.0,
    };

    /// The shares of each shard of one global batch; `class_weights` of a
    /// classifier (labels are the batch targets).
    pub fn of(shards: &[Batch], class_weights: Option<&[f64]>) -> Vec<Shares> {
        let ratio = |part: f64, whole: f64| if whole > 0.0 { part / whole } else { 0.0 };
        let samples: Vec<f64> = shards.iter().map(|s| s.batch_size() as f64).collect();
        let slots: Vec<f64> = shards.iter().map(|s| s.occupied_slots() as f64).collect();
        let pairs: Vec<f64> = samples.iter().map(|b| b * (b - 1.0) / 2.0).collect();
        let classes: Vec<f64> = shards
            .iter()
            .zip(&samples)
            .map(|(shard, &b)| match (class_weights, &shard.targets) {
                (Some(w), Some(labels)) => labels
                    .iter()
                    .map(|&c| w.get(c as usize).copied().unwrap_or(1.0))
                    .sum(),
                _ => b,
            })
            .collect();
        let total = |v: &[f64]| v.iter().sum::<f64>();
        (0..shards.len())
            .map(|r| Shares {
                samples: ratio(samples[r], total(&samples)),
                classes: ratio(classes[r], total(&classes)),
                slots: ratio(slots[r], total(&slots)),
                pairs: ratio(pairs[r], total(&pairs)),
            })
            .collect()
    }
}

/// How a replica's loss terms are weighted: for its backward pass
/// (`objective`) and for the logs (`report`: the replicas' reported values
/// sum to the global batch's).
pub(crate) struct TermScales<B: Backend> {
    unifrac: f64,
    nuc: Option<Tensor<B, 1>>,
    count: f64,
    target: f64,
}

impl<B: Backend> TermScales<B> {
    /// The objective's and the report's scales of replica `rank` of
    /// `replicas`; `nuc_share` is its share of the scored nucleotide
    /// positions (from the exchange).
    pub(crate) fn of(
        loss: &LossConfig,
        pairs: UnifracPairs,
        classifier: bool,
        shares: Shares,
        replicas: usize,
        nuc_share: Option<Tensor<B, 1>>,
    ) -> (Self, Self) {
        let target = if classifier {
            shares.classes
        } else {
            shares.samples
        };
        let (objective_base, report_base) = match (loss.base, pairs) {
            // The whole batch's pairs on every replica: its gradient reaches
            // only the replica's own rows, and its value is counted once.
            (BaseLoss::Unifrac, UnifracPairs::Global) => (1.0, 1.0 / replicas as f64),
            (BaseLoss::Unifrac, UnifracPairs::Local) => (shares.pairs, shares.pairs),
            (BaseLoss::Mse, _) => (shares.samples, shares.samples),
        };
        let scales = |unifrac| TermScales {
            unifrac,
            nuc: nuc_share.clone(),
            count: shares.slots,
            target,
        };
        (scales(objective_base), scales(report_base))
    }

    /// `parts` with each term scaled, and their weighted total.
    pub(crate) fn apply(&self, loss: &LossConfig, parts: &LossParts<B>) -> LossParts<B> {
        let scale = |p: &Option<Tensor<B, 1>>, s: f64| p.as_ref().map(|p| p.clone() * s);
        let nuc = match (&parts.nuc, &self.nuc) {
            (Some(p), Some(s)) => Some(p.clone() * s.clone()),
            (p, _) => p.clone(),
        };
        let unifrac = scale(&parts.unifrac, self.unifrac);
        let count = scale(&parts.count, self.count);
        let target = scale(&parts.target, self.target);
        let total = loss.total(
            unifrac.as_ref(),
            nuc.as_ref(),
            count.as_ref(),
            target.as_ref(),
            &parts.total.device(),
        );
        LossParts {
            total,
            unifrac,
            nuc,
            count,
            target,
        }
    }
}

/// What a replica hands the others mid-step (on the inner backend, without
/// autodiff: the values only).
#[derive(Clone, Debug)]
pub(crate) struct Offer<B: Backend> {
    /// Its sample embeddings `[B/N, D]` (`global` UniFrac pairs).
    pub embeddings: Option<Tensor<B, 2>>,
    /// Its scored nucleotide positions `[1]`.
    pub nuc_positions: Option<Tensor<B, 1>>,
}

impl<B: Backend> Offer<B> {
    /// The offer on `device` (nothing moves when it is there already).
    pub(crate) fn to_device(&self, device: &B::Device) -> Self {
        Offer {
            embeddings: self.embeddings.clone().map(|e| e.to_device(device)),
            nuc_positions: self.nuc_positions.clone().map(|n| n.to_device(device)),
        }
    }
}

/// The global batch's embeddings `[B, D]` for replica `rank`: the others'
/// as constants, its own `own` (with its autodiff graph) in its place.
pub(crate) fn gathered_embeddings<AB: AutodiffBackend>(
    offers: &[Offer<AB::InnerBackend>],
    rank: usize,
    own: Tensor<AB, 2>,
) -> Tensor<AB, 2> {
    let mut own = Some(own);
    let rows = offers
        .iter()
        .enumerate()
        .map(|(r, offer)| {
            if r == rank {
                own.take().expect("one own shard")
            } else {
                Tensor::from_inner(
                    offer
                        .embeddings
                        .clone()
                        .expect("every replica offers embeddings"),
                )
            }
        })
        .collect();
    Tensor::cat(rows, 0)
}

/// Replica `rank`'s share of the scored nucleotide positions,
/// `n_rank / max(Σ n, 1)`, as a constant `[1]`.
pub(crate) fn nucleotide_share<AB: AutodiffBackend>(
    offers: &[Offer<AB::InnerBackend>],
    rank: usize,
) -> Option<Tensor<AB, 1>> {
    let counts: Vec<Tensor<AB::InnerBackend, 1>> = offers
        .iter()
        .map(|o| o.nuc_positions.clone())
        .collect::<Option<_>>()?;
    let total = counts.iter().cloned().reduce(|a, b| a + b)?.clamp_min(1.0);
    Some(Tensor::from_inner(counts[rank].clone() / total))
}

/// Sums the replicas' gradients and gives every replica the sum on its own
/// device. The sum runs on `devices[0]` in rank order.
///
/// Gradient by gradient: concatenating them into one flat tensor per replica
/// (one move each way instead of one per parameter) cost more than it saved
/// where it was measured, two replicas on one H200 (83 against 53 ms a
/// step: a copy into the flat tensor and a slice out of it for each of the
/// ~270 gradients, each a kernel the host queues).
pub fn all_reduce<B: Backend>(buffers: &mut [GradientBuffer<B>], devices: &[B::Device]) {
    if buffers.len() < 2 {
        return;
    }
    let sums: BTreeMap<String, _> = buffers[0]
        .keys()
        .map(|key| {
            let sum = buffers
                .iter()
                .filter_map(|b| b.get(key))
                .map(|g| B::float_to_device(g.clone(), &devices[0]))
                .reduce(B::float_add)
                .expect("the first buffer has it");
            (key.clone(), sum)
        })
        .collect();
    for (buffer, device) in buffers.iter_mut().zip(devices) {
        *buffer = GradientBuffer::from_map(
            sums.iter()
                .map(|(k, g)| (k.clone(), B::float_to_device(g.clone(), device)))
                .collect(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::unifrac_loss;
    use burn::backend::NdArray;
    use burn::tensor::ops::FloatTensorOps;
    use burn::tensor::TensorMetadata;

    type B = NdArray<f32>;

    /// `local` pairs: the replicas' reported UniFrac terms sum to the
    /// reference's masked loss over the gathered batch (squared errors of
    /// the pairs within a shard, over their number); `global`: to the loss
    /// of the whole batch.
    #[test]
    fn unifrac_shares_match_the_reference_losses() {
        let device = Default::default();
        let (b, d, n) = (8, 3, 2);
        let e: Vec<f32> = (0..b * d)
            .map(|k| ((k * 37 % 11) as f32) * 0.7 - 3.0)
            .collect();
        let t: Vec<f32> = (0..b * b)
            .map(|k| {
                let (i, j) = (k / b, k % b);
                if i == j {
                    0.0
                } else {
                    0.1 + 0.8 * (((i + j) * 13 % 7) as f32) / 7.0
                }
            })
            .collect();
        let emb = Tensor::<B, 2>::from_data(TensorData::new(e, [b, d]), &device);
        let target = Tensor::<B, 2>::from_data(TensorData::new(t.clone(), [b, b]), &device);
        // The reference's masked loss: the pairs i < j inside one shard.
        let predicted = crate::loss::pairwise_tanh_distances(emb.clone())
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        let (mut sum, mut pairs) = (0.0f64, 0.0f64);
        for i in 0..b {
            for j in i + 1..b {
                if i / (b / n) == j / (b / n) {
                    sum += ((predicted[i * b + j] - t[i * b + j]) as f64).powi(2);
                    pairs += 1.0;
                }
            }
        }
        let masked = sum / pairs;
        let whole = unifrac_loss(emb.clone(), target.clone()).into_scalar() as f64;

        let loss = LossConfig::default();
        let size = b / n;
        let shares = Shares {
            samples: 0.5,
            classes: 0.5,
            slots: 0.5,
            pairs: 0.5,
        };
        let (mut local, mut global) = (0.0, 0.0);
        for r in 0..n {
            let own = emb.clone().narrow(0, r * size, size);
            let own_target = target
                .clone()
                .narrow(0, r * size, size)
                .narrow(1, r * size, size);
            let local_part = unifrac_loss(own, own_target);
            let parts = |u: Tensor<B, 1>| LossParts {
                total: u.clone(),
                unifrac: Some(u),
                nuc: None,
                count: None,
                target: None,
            };
            for (mode, part, acc) in [
                (UnifracPairs::Local, local_part, &mut local),
                (
                    UnifracPairs::Global,
                    unifrac_loss(emb.clone(), target.clone()),
                    &mut global,
                ),
            ] {
                let (_, report) = TermScales::<B>::of(&loss, mode, false, shares, n, None);
                let reported = report.apply(&loss, &parts(part));
                *acc += reported.unifrac.unwrap().into_scalar() as f64;
            }
        }
        assert!(
            (local - masked).abs() < 1e-6 * masked,
            "{local} vs {masked}"
        );
        assert!((global - whole).abs() < 1e-6 * whole, "{global} vs {whole}");
        assert!(
            (masked - whole).abs() > 1e-3,
            "the fixture must tell the modes apart"
        );
    }

    /// Every replica ends with the sum in each gradient's shape, also when
    /// a replica lacks one of the gradients.
    #[test]
    fn all_reduce_gives_every_replica_the_sum() {
        let device = Default::default();
        let grad = |values: &[f32], shape: Vec<usize>| {
            let flat = Tensor::<B, 1>::from_floats(values, &device);
            B::float_reshape(flat.into_primitive().tensor(), Shape::from(shape))
        };
        let buffer = |scale: f32, with_bias: bool| {
            let mut map = BTreeMap::new();
            let w: Vec<f32> = (0..6).map(|k| scale * k as f32).collect();
            map.insert("w".to_string(), grad(&w, vec![2, 3]));
            if with_bias {
                map.insert("b".to_string(), grad(&[scale, -scale], vec![2]));
            }
            GradientBuffer::<B>::from_map(map)
        };
        let devices = [device, device, device];
        for with_bias in [true, false] {
            let mut buffers = [
                buffer(1.0, true),
                buffer(10.0, with_bias),
                buffer(100.0, true),
            ];
            all_reduce(&mut buffers, &devices);
            for b in &buffers {
                let host = b.to_host();
                let w: Vec<f32> = (0..6).map(|k| 111.0 * k as f32).collect();
                assert_eq!(host["w"], w);
                let bias = if with_bias { 111.0 } else { 101.0 };
                assert_eq!(host["b"], vec![bias, -bias]);
                assert_eq!(b.get("w").unwrap().shape(), Shape::new([2, 3]));
            }
        }
    }

    #[test]
    fn uneven_or_odd_shards_are_refused() {
        assert!(check_shards(8, 2).is_ok());
        assert!(check_shards(8, 4).is_ok());
        for (b, n) in [(8, 3), (6, 2), (8, 0)] {
            let err = check_shards(b, n).unwrap_err().to_string();
            assert!(
                err.contains("batch-size") || err.contains("devices"),
                "{err}"
            );
        }
    }
}
