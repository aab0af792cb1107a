//! Reference §4.2: learning-rate schedules, as pure functions of the number
//! of optimiser steps taken (plus the plateau state), so a checkpoint only
//! needs `steps` and [`PlateauState`] to resume them exactly.
//!
//! Deviations from the reference (each a bug there, §8 item 11):
//! - warmup_cosine: the n-th update uses `lr·n/W` (the reference's first update
//!   uses the full lr), the cosine phase is clamped at its end instead of
//!   rising again, and a warm-up of at least the whole run is clamped to a
//!   tenth of it, with a warning;
//! - cosine/cosine_restarts get no extra step at each epoch end;
//! - one-cycle never runs past its last step (gradient-accumulation leftovers
//!   cannot over-step it).

use serde::{Deserialize, Serialize};

/// Which schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SchedulerKind {
    /// Linear warm-up, then cosine decay to 0.
    #[default]
    WarmupCosine,
    /// Cosine annealing to `eta_min` over the run.
    Cosine,
    /// Cosine annealing with warm restarts.
    CosineRestarts,
    /// Multiply by `factor` after `patience` epochs without improvement.
    Plateau,
    /// One-cycle (cosine up for 30%, then down), with β1 cycling.
    Onecycle,
    /// Constant.
    None,
}

/// Schedule parameters (reference defaults where `None`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// Which schedule.
    pub kind: SchedulerKind,
    /// Peak (base) learning rate.
    pub lr: f64,
    /// Total optimiser steps of the run.
    pub total_steps: u64,
    /// Warm-up steps (warmup_cosine).
    pub warmup_steps: u64,
    /// First restart period (cosine_restarts); default total/4.
    pub t0: Option<u64>,
    /// Period multiplier (cosine_restarts); default 2.
    pub t_mult: Option<u64>,
    /// Floor of the cosine schedules; default 0.
    pub eta_min: Option<f64>,
    /// Plateau patience in epochs; default 5.
    pub patience: Option<u64>,
    /// Plateau factor; default 0.3.
    pub factor: Option<f64>,
    /// Plateau floor; default 0.
    pub min_lr: Option<f64>,
}

impl SchedulerConfig {
    /// A schedule with the reference's defaults for every optional parameter.
    pub fn new(kind: SchedulerKind, lr: f64, total_steps: u64, warmup_steps: u64) -> Self {
        Self {
            kind,
            lr,
            total_steps,
            warmup_steps,
            t0: None,
            t_mult: None,
            eta_min: None,
            patience: None,
            factor: None,
            min_lr: None,
        }
    }
}

/// ReduceLROnPlateau's state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlateauState {
    /// Best metric so far (None before the first epoch).
    pub best: Option<f64>,
    /// Epochs since the last improvement.
    pub bad_epochs: u64,
    /// Current learning rate.
    pub lr: f64,
}

/// A learning-rate schedule in progress.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Scheduler {
    /// Parameters, with the warm-up already clamped.
    pub config: SchedulerConfig,
    /// Optimiser steps taken.
    pub steps: u64,
    /// Plateau state.
    pub plateau: PlateauState,
}

impl Scheduler {
    /// Starts a schedule; clamps a warm-up that covers the whole run.
    pub fn new(mut config: SchedulerConfig) -> Self {
        config.total_steps = config.total_steps.max(1);
        if config.kind == SchedulerKind::WarmupCosine && config.warmup_steps >= config.total_steps {
            let clamped = (config.total_steps / 10).max(1);
            tracing::warn!(
                "--warmup-steps {} is at least the whole run ({} optimiser steps); using {clamped} (10%)",
                config.warmup_steps,
                config.total_steps
            );
            config.warmup_steps = clamped;
        }
        let lr = config.lr;
        Self {
            config,
            steps: 0,
            plateau: PlateauState {
                best: None,
                bad_epochs: 0,
                lr,
            },
        }
    }

    /// The learning rate of the next optimiser step.
    pub fn lr(&self) -> f64 {
        let c = &self.config;
        let base = c.lr;
        let t = c.total_steps as f64;
        let k = self.steps as f64;
        let eta_min = c.eta_min.unwrap_or(0.0);
        let cosine = |from: f64, to: f64, progress: f64| {
            to + (from - to) * 0.5 * (1.0 + (std::f64::consts::PI * progress.clamp(0.0, 1.0)).cos())
        };
        match c.kind {
            SchedulerKind::None => base,
            SchedulerKind::Plateau => self.plateau.lr,
            SchedulerKind::WarmupCosine => {
                let w = c.warmup_steps as f64;
                let n = k + 1.0;
                if n <= w {
                    base * n / w
                } else {
                    cosine(base, 0.0, (n - w) / (t - w).max(1.0))
                }
            }
            SchedulerKind::Cosine => cosine(base, eta_min, k / t),
            SchedulerKind::CosineRestarts => {
                let mut period = c.t0.unwrap_or((c.total_steps / 4).max(1)).max(1) as f64;
                let mult = c.t_mult.unwrap_or(2).max(1) as f64;
                let mut pos = k;
                while pos >= period {
                    pos -= period;
                    period *= mult;
                }
                cosine(base, eta_min, pos / period)
            }
            SchedulerKind::Onecycle => {
                let (initial, min) = onecycle_bounds(base);
                let (end1, end2) = onecycle_phases(c.total_steps);
                let k = k.min(end2);
                if k <= end1 {
                    cosine(initial, base, k / end1.max(1.0))
                } else {
                    cosine(base, min, (k - end1) / (end2 - end1).max(1.0))
                }
            }
        }
    }

    /// Adam's β1 for the next step (one-cycle momentum 0.95 → 0.85 → 0.95).
    pub fn beta1(&self) -> Option<f64> {
        if self.config.kind != SchedulerKind::Onecycle {
            return None;
        }
        let (end1, end2) = onecycle_phases(self.config.total_steps);
        let k = (self.steps as f64).min(end2);
        let cosine = |from: f64, to: f64, p: f64| {
            to + (from - to) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
        };
        Some(if k <= end1 {
            cosine(0.95, 0.85, k / end1.max(1.0))
        } else {
            cosine(0.85, 0.95, (k - end1) / (end2 - end1).max(1.0))
        })
    }

    /// Call after each optimiser step.
    pub fn step(&mut self) {
        self.steps += 1;
    }

    /// Call at the end of an epoch with the monitored loss (plateau only).
    pub fn epoch_end(&mut self, metric: f64) {
        if self.config.kind != SchedulerKind::Plateau || !metric.is_finite() {
            return;
        }
        let p = &mut self.plateau;
        // torch: mode min, threshold 1e-4 relative.
        if p.best.is_none_or(|best| metric < best * (1.0 - 1e-4)) {
            p.best = Some(metric);
            p.bad_epochs = 0;
        } else {
            p.bad_epochs += 1;
        }
        if p.bad_epochs > self.config.patience.unwrap_or(5) {
            let new =
                (p.lr * self.config.factor.unwrap_or(0.3)).max(self.config.min_lr.unwrap_or(0.0));
            if p.lr - new > 1e-8 {
                tracing::info!("plateau: learning rate {:.3e} → {new:.3e}", p.lr);
                p.lr = new;
            }
            p.bad_epochs = 0;
        }
    }
}

/// One-cycle: start at lr/25, end at lr/25/1e4 (PyTorch defaults).
fn onecycle_bounds(lr: f64) -> (f64, f64) {
    let initial = lr / 25.0;
    (initial, initial / 1e4)
}

/// One-cycle phase ends (pct_start 0.3), in steps.
fn onecycle_phases(total: u64) -> (f64, f64) {
    let t = total as f64;
    ((0.3 * t - 1.0).max(1.0), (t - 1.0).max(2.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(kind: SchedulerKind, total: u64, warmup: u64) -> SchedulerConfig {
        SchedulerConfig::new(kind, 1.0, total, warmup)
    }

    fn run(s: &mut Scheduler, n: u64) -> Vec<f64> {
        (0..n)
            .map(|_| {
                let lr = s.lr();
                s.step();
                lr
            })
            .collect()
    }

    #[test]
    fn warmup_cosine_ramps_then_decays_to_zero() {
        let mut s = Scheduler::new(config(SchedulerKind::WarmupCosine, 10, 4));
        let lrs = run(&mut s, 10);
        assert_eq!(&lrs[..4], &[0.25, 0.5, 0.75, 1.0]);
        assert!(lrs[4..].windows(2).all(|w| w[1] < w[0]), "{lrs:?}");
        assert!(lrs[9].abs() < 1e-12);
    }

    #[test]
    fn a_warmup_longer_than_the_run_is_clamped() {
        let s = Scheduler::new(config(SchedulerKind::WarmupCosine, 50, 10_000));
        assert_eq!(s.config.warmup_steps, 5);
    }

    #[test]
    fn cosine_matches_the_closed_form() {
        let mut s = Scheduler::new(config(SchedulerKind::Cosine, 4, 0));
        let lrs = run(&mut s, 4);
        let want = [
            1.0,
            0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos()),
            0.5,
            0.5 * (1.0 + (3.0 * std::f64::consts::PI / 4.0).cos()),
        ];
        for (a, b) in lrs.iter().zip(want) {
            assert!((a - b).abs() < 1e-12);
        }
    }

    #[test]
    fn restarts_reset_the_cycle() {
        let mut c = config(SchedulerKind::CosineRestarts, 100, 0);
        c.t0 = Some(2);
        let mut s = Scheduler::new(c);
        let lrs = run(&mut s, 7);
        assert_eq!(lrs[0], 1.0);
        assert_eq!(lrs[2], 1.0); // restart after 2
        assert_eq!(lrs[6], 1.0); // then after 4 more
    }

    #[test]
    fn onecycle_starts_low_peaks_and_ends_lower() {
        let mut s = Scheduler::new(config(SchedulerKind::Onecycle, 100, 0));
        let lrs = run(&mut s, 100);
        assert!((lrs[0] - 0.04).abs() < 1e-12);
        let peak = lrs.iter().cloned().fold(0.0, f64::max);
        assert!((peak - 1.0).abs() < 1e-9);
        assert!(lrs[99] < 1e-5);
    }

    #[test]
    fn plateau_reduces_after_patience() {
        let mut c = config(SchedulerKind::Plateau, 10, 0);
        c.patience = Some(1);
        let mut s = Scheduler::new(c);
        s.epoch_end(1.0);
        s.epoch_end(1.0);
        assert_eq!(s.lr(), 1.0);
        s.epoch_end(1.0);
        assert!((s.lr() - 0.3).abs() < 1e-12);
    }
}
