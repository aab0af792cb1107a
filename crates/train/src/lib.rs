//! `aam-train`: everything between a batch and a trained checkpoint.
//!
//! **Job.** What a run is asked to do, checked before anything is loaded
//! ([`config`]: the run's hyper-parameters and the model's architecture from
//! the user's options), the run's samples from the user's files ([`prepare`]:
//! read, rarefied, joined by sample ID, split), the reference's losses and
//! metrics (§3: [`loss`], [`metrics`]), optimisers and learning-rate schedules
//! (§4.1–4.2: [`optim`], [`schedule`]), checkpoints ([`checkpoint`]) and the
//! epoch loop with validation, early stopping and logs (§4.3–4.4:
//! [`run::fit`]), generic over any Burn autodiff backend that implements the
//! attention extension, with the run's scalars in TensorBoard event files
//! ([`tensorboard`]) and the reference's checkpoint files in PyTorch's
//! format ([`torch`]); data-parallel steps over several devices
//! ([`parallel`]: one replica per device, each on its own thread, gradients
//! summed by NCCL on CUDA or through the host, UniFrac pairs across the whole
//! global batch) and over several processes and nodes ([`world`]: ranks, the
//! rendezvous, one NCCL communicator over every replica on CUDA, Burn's
//! `burn-collective` across the host sums of the other backends); and [`gradcheck`], which compares a
//! backend's training step with the CPU's on the same weights and batch.
//!
//! **How a run goes.** A front end (the `aam-rs` binary) turns flags into a
//! [`prepare::DataSpec`], a [`config::ModelSpec`] and a [`config::RunConfig`],
//! calls [`prepare::prepare`], builds the model, and hands everything to
//! [`run::fit`]. `fit` owns the loop; progress comes back through a
//! [`run::Observer`]. Modules depend downwards only: `config` ← `checkpoint`
//! ← `run`; `prepare` and `gradcheck` sit beside `run`.
//!
//! **Design choices to defend.**
//! - *Parameters are named by their torch state-dict key everywhere*: in
//!   checkpoints, in the optimiser state, in gradient buffers. A checkpoint
//!   is one safetensors file that any tool can read, the reference's names
//!   line up one to one, and resuming never depends on Burn's run-local
//!   parameter ids. This is why the optimisers are written here rather than
//!   taken from burn-optim (see [`optim`]).
//! - *Randomness is a function of counters*: batch order of `(seed, epoch)`,
//!   dropout and masking of `(seed, micro-step)`. Resuming from a checkpoint
//!   reproduces the uninterrupted run exactly on the CPU.
//! - *Where the reference is wrong, this crate is not* (reference §8): the
//!   warm-up schedule, classification targets, count-embedding validation,
//!   predictions in original units. Each deviation is marked `DEVIATION` or
//!   described in the module that makes it.
//!
//! The crate never prints; it reports through [`run::Observer`] and
//! `tracing`.

#![deny(missing_docs)]

pub mod batch_size;
pub mod checkpoint;
mod collective;
pub mod config;
mod error;
pub mod gradcheck;
pub mod loss;
pub mod metrics;
pub mod optim;
pub mod parallel;
pub mod prepare;
mod replica;
pub mod run;
pub mod schedule;
pub mod tensorboard;
pub mod torch;
pub mod world;

pub use error::{Result, TrainError};
