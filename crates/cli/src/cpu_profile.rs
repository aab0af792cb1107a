//! `diagnose step --cpu-profile`: where the host's time goes.
//!
//! On a GPU the training step is bound by the host's work per op (Burn's
//! autodiff and fusion bookkeeping, CubeCL's launch preparation;
//! `benches/RESULTS.md`, eighth session), and the device machine has no
//! `perf`. This samples every thread's call stack on `SIGPROF` (pprof-rs, the
//! process's CPU-time timer, so it needs no kernel perf events) and writes the
//! stacks folded, one `thread;outer;…;inner count` line each: the input of
//! `inferno-flamegraph` / `flamegraph.pl`, and of `benches/folded_summary.py`.
//! Symbols come from the binary's symbol table: profile an unstripped build.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Samples per second of CPU time.
const FREQUENCY: i32 = 997;

/// A running profile; [`CpuProfile::write`] ends it.
pub struct CpuProfile {
    guard: pprof::ProfilerGuard<'static>,
    path: PathBuf,
}

impl CpuProfile {
    /// Starts sampling; the result will go to `path`.
    pub fn start(path: &Path) -> Result<Self> {
        let guard = pprof::ProfilerGuardBuilder::default()
            .frequency(FREQUENCY)
            // Unwinding through the C runtime and the vDSO can fault.
            .blocklist(&["libc", "libgcc", "pthread", "vdso"])
            .build()
            .context("--cpu-profile: starting the sampler")?;
        Ok(Self {
            guard,
            path: path.to_path_buf(),
        })
    }

    /// Stops sampling and writes the folded stacks (atomically: a temporary
    /// file beside `path`, then a rename). Returns the number of samples.
    pub fn write(self) -> Result<usize> {
        let report = self
            .guard
            .report()
            .build()
            .context("--cpu-profile: symbolising the samples")?;
        drop(self.guard);
        // pprof keys samples by stack and time; fold equal stacks.
        let mut folded: BTreeMap<String, isize> = BTreeMap::new();
        for (frames, count) in &report.data {
            let mut line = frames.thread_name_or_id().replace([';', ' '], "_");
            for frame in frames.frames.iter().rev() {
                for symbol in frame.iter().rev() {
                    let name = symbol.name().replace([';', ' '], "_");
                    write!(line, ";{name}").expect("writing to a String");
                }
            }
            *folded.entry(line).or_default() += count;
        }
        let mut text = String::new();
        let mut samples = 0usize;
        for (stack, count) in folded {
            samples += count.max(0) as usize;
            writeln!(text, "{stack} {count}").expect("writing to a String");
        }
        aam_models::import::write_atomic(&self.path, text.as_bytes())
            .with_context(|| format!("--cpu-profile: writing {}", self.path.display()))?;
        Ok(samples)
    }
}
