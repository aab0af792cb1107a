//! The backends compiled into this binary, chosen at run time with `--backend`.

use clap::ValueEnum;

/// A compute backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Default)]
pub enum BackendKind {
    /// ndarray on the CPU (f32), the default embedded backend.
    #[default]
    Ndarray,
}

/// Runs `$body` with the type alias `$B` bound to the chosen backend and
/// `$device` to its default device.
#[macro_export]
macro_rules! with_backend {
    ($kind:expr, |$B:ident, $device:ident| $body:expr) => {
        match $kind {
            $crate::backend::BackendKind::Ndarray => {
                type $B = burn::backend::NdArray<f32>;
                let $device = burn::backend::ndarray::NdArrayDevice::Cpu;
                $body
            }
        }
    };
}
