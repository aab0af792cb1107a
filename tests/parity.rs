//! The workspace-level tests as one test binary, one module per file: each
//! test binary builds and links the model on its backends again, so six of
//! them take CI minutes that one does not (two cores).
//!
//! - `reference_parity`: 25 reference checkpoints, outputs and gradients vs PyTorch;
//! - `loss_parity`: every loss and its gradients vs the reference's;
//! - `state_dicts`: every reference state dict maps name for name;
//! - `import_errors`: bad checkpoints are named and refused;
//! - `backend_parity`: every compiled-in backend against ndarray f32;
//! - `train_gradients`: the training step's gradients on wgpu/CUDA equal the CPU's;
//! - `folded_biases` (wgpu): a transformer layer that adds its biases in the
//!   element-wise passes after the products equals the layer with each bias in
//!   its dense layer;
//! - `fused_vs_math` (wgpu): a whole SequenceEncoder with the fused attention
//!   kernel equals it with the math path.
//!
//! Run one file's tests with its module name as the filter, e.g.
//! `cargo test -p aam-tests --features wgpu --test parity -- backend_parity::wgpu::`.

#[path = "backend_parity.rs"]
mod backend_parity;
#[path = "folded_biases.rs"]
mod folded_biases;
#[path = "fused_vs_math.rs"]
mod fused_vs_math;
#[path = "import_errors.rs"]
mod import_errors;
#[path = "loss_parity.rs"]
mod loss_parity;
#[path = "reference_parity.rs"]
mod reference_parity;
#[path = "state_dicts.rs"]
mod state_dicts;
#[path = "train_gradients.rs"]
mod train_gradients;
