//! Reference §4.1: AdamW, Adam and SGD with the PyTorch update rules, their
//! state keyed by the parameter's **torch name**, and gradient buffers for
//! accumulation and global-norm clipping.
//!
//! Why not burn-optim: its state is keyed by `ParamId`, which is not stable
//! across a weight import (`load_state_dict` makes fresh ids), so a resumed
//! run could not find its moments; its norm clipping is per tensor, where the
//! reference (`clip_grad_norm_`) clips the global norm; and its state records
//! are not readable outside Burn. Here a checkpoint holds
//! `optim.<torch key>.exp_avg` next to `model.<torch key>`, in safetensors.

use std::collections::BTreeMap;

use aam_models::{AdamItem, AdamStep, AttentionBackend};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{TensorMetadata, TensorPrimitive};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// Which optimiser.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    /// Adam with decoupled weight decay (PyTorch `AdamW`).
    #[default]
    Adamw,
    /// Adam with L2 weight decay added to the gradient.
    Adam,
    /// SGD with momentum 0.9 and L2 weight decay.
    Sgd,
}

/// Optimiser hyper-parameters (PyTorch defaults).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerConfig {
    /// Which update rule.
    pub kind: OptimizerKind,
    /// Weight decay (applied to every trainable parameter, as the reference).
    pub weight_decay: f64,
    /// Adam β1.
    pub beta1: f64,
    /// Adam β2.
    pub beta2: f64,
    /// Adam ε.
    pub eps: f64,
    /// SGD momentum.
    pub momentum: f64,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            kind: OptimizerKind::Adamw,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            momentum: 0.9,
        }
    }
}

/// Per-parameter state.
#[derive(Clone, Debug)]
struct ParamState<B: Backend> {
    step: u64,
    /// Adam first moment, or SGD momentum buffer.
    first: Tensor<B, 1>,
    /// Adam second moment.
    second: Option<Tensor<B, 1>>,
}

impl<B: Backend> ParamState<B> {
    /// The state before the first step: zero moments shaped as `p`.
    fn fresh(p: &Tensor<B, 1>, kind: OptimizerKind) -> Self {
        Self {
            step: 0,
            first: p.zeros_like(),
            second: (kind != OptimizerKind::Sgd).then(|| p.zeros_like()),
        }
    }
}

/// An optimiser over named parameters.
#[derive(Clone, Debug)]
pub struct Optimizer<B: Backend> {
    config: OptimizerConfig,
    /// Per parameter; after a step, the moments are views into the group's
    /// flat moments below.
    state: BTreeMap<String, ParamState<B>>,
    /// The flat moments of each group after its last update, keyed by the
    /// group's parameters in order, so that the next step of the same group
    /// need not concatenate ~150 views again.
    flat_moments: BTreeMap<Vec<String>, ParamState<B>>,
    /// Update each parameter on its own instead of in flat groups: for
    /// backends that fuse element-wise chains (see [`Optimizer::step`]).
    per_parameter: bool,
}

/// Gradients by torch name, in their parameters' shapes, on the inner
/// (non-autodiff) backend. Kept as primitives of any rank: a reshape per
/// gradient is an op for the host to record on a GPU backend.
#[derive(Clone, Debug)]
pub struct GradientBuffer<B: Backend> {
    grads: BTreeMap<String, FloatTensor<B>>,
}

impl<B: Backend> Default for GradientBuffer<B> {
    fn default() -> Self {
        Self {
            grads: BTreeMap::new(),
        }
    }
}

/// Walks a module's float parameters with their dotted Burn path.
struct PathTracker {
    path: Vec<String>,
}

impl PathTracker {
    fn enter(&mut self, name: &str) {
        self.path.push(name.to_string());
    }
    fn exit(&mut self) {
        self.path.pop();
    }
    fn current(&self) -> String {
        self.path.join(".")
    }
}

impl<B: Backend> GradientBuffer<B> {
    /// Collects `scale · ∂loss/∂p` for every parameter of `module` that
    /// received a gradient; `name` maps a Burn path to the torch key.
    pub fn collect<AB, M>(
        module: &M,
        grads: &AB::Gradients,
        name: &dyn Fn(&str) -> String,
        scale: f64,
    ) -> Self
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: Module<AB>,
    {
        struct Collector<'a, AB: AutodiffBackend> {
            grads: &'a AB::Gradients,
            name: &'a dyn Fn(&str) -> String,
            scale: f64,
            path: PathTracker,
            out: BTreeMap<String, FloatTensor<AB::InnerBackend>>,
        }
        impl<AB: AutodiffBackend> ModuleVisitor<AB> for Collector<'_, AB> {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.path.enter(name);
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.path.exit();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
                if let Some(g) = param.val().grad(self.grads) {
                    let g = if self.scale == 1.0 { g } else { g * self.scale };
                    let g = g.into_primitive().tensor();
                    self.out.insert((self.name)(&self.path.current()), g);
                }
            }
        }
        let mut c = Collector::<AB> {
            grads,
            name,
            scale,
            path: PathTracker { path: Vec::new() },
            out: BTreeMap::new(),
        };
        module.visit(&mut c);
        Self { grads: c.out }
    }

    /// A buffer of these gradients, by torch key.
    pub fn from_map(grads: BTreeMap<String, FloatTensor<B>>) -> Self {
        Self { grads }
    }

    /// The torch keys that have a gradient, in order.
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.grads.keys()
    }

    /// The gradient of `key`.
    pub fn get(&self, key: &str) -> Option<&FloatTensor<B>> {
        self.grads.get(key)
    }

    /// Adds another buffer (gradient accumulation).
    pub fn accumulate(&mut self, other: Self) {
        for (k, g) in other.grads {
            match self.grads.remove(&k) {
                Some(prev) => self.grads.insert(k, B::float_add(prev, g)),
                None => self.grads.insert(k, g),
            };
        }
    }

    /// Every gradient read to the host as f32, by torch key (one read per
    /// gradient: for checks, not for the training loop).
    pub fn to_host(&self) -> BTreeMap<String, Vec<f32>> {
        self.grads
            .iter()
            .map(|(key, g)| {
                let values = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(
                    B::float_reshape(g.clone(), Shape::from(vec![g.shape().num_elements()])),
                ))
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .expect("f32 gradient");
                (key.clone(), values)
            })
            .collect()
    }

    /// Whether no gradient was collected.
    pub fn is_empty(&self) -> bool {
        self.grads.is_empty()
    }

    /// Drops every gradient (a skipped step).
    pub fn clear(&mut self) {
        self.grads.clear();
    }

    /// The global L2 norm over every gradient, as a one-element tensor on the
    /// device (no host read); `None` without gradients.
    pub fn global_norm_tensor(&self) -> Option<Tensor<B, 1>> {
        self.grads
            .values()
            .map(|g| {
                let squares = B::float_powi_scalar(g.clone(), 2.into());
                Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_sum(squares)))
            })
            .reduce(|a, b| a + b)
            .map(Tensor::sqrt)
    }

    /// The global L2 norm over every gradient (one host read).
    pub fn global_norm(&self) -> f64 {
        self.global_norm_tensor()
            .map_or(0.0, |t| t.into_scalar().elem::<f64>())
    }

    /// `clip_grad_norm_`, on the device: multiplies every gradient by
    /// `min(1, max_norm / (norm + 1e-6))`, computed in the gradients' type as
    /// torch does. Returns the norm before clipping, still on the device.
    ///
    /// No host read: the training loop queues the optimiser step behind the
    /// backward pass instead of waiting for it (the optimiser's many small
    /// kernels are dispatch-bound, ~15 ms a step on an H100), and reads the
    /// norm later with the losses.
    pub fn clip_global_norm(&mut self, max_norm: f64) -> Option<Tensor<B, 1>> {
        let norm = self.global_norm_tensor()?;
        let coef = (norm.clone() + 1e-6)
            .recip()
            .mul_scalar(max_norm)
            .clamp_max(1.0);
        for g in self.grads.values_mut() {
            // The one-element coefficient at the gradient's rank, to broadcast.
            let rank = g.shape().num_dims();
            let coef = B::float_reshape(
                coef.clone().into_primitive().tensor(),
                Shape::from(vec![1; rank]),
            );
            *g = B::float_mul(g.clone(), coef);
        }
        Some(norm)
    }

    /// Clipping with the global norm already read to the host (the fp16 path,
    /// which reads it anyway to detect overflow): scales every gradient by
    /// `max_norm / (norm + 1e-6)` when that is below 1.
    pub fn clip_to_norm(&mut self, max_norm: f64, norm: f64) {
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            for g in self.grads.values_mut() {
                *g = B::float_mul_scalar(g.clone(), coef.into());
            }
        }
    }
}

impl<B: AttentionBackend> Optimizer<B> {
    /// A fresh optimiser.
    pub fn new(config: OptimizerConfig) -> Self {
        Self {
            config,
            state: BTreeMap::new(),
            flat_moments: BTreeMap::new(),
            per_parameter: false,
        }
    }

    /// Updates each parameter on its own (`true`) or in flat groups (`false`,
    /// the default). The values are the same bit for bit; only the kernels
    /// differ. Pass `RuntimeOps::fuses_elementwise()` of the backend.
    pub fn with_per_parameter_updates(mut self, per_parameter: bool) -> Self {
        if per_parameter != self.per_parameter {
            // The states stay valid either way: a flat group's per-parameter
            // views are ordinary tensors.
            self.flat_moments.clear();
        }
        self.per_parameter = per_parameter;
        self
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// One update of every parameter that has a gradient in `grads`.
    /// `lr` gives the learning rate of a parameter by torch key (parameter
    /// groups); `beta1` overrides Adam's β1 (one-cycle momentum).
    ///
    /// Multi-tensor, as PyTorch's `foreach` optimisers: the parameters that
    /// share a learning rate and a step count are concatenated into one flat
    /// tensor and updated by a dozen element-wise kernels, then split back,
    /// instead of ~14 kernels per parameter (~2,000 a step for the default
    /// model). The arithmetic per element is unchanged (bit for bit). A group
    /// that updates again reuses its flat moments instead of concatenating
    /// the per-parameter views (on the H100 that took the optimiser phase of a
    /// real-data step from 19.8 to 14.6 ms, `docs/performance.md`).
    ///
    /// Per parameter ([`Optimizer::with_per_parameter_updates`]) where the
    /// backend fuses element-wise chains: there each parameter's update is
    /// one kernel already, and the flat groups would only add a copy of every
    /// parameter and gradient into the group (concatenation) and out again.
    /// The Adam steps of all parameters are then one
    /// [`aam_models::AdamOps::adam_steps`] (one op under fusion), on parameters
    /// and gradients in their own shapes.
    pub fn step<AB, M>(
        &mut self,
        module: M,
        mut grads: GradientBuffer<B>,
        name: &dyn Fn(&str) -> String,
        lr: &dyn Fn(&str) -> f64,
        beta1: Option<f64>,
    ) -> M
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: Module<AB>,
    {
        // 1. The parameters with a gradient, in module order.
        struct Lister<'a, AB: AutodiffBackend> {
            name: &'a dyn Fn(&str) -> String,
            has_grad: &'a BTreeMap<String, FloatTensor<AB::InnerBackend>>,
            path: PathTracker,
            out: Vec<(String, FloatTensor<AB::InnerBackend>)>,
        }
        impl<AB: AutodiffBackend> ModuleVisitor<AB> for Lister<'_, AB> {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.path.enter(name);
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.path.exit();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
                let key = (self.name)(&self.path.current());
                if self.has_grad.contains_key(&key) {
                    let p = param.val().inner().into_primitive().tensor();
                    self.out.push((key, p));
                }
            }
        }
        let mut lister = Lister::<AB> {
            name,
            has_grad: &grads.grads,
            path: PathTracker { path: Vec::new() },
            out: Vec::new(),
        };
        module.visit(&mut lister);

        let mut updated: BTreeMap<String, FloatTensor<B>> = BTreeMap::new();
        if self.per_parameter {
            let params = lister
                .out
                .into_iter()
                .map(|(key, p)| {
                    let g = grads.grads.remove(&key).expect("listed with a gradient");
                    (key, p, g)
                })
                .collect();
            updated.extend(self.update_each(params, lr, beta1));
            return module.map(&mut Writer::<AB> {
                name,
                updated,
                path: PathTracker { path: Vec::new() },
            });
        }

        // 2. Groups of one learning rate and step count, each updated flat.
        let mut groups: BTreeMap<(u64, u64), Vec<(String, Tensor<B, 1>)>> = BTreeMap::new();
        for (key, p) in lister.out {
            let step = self.state.get(&key).map_or(0, |s| s.step);
            groups
                .entry((lr(&key).to_bits(), step))
                .or_default()
                .push((key, flatten(p)));
        }
        // Groups that take no part in this step drop their flat moments.
        let mut previous = std::mem::take(&mut self.flat_moments);
        for ((lr_bits, step), members) in groups {
            let group_grads = members
                .iter()
                .map(|(key, _)| flatten(grads.grads.remove(key).expect("listed with a gradient")))
                .collect();
            let group = self.update_group(
                &mut previous,
                members,
                group_grads,
                step,
                f64::from_bits(lr_bits),
                beta1,
            );
            updated.extend(
                group
                    .into_iter()
                    .map(|(key, p)| (key, p.into_primitive().tensor())),
            );
        }

        // 3. The module with the updated values.
        struct Writer<'a, AB: AutodiffBackend> {
            name: &'a dyn Fn(&str) -> String,
            updated: BTreeMap<String, FloatTensor<AB::InnerBackend>>,
            path: PathTracker,
        }
        impl<AB: AutodiffBackend> ModuleMapper<AB> for Writer<'_, AB> {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.path.enter(name);
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.path.exit();
            }
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<AB, D>>,
            ) -> Param<Tensor<AB, D>> {
                let key = (self.name)(&self.path.current());
                let Some(value) = self.updated.remove(&key) else {
                    return param;
                };
                let (id, tensor, mapper) = param.consume();
                let require_grad = tensor.is_require_grad();
                // Per-parameter updates keep the shape; flat groups reshape.
                let flat = value.shape() != Shape::from(tensor.dims());
                let mut value =
                    Tensor::<AB::InnerBackend, D>::from_primitive(TensorPrimitive::Float(value));
                if flat {
                    value = value.reshape(tensor.dims());
                }
                let mut t = Tensor::<AB, D>::from_inner(value);
                if require_grad {
                    t = t.require_grad();
                }
                Param::from_mapped_value(id, t, mapper)
            }
        }
        module.map(&mut Writer::<AB> {
            name,
            updated,
            path: PathTracker { path: Vec::new() },
        })
    }

    /// Updates each parameter on its own, in its shape: the Adam steps of all
    /// of them as one [`aam_models::AdamOps::adam_steps`] (one op under fusion),
    /// SGD's one by one. Returns each parameter's new value.
    fn update_each(
        &mut self,
        params: Vec<(String, FloatTensor<B>, FloatTensor<B>)>,
        lr: &dyn Fn(&str) -> f64,
        beta1: Option<f64>,
    ) -> Vec<(String, FloatTensor<B>)> {
        let kind = self.config.kind;
        let fresh = |p: &FloatTensor<B>| ParamState::fresh(&flatten(p.clone()), kind);
        if kind == OptimizerKind::Sgd {
            let mut out = Vec::with_capacity(params.len());
            for (key, p, g) in params {
                let shape = p.shape();
                let mut state = self.state.remove(&key).unwrap_or_else(|| fresh(&p));
                let p = self
                    .config
                    .update(&mut state, flatten(p), flatten(g), lr(&key), beta1);
                self.state.insert(key.clone(), state);
                out.push((key, B::float_reshape(p.into_primitive().tensor(), shape)));
            }
            return out;
        }
        let mut keys = Vec::with_capacity(params.len());
        let mut items = Vec::with_capacity(params.len());
        for (key, p, g) in params {
            let state = self.state.remove(&key).unwrap_or_else(|| fresh(&p));
            let step = state.step + 1;
            items.push(AdamItem {
                param: p,
                grad: g,
                first: state.first.into_primitive().tensor(),
                second: state.second.expect("adam state").into_primitive().tensor(),
                step: self.config.adam_step(step, lr(&key), beta1),
            });
            keys.push((key, step));
        }
        let wrap = |t| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t));
        B::adam_steps(items)
            .into_iter()
            .zip(keys)
            .map(|([p, first, second], (key, step))| {
                let state = ParamState {
                    step,
                    first: wrap(first),
                    second: Some(wrap(second)),
                };
                self.state.insert(key.clone(), state);
                (key, p)
            })
            .collect()
    }

    /// Updates parameters that share a learning rate and a step count as one
    /// flat tensor; returns each parameter's new (flat) value. Their states
    /// become slices of the group's new moments.
    fn update_group(
        &mut self,
        previous: &mut BTreeMap<Vec<String>, ParamState<B>>,
        members: Vec<(String, Tensor<B, 1>)>,
        grads: Vec<Tensor<B, 1>>,
        step: u64,
        lr: f64,
        beta1: Option<f64>,
    ) -> Vec<(String, Tensor<B, 1>)> {
        let sizes: Vec<usize> = members.iter().map(|(_, p)| p.dims()[0]).collect();
        let (keys, params): (Vec<String>, Vec<Tensor<B, 1>>) = members.into_iter().unzip();
        let p = concat(params);
        let g = concat(grads);
        let adam = self.config.kind != OptimizerKind::Sgd;
        let mut state = if step == 0 {
            ParamState::fresh(&p, self.config.kind)
        } else {
            let mut firsts = Vec::with_capacity(keys.len());
            let mut seconds = Vec::with_capacity(keys.len());
            for key in &keys {
                let s = self.state.remove(key).expect("a step > 0 has state");
                firsts.push(s.first);
                seconds.extend(s.second);
            }
            // The same group at the same step as last time: its flat moments
            // are the concatenation of exactly these views.
            match previous.remove(&keys) {
                Some(cached) if cached.step == step => cached,
                _ => ParamState {
                    step,
                    first: concat(firsts),
                    second: adam.then(|| concat(seconds)),
                },
            }
        };
        let p = self.config.update(&mut state, p, g, lr, beta1);
        let mut offset = 0;
        let mut out = Vec::with_capacity(keys.len());
        for (key, size) in keys.into_iter().zip(sizes) {
            let piece = |t: &Tensor<B, 1>| t.clone().narrow(0, offset, size);
            self.state.insert(
                key.clone(),
                ParamState {
                    step: state.step,
                    first: piece(&state.first),
                    second: state.second.as_ref().map(piece),
                },
            );
            out.push((key, piece(&p)));
            offset += size;
        }
        let keys = out.iter().map(|(key, _)| key.clone()).collect();
        self.flat_moments.insert(keys, state);
        out
    }

    /// The state as named tensors (`optim.<key>.exp_avg`, `.exp_avg_sq`,
    /// `.momentum_buffer`) and per-parameter step counts.
    pub fn state_tensors(&self) -> (Vec<(String, TensorData)>, BTreeMap<String, u64>) {
        let first = if self.config.kind == OptimizerKind::Sgd {
            "momentum_buffer"
        } else {
            "exp_avg"
        };
        let mut tensors = Vec::new();
        let mut steps = BTreeMap::new();
        for (k, s) in &self.state {
            steps.insert(k.clone(), s.step);
            tensors.push((format!("optim.{k}.{first}"), s.first.to_data()));
            if let Some(v) = &s.second {
                tensors.push((format!("optim.{k}.exp_avg_sq"), v.to_data()));
            }
        }
        (tensors, steps)
    }

    /// Restores the state written by [`Self::state_tensors`].
    pub fn load_state(
        &mut self,
        tensors: &mut BTreeMap<String, (Vec<usize>, Vec<f32>)>,
        steps: &BTreeMap<String, u64>,
        device: &B::Device,
    ) -> Result<()> {
        let first = if self.config.kind == OptimizerKind::Sgd {
            "momentum_buffer"
        } else {
            "exp_avg"
        };
        let mut take = |name: String| {
            tensors
                .remove(&name)
                .map(|(shape, v)| Tensor::<B, 1>::from_data(TensorData::new(v, shape), device))
                .ok_or_else(|| {
                    TrainError::arg(
                        "resume-from",
                        format!("the checkpoint lacks optimiser tensor {name}"),
                    )
                })
        };
        self.state.clear();
        self.flat_moments.clear();
        for (k, &step) in steps {
            let first = take(format!("optim.{k}.{first}"))?;
            let second = if self.config.kind == OptimizerKind::Sgd {
                None
            } else {
                Some(take(format!("optim.{k}.exp_avg_sq"))?)
            };
            self.state.insert(
                k.clone(),
                ParamState {
                    step,
                    first,
                    second,
                },
            );
        }
        Ok(())
    }
}

/// `t` as one flat tensor.
fn flatten<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 1> {
    let n = t.shape().num_elements();
    Tensor::from_primitive(TensorPrimitive::Float(B::float_reshape(t, Shape::new([n]))))
}

/// One flat tensor of `parts`, in order.
fn concat<B: Backend>(parts: Vec<Tensor<B, 1>>) -> Tensor<B, 1> {
    if parts.len() == 1 {
        parts.into_iter().next().expect("one part")
    } else {
        Tensor::cat(parts, 0)
    }
}

impl OptimizerConfig {
    /// The coefficients of Adam's step `t` (1 for the first).
    fn adam_step(&self, t: u64, lr: f64, beta1: Option<f64>) -> AdamStep {
        AdamStep::new(
            lr,
            beta1.unwrap_or(self.beta1),
            self.beta2,
            self.eps,
            self.weight_decay,
            self.kind == OptimizerKind::Adamw,
            t as i32,
        )
    }

    /// The PyTorch update of flattened parameters `p` with gradients `g`;
    /// advances `state` (its step and moments) and returns the new values.
    fn update<B: AttentionBackend>(
        &self,
        state: &mut ParamState<B>,
        p: Tensor<B, 1>,
        g: Tensor<B, 1>,
        lr: f64,
        beta1: Option<f64>,
    ) -> Tensor<B, 1> {
        let c = self;
        let wd = c.weight_decay;
        state.step += 1;
        match c.kind {
            OptimizerKind::Adamw | OptimizerKind::Adam => {
                let step = self.adam_step(state.step, lr, beta1);
                // One op where the backend has the kernel (the CubeCL
                // backends), else the same formulas as a dozen tensor ops.
                let second = state.second.take().expect("adam state");
                let [p, g, m, v] =
                    [p, g, state.first.clone(), second].map(|t| t.into_primitive().tensor());
                let (p, m, v) = B::adam_step(p, g, m, v, step);
                let wrap = |t| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t));
                state.first = wrap(m);
                state.second = Some(wrap(v));
                wrap(p)
            }
            OptimizerKind::Sgd => {
                let g = if wd != 0.0 { g + p.clone() * wd } else { g };
                let buf = if state.step == 1 {
                    g
                } else {
                    state.first.clone() * c.momentum + g
                };
                state.first = buf.clone();
                p - buf * lr
            }
        }
    }
}

/// Dynamic loss scaling for fp16 mixed precision (torch's `GradScaler`
/// defaults): the loss is multiplied by `scale` before the backward pass so
/// that small gradients survive f16's range, and the gradients divided by it
/// again; a step whose gradients overflowed is skipped and the scale halved;
/// after 2,000 finite steps in a row it doubles.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// The current factor.
    pub scale: f64,
    /// Finite steps since the last change.
    pub finite_steps: u32,
}

impl Default for LossScaler {
    fn default() -> Self {
        Self {
            scale: 65_536.0,
            finite_steps: 0,
        }
    }
}

impl LossScaler {
    /// Finite steps after which the scale doubles.
    pub const GROWTH_INTERVAL: u32 = 2_000;

    /// Records a step's gradient check; returns whether to take the step.
    pub fn update(&mut self, gradients_finite: bool) -> bool {
        if gradients_finite {
            self.finite_steps += 1;
            if self.finite_steps == Self::GROWTH_INTERVAL {
                self.scale *= 2.0;
                self.finite_steps = 0;
            }
        } else {
            self.scale = (self.scale * 0.5).max(1.0);
            self.finite_steps = 0;
        }
        gradients_finite
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};

    type AB = Autodiff<NdArray<f32>>;

    #[derive(Module, Debug)]
    struct Toy<B: Backend> {
        w: Param<Tensor<B, 1>>,
    }

    fn toy(values: [f32; 2]) -> Toy<AB> {
        Toy {
            w: Param::from_tensor(Tensor::from_floats(values, &Default::default())),
        }
    }

    fn quad_grads(m: &Toy<AB>) -> GradientBuffer<NdArray<f32>> {
        // loss = Σ w², ∂/∂w = 2w
        let g = m.w.val().powi_scalar(2).sum().backward();
        GradientBuffer::collect(m, &g, &|p: &str| p.to_string(), 1.0)
    }

    #[test]
    fn adamw_matches_the_pytorch_rule() {
        // torch.optim.AdamW([w], lr=0.1, weight_decay=0.01), w = [1, -2], loss Σw², 2 steps:
        // step 1: w ← w(1−1e-3) − 0.1·sign(g) → [0.899, -1.898]
        // step 2: m̂, v̂ from g₁=[2,−4], g₂=2·w₁.
        let mut m = toy([1.0, -2.0]);
        let mut opt = Optimizer::<NdArray<f32>>::new(OptimizerConfig::default());
        let mut w = [1.0f64, -2.0];
        let (mut mo, mut ve) = ([0.0f64; 2], [0.0f64; 2]);
        for t in 1..=2 {
            let g = quad_grads(&m);
            m = opt.step::<AB, _>(m, g, &|p: &str| p.to_string(), &|_: &str| 0.1, None);
            for i in 0..2 {
                let gi = 2.0 * w[i];
                w[i] *= 1.0 - 0.1 * 0.01;
                mo[i] = 0.9 * mo[i] + 0.1 * gi;
                ve[i] = 0.999 * ve[i] + 0.001 * gi * gi;
                let bc1 = 1.0 - 0.9f64.powi(t);
                let bc2 = 1.0 - 0.999f64.powi(t);
                w[i] -= 0.1 / bc1 * mo[i] / (ve[i].sqrt() / bc2.sqrt() + 1e-8);
            }
        }
        let got = m.w.val().into_data().to_vec::<f32>().unwrap();
        for i in 0..2 {
            assert!((got[i] as f64 - w[i]).abs() < 1e-6, "{got:?} vs {w:?}");
        }
    }

    #[derive(Module, Debug)]
    struct Pair<B: Backend> {
        a: Param<Tensor<B, 1>>,
        b: Param<Tensor<B, 2>>,
    }

    /// Weights `a`, `b` and the named optimiser state after a run.
    type PairRun = (Vec<f32>, Vec<f32>, Vec<(String, Vec<f32>)>);

    /// Three AdamW steps on two parameters in two learning-rate groups, with
    /// per-parameter updates on at the steps `per_parameter` says: the
    /// weights and moments come out bit for bit as the flat groups'.
    fn pair_run(per_parameter: [bool; 3]) -> PairRun {
        let device = Default::default();
        let mut m = Pair::<AB> {
            a: Param::from_tensor(Tensor::from_floats([0.5, -1.5, 2.0], &device)),
            b: Param::from_tensor(Tensor::from_floats([[1.0, -0.25], [3.0, 0.75]], &device)),
        };
        let mut opt = Optimizer::<NdArray<f32>>::new(OptimizerConfig::default());
        for per in per_parameter {
            opt = opt.with_per_parameter_updates(per);
            let loss = m.a.val().powi_scalar(3).sum() + (m.b.val() * m.b.val().exp()).sum();
            let g = GradientBuffer::collect(&m, &loss.backward(), &|p: &str| p.to_string(), 1.0);
            let lr = |key: &str| if key == "a" { 0.05 } else { 0.2 };
            m = opt.step::<AB, _>(m, g, &|p: &str| p.to_string(), &lr, None);
        }
        let values = |t: Tensor<NdArray<f32>, 1>| t.into_data().to_vec::<f32>().unwrap();
        let state = opt
            .state_tensors()
            .0
            .into_iter()
            .map(|(k, d)| (k, d.to_vec::<f32>().unwrap()))
            .collect();
        (
            values(m.a.val().inner()),
            values(m.b.val().inner().reshape([4])),
            state,
        )
    }

    #[test]
    fn per_parameter_updates_equal_the_flat_groups_bit_for_bit() {
        let flat = pair_run([false; 3]);
        assert_eq!(pair_run([true; 3]), flat);
        // Switching between the two mid-run keeps the state.
        assert_eq!(pair_run([false, true, false]), flat);
        assert_eq!(pair_run([true, false, true]), flat);
        // The run did move the weights.
        assert_ne!(flat.0, vec![0.5, -1.5, 2.0]);
    }

    #[test]
    fn clipping_scales_to_the_global_norm() {
        let m = toy([3.0, 4.0]);
        let mut g = quad_grads(&m); // [6, 8], norm 10
        let before = g.clip_global_norm(5.0).unwrap().into_scalar();
        assert!((before - 10.0).abs() < 1e-5);
        assert!((g.global_norm() - 5.0).abs() < 1e-4);
        // Below the threshold nothing changes.
        let before = g.clip_global_norm(50.0).unwrap().into_scalar();
        assert!((before - 5.0).abs() < 1e-4);
        assert!((g.global_norm() - 5.0).abs() < 1e-4);
        // The host variant (fp16 path) agrees.
        let mut h = quad_grads(&m);
        h.clip_to_norm(5.0, h.global_norm());
        assert!((h.global_norm() - 5.0).abs() < 1e-4);
    }

    #[test]
    fn loss_scale_halves_on_overflow_and_doubles_after_a_finite_run() {
        let mut scaler = LossScaler::default();
        assert!(!scaler.update(false));
        assert_eq!(scaler.scale, 32_768.0);
        for _ in 0..LossScaler::GROWTH_INTERVAL - 1 {
            assert!(scaler.update(true));
        }
        assert_eq!(scaler.scale, 32_768.0);
        assert!(scaler.update(true));
        assert_eq!((scaler.scale, scaler.finite_steps), (65_536.0, 0));
        let mut floor = LossScaler {
            scale: 1.0,
            finite_steps: 7,
        };
        floor.update(false);
        assert_eq!((floor.scale, floor.finite_steps), (1.0, 0));
    }

    #[test]
    fn state_round_trips() {
        let mut m = toy([1.0, -2.0]);
        let mut opt = Optimizer::<NdArray<f32>>::new(OptimizerConfig::default());
        let g = quad_grads(&m);
        m = opt.step::<AB, _>(m, g, &|p: &str| p.to_string(), &|_: &str| 0.1, None);
        let (tensors, steps) = opt.state_tensors();
        let mut map: BTreeMap<String, (Vec<usize>, Vec<f32>)> = tensors
            .into_iter()
            .map(|(k, d)| (k, (d.shape.to_vec(), d.to_vec::<f32>().unwrap())))
            .collect();
        let mut restored = Optimizer::<NdArray<f32>>::new(OptimizerConfig::default());
        restored
            .load_state(&mut map, &steps, &Default::default())
            .unwrap();
        let (m1, m2) = (m.clone(), m);
        let a = opt.step::<AB, _>(
            m1.clone(),
            quad_grads(&m1),
            &|p: &str| p.to_string(),
            &|_: &str| 0.1,
            None,
        );
        let b = restored.step::<AB, _>(
            m2.clone(),
            quad_grads(&m2),
            &|p: &str| p.to_string(),
            &|_: &str| 0.1,
            None,
        );
        assert_eq!(a.w.val().into_data(), b.w.val().into_data());
    }
}
