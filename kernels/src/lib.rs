//! # aam-kernels: fused masked attention and lean-backward ops in CubeCL
//!
//! Job: multi-head attention `softmax(q·kᵀ·scale + mask)·v` with a per-sequence
//! key padding mask, forward and backward, as a Burn backend extension. It knows
//! nothing of AAM: it takes `[N, H, T, Dh]` tensors and an `[N, Tk]` mask, and
//! depends on no `aam-*` crate. The same extension trait carries the other ops
//! whose Burn autodiff costs a training step dearly: exact GELU, LayerNorm and
//! the dense layer, each one node with a lean backward, and dropout whose
//! mask is a hash of a seed and the element index (redrawn in the backward
//! pass, never stored). On a GPU a training step is bound by the host's work
//! per op, so on the CubeCL backends GELU, LayerNorm's forward and backward,
//! the dense backward, the sum over rows and the Adam steps are one op each
//! too (a kernel, or one custom op of Burn's fusion stream), with the tensor
//! ops as the default everywhere else. A dense layer's bias can be left to
//! the element-wise op after it ([`dropout_add`] and [`gelu_dropout`] take
//! one, and sum its gradient in the same pass as the input's), so that on a
//! GPU no pass over a layer's output exists only to add a bias.
//!
//! Why it exists: AAM attention is almost always masked (ASVs padded to 151
//! tokens, samples padded to 1024 ASV slots), and the PyTorch reference's fast
//! path (`mem_efficient` SDPA) was silently wrong with a padding mask on ROCm.
//! The kernels are flash-style (tiled over keys, online softmax, O(T) memory),
//! **skip key tiles that are entirely padding** (a sample with 200 real ASVs
//! out of 1024 slots costs ~200 keys), give a defined zero output for query
//! rows whose keys are all masked (never NaN), and apply attention dropout
//! from a counter-based hash so the backward pass regenerates the same mask
//! without storing it.
//!
//! Which attention kernel runs is decided per call by a plan (the device's
//! runtime and capabilities, the call's type and shape; `attention/plan.rs`),
//! not by settings: the table of what runs where is in the doc of the
//! `attention` module. Library code reads no environment variable.
//!
//! Layout (after Burn's custom-kernel example and its `kernel/<op>/` tree):
//! - `lib.rs`: the [`AttentionBackend`] extension trait, the Backend-generic
//!   calls on tensors ([`dropout`], [`dense`], [`layer_norm`], ...), and
//!   [`matmul`]: Burn's matmul with the unit-dimension products Burn 0.21's
//!   fusion backend gets wrong computed as a multiply and a sum.
//! - `attention/`: masked attention: [`fused_attention`],
//!   [`fused_packed_attention`] (self-attention on the packed projection
//!   `qkv`, its bias added by the kernels as they load it), the plain-tensor
//!   [`reference_attention`] (the parity tests' oracle), the plan
//!   ([`AttentionPlan`]), the launches, and the kernel families (rows, tiled,
//!   `mma`, `cmma`).
//! - `dense.rs`: the dense layer [`dense`], whose gradients sum over rows in
//!   parts (CubeCL's matmul and reduction leave most of a GPU idle on one
//!   long row axis), with [`row_product`] and [`sum_rows`].
//! - `adam.rs`: one Adam/AdamW step of a parameter as one op
//!   ([`AttentionBackend::adam_step`]), and all of a step's as one op under
//!   fusion ([`AttentionBackend::adam_steps`]); on the CubeCL backends one
//!   kernel launch per 32 parameters, which updates the moments in place.
//! - `slots.rs`: [`unpack_rows`], rows computed for the non-empty slots
//!   only put back in their slots, one op each way (the backward gathers).
//! - `norm.rs`: [`layer_norm`] over the last axis, whose autodiff node has
//!   the closed-form backward and adds the gradient its input already has
//!   (a pre-norm block's residual path) as the kernel writes `dx`.
//! - `pool.rs`: [`attention_pool`], the pooling of a row's tokens with a
//!   learned query, one op each way.
//! - `cube.rs`: `#[cube]` helpers several kernels share (the tile element,
//!   fast `exp`, the dropout hash, strided head addressing); `launch.rs`:
//!   their host-side counterparts (dropout arguments, allocation, grids).
//! - `kernel.rs`: the element-wise and row kernels (seeded dropout, GELU,
//!   LayerNorm, column sums, Adam, attention pooling).
//! - `forward.rs`: the trait for CubeCL backends: the launches.
//! - `matmul/`: the dense layers' products. A plan (`matmul/plan.rs`) picks
//!   one of a list of matmul kernels validated at AAM's shapes and layouts
//!   (three of Burn's autotune candidates are wrong at shapes their bucket
//!   admits; `dense_matmul_candidates`), or, with [`MatmulTuning::Autotune`],
//!   CubeCL's tuner times the list; `matmul/tma_tiling.rs`: CubeCL's TMA
//!   double-buffered matmul with a stage shape chosen here;
//!   `matmul/any_rows.rs`: every kernel launched with its row and inner
//!   bounds checks on, so one compiled kernel serves every batch size.
//! - `backward.rs`: the trait for `Autodiff<B>`: saved statistics, gradients.
//! - `fusion.rs`: the trait for Burn's fusion backend `Fusion<B>`: the
//!   kernels as custom operations of the lazy fusion stream.
//!
//! Backends without a kernel (ndarray, candle, libtorch) implement the trait
//! with `has_fused_attention() == false`; callers then run their math path.

use burn::prelude::*;
use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::TensorPrimitive;

mod adam;
mod attention;
mod backward;
mod dense;
mod norm;
mod pool;
mod slots;
pub use adam::{adam_step_ops, AdamItem, AdamStep};
#[cfg(feature = "cubecl")]
pub use attention::plan::{
    AttentionPlan, AttentionShape, Backward as BackwardKernel, DeviceInfo,
    Forward as ForwardKernel, Runtime, MAX_HEAD_DIM,
};
pub use attention::{
    fused_attention, fused_packed_attention, reference_attention, AttentionDropout, KernelChoice,
};
pub use dense::{row_product, sum_rows, ROWS_PER_PART};
pub use slots::{unpack_rows, RowSlots};
#[cfg(feature = "cuda")]
mod collective;
#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "cubecl")]
mod forward;
#[cfg(feature = "fusion")]
mod fusion;
#[cfg(feature = "cubecl")]
mod kernel;
#[cfg(feature = "cubecl")]
mod launch;
#[cfg(feature = "cubecl")]
mod matmul;
#[cfg(feature = "cubecl")]
pub use matmul::{
    dense_matmul_candidates, dense_matmul_plan, launch_matmul, set_matmul_tuning, DenseKernel,
    MatmulShape, MatmulTuning, TmaTiling,
};

/// Keeps compiled CUDA/HIP kernels on disk between runs.
///
/// CubeCL JIT-compiles every kernel of a training step the first time it
/// runs; on CUDA that took ~6 minutes for the default model's step on an
/// H100, every run. CubeCL can keep the compiled code, but only when its
/// configuration asks for it; this asks, next to CubeCL's autotune results
/// (`target/` of the enclosing Cargo workspace, else the user cache
/// directory's `cubecl/`). A `cubecl.toml` that sets `[compilation] cache`
/// wins. Call it once, before the first device is used; later calls, or
/// calls after CubeCL read its configuration, change nothing.
#[cfg(feature = "cubecl")]
pub fn persist_compiled_kernels() {
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
        if config.compilation.cache.is_none() {
            config.compilation.cache = Some(config.autotune.cache.clone());
        }
        // Once CubeCL has loaded its configuration it cannot change (`set`
        // would panic); the run then goes on without the cache.
        let loaded = CubeClRuntimeConfig::storage().lock().is_some();
        if !loaded {
            CubeClRuntimeConfig::set(config);
        }
    });
}

/// Where CubeCL keeps compiled kernels and autotune results for this
/// process (after [`persist_compiled_kernels`]): the root that holds
/// `cuda/`, `hip/` and `autotune/`.
#[cfg(feature = "cubecl")]
pub fn kernel_cache_root() -> std::path::PathBuf {
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    let config = CubeClRuntimeConfig::get();
    config
        .compilation
        .cache
        .as_ref()
        .unwrap_or(&config.autotune.cache)
        .root()
}

/// The backend extensions of aam-rs: masked attention as one fused kernel
/// (where the backend has it), exact GELU and LayerNorm with lean backwards,
/// and a dense layer whose gradients sum over rows in parts.
pub trait AttentionBackend: Backend {
    /// Whether [`AttentionBackend::fused_masked_attention`] runs a kernel here.
    fn has_fused_attention() -> bool {
        false
    }

    /// Whether chains of element-wise ops become one kernel here (Burn's
    /// fusion backend). Code that could batch small tensors into one large
    /// one for fewer launches (the optimiser) need not there: the chain on
    /// each small tensor is already one kernel, and the concatenation itself
    /// would cost a copy per tensor.
    fn fuses_elementwise() -> bool {
        false
    }

    /// Bytes the backend's memory pool holds on `device`, where it reports
    /// them (the CubeCL backends); `None` elsewhere. Diagnostics read it before
    /// and after an operation to see how much the pool had to grow for it.
    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        let _ = device;
        None
    }

    /// Bytes of live tensors in the memory pool on `device`, where the backend
    /// reports them (the CubeCL backends); `None` elsewhere.
    fn memory_in_use(device: &Self::Device) -> Option<u64> {
        let _ = device;
        None
    }

    /// Whether [`AttentionBackend::collective_sum`] sums on the devices here
    /// (CUDA's CubeCL runtime).
    fn has_collectives() -> bool {
        false
    }

    /// Sums each of `tensors` over `devices` with the runtime's collective
    /// library (NCCL on CUDA): every device's thread calls it with tensors of
    /// the same shapes, in the same order, and gets the sums on its own
    /// device, ready to use. `None` where the runtime has no collectives or
    /// the devices repeat; the caller then sums through the host.
    fn collective_sum(
        tensors: Vec<FloatTensor<Self>>,
        devices: &[Self::Device],
    ) -> Option<Vec<FloatTensor<Self>>> {
        let _ = (tensors, devices);
        None
    }

    /// Exact (erf) GELU, `x·Φ(x) = ½·x·(1 + erf(x/√2))`.
    ///
    /// A backend extension for its gradient, not its value: built from
    /// tensor ops, autodiff would keep `x/√2` and `Φ(x)` besides `x` for the
    /// backward pass, two more copies of the feed-forward activation (the
    /// largest of a step) per layer. `Autodiff<B>` overrides it with one node
    /// that keeps only `x` and computes the exact derivative
    /// `Φ(x) + x·φ(x)` in the backward pass. (Burn's own `gelu` keeps only
    /// `x` too, but differentiates the tanh approximation.)
    fn gelu_exact(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let cdf = normal_cdf::<Self>(x.clone());
        Self::float_mul(x, cdf)
    }

    /// The input gradient of [`AttentionBackend::gelu_exact`] at `x`:
    /// `dy·(Φ(x) + x·φ(x))`. Tensor ops by default; one kernel on the CubeCL
    /// backends and one custom op under fusion (a dozen fewer host ops per
    /// feed-forward layer).
    fn gelu_exact_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        // φ(x) = exp(−x²/2)/√(2π)
        let pdf = Self::float_mul_scalar(
            Self::float_exp(Self::float_mul_scalar(
                Self::float_powi_scalar(x.clone(), 2.into()),
                (-0.5).into(),
            )),
            (1.0 / (2.0 * std::f64::consts::PI).sqrt()).into(),
        );
        let derivative = Self::float_add(normal_cdf::<Self>(x.clone()), Self::float_mul(x, pdf));
        Self::float_mul(dy, derivative)
    }

    /// `seeded_dropout(gelu_exact(x + bias))`, the feed-forward's activation
    /// and its dropout (and the bias of the dense layer before it, one value
    /// per column of `x`'s last axis): one kernel and one pass on the CubeCL
    /// backends, where the ops write and read the layer's widest activation
    /// once more each (~0.55 ms per ASV-level layer forward and backward on
    /// an H100 at the reference's batch, and the bias's own pass ~0.45 ms).
    /// Under autodiff the node keeps only `x` (and the bias); its backward is
    /// [`AttentionBackend::gelu_exact_dropout_backward`]. The default is the
    /// ops.
    ///
    /// # Panics
    /// When [`AttentionBackend::has_seeded_dropout`] is false.
    ///
    /// # Shapes
    /// - x: `[..., F]`, bias: `[F]` → output: x's shape
    fn gelu_exact_dropout(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        Self::seeded_dropout(Self::gelu_exact(add_row_bias::<Self>(x, bias)), dropout)
    }

    /// The input gradient of [`AttentionBackend::gelu_exact_dropout`] at
    /// `x + bias`: `gelu_exact_backward(x + bias, seeded_dropout(dy))`, the
    /// mask drawn again. (The bias's gradient is this summed over the rows.)
    fn gelu_exact_dropout_backward(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        Self::gelu_exact_backward(
            add_row_bias::<Self>(x, bias),
            Self::seeded_dropout(dy, dropout),
        )
    }

    /// `(gelu_exact_dropout_backward(x, bias, dy), its sum over the rows)`:
    /// the input gradient and the bias's (`dy` and `x` `[..., F]`, the sum
    /// `[F]`). One pass on the CubeCL backends, where the sum read the
    /// gradient back in a pass of its own; the default is the two ops.
    fn gelu_exact_dropout_backward_column_sum(
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let dx = Self::gelu_exact_dropout_backward(x, bias, dy, dropout);
        let sum = column_sum_last::<Self>(dx.clone());
        (dx, sum)
    }

    /// `dense(gelu_exact_dropout(h, h_bias, dropout), weight, bias)`: a
    /// feed-forward layer's second half, and with `h_bias` the first
    /// layer's bias (so that `h` is the first layer's product without it,
    /// and no pass adds it). Under autodiff one node that keeps `h` and not
    /// the activation: its backward recomputes `gelu_exact_dropout(h)` (one
    /// element-wise pass) for the weight gradient. So a layer keeps one
    /// `[M, F]` activation where it kept two (`F = 4·D`: on the reference's
    /// batch 619 MB per ASV-level layer, a quarter of what a layer keeps for
    /// its backward). The default is the ops.
    ///
    /// # Panics
    /// When [`AttentionBackend::has_seeded_dropout`] is false.
    ///
    /// # Shapes
    /// - h: `[M, F]`, h_bias: `[F]`, weight: `[N, F]`, bias: `[N]`
    /// - output: `[M, N]`
    fn gelu_dropout_dense(
        h: FloatTensor<Self>,
        h_bias: Option<FloatTensor<Self>>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        Self::dense(Self::gelu_exact_dropout(h, h_bias, dropout), weight, bias)
    }

    /// A dense layer on rows, `y = x·wᵀ + b`, weight in torch layout.
    ///
    /// A backend extension for its gradient, not its value: `Autodiff<B>`
    /// overrides it with one node whose backward sums the weight and bias
    /// gradients over the rows in parts (see `dense.rs`: 7-10x faster on an
    /// H100 at AAM's tens of thousands of rows).
    ///
    /// # Shapes
    /// - x: `[M, K]`, weight: `[N, K]`, bias: `[N]`
    /// - output: `[M, N]`
    fn dense(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        dense::dense_forward::<Self>(
            Tensor::from_primitive(TensorPrimitive::Float(x)),
            Tensor::from_primitive(TensorPrimitive::Float(weight)),
            bias.map(|b| Tensor::from_primitive(TensorPrimitive::Float(b))),
        )
        .into_primitive()
        .tensor()
    }

    /// The gradients `(dx, dw, db)` of [`AttentionBackend::dense`] from its
    /// input, weight and output gradient, each only where `want` asks
    /// (`dense.rs`: `dx = dy·w`, and `dw`, `db` summed over the rows in parts).
    ///
    /// The default is tensor ops on this backend; Burn's fusion backend runs
    /// them on its inner backend as one custom op (a dozen fewer ops for the
    /// host to record and fuse per layer: matmuls and reductions, which
    /// fusion would not merge anyway).
    ///
    /// # Shapes
    /// - x: `[M, K]`, weight: `[N, K]`, dy: `[M, N]`
    /// - dx: `[M, K]`, dw: `[N, K]`, db: `[N]`
    #[allow(clippy::type_complexity)]
    fn dense_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        want: [bool; 3],
    ) -> (
        Option<FloatTensor<Self>>,
        Option<FloatTensor<Self>>,
        Option<FloatTensor<Self>>,
    ) {
        let wrap = |t| Tensor::<Self, 2>::from_primitive(TensorPrimitive::Float(t));
        let (dx, dw, db) = dense::dense_backward::<Self>(wrap(x), wrap(weight), wrap(dy), want);
        (
            dx.map(|t| t.into_primitive().tensor()),
            dw.map(|t| t.into_primitive().tensor()),
            db.map(|t| t.into_primitive().tensor()),
        )
    }

    /// LayerNorm over the last axis of rows (biased variance, as
    /// `torch.nn.LayerNorm`), with optional shift.
    ///
    /// A backend extension for its gradient, not its value: `Autodiff<B>`
    /// overrides it with one node whose backward is the closed form (see
    /// `norm.rs`), instead of the backward of each op of Burn's decomposed
    /// `layer_norm`.
    ///
    /// # Shapes
    /// - x: `[..., D]`, gamma / beta: `[D]`
    /// - output: `[..., D]`
    fn lean_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        eps: f64,
    ) -> FloatTensor<Self> {
        // Burn's op: backends may fuse it.
        Self::layer_norm(x, gamma, beta, eps)
    }

    /// One Adam or AdamW step of one parameter: `(param, first, second)`
    /// after it (see [`AdamStep`] for the formulas).
    ///
    /// The default is [`adam_step_ops`], a dozen element-wise ops; the CubeCL
    /// backends run one kernel, and Burn's fusion backend one custom op, so
    /// the host queues one op per parameter instead of a dozen.
    ///
    /// # Shapes
    /// - param, grad, first, second: `[n]`, one float type; outputs the same
    fn adam_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        first: FloatTensor<Self>,
        second: FloatTensor<Self>,
        step: AdamStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let wrap = |t| Tensor::<Self, 1>::from_primitive(TensorPrimitive::Float(t));
        let (p, m, v) = adam_step_ops(wrap(param), wrap(grad), wrap(first), wrap(second), step);
        let unwrap = |t: Tensor<Self, 1>| t.into_primitive().tensor();
        (unwrap(p), unwrap(m), unwrap(v))
    }

    /// The Adam or AdamW steps of many parameters, each as
    /// [`AttentionBackend::adam_step`]: `[param, first, second]` after it,
    /// the parameter in its own shape, the moments flat.
    ///
    /// The default is one flat [`AttentionBackend::adam_step`] per item; the
    /// CubeCL backends launch one kernel per 32 parameters, and Burn's fusion
    /// backend records the whole list as one custom op, where one op a
    /// parameter and the reshapes around it cost the host ~4 ops a parameter
    /// (~700 a step for the default model).
    fn adam_steps(items: Vec<AdamItem<Self>>) -> Vec<[FloatTensor<Self>; 3]> {
        use burn::tensor::TensorMetadata;
        items
            .into_iter()
            .map(|item| {
                let shape = item.param.shape();
                let flat = Shape::new([shape.num_elements()]);
                let (p, m, v) = Self::adam_step(
                    Self::float_reshape(item.param, flat.clone()),
                    Self::float_reshape(item.grad, flat),
                    item.first,
                    item.second,
                    item.step,
                );
                [Self::float_reshape(p, shape), m, v]
            })
            .collect()
    }

    /// LayerNorm over the last axis of rows with the statistics its backward
    /// needs: `(y, x̂, r)`, `x̂ = (x − mean)·r`, `r = 1/√(var + ε)` (biased
    /// variance), `y = x̂·γ (+ β)`.
    ///
    /// The default is a dozen tensor ops (`norm.rs`); the CubeCL backends run
    /// one kernel, and Burn's fusion backend one custom op: on a GPU the
    /// training step is bound by the host's work per op.
    ///
    /// # Shapes
    /// - x: `[M, D]`, gamma / beta: `[D]`
    /// - y, x̂: `[M, D]`, r: `[M, 1]`
    fn layer_norm_with_stats(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (y, normalised, r) = norm::layer_norm_with_stats_ops::<Self>(
            Tensor::from_primitive(TensorPrimitive::Float(x)),
            Tensor::from_primitive(TensorPrimitive::Float(gamma)),
            beta.map(|b| Tensor::from_primitive(TensorPrimitive::Float(b))),
            eps,
        );
        (
            y.into_primitive().tensor(),
            normalised.into_primitive().tensor(),
            r.into_primitive().tensor(),
        )
    }

    /// Attention pooling over each row's tokens (`pool.rs`): the pooled rows
    /// and each row's log-sum-exp of its scores, for the backward. `valid`
    /// is 1 at tokens that count and 0 at padding. The default is tensor
    /// ops; the CubeCL backends run one kernel that reads `x` once, and
    /// Burn's fusion backend one custom op.
    ///
    /// # Shapes
    /// - x: `[N, T, D]`, query: `[D]`, valid: `[N, T]`
    /// - pooled: `[N, D]`, lse: `[N]` (f32 on the CubeCL backends)
    fn attention_pool_with_stats(
        x: FloatTensor<Self>,
        query: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (pooled, lse) = pool::attention_pool_ops::<Self>(
            Tensor::from_primitive(TensorPrimitive::Float(x)),
            Tensor::from_primitive(TensorPrimitive::Float(query)),
            Tensor::from_primitive(TensorPrimitive::Float(valid)),
            scale,
        );
        (
            pooled.into_primitive().tensor(),
            lse.into_primitive().tensor(),
        )
    }

    /// `(dx, dquery)` of [`AttentionBackend::attention_pool_with_stats`]
    /// from its inputs, its `lse` and the pooled rows' gradient (the closed
    /// form of `pool.rs`).
    ///
    /// # Shapes
    /// - x: `[N, T, D]`, query: `[D]`, valid: `[N, T]`, lse: `[N]`, dy: `[N, D]`
    /// - dx: `[N, T, D]`, dquery: `[D]`
    fn attention_pool_backward(
        x: FloatTensor<Self>,
        query: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let wrap3 = |t| Tensor::<Self, 3>::from_primitive(TensorPrimitive::Float(t));
        let (dx, dquery) = pool::attention_pool_backward_ops::<Self>(
            wrap3(x),
            Tensor::from_primitive(TensorPrimitive::Float(query)),
            Tensor::from_primitive(TensorPrimitive::Float(valid)),
            Tensor::from_primitive(TensorPrimitive::Float(lse)),
            Tensor::from_primitive(TensorPrimitive::Float(dy)),
            scale,
        );
        (
            dx.into_primitive().tensor(),
            dquery.into_primitive().tensor(),
        )
    }

    /// The pooled rows of [`AttentionBackend::attention_pool_with_stats`];
    /// under autodiff one node whose backward is
    /// [`AttentionBackend::attention_pool_backward`].
    ///
    /// # Shapes
    /// - x: `[N, T, D]`, query: `[D]`, valid: `[N, T]`
    /// - output: `[N, D]`
    fn attention_pool(
        x: FloatTensor<Self>,
        query: FloatTensor<Self>,
        valid: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        Self::attention_pool_with_stats(x, query, valid, scale).0
    }

    /// LayerNorm's backward from [`AttentionBackend::layer_norm_with_stats`]'s
    /// `x̂` and `r`: `(dx, dγ, dβ)` (the closed form of `norm.rs`; dγ and dβ
    /// summed over the rows in parts), with `dx_add` (the input's gradient
    /// along its other paths, e.g. a residual connection) added to `dx` in
    /// the same pass. One kernel launch sequence and one custom op where the
    /// backend has them, else tensor ops.
    ///
    /// # Shapes
    /// - normalised, dy, dx_add: `[M, D]`, r: `[M, 1]`, gamma: `[D]`
    /// - dx: `[M, D]`, dγ / dβ: `[D]`
    fn layer_norm_backward(
        normalised: FloatTensor<Self>,
        r: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        dx_add: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dgamma, dbeta) = norm::layer_norm_backward_ops::<Self>(
            Tensor::from_primitive(TensorPrimitive::Float(normalised)),
            Tensor::from_primitive(TensorPrimitive::Float(r)),
            Tensor::from_primitive(TensorPrimitive::Float(gamma)),
            Tensor::from_primitive(TensorPrimitive::Float(dy)),
        );
        let dx = match dx_add {
            Some(add) => dx + Tensor::from_primitive(TensorPrimitive::Float(add)),
            None => dx,
        };
        (
            dx.into_primitive().tensor(),
            dgamma.into_primitive().tensor(),
            dbeta.into_primitive().tensor(),
        )
    }

    /// `a·b` for the dense layers' backward products (rank 2, or rank 3
    /// batched over the leading axis; no unit inner dimensions: see
    /// [`matmul`]). The default is the backend's matmul. CubeCL backends
    /// autotune over kernels validated at AAM's shapes and layouts only, not
    /// over all of Burn's candidates, some of which are wrong for some row
    /// counts (`forward.rs`, `dense_matmul_candidates`).
    fn dense_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(a, b)
    }

    /// The sum over the rows, in parts ([`sum_rows`]): one op where the
    /// backend has the kernel (instead of a split, reshapes and two sums).
    ///
    /// # Shapes
    /// - t: `[M, N]`
    /// - output: `[N]`
    fn column_sum(t: FloatTensor<Self>) -> FloatTensor<Self> {
        sum_rows::<Self>(Tensor::from_primitive(TensorPrimitive::Float(t)))
            .into_primitive()
            .tensor()
    }

    /// Packed rows back in their slots and `fill` in the others
    /// ([`unpack_rows`]). The default is a concatenation and a gather; under
    /// autodiff it is one node whose backward is
    /// [`AttentionBackend::unpack_rows_backward`], and under fusion one
    /// custom op each way.
    ///
    /// # Shapes
    /// - packed: `[M, W]`, fill: `[1, W]`
    /// - output: `[slots, W]`
    fn unpack_rows(
        packed: FloatTensor<Self>,
        fill: FloatTensor<Self>,
        slots: &RowSlots,
    ) -> FloatTensor<Self> {
        slots::unpack_rows_ops::<Self>(packed, fill, slots)
    }

    /// [`AttentionBackend::unpack_rows`]' backward: `(dpacked, dfill)`, the
    /// gradients of the non-empty slots gathered and those of the empty
    /// slots summed.
    ///
    /// # Shapes
    /// - dout: `[slots, W]`
    /// - dpacked: `[M, W]`, dfill: `[1, W]`
    fn unpack_rows_backward(
        dout: FloatTensor<Self>,
        slots: &RowSlots,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        slots::unpack_rows_backward_ops::<Self>(dout, slots)
    }

    /// Whether [`AttentionBackend::seeded_dropout`] runs a kernel here.
    fn has_seeded_dropout() -> bool {
        false
    }

    /// Dropout whose mask is a hash of `(seed, element index)`: element `i`
    /// of the contiguous tensor is kept, scaled by `1/(1−p)`, where the hash
    /// is at least `p·2³²`. The same seed gives the same mask, so the backward
    /// pass is this op again on the output gradient, and `Autodiff<B>` keeps
    /// no mask (Burn's `Dropout` keeps its f32 mask for the backward pass: on
    /// a real-sized batch ~190 MiB per ASV-level layer).
    ///
    /// # Panics
    /// When [`AttentionBackend::has_seeded_dropout`] is false.
    fn seeded_dropout(x: FloatTensor<Self>, dropout: AttentionDropout) -> FloatTensor<Self> {
        let _ = (x, dropout);
        panic!("this backend has no seeded dropout kernel; use aam_kernels::dropout")
    }

    /// `(seeded_dropout(dy), its sum over the rows)` (`dy [..., N]`, the sum
    /// `[N]`): the gradients of `x` and of the bias of
    /// [`AttentionBackend::seeded_dropout_add`]. One pass on the CubeCL
    /// backends; the default is the two ops.
    ///
    /// # Panics
    /// When [`AttentionBackend::has_seeded_dropout`] is false.
    fn seeded_dropout_column_sum(
        dy: FloatTensor<Self>,
        dropout: AttentionDropout,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let dx = Self::seeded_dropout(dy, dropout);
        let sum = column_sum_last::<Self>(dx.clone());
        (dx, sum)
    }

    /// `residual + seeded_dropout(x + bias)` (residual and x of the same
    /// shape and type, bias one value per column of their last axis): a
    /// transformer layer's residual branch, with the bias of the dense layer
    /// that made `x`, as one op and one pass (CubeCL backends), where the
    /// bias, the dropout and the add are a pass each. Under autodiff the
    /// residual's gradient is the output's, `x`'s the seeded dropout of it,
    /// and the bias's that summed over the rows. The default is the ops.
    ///
    /// # Panics
    /// When [`AttentionBackend::has_seeded_dropout`] is false.
    fn seeded_dropout_add(
        residual: FloatTensor<Self>,
        x: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        dropout: AttentionDropout,
    ) -> FloatTensor<Self> {
        Self::float_add(
            residual,
            Self::seeded_dropout(add_row_bias::<Self>(x, bias), dropout),
        )
    }

    /// Fused masked self-attention on the packed projection `qkv` (torch's
    /// `in_proj` output: per row the query, key and value, `D = H·Dh` wide
    /// each, head `h` at columns `h·Dh..(h+1)·Dh` of each), to the
    /// merged-heads context: one op instead of the split into heads, the
    /// attention and the merge (`packed.rs` says what that saves a step).
    ///
    /// The output of [`AttentionBackend::packed_attention_forward`];
    /// `Autodiff` overrides it with one node whose backward is
    /// [`AttentionBackend::packed_attention_backward`].
    ///
    /// `bias`, where given, is the input projection's bias, added to `qkv`
    /// as the kernels load it (`kernel.rs`, `bias_at`, says why); the
    /// `Autodiff` node's gradient for it is the column sum of `dqkv`.
    ///
    /// # Shapes
    /// - qkv: `[N, T, 3D]`, D divisible by `heads`, Dh ≤ 128; bias: `[3D]`
    /// - key_padding_mask: `[N, T]`, `true` = ignore this key
    /// - output: `[N, T, D]`; rows whose keys are all masked are 0
    ///
    /// # Panics
    /// When [`AttentionBackend::has_fused_attention`] is false.
    fn fused_packed_attention(
        qkv: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        key_padding_mask: Option<BoolTensor<Self>>,
        heads: usize,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> FloatTensor<Self> {
        Self::packed_attention_forward(qkv, bias, key_padding_mask, heads, scale, dropout, kernels)
            .0
    }

    /// The packed forward with its saved statistics: `(out [N, T, D], lse
    /// [N, H, T])`. The default splits the heads and runs
    /// [`AttentionBackend::fused_attention_forward`]; Burn's fusion backend
    /// makes that one custom op. On the CubeCL backends the row and `mma`
    /// kernels read the heads of `qkv` in place and write `out` merged
    /// (strided views and element offsets: no split or merge copies); the
    /// `cmma` kernels (f16/bf16 where there is no `mma.sync`) take the
    /// default. `kernels` constrains the plan.
    fn packed_attention_forward(
        qkv: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        key_padding_mask: Option<BoolTensor<Self>>,
        heads: usize,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        attention::packed::packed_forward_ops::<Self>(
            qkv,
            bias,
            key_padding_mask,
            heads,
            scale,
            dropout,
            kernels,
        )
    }

    /// The packed backward: `dqkv [N, T, 3D]` from the forward's input,
    /// output (`[N, T, D]`) and `lse`, and the output gradient `dout
    /// [N, T, D]`. The default runs
    /// [`AttentionBackend::fused_attention_backward`] on the split heads and
    /// writes the three gradients into `dqkv` in one concatenation; Burn's
    /// fusion backend makes that one custom op. On the CubeCL backends the
    /// row, tiled and `mma` kernels read `qkv`, `out` and `dout` in place and
    /// write dQ, dK and dV straight into their thirds of `dqkv`. `bias` as in the forward (the
    /// gradient of `qkv + bias` is the same `dqkv`).
    #[allow(clippy::too_many_arguments)]
    fn packed_attention_backward(
        qkv: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        key_padding_mask: Option<BoolTensor<Self>>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> FloatTensor<Self> {
        attention::packed::packed_backward_ops::<Self>(
            qkv,
            bias,
            key_padding_mask,
            out,
            lse,
            dout,
            heads,
            scale,
            dropout,
            kernels,
        )
    }

    /// Fused masked attention.
    ///
    /// # Shapes
    /// - q: `[N, H, Tq, Dh]`, k / v: `[N, H, Tk, Dh]`, Dh ≤ 128
    /// - key_padding_mask: `[N, Tk]`, `true` = ignore this key
    /// - output: `[N, H, Tq, Dh]`; rows whose keys are all masked are 0
    ///
    /// The output of [`AttentionBackend::fused_attention_forward`]; `Autodiff`
    /// overrides it to record the backward pass.
    ///
    /// # Panics
    /// When [`AttentionBackend::has_fused_attention`] is false.
    fn fused_masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> FloatTensor<Self> {
        Self::fused_attention_forward(q, k, v, key_padding_mask, scale, dropout, kernels).0
    }

    /// The forward kernel with its saved statistics: `(output, lse)`, where
    /// `lse [N, H, Tq]` (f32) is each row's log-sum-exp of scaled scores.
    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let _ = (q, k, v, key_padding_mask, scale, dropout, kernels);
        panic!("this backend has no fused attention kernel; use the math path")
    }

    /// The backward kernels: `(dq, dk, dv)` from the forward's inputs, output
    /// and `lse`, and the output gradient `dout`.
    #[allow(clippy::too_many_arguments)]
    fn fused_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding_mask: Option<BoolTensor<Self>>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dout: FloatTensor<Self>,
        scale: f64,
        dropout: AttentionDropout,
        kernels: KernelChoice,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let _ = (
            q,
            k,
            v,
            key_padding_mask,
            out,
            lse,
            dout,
            scale,
            dropout,
            kernels,
        );
        panic!("this backend has no fused attention kernel; use the math path")
    }
}

/// `Φ(x) = ½·(1 + erf(x/√2))`, the standard normal CDF.
pub(crate) fn normal_cdf<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let erf = B::float_erf(B::float_mul_scalar(
        x,
        std::f64::consts::FRAC_1_SQRT_2.into(),
    ));
    B::float_mul_scalar(B::float_add_scalar(erf, 1.0.into()), 0.5.into())
}

/// Dropout with probability `dropout.prob` (the caller decides whether it
/// is training). Where the backend has the kernel
/// ([`AttentionBackend::has_seeded_dropout`]: the CubeCL backends) the mask
/// is a hash of `(dropout.seed, element index)` and autodiff keeps none;
/// elsewhere it is Burn's `Dropout` (a Bernoulli mask from the backend's
/// RNG, `seed` unused).
pub fn dropout<B: AttentionBackend, const D: usize>(
    x: Tensor<B, D>,
    dropout: AttentionDropout,
) -> Tensor<B, D> {
    if dropout.prob <= 0.0 {
        return x;
    }
    if B::has_seeded_dropout() {
        return Tensor::from_primitive(TensorPrimitive::Float(B::seeded_dropout(
            x.into_primitive().tensor(),
            dropout,
        )));
    }
    let keep = 1.0 - dropout.prob;
    let mask = x.random_like(burn::tensor::Distribution::Bernoulli(keep));
    x * mask * (1.0 / keep)
}

/// `residual + dropout(x + bias)` ([`dropout`]; `bias` per column of the
/// last axis, where given), one op where the backend has the seeded kernel
/// ([`AttentionBackend::seeded_dropout_add`]), else the ops.
///
/// # Shapes
/// - residual, x: the same shape, bias: `[x's last axis]` → output: x's shape
pub fn dropout_add<B: AttentionBackend, const D: usize>(
    residual: Tensor<B, D>,
    x: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
    dropout: AttentionDropout,
) -> Tensor<B, D> {
    assert_eq!(residual.dims(), x.dims(), "dropout_add: shapes differ");
    if seeded_dropout_runs::<B>() {
        return Tensor::from_primitive(TensorPrimitive::Float(B::seeded_dropout_add(
            residual.into_primitive().tensor(),
            x.into_primitive().tensor(),
            bias.map(|b| b.into_primitive().tensor()),
            dropout,
        )));
    }
    residual + crate::dropout(with_row_bias(x, bias), dropout)
}

/// `dropout(gelu(x + bias))` with the exact (erf) GELU (`bias` per column
/// of the last axis, where given): one op where the backend has the seeded
/// dropout kernel ([`AttentionBackend::gelu_exact_dropout`]; the same mask
/// as [`dropout`] with the same seed), else the ops.
pub fn gelu_dropout<B: AttentionBackend, const D: usize>(
    x: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
    dropout: AttentionDropout,
) -> Tensor<B, D> {
    if seeded_dropout_runs::<B>() {
        return Tensor::from_primitive(TensorPrimitive::Float(B::gelu_exact_dropout(
            x.into_primitive().tensor(),
            bias.map(|b| b.into_primitive().tensor()),
            dropout,
        )));
    }
    let x = with_row_bias(x, bias).into_primitive().tensor();
    crate::dropout(
        Tensor::from_primitive(TensorPrimitive::Float(B::gelu_exact(x))),
        dropout,
    )
}

/// `dense(gelu_dropout(h, h_bias), weight, bias)` ([`dense`],
/// [`gelu_dropout`]): where the backend has the seeded dropout kernel one
/// op whose autodiff node keeps `h` instead of the activation
/// ([`AttentionBackend::gelu_dropout_dense`]), else the ops.
///
/// # Shapes
/// - h: `[M, F]`, h_bias: `[F]`, weight: `[N, F]`, bias: `[N]`
/// - output: `[M, N]`
pub fn gelu_dropout_dense<B: AttentionBackend>(
    h: Tensor<B, 2>,
    h_bias: Option<Tensor<B, 1>>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    dropout: AttentionDropout,
) -> Tensor<B, 2> {
    if seeded_dropout_runs::<B>() {
        return Tensor::from_primitive(TensorPrimitive::Float(B::gelu_dropout_dense(
            h.into_primitive().tensor(),
            h_bias.map(|b| b.into_primitive().tensor()),
            weight.into_primitive().tensor(),
            bias.map(|b| b.into_primitive().tensor()),
            dropout,
        )));
    }
    dense(gelu_dropout(h, h_bias, dropout), weight, bias)
}

/// Whether [`dropout_add`] and [`gelu_dropout`] run as one op, the seeded
/// kernel's: where the backend has it,
/// and for `dropout_add` also at p = 0, where it still adds the bias and
/// the residual in one pass.
///
/// A caller that moves a dense layer's bias into them (as the transformer
/// layer does) saves that bias's own pass exactly where this holds.
pub fn seeded_dropout_runs<B: AttentionBackend>() -> bool {
    B::has_seeded_dropout()
}

/// `x + bias` with `bias [W]` broadcast over the rows of `x [..., W]`; `x`
/// itself where there is no bias.
pub fn with_row_bias<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    match bias {
        Some(bias) => x + bias.unsqueeze(),
        None => x,
    }
}

/// `t [..., W]` summed over everything but its last axis, `[W]`: a
/// per-column bias's gradient ([`AttentionBackend::column_sum`]).
pub(crate) fn column_sum_last<B: AttentionBackend>(t: FloatTensor<B>) -> FloatTensor<B> {
    B::column_sum(as_rows::<B>(t))
}

/// `t [..., W]` as rows of its last axis, `[M, W]` (a reshape of the
/// tensor itself: under autodiff, of the inner tensor, recorded by no node).
pub(crate) fn as_rows<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    let shape = t.shape();
    let width = shape[shape.num_dims() - 1];
    let rows = shape.num_elements() / width.max(1);
    B::float_reshape(t, Shape::new([rows, width]))
}

/// `x + bias` with `bias [W]` broadcast over `x`'s rows (`x [..., W]`); `x`
/// itself where there is no bias.
fn add_row_bias<B: Backend>(x: FloatTensor<B>, bias: Option<FloatTensor<B>>) -> FloatTensor<B> {
    use burn::tensor::TensorMetadata;
    let Some(bias) = bias else {
        return x;
    };
    let rank = x.shape().num_dims();
    let mut dims = vec![1; rank];
    dims[rank - 1] = bias.shape()[0];
    B::float_add(x, B::float_reshape(bias, Shape::from(dims)))
}

/// A dense layer on rows, `y = x·wᵀ + b` with `weight` in torch layout
/// (`[d_output, d_input]`), through [`AttentionBackend::dense`]: the same
/// values as Burn's `linear`, and under autodiff a backward that sums the
/// weight and bias gradients over the rows in parts.
///
/// # Shapes
/// - x: `[M, K]`, weight: `[N, K]`, bias: `[N]`
/// - output: `[M, N]`
pub fn dense<B: AttentionBackend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(B::dense(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        bias.map(|b| b.into_primitive().tensor()),
    )))
}

/// LayerNorm over the last axis, through
/// [`AttentionBackend::lean_layer_norm`]: Burn's `layer_norm` in value, and
/// under autodiff one node with the closed-form backward, whose parent is
/// `x` itself (its rows are taken inside the node), so that it can add
/// the gradient `x` has from a residual path in the same pass.
///
/// # Shapes
/// - x: `[..., D]`, gamma / beta: `[D]`
/// - output: `[..., D]`
pub fn layer_norm<B: AttentionBackend, const R: usize>(
    x: Tensor<B, R>,
    gamma: Tensor<B, 1>,
    beta: Option<Tensor<B, 1>>,
    eps: f64,
) -> Tensor<B, R> {
    Tensor::from_primitive(TensorPrimitive::Float(B::lean_layer_norm(
        x.into_primitive().tensor(),
        gamma.into_primitive().tensor(),
        beta.map(|b| b.into_primitive().tensor()),
        eps,
    )))
}

/// Attention pooling of each row's tokens with a learned query (reference
/// §1.4; `pool.rs`): scores `x·query·scale`, a softmax over the tokens where
/// `valid` (uniform weights for a row with none), and the weighted sum,
/// through [`AttentionBackend::attention_pool`] (one kernel each way on the
/// CubeCL backends).
///
/// # Shapes
/// - x: `[N, T, D]`, query: `[D]`, valid: `[N, T]` (true = counts)
/// - output: `[N, D]`
pub fn attention_pool<B: AttentionBackend>(
    x: Tensor<B, 3>,
    query: Tensor<B, 1>,
    valid: Tensor<B, 2, Bool>,
    scale: f64,
) -> Tensor<B, 2> {
    let valid = valid.float().cast(x.dtype());
    Tensor::from_primitive(TensorPrimitive::Float(B::attention_pool(
        x.into_primitive().tensor(),
        query.into_primitive().tensor(),
        valid.into_primitive().tensor(),
        scale,
    )))
}

/// `a·b` over the last two axes (batch axes broadcast as `Tensor::matmul`),
/// except that a product with a unit dimension (`m`, `k` or `n` = 1:
/// matrix-vector, vector-matrix, outer product) is a broadcast multiply and a
/// sum instead of a matmul.
///
/// Why: Burn 0.21's fusion backend autotunes such products, and their
/// backward (which has the unit dimension in another place), over
/// vector-matrix kernels that assume `m = 1` and a row-major right-hand side
/// without checking (tracel-ai/burn#5122, tracel-ai/cubek#262), and can keep
/// a wrong result as the fastest: the gradients of a one-output head or of
/// attention over one key came out 10-100% off on an H100. A multiply and a
/// sum is an element-wise op and a reduction for every backend, as fast for
/// these thin shapes, and its backward is again element-wise.
///
/// # Shapes
/// - a: `[..., m, k]`, b: `[..., k, n]` (batch axes equal or 1)
/// - output: `[..., m, n]`
pub fn matmul<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    let [m, k] = [a.dims()[D - 2], a.dims()[D - 1]];
    let n = b.dims()[D - 1];
    if (m > 1 && k > 1 && n > 1) || D > 4 {
        return a.matmul(b);
    }
    // In rank 5, padded with leading unit axes: `[.., m, k, 1] · [.., 1, k, n]`
    // summed over k (axis 3) is `[.., m, 1, n]`. Written through rank 5
    // because Burn's ranks are const generics.
    let (a_dims, b_dims) = (a.dims(), b.dims());
    let a = a.reshape(rank5(&a_dims, [m, k, 1]));
    let b = b.reshape(rank5(&b_dims, [1, k, n]));
    let mut out = [0; D];
    for i in 0..D - 2 {
        out[i] = a_dims[i].max(b_dims[i]);
    }
    out[D - 2] = m;
    out[D - 1] = n;
    (a * b).sum_dim(3).reshape(out)
}

/// The batch axes of `dims` followed by `last`, padded with leading unit
/// axes to rank 5 (for [`matmul`]).
fn rank5<const D: usize>(dims: &[usize; D], last: [usize; 3]) -> [usize; 5] {
    let mut out = [1; 5];
    let batch = &dims[..D - 2];
    out[2 - batch.len()..2].copy_from_slice(batch);
    out[2..].copy_from_slice(&last);
    out
}

#[cfg(feature = "ndarray")]
impl AttentionBackend for burn::backend::NdArray<f32> {}
#[cfg(feature = "ndarray")]
impl AttentionBackend for burn::backend::NdArray<f64> {}

#[cfg(feature = "candle")]
#[allow(deprecated)] // burn-candle: deprecated upstream after 0.21, kept while it works
impl<F, I> AttentionBackend for burn::backend::Candle<F, I>
where
    burn::backend::Candle<F, I>: Backend,
    F: burn::backend::candle::FloatCandleElement,
    I: burn::backend::candle::IntCandleElement,
{
}

#[cfg(feature = "tch")]
impl<E> AttentionBackend for burn::backend::LibTorch<E> where burn::backend::LibTorch<E>: Backend {}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Distribution, Tolerance};

    type Ad = Autodiff<NdArray<f32>>;

    /// `matmul` against `Tensor::matmul`, value and both gradients, for every
    /// unit-dimension shape (and a general one), ranks 2-4, broadcast batches.
    #[test]
    fn matmul_with_unit_dimensions_equals_matmul() {
        let device = Default::default();
        fn check<const D: usize>(
            a: [usize; D],
            b: [usize; D],
            device: &burn::backend::ndarray::NdArrayDevice,
        ) {
            let a = Tensor::<Ad, D>::random(a, Distribution::Normal(0.0, 1.0), device);
            let b = Tensor::<Ad, D>::random(b, Distribution::Normal(0.0, 1.0), device);
            let run = |thin: bool| {
                let (a, b) = (a.clone().require_grad(), b.clone().require_grad());
                let out = if thin {
                    matmul(a.clone(), b.clone())
                } else {
                    a.clone().matmul(b.clone())
                };
                // A non-uniform output gradient.
                let w = Tensor::<Ad, D>::ones(out.dims(), device).cumsum(D - 1);
                let grads = (out.clone() * w).sum().backward();
                let ga = a.grad(&grads).unwrap().into_data();
                let gb = b.grad(&grads).unwrap().into_data();
                (out.into_data(), ga, gb)
            };
            let (want, got) = (run(false), run(true));
            let tol = Tolerance::<f32>::rel_abs(1e-5, 1e-5);
            want.0.assert_approx_eq::<f32>(&got.0, tol);
            want.1.assert_approx_eq::<f32>(&got.1, tol);
            want.2.assert_approx_eq::<f32>(&got.2, tol);
        }
        check([5, 3], [3, 1], &device); // matrix-vector
        check([1, 3], [3, 4], &device); // vector-matrix
        check([5, 1], [1, 4], &device); // outer product
        check([1, 3], [3, 1], &device); // inner product
        check([2, 5, 3], [1, 3, 1], &device); // broadcast batch
        check([2, 1, 7], [2, 7, 4], &device);
        check([2, 3, 6, 4], [2, 3, 4, 1], &device); // attention over one key
        check([2, 3, 1, 4], [2, 3, 4, 6], &device); // one query
        check([2, 3, 6, 1], [2, 3, 1, 4], &device);
        check([2, 3, 6, 4], [2, 3, 4, 5], &device); // general: Tensor::matmul
    }
}
