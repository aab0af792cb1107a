//! §1.10 Fusion of sample embeddings with categorical metadata: GMU,
//! cross-attention and Perceiver. (Concat and add have no module of their
//! own; they live in the predictor, §1.8 step 4.)

use aam_kernels::AttentionBackend;
use burn::prelude::*;
use burn::tensor::activation;

use crate::attention::{AttnImplementation, MultiheadAttention, MultiheadAttentionConfig};
use crate::nn::{Activation, LayerNorm, LayerNormConfig, Linear, LinearConfig, LinearInit};
use crate::transformer::{TransformerEncoderLayer, TransformerEncoderLayerConfig};

fn xavier_linear<B: Backend>(d_in: usize, d_out: usize, device: &B::Device) -> Linear<B> {
    LinearConfig::new(d_in, d_out)
        .with_init(LinearInit::XavierZeroBias)
        .init(device)
}

/// Configuration of [`Gmu`].
#[derive(Config, Debug)]
pub struct GmuConfig {
    /// Sequence width D.
    pub seq_dim: usize,
    /// Categorical width C.
    pub cat_dim: usize,
}

/// Gated multimodal unit (residual form).
#[derive(Module, Debug)]
pub struct Gmu<B: Backend> {
    /// `cat_transform [D, C]`
    pub cat_transform: Linear<B>,
    /// `gate [D, D+C]`
    pub gate: Linear<B>,
}

impl GmuConfig {
    /// Builds the unit (Xavier weights, zero biases).
    pub fn init<B: Backend>(&self, device: &B::Device) -> Gmu<B> {
        Gmu {
            cat_transform: xavier_linear(self.cat_dim, self.seq_dim, device),
            gate: xavier_linear(self.seq_dim + self.cat_dim, self.seq_dim, device),
        }
    }
}

impl<B: AttentionBackend> Gmu<B> {
    /// `out = h + z ⊙ tanh(cat_transform(c))`, `z = σ(gate([h ‖ c]))`.
    ///
    /// # Shapes
    /// - h: `[B, D]`, c: `[B, C]` → (out `[B, D]`, gate z `[B, D]`)
    pub fn forward(&self, h: Tensor<B, 2>, c: Tensor<B, 2>) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let h_cat = self.cat_transform.forward(c.clone()).tanh();
        let z = activation::sigmoid(self.gate.forward(Tensor::cat(vec![h.clone(), c], 1)));
        (h + z.clone() * h_cat, z)
    }
}

/// Configuration of [`CrossAttentionFusion`].
#[derive(Config, Debug)]
pub struct CrossAttentionFusionConfig {
    /// Sequence width D.
    pub seq_dim: usize,
    /// Categorical width C.
    pub cat_dim: usize,
    /// Heads. Default: 8.
    #[config(default = 8)]
    pub num_heads: usize,
    /// Attention dropout. Default: 0.1.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Attention implementation. Default: auto.
    #[config(default = "AttnImplementation::Auto")]
    pub attn_implementation: AttnImplementation,
}

/// Every slot attends to one metadata token; `out = LN(seq + attn)`.
#[derive(Module, Debug)]
pub struct CrossAttentionFusion<B: Backend> {
    /// `cat_projection [D, C]`
    pub cat_projection: Linear<B>,
    /// `cross_attn.*`
    pub cross_attn: MultiheadAttention<B>,
    /// `norm` LayerNorm(D).
    pub norm: LayerNorm<B>,
}

impl CrossAttentionFusionConfig {
    /// Builds the module.
    pub fn init<B: Backend>(&self, device: &B::Device) -> CrossAttentionFusion<B> {
        CrossAttentionFusion {
            cat_projection: xavier_linear(self.cat_dim, self.seq_dim, device),
            cross_attn: MultiheadAttentionConfig::new(self.seq_dim, self.num_heads)
                .with_dropout(self.dropout)
                .with_attn_implementation(self.attn_implementation)
                .init(device),
            norm: LayerNormConfig::new(self.seq_dim).init(device),
        }
    }
}

impl<B: AttentionBackend> CrossAttentionFusion<B> {
    /// With one key every weight is exactly 1, so every slot receives the same
    /// update (§8 item 10); ported as is.
    ///
    /// # Shapes
    /// - seq: `[B, S, D]`, cat: `[B, C]` → (out `[B, S, D]`, weights `[B, H, S, 1]`)
    pub fn forward(&self, seq: Tensor<B, 3>, cat: Tensor<B, 2>) -> (Tensor<B, 3>, Tensor<B, 4>) {
        let [b, d] = [seq.dims()[0], seq.dims()[2]];
        let meta = self.cat_projection.forward(cat).reshape([b, 1, d]);
        let (attended, weights) = self
            .cross_attn
            .cross_attention(seq.clone(), meta.clone(), meta);
        (self.norm.forward(seq + attended), weights)
    }
}

/// Configuration of [`PerceiverFusion`].
#[derive(Config, Debug)]
pub struct PerceiverFusionConfig {
    /// Sequence width D (also the latent width).
    pub seq_dim: usize,
    /// Categorical width C.
    pub cat_dim: usize,
    /// Latent vectors. Default: 64.
    #[config(default = 64)]
    pub num_latents: usize,
    /// Latent self-attention layers. Default: 2.
    #[config(default = 2)]
    pub num_layers: usize,
    /// Heads. Default: 8.
    #[config(default = 8)]
    pub num_heads: usize,
    /// Dropout. Default: 0.1.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Attention implementation. Default: auto.
    #[config(default = "AttnImplementation::Auto")]
    pub attn_implementation: AttnImplementation,
}

/// Latents cross-attend to `[projected slots ‖ metadata token]`, self-attend,
/// and are averaged into one vector; replaces target encoder and pooling.
#[derive(Module, Debug)]
pub struct PerceiverFusion<B: Backend> {
    /// `latents [num_latents, D]`
    pub latents: burn::module::Param<Tensor<B, 2>>,
    /// `seq_projection [D, D]`
    pub seq_projection: Linear<B>,
    /// `cat_projection [D, C]`
    pub cat_projection: Linear<B>,
    /// `cross_attn.*`
    pub cross_attn: MultiheadAttention<B>,
    /// `cross_norm`
    pub cross_norm: LayerNorm<B>,
    /// `self_attn_layers.<i>.*`: pre-norm layers, ReLU, F = 4·D, no final norm.
    pub self_attn_layers: Vec<TransformerEncoderLayer<B>>,
    /// `output_projection [D, D]`
    pub output_projection: Linear<B>,
}

impl PerceiverFusionConfig {
    /// Builds the module (latents N(0, 0.02²)).
    pub fn init<B: Backend>(&self, device: &B::Device) -> PerceiverFusion<B> {
        let d = self.seq_dim;
        let layer = TransformerEncoderLayerConfig::new(d, self.num_heads, 4 * d)
            .with_dropout(self.dropout)
            .with_activation(Activation::Relu)
            .with_attn_implementation(self.attn_implementation);
        PerceiverFusion {
            latents: burn::module::Initializer::Normal {
                mean: 0.0,
                std: 0.02,
            }
            .init([self.num_latents, d], device),
            seq_projection: xavier_linear(d, d, device),
            cat_projection: xavier_linear(self.cat_dim, d, device),
            cross_attn: MultiheadAttentionConfig::new(d, self.num_heads)
                .with_dropout(self.dropout)
                .with_attn_implementation(self.attn_implementation)
                .init(device),
            cross_norm: LayerNormConfig::new(d).init(device),
            self_attn_layers: (0..self.num_layers).map(|_| layer.init(device)).collect(),
            output_projection: xavier_linear(d, d, device),
        }
    }
}

impl<B: AttentionBackend> PerceiverFusion<B> {
    /// Padded slots are not masked (as the reference).
    ///
    /// # Shapes
    /// - seq: `[B, S, D]`, cat: `[B, C]` → (out `[B, D]`, weights `[B, H, latents, S+1]`)
    pub fn forward(&self, seq: Tensor<B, 3>, cat: Tensor<B, 2>) -> (Tensor<B, 2>, Tensor<B, 4>) {
        let [b, _s, d] = seq.dims();
        let inputs = Tensor::cat(
            vec![
                self.seq_projection.forward(seq),
                self.cat_projection.forward(cat).reshape([b, 1, d]),
            ],
            1,
        );
        let [latents, _] = self.latents.dims();
        let lat = self.latents.val().unsqueeze::<3>().expand([b, latents, d]);
        let (attended, weights) =
            self.cross_attn
                .cross_attention(lat.clone(), inputs.clone(), inputs);
        let lat = self.cross_norm.forward(lat + attended);
        let lat = self
            .self_attn_layers
            .iter()
            .fold(lat, |x, layer| layer.forward(x, None));
        let pooled = lat.mean_dim(1).reshape([b, d]);
        (self.output_projection.forward(pooled), weights)
    }
}
