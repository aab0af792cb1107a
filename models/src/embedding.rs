//! §1.2 Embeddings: the token lookup table and the learned `PositionEmbedding`.

use burn::nn::{Embedding, EmbeddingConfig};
use burn::prelude::*;

/// Configuration of [`PositionEmbedding`].
#[derive(Config, Debug)]
pub struct PositionEmbeddingConfig {
    /// Rows of the table (`max_length`).
    pub max_length: usize,
    /// Model width D.
    pub hidden_dim: usize,
}

/// `PositionEmbedding(max_length, D)`: adds learned rows `0..T` to its input.
#[derive(Module, Debug)]
pub struct PositionEmbedding<B: Backend> {
    /// `position_embedding.weight [max_length, D]`
    pub position_embedding: Embedding<B>,
}

impl PositionEmbeddingConfig {
    /// Builds the table, N(0, 1) as `nn.Embedding`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> PositionEmbedding<B> {
        PositionEmbedding {
            position_embedding: token_embedding(self.max_length, self.hidden_dim, device),
        }
    }
}

impl<B: Backend> PositionEmbedding<B> {
    /// `out[n, t, :] = x[n, t, :] + P[t, :]`.
    ///
    /// # Shapes
    /// - x / output: `[N, T, D]` with T ≤ max_length
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [_n, t, _d] = x.dims();
        let table = self.position_embedding.weight.val();
        let max_length = table.dims()[0];
        assert!(
            t <= max_length,
            "sequence length {t} exceeds the position table ({max_length} rows)"
        );
        x + table.narrow(0, 0, t).unsqueeze::<3>()
    }
}

/// `nn.Embedding(n, d)`: a lookup table initialised N(0, 1).
pub(crate) fn token_embedding<B: Backend>(n: usize, d: usize, device: &B::Device) -> Embedding<B> {
    EmbeddingConfig::new(n, d)
        .with_initializer(burn::module::Initializer::Normal {
            mean: 0.0,
            std: 1.0,
        })
        .init(device)
}
