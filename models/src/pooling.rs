//! §1.4 `AttentionPooling`: a learned query scores each position, a masked
//! softmax weighs them, and the weighted sum is layer-normalised.

use burn::prelude::*;
use burn::tensor::activation;

use crate::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use crate::precision::cast_to;
use aam_kernels::AttentionBackend;

/// Configuration of [`AttentionPooling`].
#[derive(Config, Debug)]
pub struct AttentionPoolingConfig {
    /// Model width D (`hidden_dim`).
    pub hidden_dim: usize,
}

/// `AttentionPooling(hidden_dim)`.
#[derive(Module, Debug)]
pub struct AttentionPooling<B: Backend> {
    /// `query.weight [1, D]` (no bias).
    pub query: Linear<B>,
    /// `norm` LayerNorm(D), eps 1e-5.
    pub norm: LayerNorm<B>,
    hidden_dim: usize,
}

impl AttentionPoolingConfig {
    /// Builds the module (torch default init for `query`).
    pub fn init<B: Backend>(&self, device: &B::Device) -> AttentionPooling<B> {
        AttentionPooling {
            query: LinearConfig::new(self.hidden_dim, 1)
                .with_bias(false)
                .init(device),
            norm: LayerNormConfig::new(self.hidden_dim).init(device),
            hidden_dim: self.hidden_dim,
        }
    }
}

impl<B: AttentionBackend> AttentionPooling<B> {
    /// Pools `x` over T. `valid` is `true` at positions that count (the
    /// reference's `mask == 1`). A row with no valid position gets uniform
    /// weights 1/T (§1.4 step 5), so an all-zero row pools to the norm's β.
    ///
    /// Steps 2-6 run as one op each way ([`aam_kernels::attention_pool`]:
    /// one kernel that reads `x` once on the CubeCL backends, the
    /// reference's tensor ops elsewhere; `pool/mod.rs` there says why).
    ///
    /// DEVIATION(§1.4 steps 1 and 6): the reference raises on NaN at three
    /// points; checking needs a device→host read per call, and no NaN can
    /// arise here from finite inputs (masked rows are handled explicitly).
    ///
    /// # Shapes
    /// - x: `[N, T, D]`, valid: `[N, T]`
    /// - output: `[N, D]`
    pub fn forward(&self, x: Tensor<B, 3>, valid: Option<Tensor<B, 2, Bool>>) -> Tensor<B, 2> {
        let [n, t, d] = x.dims();
        // s = query(x) / √D  (√hidden_dim, not √head_dim)
        let scale = 1.0 / (self.hidden_dim as f64).sqrt();
        let pooled = match valid {
            Some(valid) => {
                let query = cast_to(self.query.weight.val(), x.dtype()).reshape([d]);
                aam_kernels::attention_pool(x, query, valid, scale)
            }
            None => {
                let scores = self.query.forward(x.clone()).reshape([n, t]) * scale;
                let weights = activation::softmax(scores, 1);
                aam_kernels::matmul(weights.reshape([n, 1, t]), x).reshape([n, d])
            }
        };
        self.norm.forward(pooled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::{Distribution, Tolerance};

    type TB = NdArray<f32>;

    #[test]
    fn all_padding_zero_row_pools_to_norm_bias() {
        let device = Default::default();
        let mut pool = AttentionPoolingConfig::new(4).init::<TB>(&device);
        pool.norm.bias =
            burn::module::Param::from_tensor(Tensor::from_floats([1.0, -2.0, 3.0, 0.5], &device));
        let x = Tensor::<TB, 3>::zeros([1, 3, 4], &device);
        let valid = Tensor::<TB, 2, Bool>::from_data([[false, false, false]], &device);
        let out = pool.forward(x, Some(valid));
        out.into_data().assert_approx_eq::<f32>(
            &TensorData::from([[1.0, -2.0, 3.0, 0.5]]),
            Tolerance::default(),
        );
    }

    #[test]
    fn padded_positions_are_ignored() {
        let device = Default::default();
        let pool = AttentionPoolingConfig::new(4).init::<TB>(&device);
        let x = Tensor::<TB, 3>::random([1, 3, 4], Distribution::Normal(0.0, 1.0), &device);
        let valid = Tensor::<TB, 2, Bool>::from_data([[true, true, false]], &device);
        let masked = pool.forward(x.clone(), Some(valid));
        let truncated = pool.forward(x.narrow(1, 0, 2), None);
        masked
            .into_data()
            .assert_approx_eq::<f32>(&truncated.into_data(), Tolerance::default());
    }
}
