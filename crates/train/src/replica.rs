//! One replica's part of a training step, and the threads that run the
//! replicas of a data-parallel run.
//!
//! A [`Replica`] owns a model, its optimiser and its gradients on one
//! device. On one device the training thread runs the only replica. On
//! several, replica 0 stays on the training thread (it holds the run's
//! checkpoints and validation) and every other replica runs on a thread of
//! its own ([`Workers`]), created there from replica 0's weights: Burn's
//! fusion streams are per thread, so no tensor ever crosses threads. The
//! training thread sends each worker the same [`Job`]s it runs itself, in
//! the same order; the replicas meet in their [`Group`]'s sums (NCCL on
//! CUDA, else through the host), which is what keeps them in step. The host
//! work of the replicas (recording and launching kernels, which bounds a
//! step at the reference's batch) runs in parallel, one core each.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::Scope;

use aam_data::Batch;
use aam_models::model::{AamModel, ModelConfig, StateTensor};
use aam_models::{autocast, set_attention_dropout_seed, AttentionBackend};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::TensorPrimitive;

use crate::config::RunConfig;
use crate::error::{Result, TrainError};
use crate::loss::{nucleotide_accuracy, nucleotide_positions, LossParts, LossTargets, Predictions};
use crate::optim::{GradientBuffer, Optimizer};
use crate::parallel::{gathered_embeddings, Exchanged, Group, HostExchange, Shares, TermScales};
use crate::run::{batch_tensors, mix, predict_batch, Slots, StepProfiler};

/// What every replica of a run shares and never changes.
pub(crate) struct Setup<'a> {
    pub(crate) run: &'a RunConfig,
    pub(crate) model_config: &'a ModelConfig,
    pub(crate) classifier: bool,
    pub(crate) slots: Slots,
    pub(crate) return_nucleotides: bool,
    /// `(torch key, shape)` of every parameter, in module order.
    pub(crate) parameters: Vec<(String, Vec<usize>)>,
}

impl Setup<'_> {
    pub(crate) fn context(&self, loss_scale: f64, replicas: usize) -> PassContext<'_> {
        PassContext {
            setup: self,
            loss_scale,
            replicas,
            stop: false,
        }
    }
}

/// An optimiser's state as a checkpoint holds it: tensors by name (shape,
/// values), and steps by parameter.
pub(crate) type OptimizerState = (
    BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    BTreeMap<String, u64>,
);

/// How the gradients are clipped before a step.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Clip {
    None,
    /// To this global norm, computed on the device.
    OnDevice(f64),
    /// To `max_norm`, from the global norm `norm` read on the host (fp16).
    ToNorm {
        max_norm: f64,
        norm: f64,
    },
}

/// One optimiser step, the same on every replica.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepPlan {
    pub(crate) clip: Clip,
    pub(crate) lr: f64,
    /// The schedule's factor (`lr / base lr`), for the categorical group.
    pub(crate) factor: f64,
    pub(crate) beta1: Option<f64>,
}

/// One replica: a model, its optimiser and its accumulated gradients on one
/// device, and its place among the replicas.
pub(crate) struct Replica<AB: AutodiffBackend> {
    pub(crate) device: AB::Device,
    /// Always present between calls (taken for the optimiser step only).
    model: Option<AamModel<AB>>,
    pub(crate) optimizer: Optimizer<AB::InnerBackend>,
    pub(crate) buffer: GradientBuffer<AB::InnerBackend>,
    pub(crate) group: Group<AB::InnerBackend>,
}

impl<AB> Replica<AB>
where
    AB: AutodiffBackend + AttentionBackend,
    AB::InnerBackend: AttentionBackend,
{
    pub(crate) fn new(
        model: AamModel<AB>,
        optimizer: Optimizer<AB::InnerBackend>,
        group: Group<AB::InnerBackend>,
    ) -> Self {
        Self {
            device: group.device().clone(),
            model: Some(model),
            optimizer,
            buffer: GradientBuffer::default(),
            group,
        }
    }

    pub(crate) fn model(&self) -> &AamModel<AB> {
        self.model
            .as_ref()
            .expect("a replica holds its model between steps")
    }

    /// The forward and backward passes of `shard` (seeded from `stream`):
    /// gradients added to the buffer; this replica's share of the batch's
    /// losses returned (the shares add up to the batch's, on the host).
    pub(crate) fn pass(
        &mut self,
        ctx: &PassContext,
        shard: &Shard,
        stream: u64,
        timer: Option<&mut StepProfiler>,
    ) -> Result<StepValues<AB::InnerBackend>> {
        let rank = self.group.rank;
        let seed = if rank == 0 {
            stream
        } else {
            mix(stream, rank as u64)
        };
        AB::seed(&self.device, seed);
        set_attention_dropout_seed(seed);
        let model = self.model.as_ref().expect("a replica holds its model");
        if ctx.replicas == 1 {
            let mut timer = timer;
            let forward = shard_forward(ctx, model, &self.device, shard, timer.as_deref_mut())?;
            return shard_backward(
                ctx,
                model,
                &self.device,
                shard,
                forward,
                None,
                &mut self.buffer,
                timer,
            );
        }
        let mut forward = shard_forward(ctx, model, &self.device, shard, None)?;
        let offer = forward.offer.take().expect("several replicas offer");
        let exchanged = Exchanged::exchange(&self.group, offer.embeddings, offer.nuc_positions)?;
        let values = shard_backward(
            ctx,
            model,
            &self.device,
            shard,
            forward,
            Some(exchanged),
            &mut self.buffer,
            None,
        )?;
        if !self.group.processes {
            return Ok(values);
        }
        // Across processes every replica ends with the batch's values (the
        // process that logs has not the others' on its host).
        // So does a request to stop (a signal to any process): every
        // process then stops at the same step.
        let StepValues {
            names,
            values,
            accuracy,
            stop: _,
        } = values;
        let with_accuracy = accuracy.is_some();
        // Made on the device (no upload in every step).
        let stop = if ctx.stop {
            Tensor::<AB::InnerBackend, 1>::ones([1], &self.device)
        } else {
            Tensor::<AB::InnerBackend, 1>::zeros([1], &self.device)
        };
        let mut parts = vec![
            values.into_primitive().tensor(),
            stop.into_primitive().tensor(),
        ];
        parts.extend(accuracy.map(|a| a.into_primitive().tensor()));
        let mut sums = self
            .group
            .sum(parts)?
            .into_iter()
            .map(|t| Tensor::from_primitive(TensorPrimitive::Float(t)));
        Ok(StepValues {
            names,
            values: sums.next().expect("summed"),
            stop: sums.next(),
            accuracy: if with_accuracy { sums.next() } else { None },
        })
    }

    /// Sums the replicas' accumulated gradients ([`Group::sum_gradients`]).
    pub(crate) fn reduce(&mut self, setup: &Setup) -> Result<()> {
        self.group
            .sum_gradients(&mut self.buffer, &setup.parameters)
    }

    /// Clips the (summed) gradients and takes one optimiser step; returns the
    /// norm before clipping where it was computed on the device.
    pub(crate) fn step(
        &mut self,
        setup: &Setup,
        plan: &StepPlan,
    ) -> Option<Tensor<AB::InnerBackend, 1>> {
        let mut grad_norm = None;
        match plan.clip {
            Clip::None => {}
            Clip::OnDevice(max_norm) => grad_norm = self.buffer.clip_global_norm(max_norm),
            Clip::ToNorm { max_norm, norm } => self.buffer.clip_to_norm(max_norm, norm),
        }
        let run = setup.run;
        let group_lr = |key: &str| match run.categorical_lr {
            Some(c) if crate::run::is_categorical_param(key) => c * plan.factor,
            _ => plan.lr,
        };
        let name = |path: &str| setup.model_config.torch_key(path);
        let model = self.model.take().expect("a replica holds its model");
        let grads = std::mem::take(&mut self.buffer);
        self.model = Some(step_model(
            &mut self.optimizer,
            model,
            grads,
            &name,
            &group_lr,
            plan.beta1,
        ));
        grad_norm
    }
}

/// A job for a worker replica; the training thread runs the same on replica 0.
pub(crate) enum Job {
    /// [`Replica::pass`] on this shard; its values are read to the host at
    /// once with `read`, else after the next step.
    Pass {
        batch: Batch,
        shares: Shares,
        global_unifrac: Option<Arc<Vec<f32>>>,
        stream: u64,
        loss_scale: f64,
        read: bool,
    },
    /// [`Replica::reduce`].
    Reduce,
    /// [`Replica::step`].
    Step(StepPlan),
    /// Drop the accumulated gradients.
    Clear,
    /// Send back the weights (to check that the replicas agree).
    Weights,
}

/// A worker's answer to a job.
pub(crate) enum Done {
    Ok,
    /// Its share of a batch's values ([`host_values`]).
    Values(Vec<f64>),
    Weights(Vec<(String, StateTensor)>),
}

/// A replica's share of a batch's values on the host: the losses, then the
/// nucleotide accuracy counts (hits, scored) where there are.
///
/// The shares are added on the host rather than on the devices: summed by
/// NCCL on two H200s (2026-11-29), the loss values read back wrong in some
/// steps (while the gradients and embeddings summed the same way did not).
pub(crate) fn host_values<B: Backend>(values: StepValues<B>) -> Vec<f64> {
    let mut all = vec![values.values];
    all.extend(values.accuracy);
    Tensor::cat(all, 0)
        .into_data()
        .convert::<f64>()
        .to_vec::<f64>()
        .expect("f64")
}

/// Where this process's replicas stand among all of the run's.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ranks {
    /// The global rank of this process's first replica.
    pub(crate) first: usize,
    /// All replicas of the run.
    pub(crate) replicas: usize,
    /// Whether they are in several processes.
    pub(crate) processes: bool,
}

/// This process's worker replicas (local ranks 1..L) of a data-parallel run,
/// each on its own thread of a scope that outlives them.
pub(crate) struct Workers {
    jobs: Vec<Sender<Job>>,
    done: Receiver<(usize, Result<Done>)>,
    host: Arc<HostExchange>,
}

impl Workers {
    /// Starts a thread for each device after the first, each building its
    /// replica from `weights` (replica 0's) and, on resume, the optimiser
    /// state `optimizer` (tensors, steps); returns once every replica is
    /// built (the first error where one could not be).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn spawn<'scope, 'env, AB>(
        scope: &'scope Scope<'scope, 'env>,
        setup: &'env Setup<'env>,
        devices: &Arc<Vec<AB::Device>>,
        host: &Arc<HostExchange>,
        ranks: Ranks,
        weights: &Arc<HashMap<String, StateTensor>>,
        optimizer: Option<&Arc<OptimizerState>>,
    ) -> Result<Self>
    where
        AB: AutodiffBackend + AttentionBackend,
        AB::InnerBackend: AttentionBackend,
    {
        let (reply, done) = channel();
        let jobs = (1..devices.len())
            .map(|local| {
                let (send, jobs) = channel::<Job>();
                let rank = ranks.first + local;
                let group = Group {
                    rank,
                    local,
                    replicas: ranks.replicas,
                    devices: devices.clone(),
                    host: host.clone(),
                    processes: ranks.processes,
                    disagreements: None,
                };
                let (reply, weights) = (reply.clone(), weights.clone());
                let optimizer = optimizer.cloned();
                // Named for debuggers, `top -H` and profilers.
                let thread = std::thread::Builder::new().name(format!("aam-replica-{rank}"));
                let spawned = thread.spawn_scoped(scope, move || {
                    let guard = PanicGuard {
                        rank,
                        local,
                        reply: reply.clone(),
                        host: group.host.clone(),
                    };
                    let replica =
                        worker_replica::<AB>(setup, group, &weights, optimizer.as_deref());
                    match replica {
                        Ok(replica) => {
                            if reply.send((local, Ok(Done::Ok))).is_ok() {
                                serve(setup, replica, jobs, &reply);
                            }
                        }
                        Err(e) => {
                            guard.host.abort();
                            let _ = reply.send((local, Err(e)));
                        }
                    }
                    drop(guard);
                });
                spawned.map(|_| send).map_err(|e| TrainError::Replica {
                    rank,
                    reason: format!("starting its thread: {e}"),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let workers = Self {
            jobs,
            done,
            host: host.clone(),
        };
        workers.wait()?;
        Ok(workers)
    }

    /// Releases every replica waiting in a host sum.
    pub(crate) fn abort(&self) {
        self.host.abort();
    }

    /// Sends every worker a job (`job(rank)`).
    pub(crate) fn send(&self, mut job: impl FnMut(usize) -> Job) {
        for (k, jobs) in self.jobs.iter().enumerate() {
            // A worker that stopped has answered with its error already.
            let _ = jobs.send(job(k + 1));
        }
    }

    /// Every worker's answer to its last job, by rank; the first error if
    /// any failed.
    pub(crate) fn wait(&self) -> Result<Vec<Done>> {
        let mut answers: Vec<Option<Result<Done>>> = (0..self.jobs.len()).map(|_| None).collect();
        for _ in 0..self.jobs.len() {
            let (local, answer) = self.done.recv().map_err(|_| TrainError::Replica {
                rank: 0,
                reason: "the worker replicas stopped".into(),
            })?;
            answers[local - 1] = Some(answer);
        }
        answers
            .into_iter()
            .map(|a| a.expect("one answer per worker"))
            .collect()
    }
}

impl Drop for Workers {
    /// Releases workers waiting in a host sum (the run stopped), then ends
    /// their job loops.
    fn drop(&mut self) {
        self.host.abort();
        self.jobs.clear();
    }
}

/// Answers for a worker that panicked, so that the training thread does not
/// wait for it (the scope then re-raises the panic).
struct PanicGuard {
    rank: usize,
    local: usize,
    reply: Sender<(usize, Result<Done>)>,
    host: Arc<HostExchange>,
}

impl Drop for PanicGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.host.abort();
            let _ = self.reply.send((
                self.local,
                Err(TrainError::Replica {
                    rank: self.rank,
                    reason: "its thread panicked".into(),
                }),
            ));
        }
    }
}

/// A worker's replica, built on its own thread and device.
fn worker_replica<AB>(
    setup: &Setup,
    group: Group<AB::InnerBackend>,
    weights: &HashMap<String, StateTensor>,
    optimizer: Option<&OptimizerState>,
) -> Result<Replica<AB>>
where
    AB: AutodiffBackend + AttentionBackend,
    AB::InnerBackend: AttentionBackend,
{
    let device = group.device().clone();
    let mut model = setup.model_config.init::<AB>(&device)?;
    model
        .load_state_dict(
            setup.model_config,
            weights.clone(),
            Path::new("replica 0's weights"),
        )
        .map_err(|e| TrainError::Replica {
            rank: group.rank,
            reason: format!("taking replica 0's weights: {e}"),
        })?;
    let mut optim = Optimizer::<AB::InnerBackend>::new(setup.run.optimizer.clone())
        .with_per_parameter_updates(AB::fuses_elementwise());
    if let Some((tensors, steps)) = optimizer {
        optim.load_state(&mut tensors.clone(), steps, &device)?;
    }
    Ok(Replica::new(model, optim, group))
}

/// A worker's job loop: until the training thread drops its sender.
fn serve<AB>(
    setup: &Setup,
    mut replica: Replica<AB>,
    jobs: Receiver<Job>,
    reply: &Sender<(usize, Result<Done>)>,
) where
    AB: AutodiffBackend + AttentionBackend,
    AB::InnerBackend: AttentionBackend,
{
    let (rank, local) = (replica.group.rank, replica.group.local);
    let replicas = replica.group.replicas();
    // The last pass's values, until they are read (after the step).
    let mut unread = None;
    while let Ok(job) = jobs.recv() {
        let answer = match job {
            Job::Pass {
                batch,
                shares,
                global_unifrac,
                stream,
                loss_scale,
                read,
            } => {
                let shard = Shard {
                    rank,
                    batch: &batch,
                    shares,
                    global_unifrac: global_unifrac.as_deref().map(Vec::as_slice),
                };
                let ctx = setup.context(loss_scale, replicas);
                replica.pass(&ctx, &shard, stream, None).map(|values| {
                    if read {
                        Done::Values(host_values(values))
                    } else {
                        unread = Some(values);
                        Done::Ok
                    }
                })
            }
            Job::Reduce => replica.reduce(setup).map(|()| Done::Ok),
            Job::Step(plan) => {
                replica.step(setup, &plan);
                Ok(match unread.take() {
                    Some(values) => Done::Values(host_values(values)),
                    None => Done::Ok,
                })
            }
            Job::Clear => {
                replica.buffer.clear();
                Ok(Done::Ok)
            }
            Job::Weights => Ok(Done::Weights(
                replica.model().state_dict(setup.model_config),
            )),
        };
        if answer.is_err() {
            replica.group.host.abort();
        }
        if reply.send((local, answer)).is_err() {
            break;
        }
    }
}

/// A batch's losses (and nucleotide accuracy counts) as one `[k]` tensor
/// on the inner backend, named: what the step reads to the host at its end.
#[derive(Clone)]
pub(crate) struct StepValues<B: Backend> {
    pub(crate) names: Vec<&'static str>,
    pub(crate) values: Tensor<B, 1>,
    /// Nucleotide hits and scored positions `[2]`.
    pub(crate) accuracy: Option<Tensor<B, 1>>,
    /// Across processes: how many processes asked to stop `[1]`.
    pub(crate) stop: Option<Tensor<B, 1>>,
}

impl<B: Backend> StepValues<B> {
    pub(crate) fn new(
        parts: &LossParts<B>,
        accuracy: Option<(Tensor<B, 1>, Tensor<B, 1>)>,
    ) -> Self {
        let mut names = vec!["total_loss"];
        let mut values = vec![parts.total.clone()];
        for (name, part) in [
            ("unifrac_loss", &parts.unifrac),
            ("nuc_loss", &parts.nuc),
            ("count_loss", &parts.count),
            ("target_loss", &parts.target),
        ] {
            if let Some(p) = part {
                names.push(name);
                values.push(p.clone());
            }
        }
        Self {
            names,
            values: Tensor::cat(values, 0),
            accuracy: accuracy.map(|(hits, n)| Tensor::cat(vec![hits, n], 0)),
            stop: None,
        }
    }
}

impl<AB: AutodiffBackend> StepValues<AB> {
    /// The values without their autodiff graph.
    pub(crate) fn into_inner(self) -> StepValues<AB::InnerBackend> {
        StepValues {
            names: self.names,
            values: self.values.inner(),
            accuracy: self.accuracy.map(Tensor::inner),
            stop: self.stop.map(Tensor::inner),
        }
    }
}

/// What every replica's pass of one step reads, besides its own batch.
pub(crate) struct PassContext<'a> {
    pub(crate) setup: &'a Setup<'a>,
    pub(crate) loss_scale: f64,
    pub(crate) replicas: usize,
    /// Across processes: whether this process asks every process to stop
    /// at this step (its replica 0 says so in the step's sum).
    pub(crate) stop: bool,
}

/// One replica's part of a step: its shard of the batch and what it shares.
pub(crate) struct Shard<'a> {
    pub(crate) rank: usize,
    pub(crate) batch: &'a Batch,
    pub(crate) shares: Shares,
    /// The global batch's UniFrac block `[B, B]` (`global` pairs).
    pub(crate) global_unifrac: Option<&'a [f32]>,
}

/// What a replica offers the others mid-step (values, without autodiff).
struct Offer<B: Backend> {
    /// Its sample embeddings `[B/N, D]` (`global` UniFrac pairs).
    embeddings: Option<Tensor<B, 2>>,
    /// Its count of scored nucleotide positions `[1]`.
    nuc_positions: Option<Tensor<B, 1>>,
}

/// A shard's forward pass, waiting for the other replicas' offers.
struct ShardForward<AB: AutodiffBackend> {
    predictions: Predictions<AB>,
    targets: LossTargets<AB>,
    /// What this replica hands the others (several replicas only).
    offer: Option<Offer<AB::InnerBackend>>,
}

/// The forward pass of one replica's shard; with `replicas > 1`, also what
/// it offers the others (its embeddings in `global` mode, its count of
/// scored nucleotide positions).
fn shard_forward<AB>(
    ctx: &PassContext,
    model: &AamModel<AB>,
    device: &AB::Device,
    shard: &Shard,
    mut timer: Option<&mut StepProfiler>,
) -> Result<ShardForward<AB>>
where
    AB: AutodiffBackend + AttentionBackend,
    AB::InnerBackend: AttentionBackend,
{
    let (input, mut targets) =
        batch_tensors::<AB>(shard.batch, device, ctx.setup.classifier, ctx.setup.slots);
    if let Some(t) = timer.as_deref_mut() {
        t.mark::<AB>(device, "upload");
    }
    if let Some(u) = shard.global_unifrac {
        let b = (u.len() as f64).sqrt() as usize;
        targets.base = Some(Tensor::from_data(
            TensorData::new(u.to_vec(), [b, b]),
            device,
        ));
    }
    let predictions = {
        let _autocast = autocast(ctx.setup.run.mixed_precision);
        predict_batch(model, input, ctx.setup.return_nucleotides)
    };
    if let Some(t) = timer {
        t.mark::<AB>(device, "forward");
    }
    let offer = if ctx.replicas > 1 {
        let nuc_positions = predictions
            .nuc_logits
            .as_ref()
            .map(|_| {
                Ok::<_, TrainError>(
                    nucleotide_positions(
                        predictions.nuc_targets(&targets)?,
                        predictions.mask_indices.clone(),
                    )
                    .float()
                    .sum()
                    .inner(),
                )
            })
            .transpose()?;
        let embeddings = predictions
            .embeddings
            .as_ref()
            .filter(|_| shard.global_unifrac.is_some())
            .map(|e| e.clone().detach().inner());
        Some(Offer {
            embeddings,
            nuc_positions,
        })
    } else {
        None
    };
    Ok(ShardForward {
        predictions,
        targets,
        offer,
    })
}

/// The losses and backward pass of one replica's shard, with every
/// replica's offer summed (none on one device); its gradients are added to
/// `buffer`, scaled for accumulation and fp16.
#[allow(clippy::too_many_arguments)]
fn shard_backward<AB>(
    ctx: &PassContext,
    model: &AamModel<AB>,
    device: &AB::Device,
    shard: &Shard,
    forward: ShardForward<AB>,
    exchanged: Option<Exchanged<AB::InnerBackend>>,
    buffer: &mut GradientBuffer<AB::InnerBackend>,
    mut timer: Option<&mut StepProfiler>,
) -> Result<StepValues<AB::InnerBackend>>
where
    AB: AutodiffBackend + AttentionBackend,
    AB::InnerBackend: AttentionBackend,
{
    let mut mark = |phase| {
        if let Some(t) = timer.as_deref_mut() {
            t.mark::<AB>(device, phase)
        }
    };
    let ShardForward {
        mut predictions,
        targets,
        ..
    } = forward;
    let scales = exchanged.map(|exchanged| {
        if let Some(all) = exchanged.embeddings {
            if let Some(own) = predictions.embeddings.take() {
                predictions.embeddings = Some(gathered_embeddings::<AB>(all, shard.rank, own));
            }
        }
        TermScales::of(
            &ctx.setup.run.loss,
            ctx.setup.run.unifrac_pairs,
            ctx.setup.classifier,
            shard.shares,
            ctx.replicas,
            exchanged.nuc_share.map(Tensor::from_inner),
        )
    });
    let parts = ctx.setup.run.loss.forward(&predictions, &targets)?;
    let (objective, parts) = match scales {
        None => (parts.total.clone(), parts),
        Some((objective, report)) => (
            objective.apply(&ctx.setup.run.loss, &parts).total,
            report.apply(&ctx.setup.run.loss, &parts),
        ),
    };
    let accuracy = predictions
        .nuc_logits
        .as_ref()
        .map(|logits| {
            Ok::<_, TrainError>(nucleotide_accuracy(
                logits.clone().detach(),
                predictions.nuc_targets(&targets)?,
                predictions.mask_indices.clone(),
            ))
        })
        .transpose()?;
    mark("loss");
    let grads = if ctx.loss_scale == 1.0 {
        objective.backward()
    } else {
        (objective * ctx.loss_scale).backward()
    };
    mark("backward");
    let name = |path: &str| ctx.setup.model_config.torch_key(path);
    buffer.accumulate(GradientBuffer::collect_model(
        model,
        &grads,
        &name,
        1.0 / (ctx.setup.run.gradient_accumulation_steps as f64 * ctx.loss_scale),
    ));
    mark("collect");
    Ok(StepValues::new(&parts, accuracy).into_inner())
}

fn step_model<AB>(
    optimizer: &mut Optimizer<AB::InnerBackend>,
    model: AamModel<AB>,
    grads: GradientBuffer<AB::InnerBackend>,
    name: &dyn Fn(&str) -> String,
    lr: &dyn Fn(&str) -> f64,
    beta1: Option<f64>,
) -> AamModel<AB>
where
    AB: AutodiffBackend,
    AB::InnerBackend: AttentionBackend,
{
    match model {
        AamModel::SequenceEncoder(m) => {
            AamModel::SequenceEncoder(optimizer.step::<AB, _>(m, grads, name, lr, beta1))
        }
        AamModel::SequencePredictor(m) => {
            AamModel::SequencePredictor(optimizer.step::<AB, _>(m, grads, name, lr, beta1))
        }
    }
}

impl<B: Backend> GradientBuffer<B> {
    /// [`GradientBuffer::collect`] for either model.
    pub fn collect_model<AB: AutodiffBackend<InnerBackend = B>>(
        model: &AamModel<AB>,
        grads: &AB::Gradients,
        name: &dyn Fn(&str) -> String,
        scale: f64,
    ) -> Self {
        match model {
            AamModel::SequenceEncoder(m) => Self::collect(m, grads, name, scale),
            AamModel::SequencePredictor(m) => Self::collect(m, grads, name, scale),
        }
    }
}
