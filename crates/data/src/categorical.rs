//! §2.7 Categorical encoding (`CategoricalEncoder`).
//!
//! Per column, the distinct non-missing training values, sorted (byte order of
//! UTF-8 = Python's code-point order), map to 1..=N; index 0 is "unknown or
//! missing". The mapping is the reference's JSON
//! (`{"mappings": {col: {value: index}}, "column_names": [...]}`) so it can be
//! saved with a model and read by either implementation. Values are the
//! metadata text as written (the reference uses pandas' `str(v)`, which turns
//! a numeric `2008` into `2008` but a column with a gap into `2008.0`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::metadata::Metadata;

/// Index of unknown and missing values.
pub const UNKNOWN: i64 = 0;

/// A fitted encoder of categorical metadata columns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CategoricalEncoder {
    mappings: BTreeMap<String, BTreeMap<String, i64>>,
    column_names: Vec<String>,
}

impl CategoricalEncoder {
    /// Fit on the metadata rows of `sample_ids` (the training split); IDs
    /// without a metadata row are ignored. Unknown column names are an error
    /// listing the columns present.
    pub fn fit<C: AsRef<str>, S: AsRef<str>>(
        metadata: &Metadata,
        columns: &[C],
        sample_ids: &[S],
    ) -> Result<Self> {
        let rows: Vec<usize> = sample_ids
            .iter()
            .filter_map(|id| metadata.row(id.as_ref()))
            .collect();
        let mut mappings = BTreeMap::new();
        let mut column_names = Vec::with_capacity(columns.len());
        for name in columns {
            let c = metadata.column(name.as_ref())?;
            let column = metadata.columns()[c].clone();
            let mut values: Vec<&str> = rows.iter().filter_map(|&r| metadata.value(r, c)).collect();
            values.sort_unstable();
            values.dedup();
            if values.is_empty() {
                tracing::warn!(column = %column, "categorical column has no value in the training samples; every sample encodes as unknown (0)");
            }
            let mapping = values
                .iter()
                .enumerate()
                .map(|(i, v)| (v.to_string(), i as i64 + 1))
                .collect();
            mappings.insert(column.clone(), mapping);
            column_names.push(column);
        }
        Ok(Self {
            mappings,
            column_names,
        })
    }

    /// The encoded columns, in fitting order.
    pub fn column_names(&self) -> &[String] {
        &self.column_names
    }

    /// Number of indices per column including 0 (N + 1), in column order.
    pub fn cardinalities(&self) -> Vec<usize> {
        self.column_names
            .iter()
            .map(|c| self.mappings.get(c).map_or(0, |m| m.len()) + 1)
            .collect()
    }

    /// The index of a value of column `k` (0 when unknown or missing).
    ///
    /// # Panics
    /// If `k` is out of range (a programmer error).
    pub fn encode(&self, k: usize, value: Option<&str>) -> i64 {
        let Some(mapping) = self.mappings.get(&self.column_names[k]) else {
            return UNKNOWN;
        };
        value
            .and_then(|v| mapping.get(v.trim()).copied())
            .unwrap_or(UNKNOWN)
    }

    /// The value of index `index` of column `k` (None for 0 or unknown indices).
    pub fn decode(&self, k: usize, index: i64) -> Option<&str> {
        let mapping = self.mappings.get(self.column_names.get(k)?)?;
        mapping
            .iter()
            .find(|(_, &i)| i == index)
            .map(|(v, _)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn meta() -> Metadata {
        Metadata::from_bytes(
            b"id\tsite\tseason\ns1\tgut\tsummer\ns2\ttongue\tNA\ns3\tgut\twinter\ns4\tskin\tspring\n",
            Path::new("m.tsv"),
        )
        .unwrap()
    }

    #[test]
    fn sorted_mapping_fitted_on_training_rows_only() {
        let m = meta();
        let enc = CategoricalEncoder::fit(&m, &["site", "season"], &["s1", "s2", "s3", "absent"])
            .unwrap();
        assert_eq!(
            enc.column_names(),
            &["site".to_string(), "season".to_string()]
        );
        // site: gut, tongue (skin only in s4, not trained); season: summer, winter.
        assert_eq!(enc.cardinalities(), vec![3, 3]);
        assert_eq!(enc.encode(0, Some("gut")), 1);
        assert_eq!(enc.encode(0, Some("tongue")), 2);
        assert_eq!(enc.encode(0, Some("skin")), UNKNOWN);
        assert_eq!(enc.encode(1, None), UNKNOWN);
        assert_eq!(enc.decode(1, 2), Some("winter"));
        assert_eq!(enc.decode(1, 0), None);
    }

    #[test]
    fn json_layout_matches_the_reference_and_round_trips() {
        let enc = CategoricalEncoder::fit(&meta(), &["site"], &["s1", "s2", "s3", "s4"]).unwrap();
        let json = serde_json::to_string(&enc).unwrap();
        assert_eq!(
            json,
            r#"{"mappings":{"site":{"gut":1,"skin":2,"tongue":3}},"column_names":["site"]}"#
        );
        let back: CategoricalEncoder = serde_json::from_str(&json).unwrap();
        assert_eq!(back, enc);
    }

    #[test]
    fn unknown_column_is_an_error() {
        let err = CategoricalEncoder::fit(&meta(), &["sight"], &["s1"]).unwrap_err();
        assert!(err.to_string().contains("\"sight\""), "{err}");
    }
}

/// Per-category loss weights (`--categorical-loss-weights`, §2.10): one
/// weight per value of a metadata column, attached to each sample's target
/// loss. A value without a weight, or a missing one, weighs 1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CategoryWeights {
    /// The metadata column.
    pub column: String,
    /// Weight by the column's value.
    pub weights: BTreeMap<String, f64>,
}

impl CategoryWeights {
    /// `auto`: `w_k = N / (K · n_k)` over the training samples with a value
    /// (N of them, K distinct values, n_k of value k), so that every value
    /// weighs as much in all.
    pub fn balanced<S: AsRef<str>>(
        metadata: &Metadata,
        column: &str,
        sample_ids: &[S],
    ) -> Result<Self> {
        let c = metadata.column(column)?;
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for id in sample_ids {
            if let Some(v) = metadata.row(id.as_ref()).and_then(|r| metadata.value(r, c)) {
                *counts.entry(v.to_string()).or_default() += 1;
            }
        }
        let (n, k) = (counts.values().sum::<usize>() as f64, counts.len() as f64);
        Ok(CategoryWeights {
            column: column.to_string(),
            weights: counts
                .into_iter()
                .map(|(v, nk)| (v, n / (k * nk as f64)))
                .collect(),
        })
    }

    /// Given weights, keyed `value` or, as the reference writes them,
    /// `column=value`.
    pub fn given(column: &str, weights: BTreeMap<String, f64>) -> Self {
        let prefix = format!("{column}=");
        CategoryWeights {
            column: column.to_string(),
            weights: weights
                .into_iter()
                .map(|(k, w)| (k.strip_prefix(&prefix).unwrap_or(&k).to_string(), w))
                .collect(),
        }
    }

    /// The weight of a sample whose column holds `value`.
    pub fn weight(&self, value: Option<&str>) -> f64 {
        value
            .and_then(|v| self.weights.get(v))
            .copied()
            .unwrap_or(1.0)
    }
}
