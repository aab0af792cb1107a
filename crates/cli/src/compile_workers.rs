//! Helper processes that compile the dense layers' kernels while the first
//! forward pass runs (`--compile-workers`), and the hidden
//! `aam-rs compile-kernels` command each of them is.
//!
//! On CUDA and ROCm a kernel is compiled at its first launch, one after
//! another on the launching thread; on an empty kernel cache the matmul
//! kernels were 26 of a first step's 46 s on an H200. The model announces
//! its levels' row counts before its first layer, and each dense layer's
//! forward its backward's problem (`aam_kernels::set_compile_ahead_hook`).
//! From the row counts and the model's weight shapes this module makes the
//! problems of every dense layer at every level (`aam_kernels::dense_problems`,
//! a superset of those the step runs), forwards first, then each backward
//! split into its `dx` and its `dw`/`db` halves, and hands them in turn to a few
//! `aam-rs compile-kernels` processes (their own device contexts, the same
//! on-disk kernel cache), which run each on zeros. When the training
//! process launches those kernels CubeCL finds them compiled in the cache.
//! Problems are handed out during the first step only (later batches bring
//! new row counts but rarely new kernels, and helpers running then would
//! take the host's cores from the training). A helper that fails costs
//! nothing but its help: the training process compiles what it needs.

use std::collections::HashSet;
use std::io::{BufRead, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};

use aam_cli::args::MatmulKernels;
use aam_cli::backend::BackendKind;
use aam_kernels::{Ahead, DenseLayer, DenseProblem};
use anyhow::{bail, Context, Result};
use clap::Args;

/// `aam-rs compile-kernels`: reads dense problems from stdin, one per line
/// (`aam_kernels::DenseProblem`'s text form), and runs each on zeros on the
/// backend's first device.
#[derive(Args, Debug)]
pub struct CompileKernelsArgs {
    #[arg(long, value_enum)]
    pub backend: BackendKind,
    #[arg(long, value_enum, default_value_t)]
    pub matmul_kernels: MatmulKernels,
}

/// The helper's loop; ends at the end of its input.
pub fn run(args: CompileKernelsArgs) -> Result<()> {
    args.matmul_kernels.apply();
    aam_cli::with_backend!(args.backend, |B, device| {
        let stdin = std::io::stdin();
        let mut result = Ok(());
        for (number, line) in stdin.lock().lines().enumerate() {
            let line = line.context("reading the problems on stdin")?;
            let problem: DenseProblem = match line.parse() {
                Ok(p) => p,
                Err(e) => {
                    result = Err(anyhow::anyhow!("stdin line {}: {e}", number + 1));
                    break;
                }
            };
            if let Err(e) = aam_kernels::run_dense_problem::<B>(&problem, &device) {
                result = Err(anyhow::anyhow!("stdin line {} ({line}): {e}", number + 1));
                break;
            }
        }
        result
    })
}

/// Running helpers. [`CompileWorkers::stop`] (or dropping it) ends the
/// announcements and closes their input: each runs what it was handed and
/// exits.
pub struct CompileWorkers {
    shared: Arc<Mutex<Shared>>,
}

struct Shared {
    stdins: Vec<Option<ChildStdin>>,
    children: Vec<Child>,
    /// The model's dense layers.
    layers: Vec<DenseLayer>,
    seen: HashSet<DenseProblem>,
    next: usize,
    sent: usize,
}

impl CompileWorkers {
    /// `count` helpers on `backend`'s first device.
    pub fn start(count: usize, backend: BackendKind, matmul: MatmulKernels) -> Result<Self> {
        if count == 0 {
            bail!("no helpers to start");
        }
        let exe = std::env::current_exe().context("locating this program to start its helpers")?;
        let matmul = match matmul {
            MatmulKernels::Plan => "plan",
            MatmulKernels::Autotune => "autotune",
        };
        let mut children = Vec::with_capacity(count);
        let mut stdins = Vec::with_capacity(count);
        for _ in 0..count {
            let mut command = Command::new(&exe);
            command
                .args(["compile-kernels", "--backend", &backend.name()])
                .args(["--matmul-kernels", matmul])
                .stdin(Stdio::piped())
                .stdout(Stdio::null());
            // Their log is errors only (the log filter `aam_cli::init` reads):
            // the training process logs the rest, and CubeCL warns when
            // helpers tune the same reduction at once.
            command.env("AAM_LOG", "error");
            let mut child = command
                .spawn()
                .with_context(|| format!("starting {} compile-kernels", exe.display()))?;
            stdins.push(child.stdin.take());
            children.push(child);
        }
        let shared = Arc::new(Mutex::new(Shared {
            stdins,
            children,
            layers: Vec::new(),
            seen: HashSet::new(),
            next: 0,
            sent: 0,
        }));
        let hook = shared.clone();
        aam_kernels::set_compile_ahead_hook(Some(Arc::new(move |ahead| {
            hook.lock()
                .unwrap_or_else(|e| e.into_inner())
                .receive(ahead)
        })));
        Ok(Self { shared })
    }

    /// The model's dense layers, from its torch-named weight shapes
    /// (`aam_kernels::dense_layers`).
    pub fn expect_layers(&self, shapes: &[(String, Vec<usize>)]) {
        self.shared.lock().unwrap_or_else(|e| e.into_inner()).layers =
            aam_kernels::dense_layers(shapes);
    }

    /// Ends the announcements; the helpers run what they were handed.
    pub fn stop(self) {}
}

impl Shared {
    fn receive(&mut self, ahead: Ahead) {
        let problems = match ahead {
            Ahead::Rows { rows, dtypes } => {
                aam_kernels::dense_problems(&rows, &dtypes, &self.layers)
            }
            Ahead::Dense(problem) => vec![problem],
        };
        for problem in problems {
            self.hand_out(problem);
        }
    }

    /// Hands a new problem to the next helpers in turn (a backward in its
    /// `dx` and `dw`/`db` halves).
    fn hand_out(&mut self, problem: DenseProblem) {
        let [dx, dw, db] = problem.want;
        let parts = if problem.forward {
            vec![problem]
        } else {
            [[dx, false, false], [false, dw, db]]
                .into_iter()
                .filter(|w| w.contains(&true))
                .map(|want| DenseProblem { want, ..problem })
                .collect()
        };
        for part in parts {
            if !self.seen.insert(part) {
                continue;
            }
            let line = format!("{part}\n");
            let count = self.stdins.len();
            // The next helper whose input is still open.
            for _ in 0..count {
                let i = self.next % count;
                self.next += 1;
                if let Some(stdin) = &mut self.stdins[i] {
                    if stdin.write_all(line.as_bytes()).is_ok() && stdin.flush().is_ok() {
                        self.sent += 1;
                        break;
                    }
                    tracing::debug!("kernel-compiling helper {i} stopped taking problems");
                    self.stdins[i] = None;
                }
            }
        }
    }
}

impl Drop for CompileWorkers {
    fn drop(&mut self) {
        aam_kernels::set_compile_ahead_hook(None);
        let mut shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        shared.stdins.clear();
        tracing::debug!(
            "kernel-compiling helpers: {} problems handed out; closing their input",
            shared.sent
        );
        // Reaped in the background: each runs what it was handed first.
        let children = std::mem::take(&mut shared.children);
        std::thread::spawn(move || {
            for mut child in children {
                let _ = child.wait();
            }
        });
    }
}
