//! Torch-layout building blocks: `Linear`, `LayerNorm`, the activations and the
//! initialisers the reference uses.
//!
//! Burn's own `Linear` stores its weight as `[d_input, d_output]` and its
//! `LayerNorm` names its parameters `gamma`/`beta`. These keep PyTorch's layout
//! and names (`weight [out, in]`, `bias`), so that every parameter path of an
//! aam-rs model *is* the reference state-dict key and checkpoint import is a
//! table of renames, never a transpose (see `import.rs`).

use std::cell::Cell;

use burn::module::{Initializer, Param};
use burn::prelude::*;
use burn::tensor::{activation, TensorPrimitive};
use serde::{Deserialize, Serialize};

use crate::precision::cast_to;
use aam_kernels::AttentionBackend;

/// How a [`Linear`] is initialised (only matters for training from scratch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinearInit {
    /// PyTorch's `nn.Linear` default: weight and bias `U(±1/√fan_in)`.
    TorchDefault,
    /// Xavier-uniform weight, zero bias (the reference's heads and projections).
    XavierZeroBias,
}

/// Configuration of a torch-layout [`Linear`].
#[derive(Config, Debug)]
pub struct LinearConfig {
    /// Input features.
    pub d_input: usize,
    /// Output features.
    pub d_output: usize,
    /// Whether the layer has a bias. Default: true.
    #[config(default = true)]
    pub bias: bool,
    /// Initialisation. Default: `LinearInit::TorchDefault`.
    #[config(default = "LinearInit::TorchDefault")]
    pub init: LinearInit,
}

/// `y = x·Wᵀ + b`, with `weight` stored PyTorch-style as `[d_output, d_input]`.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// `weight [d_output, d_input]`.
    pub weight: Param<Tensor<B, 2>>,
    /// `bias [d_output]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
}

impl LinearConfig {
    /// Builds the layer.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Linear<B> {
        let fan_in = self.d_input as f64;
        let fan_out = self.d_output as f64;
        let (weight_init, bias_init) = match self.init {
            LinearInit::TorchDefault => {
                let k = 1.0 / fan_in.sqrt();
                let u = Initializer::Uniform { min: -k, max: k };
                (u.clone(), u)
            }
            LinearInit::XavierZeroBias => {
                let a = (6.0 / (fan_in + fan_out)).sqrt();
                (Initializer::Uniform { min: -a, max: a }, Initializer::Zeros)
            }
        };
        Linear {
            weight: weight_init.init([self.d_output, self.d_input], device),
            bias: self.bias.then(|| bias_init.init([self.d_output], device)),
        }
    }
}

impl<B: AttentionBackend> Linear<B> {
    /// Computes in the input's float type: f32 weights are cast to it at use
    /// (mixed precision, see `precision.rs`).
    ///
    /// # Shapes
    /// - input: `[..., d_input]`
    /// - output: `[..., d_output]`
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        let dtype = input.dtype();
        linear(
            input,
            cast_to(self.weight.val(), dtype),
            self.bias_in(dtype),
        )
    }

    /// `input·Wᵀ`, the layer without its bias: for a caller that adds
    /// [`Linear::bias_in`] in the element-wise pass that follows (the
    /// transformer layer, see [`crate::transformer`]), instead of in a pass
    /// of its own.
    ///
    /// # Shapes
    /// - input: `[..., d_input]`
    /// - output: `[..., d_output]`
    pub fn forward_without_bias<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        let dtype = input.dtype();
        linear(input, cast_to(self.weight.val(), dtype), None)
    }

    /// The bias, cast to `dtype` (mixed precision), if the layer has one.
    pub fn bias_in(&self, dtype: burn::tensor::DType) -> Option<Tensor<B, 1>> {
        self.bias.as_ref().map(|b| cast_to(b.val(), dtype))
    }

    /// `self.forward(dropout.forward(activation.forward(input + input_bias)))`,
    /// a feed-forward layer's second half (dropout active only while autodiff
    /// is on, as [`dropout`]; `input_bias` is the first layer's bias where
    /// the caller left it out of `input`, see [`Linear::forward_without_bias`]).
    /// With exact GELU in training, one op
    /// ([`aam_kernels::gelu_dropout_dense`]): on the CubeCL backends its
    /// autodiff node keeps `input` and recomputes the activation in the
    /// backward pass instead of keeping it (a quarter less memory per
    /// layer), with the same values and dropout mask as the ops.
    ///
    /// With `without_bias`, this layer's own bias is left out of the output
    /// for the caller to add (as [`Linear::forward_without_bias`]).
    ///
    /// # Shapes
    /// - input: `[..., d_input]`, input_bias: `[d_input]`
    /// - output: `[..., d_output]`
    pub fn forward_activated<const D: usize>(
        &self,
        input: Tensor<B, D>,
        input_bias: Option<Tensor<B, 1>>,
        activation: Activation,
        dropout: &burn::nn::Dropout,
        without_bias: bool,
    ) -> Tensor<B, D> {
        let dtype = input.dtype();
        let bias = if without_bias {
            None
        } else {
            self.bias_in(dtype)
        };
        let input_bias = input_bias.map(|b| cast_to(b, dtype));
        let training = B::ad_enabled(&input.device()) && dropout.prob > 0.0;
        if activation != Activation::Gelu || !training {
            let input = aam_kernels::with_row_bias(input, input_bias);
            let activated = self::dropout(dropout, activation.forward(input));
            return linear(activated, cast_to(self.weight.val(), dtype), bias);
        }
        let dims = input.dims();
        let [d_output, d_input] = self.weight.dims();
        let rows = dims[..D - 1].iter().product::<usize>();
        let y = aam_kernels::gelu_dropout_dense(
            input.reshape([rows, d_input]),
            input_bias,
            cast_to(self.weight.val(), dtype),
            bias,
            aam_kernels::AttentionDropout {
                prob: dropout.prob,
                seed: next_dropout_seed(),
            },
        );
        let mut out = dims;
        out[D - 1] = d_output;
        y.reshape(out)
    }
}

/// `y = x·Wᵀ + b` over the last axis, with `weight` in torch layout.
///
/// Every input is flattened to one `[rows, d_input]` product and goes through
/// [`aam_kernels::dense`]: Burn's `linear` in value, with a backward that sums
/// the weight and bias gradients over the rows in parts (the ASV level has
/// tens of thousands of rows; on an H100 that made those gradients 7-15x
/// faster, `docs/performance.md`). A product with a unit dimension (one input
/// or output feature, or one row) is a multiply and a sum there (why:
/// [`aam_kernels::matmul`]). Flattening also keeps the fusion backend off the
/// rank-3 batched `linear`, whose gradients Burn 0.21's fusion backend gets
/// wrong on CUDA (the parity suite's count-embedding and predictor cases,
/// 0.66-1.1 relative;
/// `benches/results/2026-11-23_h100_backend_parity_cuda_fusion_batched_linear.log`).
/// The cost: CubeCL's matmul autotune key holds the row count's bucket,
/// which for packed ASVs changes from batch to batch, so a cold machine
/// autotunes tens of shapes (minutes, once; the results are cached).
///
/// # Shapes
/// - x: `[..., d_input]`, weight: `[d_output, d_input]`, bias: `[d_output]`
/// - output: `[..., d_output]`
pub fn linear<B: AttentionBackend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    let dims = x.dims();
    let [d_output, d_input] = weight.dims();
    let rows = dims[..D - 1].iter().product::<usize>();
    let y = aam_kernels::dense(x.reshape([rows, d_input]), weight, bias);
    let mut out = dims;
    out[D - 1] = d_output;
    y.reshape(out)
}

/// Configuration of a torch-named [`LayerNorm`].
#[derive(Config, Debug)]
pub struct LayerNormConfig {
    /// Normalised width.
    pub d_model: usize,
    /// Added to the variance. Default: 1e-5 (PyTorch's default).
    #[config(default = 1e-5)]
    pub eps: f64,
}

/// LayerNorm over the last axis with affine `weight`/`bias` (PyTorch names).
#[derive(Module, Debug)]
pub struct LayerNorm<B: Backend> {
    /// `weight [d_model]` (γ).
    pub weight: Param<Tensor<B, 1>>,
    /// `bias [d_model]` (β).
    pub bias: Param<Tensor<B, 1>>,
    eps: f64,
}

impl LayerNormConfig {
    /// Builds the layer (γ = 1, β = 0).
    pub fn init<B: Backend>(&self, device: &B::Device) -> LayerNorm<B> {
        LayerNorm {
            weight: Initializer::Ones.init([self.d_model], device),
            bias: Initializer::Zeros.init([self.d_model], device),
            eps: self.eps,
        }
    }
}

impl<B: AttentionBackend> LayerNorm<B> {
    /// Biased variance, as `torch.nn.LayerNorm`; through
    /// [`aam_kernels::layer_norm`], whose autodiff node has the closed-form
    /// backward.
    ///
    /// # Shapes
    /// - input / output: `[..., d_model]`
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        aam_kernels::layer_norm(input, self.weight.val(), Some(self.bias.val()), self.eps)
    }
}

/// The feed-forward activation of a transformer stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// Exact (erf) GELU, `nn.GELU()`. The reference default.
    #[default]
    Gelu,
    /// ReLU.
    Relu,
}

impl Activation {
    /// Applies the activation element-wise.
    pub fn forward<B: AttentionBackend, const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Activation::Gelu => gelu(x),
            Activation::Relu => activation::relu(x),
        }
    }
}

/// Exact GELU, `x·Φ(x) = ½·x·(1 + erf(x/√2))`, as `nn.GELU()`, value and
/// gradient.
///
/// Burn 0.21's fused `gelu` computes the erf form forward but differentiates
/// the tanh approximation (`gelu_backward`), off by up to ~9e-4 per element;
/// training would then follow a slightly different gradient than the
/// reference's. Built from `erf` instead, autodiff would keep two extra
/// copies of the feed-forward activation per layer. The backend op
/// ([`aam_kernels::GeluOps::gelu_exact`]) keeps only `x` and differentiates
/// exactly.
pub fn gelu<B: AttentionBackend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::gelu_exact(
        x.into_primitive().tensor(),
    )))
}

/// `dropout.forward(x)` (active only while autodiff is on, as Burn's),
/// through [`aam_kernels::dropout`]: on the CubeCL backends the mask is a
/// hash of a per-call seed and the element index, which the backward pass
/// draws again instead of keeping the mask (Burn's `Dropout` keeps an f32
/// mask as large as `x` for the backward pass); elsewhere it is Burn's.
pub fn dropout<B: AttentionBackend, const D: usize>(
    dropout: &burn::nn::Dropout,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    if !B::ad_enabled(&x.device()) || dropout.prob == 0.0 {
        return x;
    }
    aam_kernels::dropout(
        x,
        aam_kernels::AttentionDropout {
            prob: dropout.prob,
            seed: next_dropout_seed(),
        },
    )
}

/// `residual + dropout(x + bias)`: a residual branch (`bias`, per column of
/// the last axis, the bias of the dense layer that made `x` where the caller
/// left it out), one op on the CubeCL backends
/// ([`aam_kernels::dropout_add`]); dropout only in training, as [`dropout`].
pub fn dropout_add<B: AttentionBackend, const D: usize>(
    dropout: &burn::nn::Dropout,
    residual: Tensor<B, D>,
    x: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    if !B::ad_enabled(&x.device()) || dropout.prob == 0.0 {
        return residual + aam_kernels::with_row_bias(x, bias);
    }
    aam_kernels::dropout_add(
        residual,
        x,
        bias,
        aam_kernels::AttentionDropout {
            prob: dropout.prob,
            seed: next_dropout_seed(),
        },
    )
}

/// `torch.nn.functional.softplus(x, beta=1, threshold=20)`: `ln(1 + eˣ)`, and `x`
/// itself where `x > 20` (Burn's `softplus` has no threshold and overflows).
pub fn softplus<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let linear_region = x.clone().greater_elem(20.0);
    let smooth = x.clone().clamp_max(20.0).exp().log1p();
    smooth.mask_where(linear_region, x)
}

/// Xavier-uniform initialiser for a `[fan_out, fan_in]` matrix.
pub(crate) fn xavier_uniform(fan_in: usize, fan_out: usize) -> Initializer {
    let a = (6.0 / (fan_in + fan_out) as f64).sqrt();
    Initializer::Uniform { min: -a, max: a }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::{TensorData, Tolerance};

    type TB = NdArray<f32>;

    #[test]
    fn linear_is_x_times_w_transposed_plus_b() {
        let device = Default::default();
        let mut layer = LinearConfig::new(2, 3).init::<TB>(&device);
        layer.weight = Param::from_tensor(Tensor::from_floats(
            [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
            &device,
        ));
        layer.bias = Some(Param::from_tensor(Tensor::from_floats(
            [0.5, 0.0, -1.0],
            &device,
        )));
        let y = layer.forward(Tensor::<TB, 2>::from_floats([[1.0, -1.0]], &device));
        y.into_data().assert_approx_eq::<f32>(
            &TensorData::from([[-0.5, -1.0, -2.0]]),
            Tolerance::default(),
        );
    }

    #[test]
    fn softplus_is_linear_above_threshold_and_finite() {
        let device = Default::default();
        let y = softplus(Tensor::<TB, 1>::from_floats(
            [0.0, 30.0, 1000.0, -5.0],
            &device,
        ));
        let expected = [2f32.ln(), 30.0, 1000.0, (1.0 + (-5f32).exp()).ln()];
        y.into_data()
            .assert_approx_eq::<f32>(&TensorData::from(expected), Tolerance::default());
    }

    #[test]
    fn layer_norm_of_zero_vector_is_bias() {
        let device = Default::default();
        let mut norm = LayerNormConfig::new(4).init::<TB>(&device);
        norm.bias = Param::from_tensor(Tensor::from_floats([1.0, 2.0, 3.0, 4.0], &device));
        let y = norm.forward(Tensor::<TB, 2>::zeros([1, 4], &device));
        y.into_data().assert_approx_eq::<f32>(
            &TensorData::from([[1.0, 2.0, 3.0, 4.0]]),
            Tolerance::default(),
        );
    }

    #[test]
    fn gelu_value_and_gradient_are_the_erf_form() {
        use burn::backend::Autodiff;
        type Ad = Autodiff<TB>;
        let device = Default::default();
        let xs: Vec<f32> = (0..61).map(|i| -3.0 + i as f32 * 0.1).collect();
        let x = Tensor::<Ad, 1>::from_floats(xs.as_slice(), &device).require_grad();
        let y = gelu(x.clone());
        let values = y.clone().into_data().to_vec::<f32>().unwrap();
        let grads = x
            .grad(&y.sum().backward())
            .unwrap()
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        for ((x, v), g) in xs.iter().zip(values).zip(grads) {
            let x = *x as f64;
            let pdf = (-x * x / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let cdf = 0.5 * (1.0 + erf(x / std::f64::consts::SQRT_2));
            assert!((v as f64 - x * cdf).abs() < 1e-6, "gelu({x})");
            assert!(
                (g as f64 - (cdf + x * pdf)).abs() < 1e-6,
                "gelu'({x}) = {g}, want {}",
                cdf + x * pdf
            );
        }
    }

    /// erf to ~1e-7 (Numerical Recipes' erfc Chebyshev fit), for test oracles.
    fn erf(x: f64) -> f64 {
        let t = 1.0 / (1.0 + 0.5 * x.abs());
        let poly = -x * x - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87
                                        + t * (-0.822_152_23 + t * 0.170_872_77))))))));
        let y = 1.0 - t * poly.exp();
        if x >= 0.0 {
            y
        } else {
            -y
        }
    }
}

thread_local! {
    /// Seeds of the seeded masks (dropout, nucleotide masking): one per call,
    /// from a counter of the calling thread (set it with
    /// [`set_attention_dropout_seed`] for reproducible training), so no
    /// device→host read is needed per call, and data-parallel replicas, each
    /// on its own thread, draw their own reproducible masks.
    static DROPOUT_SEED: Cell<u32> = const { Cell::new(0x5eed_0001) };
}

/// Sets this thread's counter behind the seeded masks: fused attention's
/// dropout, the transformer layers' dropout and the nucleotide masking on
/// backends with the seeded dropout kernel ([`dropout`]).
pub fn set_attention_dropout_seed(seed: u64) {
    DROPOUT_SEED.with(|s| s.set((seed ^ (seed >> 32)) as u32));
}

/// The next seed of a seeded mask (one per call).
pub(crate) fn next_dropout_seed() -> u32 {
    DROPOUT_SEED.with(|s| {
        let seed = s.get();
        s.set(seed.wrapping_add(0x9e37_79b9));
        seed
    })
}

/// A bool tensor's values on the host.
pub(crate) fn bool_vec<B: Backend, const D: usize>(t: Tensor<B, D, Bool>) -> Vec<bool> {
    t.into_data()
        .convert::<bool>()
        .to_vec::<bool>()
        .expect("bool data")
}
