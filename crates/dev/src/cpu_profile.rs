//! `aam-dev step --cpu-profile`: where the host's time goes.
//!
//! On a GPU the training step is bound by the host's work per op (Burn's
//! autodiff and fusion bookkeeping, CubeCL's launch preparation;
//! `docs/performance.md`), and the device machine has no
//! `perf`. This samples every thread's call stack on `SIGPROF` (pprof-rs's
//! handler, no kernel perf events needed) and writes the stacks folded, one
//! `thread;outer;…;inner count` line each: the input of `inferno-flamegraph` /
//! `flamegraph.pl`, and of `benches/folded_summary.py`. Symbols come from the
//! binary's symbol table: profile an unstripped build.
//!
//! Why a timer per thread: pprof-rs's own timer (`setitimer(ITIMER_PROF)`)
//! counts the whole process's CPU time and Linux sends its signal to one
//! thread, mostly the main one: on an H100 step (2026-11-25) the busy device
//! threads (Burn fusion's stream, CubeCL's server) got 31 of 145 samples. Here each
//! thread alive at the start gets a POSIX timer on its own CPU-time clock
//! whose signal goes to that thread alone (`SIGEV_THREAD_ID`), so each thread
//! is sampled in proportion to the CPU time it uses.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Samples per second of each thread's CPU time.
const FREQUENCY: i64 = 997;

/// A running profile; [`CpuProfile::write`] ends it.
pub struct CpuProfile {
    guard: pprof::ProfilerGuard<'static>,
    timers: Vec<ThreadTimer>,
    path: PathBuf,
}

/// A POSIX timer on one thread's CPU-time clock that sends `SIGPROF` to that
/// thread; deleted on drop.
struct ThreadTimer(libc::timer_t);

impl ThreadTimer {
    /// Starts sampling thread `tid` of this process `FREQUENCY` times per
    /// second of its CPU time.
    fn start(tid: libc::pid_t) -> std::io::Result<Self> {
        // The kernel's `MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)`: another
        // thread's CPU clock, which `pthread_getcpuclockid` gives only for
        // threads this code started.
        let clock = (!tid << 3) | 6;
        // SAFETY: `sigevent` is plain data (zero is a valid value of every
        // field); the fields set are those `SIGEV_THREAD_ID` reads.
        let mut event: libc::sigevent = unsafe { std::mem::zeroed() };
        event.sigev_notify = libc::SIGEV_THREAD_ID;
        event.sigev_signo = libc::SIGPROF;
        event.sigev_notify_thread_id = tid;
        let mut timer: libc::timer_t = std::ptr::null_mut();
        // SAFETY: valid pointers to an initialised event and to the output.
        if unsafe { libc::timer_create(clock, &mut event, &mut timer) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let timer = Self(timer);
        let period = libc::timespec {
            tv_sec: 0,
            tv_nsec: 1_000_000_000 / FREQUENCY,
        };
        let spec = libc::itimerspec {
            it_interval: period,
            it_value: period,
        };
        // SAFETY: `timer.0` was created above; `spec` is initialised.
        if unsafe { libc::timer_settime(timer.0, 0, &spec, std::ptr::null_mut()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(timer)
    }
}

impl Drop for ThreadTimer {
    fn drop(&mut self) {
        // SAFETY: created by `timer_create` and deleted only here.
        unsafe { libc::timer_delete(self.0) };
    }
}

impl CpuProfile {
    /// Starts sampling every thread alive now (the device threads exist once
    /// a step has run); the result will go to `path`.
    pub fn start(path: &Path) -> Result<Self> {
        let guard = pprof::ProfilerGuardBuilder::default()
            // pprof's process-wide timer only installs the handler here; the
            // samples come from the per-thread timers.
            .frequency(1)
            // Unwinding through the C runtime and the vDSO can fault.
            .blocklist(&["libc", "libgcc", "pthread", "vdso"])
            .build()
            .context("--cpu-profile: starting the sampler")?;
        let mut timers = Vec::new();
        for entry in
            std::fs::read_dir("/proc/self/task").context("--cpu-profile: /proc/self/task")?
        {
            let name = entry.context("--cpu-profile: /proc/self/task")?.file_name();
            let tid: libc::pid_t = name
                .to_str()
                .and_then(|tid| tid.parse().ok())
                .with_context(|| {
                    format!("--cpu-profile: /proc/self/task/{name:?} is no thread id")
                })?;
            match ThreadTimer::start(tid) {
                Ok(timer) => timers.push(timer),
                // The thread ended between the listing and now.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => {
                    return Err(e).context(format!("--cpu-profile: a timer for thread {tid}"))
                }
            }
        }
        Ok(Self {
            guard,
            timers,
            path: path.to_path_buf(),
        })
    }

    /// Stops sampling and writes the folded stacks (atomically: a temporary
    /// file beside `path`, then a rename). Returns the number of samples.
    pub fn write(self) -> Result<usize> {
        // No signal may arrive after pprof gives the handler back.
        drop(self.timers);
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
        aam_data::write_atomic(&self.path, text.as_bytes())
            .with_context(|| format!("--cpu-profile: writing {}", self.path.display()))?;
        Ok(samples)
    }
}
