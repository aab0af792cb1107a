//! §1.3 `TransformerEncoder`: a stack of pre-norm `nn.TransformerEncoderLayer`s
//! (`norm_first=True`, `batch_first=True`) plus a final LayerNorm with eps 1e-6.
//!
//! Written here rather than taken from burn-nn because burn-nn's layer differs
//! from torch's in ways that change numbers or names: it drops out raw scores
//! instead of probabilities, fills masks with -1e4, swaps `norm_1`/`norm_2`
//! and keeps separate q/k/v projections.

use aam_kernels::AttentionBackend;
use burn::nn::{Dropout, DropoutConfig};
use burn::prelude::*;

use crate::attention::{AttnImplementation, MultiheadAttention, MultiheadAttentionConfig};
use crate::nn::{dropout_add, Activation, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use crate::precision::{cast_to, compute_dtype};

/// Configuration of one [`TransformerEncoderLayer`].
#[derive(Config, Debug)]
pub struct TransformerEncoderLayerConfig {
    /// Model width D (`d_model`).
    pub d_model: usize,
    /// Attention heads H (`nhead`).
    pub num_heads: usize,
    /// Feed-forward width F (`dim_feedforward`).
    pub dim_feedforward: usize,
    /// Dropout p at every site of the layer. Default: 0.1.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Feed-forward activation. Default: gelu.
    #[config(default = "Activation::Gelu")]
    pub activation: Activation,
    /// Attention implementation. Default: auto.
    #[config(default = "AttnImplementation::Auto")]
    pub attn_implementation: AttnImplementation,
}

/// `nn.TransformerEncoderLayer(norm_first=True)`; field order = state-dict order.
#[derive(Module, Debug)]
pub struct TransformerEncoderLayer<B: Backend> {
    /// `self_attn.*`
    pub self_attn: MultiheadAttention<B>,
    /// `linear1 [F, D]`
    pub linear1: Linear<B>,
    dropout: Dropout,
    /// `linear2 [D, F]`
    pub linear2: Linear<B>,
    /// `norm1` (before attention), eps 1e-5.
    pub norm1: LayerNorm<B>,
    /// `norm2` (before the feed-forward), eps 1e-5.
    pub norm2: LayerNorm<B>,
    dropout1: Dropout,
    dropout2: Dropout,
    #[module(skip)]
    activation: Activation,
}

impl TransformerEncoderLayerConfig {
    /// Builds the layer with torch's initialisation.
    pub fn init<B: Backend>(&self, device: &B::Device) -> TransformerEncoderLayer<B> {
        let dropout = || DropoutConfig::new(self.dropout).init();
        TransformerEncoderLayer {
            self_attn: MultiheadAttentionConfig::new(self.d_model, self.num_heads)
                .with_dropout(self.dropout)
                .with_attn_implementation(self.attn_implementation)
                .init(device),
            linear1: LinearConfig::new(self.d_model, self.dim_feedforward).init(device),
            dropout: dropout(),
            linear2: LinearConfig::new(self.dim_feedforward, self.d_model).init(device),
            norm1: LayerNormConfig::new(self.d_model).init(device),
            norm2: LayerNormConfig::new(self.d_model).init(device),
            dropout1: dropout(),
            dropout2: dropout(),
            activation: self.activation,
        }
    }
}

impl<B: AttentionBackend> TransformerEncoderLayer<B> {
    /// # Shapes
    /// - x: `[N, T, D]`, key_padding_mask: `[N, T]` (true = ignore)
    /// - output: `[N, T, D]`
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        key_padding_mask: Option<Tensor<B, 2, Bool>>,
    ) -> Tensor<B, 3> {
        // Mixed precision: the residual stream and the norms stay in x's type
        // (f32); attention and the feed-forward run in the scope's low type.
        let residual_dtype = x.dtype();
        let compute_dtype = compute_dtype().unwrap_or(residual_dtype);
        let low = |t: Tensor<B, 3>| cast_to(t, compute_dtype);
        let back = |t: Tensor<B, 3>| cast_to(t, residual_dtype);
        // Where the seeded dropout kernels run in training, the biases of
        // the attention's output projection and of both feed-forward layers
        // are added by the element-wise pass after each (dropout plus
        // residual, GELU) instead of in a pass of their own: on an H100 at
        // the reference's batch those passes took ~0.7 ms an ASV-level layer.
        let fold_biases = B::ad_enabled(&x.device())
            && self.dropout.prob > 0.0
            && aam_kernels::seeded_dropout_runs::<B>();
        // 1-3. x = x + dropout(MHA(LN1(x)))
        let attn = self.self_attn.self_attention_with(
            low(self.norm1.forward(x.clone())),
            key_padding_mask,
            !fold_biases,
        );
        let attn_bias = fold_biases
            .then(|| self.self_attn.out_proj.bias_in(residual_dtype))
            .flatten();
        // The dropout follows the cast back: with mixed precision it drops
        // and scales the f32 values of the low-precision output.
        let x = dropout_add(&self.dropout1, x, back(attn), attn_bias);
        // 4-6. x = x + dropout(linear2(dropout(act(linear1(LN2(x))))))
        let ln2 = low(self.norm2.forward(x.clone()));
        let (h, h_bias) = if fold_biases {
            let h = self.linear1.forward_without_bias(ln2);
            let bias = self.linear1.bias_in(compute_dtype);
            (h, bias)
        } else {
            (self.linear1.forward(ln2), None)
        };
        let ff =
            self.linear2
                .forward_activated(h, h_bias, self.activation, &self.dropout, fold_biases);
        let ff_bias = fold_biases
            .then(|| self.linear2.bias_in(residual_dtype))
            .flatten();
        dropout_add(&self.dropout2, x, back(ff), ff_bias)
    }
}

/// Configuration of a [`TransformerEncoder`] (the reference's wrapper class).
#[derive(Config, Debug)]
pub struct TransformerEncoderConfig {
    /// Layers in the stack.
    pub num_layers: usize,
    /// Attention heads H.
    pub num_heads: usize,
    /// Model width D (`hidden_dim`).
    pub hidden_dim: usize,
    /// Feed-forward width F. Default: None (→ 4·D).
    pub intermediate_size: Option<usize>,
    /// Dropout p. Default: 0.1.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Activation. Default: gelu.
    #[config(default = "Activation::Gelu")]
    pub activation: Activation,
    /// Attention implementation. Default: auto.
    #[config(default = "AttnImplementation::Auto")]
    pub attn_implementation: AttnImplementation,
}

/// The `nn.TransformerEncoder` inside the wrapper: holds `layers`, so that the
/// parameter paths read `<P>.encoder.layers.<i>.…` as in torch.
#[derive(Module, Debug)]
pub struct EncoderLayers<B: Backend> {
    /// `encoder.layers.<i>`
    pub layers: Vec<TransformerEncoderLayer<B>>,
}

/// §1.3: `num_layers` pre-norm layers, then `norm` (LayerNorm, eps 1e-6).
#[derive(Module, Debug)]
pub struct TransformerEncoder<B: Backend> {
    /// `encoder.layers.*`
    pub encoder: EncoderLayers<B>,
    /// `norm`: the final LayerNorm, eps 1e-6.
    pub norm: LayerNorm<B>,
}

impl TransformerEncoderConfig {
    /// Feed-forward width F (4·D unless given).
    pub fn dim_feedforward(&self) -> usize {
        self.intermediate_size.unwrap_or(4 * self.hidden_dim)
    }

    /// The configuration of each layer of the stack.
    pub fn layer_config(&self) -> TransformerEncoderLayerConfig {
        TransformerEncoderLayerConfig::new(self.hidden_dim, self.num_heads, self.dim_feedforward())
            .with_dropout(self.dropout)
            .with_activation(self.activation)
            .with_attn_implementation(self.attn_implementation)
    }

    /// Builds the stack. As in torch, every layer starts from the same weights
    /// (the reference deep-copies one prototype layer).
    pub fn init<B: Backend>(&self, device: &B::Device) -> TransformerEncoder<B> {
        let prototype = self.layer_config().init::<B>(device);
        let layers = (0..self.num_layers)
            .map(|_| prototype.clone().map(&mut FreshParamIds))
            .collect();
        TransformerEncoder {
            encoder: EncoderLayers { layers },
            norm: LayerNormConfig::new(self.hidden_dim)
                .with_eps(1e-6)
                .init(device),
        }
    }
}

/// Gives every parameter of a cloned module a new id (a clone shares ids, and
/// optimisers key their state by id).
struct FreshParamIds;

impl<B: Backend> burn::module::ModuleMapper<B> for FreshParamIds {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<B, D>>,
    ) -> burn::module::Param<Tensor<B, D>> {
        let (_, tensor, mapper) = param.consume();
        burn::module::Param::from_mapped_value(burn::module::ParamId::new(), tensor, mapper)
    }
}

impl<B: AttentionBackend> TransformerEncoder<B> {
    /// # Shapes
    /// - x: `[N, T, D]`, key_padding_mask: `[N, T]` (true = ignore)
    /// - output: `[N, T, D]` (padded rows are computed, not zeroed)
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        key_padding_mask: Option<Tensor<B, 2, Bool>>,
    ) -> Tensor<B, 3> {
        let x = self
            .encoder
            .layers
            .iter()
            .fold(x, |x, layer| layer.forward(x, key_padding_mask.clone()));
        self.norm.forward(x)
    }
}
