//! The kernel crate's tests, as one test binary: each test binary builds and
//! links the backends again (four of them took 977 s of one core to build,
//! `cargo build --timings`, 2026-11-28). The kernel a test runs is a value it
//! passes (a `KernelChoice` or the plan of its device), so the suites share
//! a process. Run one suite with its module as the filter, e.g.
//! `cargo test -p aam-kernels --features wgpu,ndarray --test kernels fused_parity::`.
//!
//! - `fused_parity`: the fused attention kernels against the math path.
//! - `half_precision`: the f16/bf16 kernels against the f32 kernel.
//! - `matmul_kernels`: the dense layers' products against a float64 product.
//! - `ops`: the one-op kernels (`ops/mod.rs`).
//! - `layout`: no import cycles among the modules of `kernels/` and `models/`.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

mod common;
mod fused_parity;
mod half_precision;
mod layout;
mod matmul_kernels;
mod ops;
