//! Reference §3.6: streaming validation metrics, on the host in f64.

use std::collections::BTreeMap;

/// Streaming MAE, MSE and R² (Welford for the target variance).
#[derive(Clone, Debug, Default)]
pub struct RegressionMetrics {
    n: u64,
    abs_sum: f64,
    sq_sum: f64,
    mean_y: f64,
    m2_y: f64,
}

impl RegressionMetrics {
    /// Adds prediction/target pairs.
    pub fn update(&mut self, predictions: &[f64], targets: &[f64]) {
        for (&p, &y) in predictions.iter().zip(targets) {
            self.n += 1;
            let e = p - y;
            self.abs_sum += e.abs();
            self.sq_sum += e * e;
            let delta = y - self.mean_y;
            self.mean_y += delta / self.n as f64;
            self.m2_y += delta * (y - self.mean_y);
        }
    }

    /// Number of pairs seen.
    pub fn count(&self) -> u64 {
        self.n
    }

    /// Mean absolute error.
    pub fn mae(&self) -> f64 {
        self.abs_sum / self.n.max(1) as f64
    }

    /// Mean squared error.
    pub fn mse(&self) -> f64 {
        self.sq_sum / self.n.max(1) as f64
    }

    /// `1 − SSE/SST`; 0 when the targets have no variance.
    pub fn r2(&self) -> f64 {
        if self.m2_y <= 0.0 {
            0.0
        } else {
            1.0 - self.sq_sum / self.m2_y
        }
    }
}

/// Confusion-matrix metrics of a classifier.
#[derive(Clone, Debug, Default)]
pub struct ClassificationMetrics {
    /// (true, predicted) → count.
    confusion: BTreeMap<(usize, usize), u64>,
    n: u64,
}

impl ClassificationMetrics {
    /// Adds one prediction.
    pub fn update(&mut self, truth: usize, predicted: usize) {
        *self.confusion.entry((truth, predicted)).or_default() += 1;
        self.n += 1;
    }

    /// Fraction correct.
    pub fn accuracy(&self) -> f64 {
        let correct: u64 = self
            .confusion
            .iter()
            .filter(|((t, p), _)| t == p)
            .map(|(_, c)| c)
            .sum();
        correct as f64 / self.n.max(1) as f64
    }

    /// Support-weighted F1 over the classes that occur in the truth.
    pub fn f1(&self) -> f64 {
        let mut support: BTreeMap<usize, u64> = BTreeMap::new();
        let mut predicted: BTreeMap<usize, u64> = BTreeMap::new();
        let mut hits: BTreeMap<usize, u64> = BTreeMap::new();
        for (&(t, p), &c) in &self.confusion {
            *support.entry(t).or_default() += c;
            *predicted.entry(p).or_default() += c;
            if t == p {
                *hits.entry(t).or_default() += c;
            }
        }
        let mut total = 0.0;
        for (&class, &s) in &support {
            let tp = *hits.get(&class).unwrap_or(&0) as f64;
            let precision = match predicted.get(&class) {
                Some(&p) if p > 0 => tp / p as f64,
                _ => 0.0,
            };
            let recall = tp / s as f64;
            let f1 = if precision + recall > 0.0 {
                2.0 * precision * recall / (precision + recall)
            } else {
                0.0
            };
            total += f1 * s as f64;
        }
        total / self.n.max(1) as f64
    }
}

/// Running means of named scalars (per-batch losses → epoch values).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Means {
    sums: BTreeMap<String, (f64, u64)>,
}

impl Means {
    /// Adds one value.
    pub fn add(&mut self, name: &str, value: f64) {
        let e = self.sums.entry(name.to_string()).or_default();
        e.0 += value;
        e.1 += 1;
    }

    /// Adds every value of `other`.
    pub fn merge(&mut self, other: Means) {
        for (name, (sum, n)) in other.sums {
            let e = self.sums.entry(name).or_default();
            e.0 += sum;
            e.1 += n;
        }
    }

    /// The means.
    pub fn finish(&self) -> BTreeMap<String, f64> {
        self.sums
            .iter()
            .map(|(k, (s, n))| (k.clone(), s / (*n).max(1) as f64))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regression_metrics_match_the_definitions() {
        let mut m = RegressionMetrics::default();
        m.update(&[1.0, 2.0], &[1.5, 2.5]);
        m.update(&[4.0], &[3.0]);
        assert!((m.mae() - (0.5 + 0.5 + 1.0) / 3.0).abs() < 1e-12);
        assert!((m.mse() - (0.25 + 0.25 + 1.0) / 3.0).abs() < 1e-12);
        let mean = (1.5 + 2.5 + 3.0) / 3.0;
        let sst: f64 = [1.5f64, 2.5, 3.0].iter().map(|y| (y - mean).powi(2)).sum();
        assert!((m.r2() - (1.0 - 1.5 / sst)).abs() < 1e-12);
    }

    #[test]
    fn weighted_f1() {
        let mut m = ClassificationMetrics::default();
        for (t, p) in [(0, 0), (0, 1), (1, 1), (1, 1)] {
            m.update(t, p);
        }
        assert_eq!(m.accuracy(), 0.75);
        // class 0: p=1, r=0.5, f1=2/3; class 1: p=2/3, r=1, f1=0.8; weighted by support 2,2.
        assert!((m.f1() - (2.0 / 3.0 + 0.8) / 2.0).abs() < 1e-12);
    }
}
