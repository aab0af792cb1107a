//! Data-parallel training in one process: one replica of the model per entry
//! of `--devices`, each running its shard of the global batch on its own
//! thread (see `replica.rs` for the threads).
//!
//! **The step.** The global batch of `--batch-size` samples is cut into `N`
//! consecutive shards ([`Batch::shards`]). Replica `r` runs the forward pass
//! of shard `r` on its device. The replicas then sum (`Exchanged`) their
//! sample embeddings, each in its rows of a zero `[B, D]` (which gathers the
//! batch), and their counts of scored nucleotide positions. Each replica's
//! backward pass starts from *its share of the global batch's loss*
//! ([`Shares`]), so that the replicas' gradients summed
//! (`Group::sum_gradients`) are the gradient of the loss of the whole
//! batch on one device. Every replica then takes the same optimiser step on
//! the same summed gradients, which keeps the replicas identical.
//!
//! **Shares.** Each loss term is a mean with its own denominator: samples
//! (target loss), class weights (class-weighted NLL), filled ASV slots
//! (count loss), scored nucleotide positions (nucleotide loss), sample pairs
//! (UniFrac). A replica's term is its own mean times its share of the
//! denominator: `mean_r · n_r / Σ n`. The denominators known on the host
//! come from the shard's batch; the nucleotide positions (drawn by masking on
//! the device) are summed with the embeddings.
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
//! **Collectives** (`Group`). On CUDA with one replica per GPU, every sum
//! is an NCCL all-reduce, one per tensor, queued on each GPU's
//! communication stream behind its compute (`RuntimeOps::collective_sum`;
//! under Burn's fusion backend, one custom op per sum); no thread waits for
//! another. Elsewhere (HIP, wgpu, the CPU backends, and
//! replicas that share a device) each replica reads its tensors to the host
//! in one read, and `HostExchange` adds them in rank order, so a run
//! repeats bit for bit. Which gradients exist is agreed through the host
//! first (a parameter may have none on a shard), so every replica sums the
//! same tensors in the same order.
//!
//! Across processes ([`crate::world`]) without NCCL, each process sums its
//! replicas through the host as above, and `HostExchange` all-reduces that
//! sum with the other processes' (`burn-collective`, `collective.rs`).
//! With NCCL (CUDA), every replica is a rank of one NCCL
//! communicator over all of them, and every sum goes through it
//! (`RuntimeOps::process_group_sum`); which gradients exist is then not
//! agreed through the host (a read would drain each GPU's queue mid-step):
//! every parameter is summed, with each replica's flags beside them, and
//! the flags' agreement is read at the epoch's end.
//!
//! Point-to-point moves between GPUs (`to_device`, an NCCL send and receive
//! in CubeCL 0.10) are not used: without `CUDA_LAUNCH_BLOCKING` they failed
//! with `CUDA_ERROR_ILLEGAL_ADDRESS` in f32 runs on two H200s (2026-11-29).

use std::sync::{Arc, Condvar, Mutex};

use aam_data::Batch;
use aam_models::AttentionBackend;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, TensorMetadata, TensorPrimitive};
use serde::{Deserialize, Serialize};

use crate::collective::ProcessSum;
use crate::error::{Result, TrainError};
use crate::loss::{BaseLoss, LossConfig, LossParts};
use crate::optim::GradientBuffer;

/// Whether replicas on `devices` sum on the devices (NCCL on CUDA, one
/// replica per GPU) rather than through the host.
pub fn sums_on_devices<B: AttentionBackend>(devices: &[B::Device]) -> bool {
    use burn::tensor::backend::DeviceOps;
    let mut ids: Vec<_> = devices.iter().map(DeviceOps::id).collect();
    ids.sort();
    ids.dedup();
    B::has_collectives() && ids.len() == devices.len()
}

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

/// What a replica learns from the others mid-step, between its forward and
/// backward passes (on the inner backend, without autodiff: values only).
pub(crate) struct Exchanged<B: Backend> {
    /// The global batch's sample embeddings `[B, D]` (`global` UniFrac pairs).
    pub embeddings: Option<Tensor<B, 2>>,
    /// The replica's share of the scored nucleotide positions `[1]`,
    /// `n_rank / max(Σ n, 1)`.
    pub nuc_share: Option<Tensor<B, 1>>,
}

impl<B: AttentionBackend> Exchanged<B> {
    /// Sums over the replicas what each offers: its embeddings `own [B/N, D]`
    /// in its rows of a zero `[B, D]` (the sum gathers the batch), and its
    /// count of scored nucleotide positions `[1]`.
    pub(crate) fn exchange(
        group: &Group<B>,
        own: Option<Tensor<B, 2>>,
        nuc_positions: Option<Tensor<B, 1>>,
    ) -> Result<Self> {
        let (rank, replicas) = (group.rank, group.replicas());
        let padded = own.map(|own| {
            let [b, d] = own.dims();
            let device = own.device();
            let zeros = |rows: usize| Tensor::<B, 2>::zeros([rows, d], &device).cast(own.dtype());
            let mut rows = Vec::with_capacity(3);
            if rank > 0 {
                rows.push(zeros(rank * b));
            }
            rows.push(own.clone());
            if rank + 1 < replicas {
                rows.push(zeros((replicas - rank - 1) * b));
            }
            Tensor::cat(rows, 0)
        });
        let mut parts = Vec::new();
        parts.extend(padded.clone().map(|e| e.into_primitive().tensor()));
        parts.extend(nuc_positions.clone().map(|n| n.into_primitive().tensor()));
        let mut sums = group.sum(parts)?.into_iter();
        let embeddings = padded
            .map(|_| Tensor::from_primitive(TensorPrimitive::Float(sums.next().expect("summed"))));
        let nuc_share = nuc_positions.map(|own| {
            let total: Tensor<B, 1> =
                Tensor::from_primitive(TensorPrimitive::Float(sums.next().expect("summed")));
            own / total.clamp_min(1.0)
        });
        Ok(Self {
            embeddings,
            nuc_share,
        })
    }
}

/// The global batch's embeddings `[B, D]` for replica `rank` from all
/// replicas' (`all`, constants): its own rows replaced by `own` (with its
/// autodiff graph).
pub(crate) fn gathered_embeddings<AB: AutodiffBackend>(
    all: Tensor<AB::InnerBackend, 2>,
    rank: usize,
    own: Tensor<AB, 2>,
) -> Tensor<AB, 2> {
    let total = all.dims()[0];
    let b = own.dims()[0];
    let start = rank * b;
    let mut rows = Vec::with_capacity(3);
    if start > 0 {
        rows.push(Tensor::from_inner(all.clone().narrow(0, 0, start)));
    }
    rows.push(own);
    if start + b < total {
        rows.push(Tensor::from_inner(all.narrow(
            0,
            start + b,
            total - start - b,
        )));
    }
    Tensor::cat(rows, 0)
}

/// A rendezvous of the replicas' threads that sums host vectors: each
/// replica hands in its part and gets the sum of all parts, added in rank
/// order (so a run repeats bit for bit). Across processes without NCCL the
/// process's sum is then summed with the other processes' ([`ProcessSum`]).
/// [`HostExchange::abort`] releases every waiting replica with an error (a
/// replica that failed will not come).
pub(crate) struct HostExchange {
    replicas: usize,
    state: Mutex<ExchangeState>,
    ready: Condvar,
    across: Option<ProcessSum>,
}

struct ExchangeState {
    /// Completed exchanges.
    round: u64,
    parts: Vec<Option<Vec<f32>>>,
    arrived: usize,
    sum: Arc<Vec<f32>>,
    aborted: bool,
}

impl HostExchange {
    pub(crate) fn new(replicas: usize) -> Self {
        Self {
            replicas,
            state: Mutex::new(ExchangeState {
                round: 0,
                parts: vec![None; replicas],
                arrived: 0,
                sum: Arc::new(Vec::new()),
                aborted: false,
            }),
            ready: Condvar::new(),
            across: None,
        }
    }

    /// The exchange of this process's `replicas` in a run of several
    /// processes that sum through the host: every sum also crosses them.
    pub(crate) fn across_processes(replicas: usize, across: ProcessSum) -> Self {
        Self {
            across: Some(across),
            ..Self::new(replicas)
        }
    }

    /// Whether its sums cross processes (`burn-collective`).
    pub(crate) fn crosses_processes(&self) -> bool {
        self.across.is_some()
    }

    /// Leaves the processes' collective, at the run's end.
    pub(crate) fn finish(&self) {
        if let Some(across) = &self.across {
            across.finish();
        }
    }

    /// The sum over the replicas of their `part`s (of one length), once
    /// every replica has handed in its own.
    pub(crate) fn sum(&self, rank: usize, part: Vec<f32>) -> Result<Arc<Vec<f32>>> {
        let aborted = || TrainError::Replica {
            rank,
            reason: "another replica stopped with an error".into(),
        };
        let mut state = self.state.lock().map_err(|_| aborted())?;
        if state.aborted {
            return Err(aborted());
        }
        let round = state.round;
        state.parts[rank] = Some(part);
        state.arrived += 1;
        if state.arrived == self.replicas {
            let mut parts = state.parts.iter_mut().map(|p| p.take().unwrap_or_default());
            let mut sum = parts.next().unwrap_or_default();
            for part in parts {
                if part.len() != sum.len() {
                    state.aborted = true;
                    self.ready.notify_all();
                    return Err(TrainError::Replica {
                        rank,
                        reason: format!(
                            "the replicas exchanged {} and {} values in one sum",
                            sum.len(),
                            part.len()
                        ),
                    });
                }
                sum.iter_mut().zip(&part).for_each(|(s, p)| *s += p);
            }
            if let Some(across) = &self.across {
                // The other replicas wait on `ready` (the lock is theirs
                // again only once this sum is in).
                sum = match across.sum(sum) {
                    Ok(sum) => sum,
                    Err(e) => {
                        state.aborted = true;
                        self.ready.notify_all();
                        return Err(e);
                    }
                };
            }
            state.sum = Arc::new(sum);
            state.arrived = 0;
            state.round += 1;
            self.ready.notify_all();
            return Ok(state.sum.clone());
        }
        while state.round == round && !state.aborted {
            state = self.ready.wait(state).map_err(|_| aborted())?;
        }
        if state.round == round {
            return Err(aborted());
        }
        Ok(state.sum.clone())
    }

    /// Releases every replica waiting in [`HostExchange::sum`], and refuses
    /// later sums.
    pub(crate) fn abort(&self) {
        if let Ok(mut state) = self.state.lock() {
            state.aborted = true;
        }
        self.ready.notify_all();
    }
}

/// One replica's handle on the others: sums of tensors over the replicas,
/// on the devices where the runtime has collectives (NCCL on CUDA), else
/// through the host ([`HostExchange`]); over a process group where the
/// replicas are in several processes ([`crate::world`]).
pub(crate) struct Group<B: Backend> {
    /// The replica's rank among all replicas of the run (its shard).
    pub(crate) rank: usize,
    /// Its index among this process's replicas.
    pub(crate) local: usize,
    /// All replicas of the run, in every process.
    pub(crate) replicas: usize,
    /// This process's replicas' devices, by local index.
    pub(crate) devices: Arc<Vec<B::Device>>,
    /// The sums of this process's replicas on the host.
    pub(crate) host: Arc<HostExchange>,
    /// Whether the replicas are in several processes.
    pub(crate) processes: bool,
    /// Across processes: the parameters (summed over the steps) whose
    /// gradient this replica had and another had not, or the reverse, still
    /// on the device ([`Group::check_agreement`]).
    pub(crate) disagreements: Option<Tensor<B, 1>>,
}

impl<B: AttentionBackend> Group<B> {
    pub(crate) fn replicas(&self) -> usize {
        self.replicas
    }

    pub(crate) fn device(&self) -> &B::Device {
        &self.devices[self.local]
    }

    /// Whether the replicas sum over the runtime's process group (NCCL
    /// across processes), rather than through the host (which crosses
    /// processes with `burn-collective` where it must).
    fn process_group(&self) -> bool {
        self.processes && !self.host.crosses_processes()
    }

    /// Each tensor (on this replica's device) summed over the replicas, in
    /// its shape and dtype. Every replica calls with the same shapes in the
    /// same order.
    pub(crate) fn sum(&self, tensors: Vec<FloatTensor<B>>) -> Result<Vec<FloatTensor<B>>> {
        if self.replicas() < 2 || tensors.is_empty() {
            return Ok(tensors);
        }
        if self.process_group() {
            return B::process_group_sum(tensors, self.device()).ok_or_else(|| {
                TrainError::Replica {
                    rank: self.rank,
                    reason: "its device joined no process group".into(),
                }
            });
        }
        if B::has_collectives() {
            if let Some(sums) = B::collective_sum(tensors.clone(), &self.devices) {
                return Ok(sums);
            }
        }
        let device = self.device();
        let like: Vec<(Shape, DType)> = tensors.iter().map(|t| (t.shape(), t.dtype())).collect();
        let flat: Vec<Tensor<B, 1>> = tensors
            .into_iter()
            .map(|t| {
                let n = t.shape().num_elements();
                Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(
                    t,
                    Shape::new([n]),
                )))
                .cast(DType::F32)
            })
            .collect();
        let host = Tensor::cat(flat, 0)
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| TrainError::Replica {
                rank: self.rank,
                reason: format!("reading its values for a sum: {e:?}"),
            })?;
        let sum = self.host.sum(self.local, host)?;
        let sum = Tensor::<B, 1>::from_data(TensorData::new(sum.to_vec(), [sum.len()]), device);
        let mut offset = 0;
        Ok(like
            .into_iter()
            .map(|(shape, dtype)| {
                let n = shape.num_elements();
                let part = sum.clone().narrow(0, offset, n).cast(dtype);
                offset += n;
                B::float_reshape(part.into_primitive().tensor(), shape)
            })
            .collect())
    }

    /// Sums the replicas' gradients: every replica ends with the sum of the
    /// gradients of the parameters that any replica has one for (in rank
    /// order where summed on the host). Which parameters have gradients is
    /// agreed through the host first: the device sums must match.
    pub(crate) fn sum_gradients(
        &mut self,
        buffer: &mut GradientBuffer<B>,
        parameters: &[(String, Vec<usize>)],
    ) -> Result<()> {
        if self.replicas() < 2 {
            return Ok(());
        }
        let have: Vec<f32> = parameters
            .iter()
            .map(|(key, _)| f32::from(u8::from(buffer.get(key).is_some())))
            .collect();
        if self.process_group() {
            return self.sum_gradients_across_processes(buffer, parameters, have);
        }
        let anyone = self.host.sum(self.local, have)?;
        let device = self.device();
        let keys: Vec<&(String, Vec<usize>)> = parameters
            .iter()
            .zip(anyone.iter())
            .filter(|(_, &n)| n > 0.0)
            .map(|(p, _)| p)
            .collect();
        let tensors = keys
            .iter()
            .map(|(key, shape)| match buffer.get(key) {
                Some(g) => g.clone(),
                None => B::float_zeros(Shape::from(shape.clone()), device, FloatDType::F32),
            })
            .collect();
        let sums = self.sum(tensors)?;
        *buffer = GradientBuffer::from_map(
            keys.into_iter()
                .map(|(key, _)| key.clone())
                .zip(sums)
                .collect(),
        );
        Ok(())
    }

    /// [`Group::sum_gradients`] across processes, without a host read (which
    /// would drain each GPU's queue mid-step): every parameter's gradient is
    /// summed (zeros where this replica has none), with the replicas'
    /// `have` flags beside them, and this replica keeps the parameters it
    /// has a gradient for. Which parameters have gradients follows from the
    /// model and the loss, so the replicas agree; that they did is checked
    /// on the device and read at the epoch's end ([`Group::check_agreement`]).
    fn sum_gradients_across_processes(
        &mut self,
        buffer: &mut GradientBuffer<B>,
        parameters: &[(String, Vec<usize>)],
        have: Vec<f32>,
    ) -> Result<()> {
        let device = self.device().clone();
        let mut tensors: Vec<FloatTensor<B>> = parameters
            .iter()
            .map(|(key, shape)| match buffer.get(key) {
                Some(g) => g.clone(),
                None => B::float_zeros(Shape::from(shape.clone()), &device, FloatDType::F32),
            })
            .collect();
        let n = have.len();
        let own = Tensor::<B, 1>::from_data(TensorData::new(have.clone(), [n]), &device);
        tensors.push(own.clone().into_primitive().tensor());
        let mut sums = self.sum(tensors)?;
        let all = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(
            sums.pop().expect("the have flags"),
        ));
        let disagreements = (all - own * self.replicas as f64).abs().sum();
        self.disagreements = Some(match self.disagreements.take() {
            Some(d) => d + disagreements,
            None => disagreements,
        });
        *buffer = GradientBuffer::from_map(
            parameters
                .iter()
                .zip(have)
                .zip(sums)
                .filter(|((_, h), _)| *h > 0.0)
                .map(|(((key, _), _), g)| (key.clone(), g))
                .collect(),
        );
        Ok(())
    }

    /// Across processes: an error if, in a step since the last check, the
    /// replicas did not all have gradients for the same parameters (their
    /// optimiser steps then differed). Reads one number from the device.
    pub(crate) fn check_agreement(&mut self) -> Result<()> {
        let Some(d) = self.disagreements.take() else {
            return Ok(());
        };
        let d: f32 = d.into_scalar().elem();
        if d != 0.0 {
            return Err(TrainError::Replica {
                rank: self.rank,
                reason: "the replicas had gradients for different parameters in a step (a \
                         parameter unused in some shards): their weights differ now; train \
                         this model in one process (--devices)"
                    .into(),
            });
        }
        Ok(())
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

    /// Replicas on their own threads, summing through the host: every one
    /// ends with the sum of the gradients that any replica has, in each
    /// gradient's shape, also when a replica lacks one; a parameter that no
    /// replica has a gradient for stays without one.
    #[test]
    fn replicas_sum_their_gradients() {
        let device = Default::default();
        let parameters = vec![
            ("b".to_string(), vec![2]),
            ("unused".to_string(), vec![4]),
            ("w".to_string(), vec![2, 3]),
        ];
        let buffer = |scale: f32, with_bias: bool| {
            let grad = |values: &[f32], shape: Vec<usize>| {
                let flat = Tensor::<B, 1>::from_floats(values, &device);
                B::float_reshape(flat.into_primitive().tensor(), Shape::from(shape))
            };
            let mut map = std::collections::BTreeMap::new();
            let w: Vec<f32> = (0..6).map(|k| scale * k as f32).collect();
            map.insert("w".to_string(), grad(&w, vec![2, 3]));
            if with_bias {
                map.insert("b".to_string(), grad(&[scale, -scale], vec![2]));
            }
            GradientBuffer::<B>::from_map(map)
        };
        for with_bias in [true, false] {
            let devices = Arc::new(vec![device; 3]);
            let host = Arc::new(HostExchange::new(3));
            let summed: Vec<_> = std::thread::scope(|s| {
                let replicas: Vec<_> = [(1.0, true), (10.0, with_bias), (100.0, true)]
                    .into_iter()
                    .enumerate()
                    .map(|(rank, (scale, bias))| {
                        let mut group = Group::<B> {
                            rank,
                            local: rank,
                            replicas: 3,
                            devices: devices.clone(),
                            host: host.clone(),
                            processes: false,
                            disagreements: None,
                        };
                        let (parameters, buffer) = (&parameters, &buffer);
                        s.spawn(move || {
                            let mut grads = buffer(scale, bias);
                            group.sum_gradients(&mut grads, parameters).unwrap();
                            let shape = grads.get("w").unwrap().shape();
                            (grads.to_host(), shape)
                        })
                    })
                    .collect();
                replicas.into_iter().map(|r| r.join().unwrap()).collect()
            });
            for (host, shape) in summed {
                let w: Vec<f32> = (0..6).map(|k| 111.0 * k as f32).collect();
                assert_eq!(host["w"], w);
                let bias = if with_bias { 111.0 } else { 101.0 };
                assert_eq!(host["b"], vec![bias, -bias]);
                assert!(!host.contains_key("unused"));
                assert_eq!(shape, Shape::new([2, 3]));
            }
        }
    }

    /// A replica that stops releases the others from a sum with an error.
    #[test]
    fn an_aborted_exchange_releases_the_waiting_replicas() {
        let host = HostExchange::new(2);
        std::thread::scope(|s| {
            let waiting = s.spawn(|| host.sum(0, vec![1.0]));
            std::thread::sleep(std::time::Duration::from_millis(50));
            host.abort();
            assert!(waiting.join().unwrap().is_err());
        });
        assert!(host.sum(1, vec![1.0]).is_err());
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
