//! Stopping training on a signal without losing work. SLURM sends SIGTERM on
//! `scancel` and at a job's time limit (SIGKILL follows after `KillWait`),
//! and a chosen signal some time before the limit with
//! `--signal=USR1@<seconds>`; Kubernetes and systemd send SIGTERM too. While
//! `aam-rs pretrain` or `train` runs, SIGTERM and SIGUSR1 ask the run to stop
//! at its next optimiser step, with `checkpoints/last.safetensors` written
//! there ([`aam_train::run::Observer::interrupted`]); the command then exits
//! with [`aam_cli::Interrupted::EXIT_STATUS`]. A second signal ends the
//! process at once. SIGINT (Ctrl-C) ends it at once, as by default, also
//! after a library took SIGINT over (process 0 of a run across processes on
//! the CPU backends runs `burn-collective`'s coordinator, which does).

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

/// The first stop signal received, if any (0: none).
#[derive(Clone, Debug, Default)]
pub struct StopSignal(Arc<AtomicI32>);

impl StopSignal {
    /// Handles SIGTERM and SIGUSR1 (and SIGINT) from now on (for the rest of
    /// the process).
    #[cfg(unix)]
    pub fn install() -> anyhow::Result<Self> {
        let stop = Self::default();
        for signal in [libc::SIGTERM, libc::SIGUSR1] {
            let flag = stop.0.clone();
            // SAFETY: the action only does async-signal-safe work: an atomic
            // swap, and `_exit` on a second signal.
            let registered = unsafe {
                signal_hook_registry::register(signal, move || {
                    if flag.swap(signal, Ordering::SeqCst) != 0 {
                        libc::_exit(128 + signal);
                    }
                })
            };
            registered.map_err(|e| anyhow::anyhow!("handling signal {signal}: {e}"))?;
        }
        // SAFETY: `_exit` is async-signal-safe.
        let registered = unsafe {
            signal_hook_registry::register(libc::SIGINT, || libc::_exit(128 + libc::SIGINT))
        };
        registered.map_err(|e| anyhow::anyhow!("handling SIGINT: {e}"))?;
        Ok(stop)
    }

    /// Signals are not handled on this platform (Ctrl-C ends the run; the
    /// last checkpoint stays).
    #[cfg(not(unix))]
    pub fn install() -> anyhow::Result<Self> {
        Ok(Self::default())
    }

    /// The name of the signal received, if any.
    pub fn received(&self) -> Option<&'static str> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            #[cfg(unix)]
            libc::SIGTERM => Some("SIGTERM"),
            #[cfg(unix)]
            libc::SIGUSR1 => Some("SIGUSR1"),
            _ => Some("a signal"),
        }
    }
}
