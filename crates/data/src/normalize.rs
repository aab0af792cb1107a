//! §2.8 Target normalisation and §2.9 count normalisation, with exact inverses.
//!
//! Order per target: `ln(y + 1)` for the log variants, then at most one of
//! per-category z-score, global z-score, min-max. Statistics are fitted on the
//! training split only. The inverse applies the steps backwards and clamps the
//! exponent at 88 as the reference does (so it is exact for every value the
//! forward transform can produce from y < 1.6e38).
//!
//! Deviation (§8 item 8): the reference maps "per-category + log" to a
//! *global* z-score; here `log-zscore-category` is its own transform and
//! per-category statistics are always per-category.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::metadata::Metadata;

/// Floor of standard deviations (the reference's `MIN_STD`).
pub const MIN_STD: f64 = 1e-8;
/// Exponent clamp of the log inverse.
pub const MAX_EXP_INPUT: f64 = 88.0;

/// `--target-transform`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum TargetTransform {
    /// Raw targets.
    #[serde(rename = "none")]
    None,
    /// `(y - min) / (max - min)`; the CLI default.
    #[default]
    #[serde(rename = "minmax")]
    MinMax,
    /// `(y - mean) / std`.
    #[serde(rename = "zscore")]
    ZScore,
    /// `(y - mean_k) / std_k` for the sample's category key k.
    #[serde(rename = "zscore-category")]
    ZScoreCategory,
    /// `ln(y + 1)`, then min-max.
    #[serde(rename = "log-minmax")]
    LogMinMax,
    /// `ln(y + 1)`, then global z-score.
    #[serde(rename = "log-zscore")]
    LogZScore,
    /// `ln(y + 1)`, then per-category z-score (not in the reference; §8 item 8).
    #[serde(rename = "log-zscore-category")]
    LogZScoreCategory,
}

impl TargetTransform {
    /// All transforms, in CLI order.
    pub const ALL: [TargetTransform; 7] = [
        Self::None,
        Self::MinMax,
        Self::ZScore,
        Self::ZScoreCategory,
        Self::LogMinMax,
        Self::LogZScore,
        Self::LogZScoreCategory,
    ];

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::MinMax => "minmax",
            Self::ZScore => "zscore",
            Self::ZScoreCategory => "zscore-category",
            Self::LogMinMax => "log-minmax",
            Self::LogZScore => "log-zscore",
            Self::LogZScoreCategory => "log-zscore-category",
        }
    }

    /// True for the `log-*` transforms.
    pub fn uses_log(self) -> bool {
        matches!(
            self,
            Self::LogMinMax | Self::LogZScore | Self::LogZScoreCategory
        )
    }

    /// True when statistics are per category key.
    pub fn is_per_category(self) -> bool {
        matches!(self, Self::ZScoreCategory | Self::LogZScoreCategory)
    }

    /// True when counts are min-max normalised too (§2.9: minmax and log-minmax).
    pub fn normalizes_counts(self) -> bool {
        matches!(self, Self::MinMax | Self::LogMinMax)
    }
}

impl fmt::Display for TargetTransform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TargetTransform {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        Self::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| Error::UnknownTransform {
                name: s.to_string(),
            })
    }
}

/// Mean and (floored) population standard deviation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MeanStd {
    /// Mean.
    pub mean: f64,
    /// Standard deviation (ddof 0), floored.
    pub std: f64,
}

impl MeanStd {
    fn of(values: &[f64], floor_to: f64) -> Self {
        let n = values.len() as f64;
        let mean = values.iter().sum::<f64>() / n;
        let var = values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let std = var.sqrt();
        Self {
            mean,
            std: if std < MIN_STD { floor_to } else { std },
        }
    }
}

/// Per-category statistics (the reference's `CategoryNormalizer`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CategoryStats {
    /// The metadata columns that make the key, in key order.
    pub columns: Vec<String>,
    /// Statistics per key `"col1=v1,col2=v2"`.
    pub stats: BTreeMap<String, MeanStd>,
    /// Fallback for keys unseen in training.
    pub global: MeanStd,
}

/// A fitted target transform; serialisable, saved with the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetNormalizer {
    /// Which transform.
    pub transform: TargetTransform,
    /// Training minimum (after log), for min-max.
    pub min: f64,
    /// Training maximum (after log), for min-max.
    pub max: f64,
    /// `max - min`, or 1 when that is 0.
    pub scale: f64,
    /// Global mean and std (after log), for z-score.
    pub global: MeanStd,
    /// Per-category statistics for the `*-category` transforms.
    pub category: Option<CategoryStats>,
}

impl TargetNormalizer {
    /// Fit on training targets. `keys[i]` is the category key of `values[i]`
    /// (required by the per-category transforms, ignored otherwise); `ids`
    /// name the samples in errors.
    pub fn fit<S: AsRef<str>>(
        transform: TargetTransform,
        ids: &[S],
        values: &[f64],
        category_columns: &[String],
        keys: Option<&[String]>,
    ) -> Result<Self> {
        if values.is_empty() {
            return Err(Error::NothingToFit {
                what: format!("the {transform} target transform"),
            });
        }
        let mut y = Vec::with_capacity(values.len());
        for (id, &v) in ids.iter().zip(values) {
            y.push(Self::log_step(transform, id.as_ref(), v)?);
        }
        let min = y.iter().copied().fold(f64::INFINITY, f64::min);
        let max = y.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut scale = max - min;
        if scale == 0.0 {
            if transform == TargetTransform::MinMax || transform == TargetTransform::LogMinMax {
                tracing::warn!("all training targets are equal ({min}); min-max normalisation only shifts them");
            }
            scale = 1.0;
        }
        let global = MeanStd::of(&y, 1.0);
        let category = if transform.is_per_category() {
            let keys = keys.ok_or_else(|| Error::InvalidConfig {
                reason: format!(
                    "the {transform} transform needs category columns (--normalize-by)"
                ),
            })?;
            if category_columns.is_empty() || keys.len() != y.len() {
                return Err(Error::InvalidConfig {
                    reason: format!("the {transform} transform needs one category key per target and at least one column"),
                });
            }
            let mut groups: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
            for (k, &v) in keys.iter().zip(&y) {
                groups.entry(k.as_str()).or_default().push(v);
            }
            let stats = groups
                .into_iter()
                .map(|(k, v)| (k.to_string(), MeanStd::of(&v, MIN_STD)))
                .collect();
            Some(CategoryStats {
                columns: category_columns.to_vec(),
                stats,
                global: MeanStd::of(&y, MIN_STD),
            })
        } else {
            None
        };
        Ok(Self {
            transform,
            min,
            max,
            scale,
            global,
            category,
        })
    }

    /// Fit from a metadata column over the training samples (`train_ids`);
    /// training samples without a value are skipped. For per-category
    /// transforms, `category_columns` name the key columns.
    pub fn fit_metadata<S: AsRef<str>>(
        transform: TargetTransform,
        metadata: &Metadata,
        target_column: &str,
        category_columns: &[String],
        train_ids: &[S],
    ) -> Result<Self> {
        let values = metadata.numeric(target_column)?;
        let key_columns = category_columns
            .iter()
            .map(|c| metadata.column(c))
            .collect::<Result<Vec<_>>>()?;
        let names: Vec<String> = key_columns
            .iter()
            .map(|&c| metadata.columns()[c].clone())
            .collect();
        let (mut ids, mut ys, mut keys) = (Vec::new(), Vec::new(), Vec::new());
        for id in train_ids {
            let Some(row) = metadata.row(id.as_ref()) else {
                continue;
            };
            let Some(v) = values[row] else { continue };
            ids.push(id.as_ref().to_string());
            ys.push(v);
            keys.push(metadata.category_key(row, &key_columns));
        }
        Self::fit(
            transform,
            &ids,
            &ys,
            &names,
            transform.is_per_category().then_some(keys.as_slice()),
        )
    }

    /// `ln(y + 1)` for the log transforms (error outside its domain), else y.
    fn log_step(transform: TargetTransform, sample: &str, y: f64) -> Result<f64> {
        if !transform.uses_log() {
            return Ok(y);
        }
        if y <= -1.0 || !y.is_finite() {
            return Err(Error::LogDomain {
                sample: sample.to_string(),
                value: y,
            });
        }
        Ok(y.ln_1p())
    }

    /// Check that a target can be transformed (the log domain); `sample`
    /// names it in the error.
    pub fn check(&self, sample: &str, y: f64) -> Result<()> {
        Self::log_step(self.transform, sample, y).map(|_| ())
    }

    fn category_stats(&self, key: Option<&str>) -> MeanStd {
        let Some(cat) = &self.category else {
            return self.global;
        };
        key.and_then(|k| cat.stats.get(k))
            .copied()
            .unwrap_or(cat.global)
    }

    /// True when `key` has its own statistics (false: the global fallback is used).
    pub fn knows_key(&self, key: &str) -> bool {
        self.category
            .as_ref()
            .is_none_or(|c| c.stats.contains_key(key))
    }

    /// Transform a target; `key` is its category key (per-category transforms).
    /// Call [`Self::check`] first for untrusted values of log transforms.
    pub fn normalize(&self, y: f64, key: Option<&str>) -> f64 {
        let y = if self.transform.uses_log() {
            y.ln_1p()
        } else {
            y
        };
        match self.transform {
            TargetTransform::None => y,
            TargetTransform::MinMax | TargetTransform::LogMinMax => (y - self.min) / self.scale,
            TargetTransform::ZScore | TargetTransform::LogZScore => {
                (y - self.global.mean) / self.global.std
            }
            TargetTransform::ZScoreCategory | TargetTransform::LogZScoreCategory => {
                let s = self.category_stats(key);
                (y - s.mean) / s.std
            }
        }
    }

    /// The inverse of [`Self::normalize`] (predictions back to target units).
    pub fn denormalize(&self, x: f64, key: Option<&str>) -> f64 {
        let y = match self.transform {
            TargetTransform::None => x,
            TargetTransform::MinMax | TargetTransform::LogMinMax => x * self.scale + self.min,
            TargetTransform::ZScore | TargetTransform::LogZScore => {
                x * self.global.std + self.global.mean
            }
            TargetTransform::ZScoreCategory | TargetTransform::LogZScoreCategory => {
                let s = self.category_stats(key);
                x * s.std + s.mean
            }
        };
        if self.transform.uses_log() {
            y.min(MAX_EXP_INPUT).exp_m1()
        } else {
            y
        }
    }
}

/// §2.9 min-max normalisation of counts over the training table's non-zero
/// entries; padding stays 0.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CountNormalizer {
    /// Smallest non-zero training count.
    pub min: f64,
    /// Largest training count.
    pub max: f64,
    /// `max - min`, or 1 when that is 0.
    pub scale: f64,
}

impl CountNormalizer {
    /// Fit on non-zero counts.
    pub fn fit(counts: impl IntoIterator<Item = f64>) -> Result<Self> {
        let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
        for c in counts.into_iter().filter(|&c| c > 0.0) {
            min = min.min(c);
            max = max.max(c);
        }
        if !min.is_finite() {
            return Err(Error::NothingToFit {
                what: "count normalisation".into(),
            });
        }
        let scale = if max - min == 0.0 { 1.0 } else { max - min };
        Ok(Self { min, max, scale })
    }

    /// `(c - min) / scale`.
    pub fn normalize(&self, c: f64) -> f64 {
        (c - self.min) / self.scale
    }

    /// The inverse.
    pub fn denormalize(&self, x: f64) -> f64 {
        x * self.scale + self.min
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDS: [&str; 6] = ["a", "b", "c", "d", "e", "f"];
    const Y: [f64; 6] = [18.0, 25.0, 40.0, 61.0, 85.0, 33.0];

    fn keys() -> Vec<String> {
        ["s=x", "s=x", "s=y", "s=y", "s=y", "s=x"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    #[test]
    fn every_transform_round_trips() {
        let cols = vec!["s".to_string()];
        for t in TargetTransform::ALL {
            let keys = keys();
            let n = TargetNormalizer::fit(t, &IDS, &Y, &cols, Some(&keys)).unwrap();
            for (y, k) in Y.iter().chain(&[0.0, 150.0, -0.5]).zip(keys.iter().cycle()) {
                let x = n.normalize(*y, Some(k));
                let back = n.denormalize(x, Some(k));
                assert!(
                    (back - y).abs() <= 1e-12 * y.abs().max(1.0),
                    "{t}: {y} -> {x} -> {back}"
                );
            }
            let json = serde_json::to_string(&n).unwrap();
            let back: TargetNormalizer = serde_json::from_str(&json).unwrap();
            assert_eq!(back, n, "{t}");
        }
    }

    #[test]
    fn known_values() {
        let cols = vec!["s".to_string()];
        let n = TargetNormalizer::fit(TargetTransform::MinMax, &IDS, &Y, &cols, None).unwrap();
        assert_eq!(n.normalize(18.0, None), 0.0);
        assert_eq!(n.normalize(85.0, None), 1.0);
        let n = TargetNormalizer::fit(TargetTransform::ZScore, &IDS, &Y, &cols, None).unwrap();
        let mean = Y.iter().sum::<f64>() / 6.0;
        let std = (Y.iter().map(|y| (y - mean).powi(2)).sum::<f64>() / 6.0).sqrt();
        assert!((n.normalize(40.0, None) - (40.0 - mean) / std).abs() < 1e-12);
        let n = TargetNormalizer::fit(TargetTransform::LogMinMax, &IDS, &Y, &cols, None).unwrap();
        assert!((n.min - 19f64.ln()).abs() < 1e-12 && (n.max - 86f64.ln()).abs() < 1e-12);
        // Per category: x group = {18, 25, 33}, mean 25.333.., unseen key -> global.
        let keys = keys();
        let n = TargetNormalizer::fit(
            TargetTransform::ZScoreCategory,
            &IDS,
            &Y,
            &cols,
            Some(&keys),
        )
        .unwrap();
        let xs = [18.0, 25.0, 33.0];
        let m = xs.iter().sum::<f64>() / 3.0;
        let s = (xs.iter().map(|v| (v - m).powi(2)).sum::<f64>() / 3.0).sqrt();
        assert!((n.normalize(30.0, Some("s=x")) - (30.0 - m) / s).abs() < 1e-12);
        assert!(!n.knows_key("s=z"));
        assert!(
            (n.normalize(30.0, Some("s=z")) - (30.0 - n.global.mean) / n.global.std).abs() < 1e-12
        );
    }

    #[test]
    fn constant_targets_and_errors() {
        let n = TargetNormalizer::fit(TargetTransform::MinMax, &["a", "b"], &[5.0, 5.0], &[], None)
            .unwrap();
        assert_eq!(n.scale, 1.0);
        assert_eq!(n.normalize(5.0, None), 0.0);
        let n = TargetNormalizer::fit(TargetTransform::ZScore, &["a", "b"], &[5.0, 5.0], &[], None)
            .unwrap();
        assert_eq!(n.global.std, 1.0);
        let err = TargetNormalizer::fit(
            TargetTransform::LogMinMax,
            &["a", "b"],
            &[1.0, -3.0],
            &[],
            None,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("\"b\"") && err.to_string().contains("-3"),
            "{err}"
        );
        assert!(
            TargetNormalizer::fit(TargetTransform::ZScoreCategory, &["a"], &[1.0], &[], None)
                .is_err()
        );
        assert!(matches!(
            TargetNormalizer::fit::<&str>(TargetTransform::MinMax, &[], &[], &[], None),
            Err(Error::NothingToFit { .. })
        ));
        assert!("log_minmax".parse::<TargetTransform>().is_err());
        assert_eq!(
            "log-zscore".parse::<TargetTransform>().unwrap(),
            TargetTransform::LogZScore
        );
    }

    #[test]
    fn count_normalizer_uses_non_zero_entries() {
        let c = CountNormalizer::fit([0.0, 2.0, 10.0, 4.0]).unwrap();
        assert_eq!((c.min, c.max, c.scale), (2.0, 10.0, 8.0));
        assert_eq!(c.normalize(6.0), 0.5);
        assert_eq!(c.denormalize(0.5), 6.0);
        assert!(CountNormalizer::fit([0.0]).is_err());
        assert_eq!(CountNormalizer::fit([3.0, 3.0]).unwrap().scale, 1.0);
    }
}
