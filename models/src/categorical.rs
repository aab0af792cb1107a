//! §1.9 `CategoricalEmbedder`: one embedding table per metadata column, in
//! sorted column order, concatenated.

use std::collections::BTreeMap;

use burn::nn::{Dropout, DropoutConfig, Embedding};
use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::embedding::token_embedding;

/// Embedding width: one for every column, or one per column.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum CategoricalEmbedDim {
    /// The same width for every column.
    Uniform(usize),
    /// A width per column name.
    PerColumn(BTreeMap<String, usize>),
}

impl Default for CategoricalEmbedDim {
    fn default() -> Self {
        Self::Uniform(16)
    }
}

impl CategoricalEmbedDim {
    /// The width of `column`.
    pub fn of(&self, column: &str) -> usize {
        match self {
            Self::Uniform(d) => *d,
            Self::PerColumn(dims) => *dims
                .get(column)
                .unwrap_or_else(|| panic!("no categorical_embed_dim for column '{column}'")),
        }
    }
}

/// Configuration of [`CategoricalEmbedder`].
#[derive(Config, Debug)]
pub struct CategoricalEmbedderConfig {
    /// Column name → cardinality (distinct training categories + 1; index 0 =
    /// unknown). A `BTreeMap`, so iteration is the reference's sorted order.
    pub column_cardinalities: BTreeMap<String, usize>,
    /// Width per column. Default: 16.
    #[config(default = "CategoricalEmbedDim::Uniform(16)")]
    pub embed_dim: CategoricalEmbedDim,
    /// Dropout on the concatenated output. Default: 0.1.
    #[config(default = 0.1)]
    pub dropout: f64,
}

/// `CategoricalEmbedder`: `embeddings.<column>.weight [cardinality, dim]`.
///
/// Burn modules have no maps, so the tables sit in a `Vec` in sorted column
/// order; `import.rs` maps `embeddings.<i>` ↔ `embeddings.<column>`.
#[derive(Module, Debug)]
pub struct CategoricalEmbedder<B: Backend> {
    /// One table per column, sorted by name.
    pub embeddings: Vec<Embedding<B>>,
    dropout: Dropout,
    #[module(skip)]
    columns: Vec<String>,
}

impl CategoricalEmbedderConfig {
    /// Total output width C = Σ per-column widths.
    pub fn total_dim(&self) -> usize {
        self.column_cardinalities
            .keys()
            .map(|c| self.embed_dim.of(c))
            .sum()
    }

    /// Builds the tables: N(0, 1), with row 0 (`padding_idx=0`, unknown) zero.
    pub fn init<B: Backend>(&self, device: &B::Device) -> CategoricalEmbedder<B> {
        let embeddings = self
            .column_cardinalities
            .iter()
            .map(|(column, &cardinality)| {
                let mut table =
                    token_embedding::<B>(cardinality, self.embed_dim.of(column), device);
                // Zero row 0 on the host: a tensor op would make the parameter a
                // non-leaf node under Autodiff.
                let data = table.weight.val().into_data().convert::<f32>();
                let shape = data.shape.clone();
                let dim = shape[1];
                let mut values = data.to_vec::<f32>().expect("f32 data");
                values[..dim].fill(0.0);
                table.weight = burn::module::Param::from_tensor(Tensor::from_data(
                    TensorData::new(values, shape),
                    device,
                ));
                table
            })
            .collect();
        CategoricalEmbedder {
            embeddings,
            dropout: DropoutConfig::new(self.dropout).init(),
            columns: self.column_cardinalities.keys().cloned().collect(),
        }
    }
}

impl<B: Backend> CategoricalEmbedder<B> {
    /// Column names, in table order.
    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// Looks up each column's ids; a column absent from `ids` uses id 0 (unknown).
    ///
    /// # Shapes
    /// - ids: column → `[B]`
    /// - output: `[B, C]`
    ///
    /// # Panics
    /// If `ids` is empty (the batch size is unknown), as the reference raises.
    pub fn forward(&self, ids: &BTreeMap<String, Tensor<B, 1, Int>>) -> Tensor<B, 2> {
        let any = ids
            .values()
            .next()
            .expect("categorical ids: at least one column is required");
        let batch = any.dims()[0];
        let device = any.device();
        let parts = self
            .columns
            .iter()
            .zip(&self.embeddings)
            .map(|(column, table)| {
                let col_ids = ids
                    .get(column)
                    .cloned()
                    .unwrap_or_else(|| Tensor::zeros([batch], &device));
                let [_, dim] = table.weight.dims();
                let looked_up = table
                    .forward(col_ids.clone().reshape([batch, 1]))
                    .reshape([batch, dim]);
                // padding_idx=0: row 0 is used in the forward but never receives
                // a gradient (torch's semantics), so use its detached value there.
                let unknown = col_ids
                    .equal_elem(0)
                    .reshape([batch, 1])
                    .expand([batch, dim]);
                let row0 = table
                    .weight
                    .val()
                    .detach()
                    .narrow(0, 0, 1)
                    .expand([batch, dim]);
                looked_up.mask_where(unknown, row0)
            })
            .collect();
        self.dropout.forward(Tensor::cat(parts, 1))
    }
}
