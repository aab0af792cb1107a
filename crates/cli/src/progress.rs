//! Progress bars (indicatif) and per-epoch log lines for training.

use aam_train::checkpoint::EpochRecord;
use aam_train::run::{BatchStatus, Observer};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::compile_workers::CompileWorkers;
use crate::stop::StopSignal;

/// Draws one bar per epoch on stderr (hidden when stderr is not a terminal)
/// and logs a summary line per epoch.
pub struct Progress {
    bar: Option<ProgressBar>,
    epochs: usize,
    stop: StopSignal,
    /// When training started, until the first step's line is logged.
    started: Option<std::time::Instant>,
    /// Handed problems until the first step ends.
    helpers: Option<CompileWorkers>,
}

impl Progress {
    /// For a run of at most `epochs` epochs, stopped at a step when `stop`
    /// receives a signal.
    pub fn new(epochs: usize, stop: StopSignal) -> Self {
        Self {
            bar: None,
            epochs,
            stop,
            started: Some(std::time::Instant::now()),
            helpers: None,
        }
    }

    /// With `--compile-workers` helpers, stopped when the first step ends.
    pub fn with_helpers(mut self, helpers: Option<CompileWorkers>) -> Self {
        self.helpers = helpers;
        self
    }

    fn bar(&mut self, len: usize, prefix: String) -> &ProgressBar {
        let bar = self.bar.get_or_insert_with(|| {
            let bar = ProgressBar::with_draw_target(Some(len as u64), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed}<{eta})",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            bar
        });
        bar.set_prefix(prefix);
        bar
    }

    /// Clears the bar.
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

impl Observer for Progress {
    fn batch(&mut self, s: &BatchStatus) {
        if let Some(started) = self.started.take() {
            // On a machine that compiles its kernels, the first step's time is
            // mostly that (docs/backends.md).
            if let Some(helpers) = self.helpers.take() {
                helpers.stop();
            }
            tracing::info!(
                "first step done, {:.1} s after training started",
                started.elapsed().as_secs_f64()
            );
        }
        let prefix = format!("epoch {}/{}", s.epoch + 1, self.epochs);
        let bar = self.bar(s.batches, prefix);
        bar.set_length(s.batches as u64);
        bar.set_position(s.batch as u64);
        bar.set_message(format!(
            "loss {:.4} lr {:.2e} {:.1} samples/s",
            s.loss, s.lr, s.samples_per_sec
        ));
    }

    fn validating(&mut self, batches: usize) {
        if let Some(bar) = &self.bar {
            bar.set_message(format!("validating ({batches} batches)"));
        }
    }

    fn epoch(&mut self, r: &EpochRecord, improved: bool) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        let fmt = |m: &std::collections::BTreeMap<String, f64>| {
            m.iter()
                .map(|(k, v)| format!("{k} {v:.4}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        tracing::info!(
            "epoch {}/{}: train [{}] val [{}] lr {:.2e}, {:.1} samples/s, {:.1}s{}",
            r.epoch + 1,
            self.epochs,
            fmt(&r.train),
            fmt(&r.validation),
            r.lr,
            r.samples_per_sec,
            r.seconds,
            if improved { " (best)" } else { "" }
        );
    }

    fn interrupted(&mut self) -> bool {
        self.stop.received().is_some()
    }
}
