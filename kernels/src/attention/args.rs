//! The arguments every attention kernel takes, as two launch structs: the
//! runtime scalars ([`Scalars`]; the launch sites build it once per chunk of
//! heads, [`HostScalars::launch`]) and the shared inputs ([`Operands`]: Q, K,
//! V, the bias and the keys' validity). Each kernel lists only what is its
//! own besides them (its outputs, saved statistics, tile validity).

use cubecl::prelude::*;

use super::AttentionDropout;
use crate::launch::{dropout_args, element_offset};

/// Scale, layout offsets and dropout of one attention launch.
///
/// Offsets are in elements of the operands' buffers: `k_offset`/`v_offset`
/// where K and V start in theirs (the packed projection holds Q, K and V in
/// one buffer), `dk_offset`/`dv_offset` where a backward writes dK and dV
/// (zero where a kernel does not). `bh_offset` is the first (sequence ·
/// heads + head) of the launch (launches cover at most 65,535 of them).
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub struct Scalars {
    /// The score scale (1/√Dh unless the caller set another).
    pub scale: f32,
    /// Heads per sequence.
    pub heads: u32,
    /// The launch's first (sequence · heads + head).
    pub bh_offset: u32,
    /// Where K starts in its buffer.
    pub k_offset: u32,
    /// Where V starts in its buffer.
    pub v_offset: u32,
    /// Where dK starts in its buffer.
    pub dk_offset: u32,
    /// Where dV starts in its buffer.
    pub dv_offset: u32,
    /// A probability is dropped where its hash falls below this.
    pub dropout_threshold: u32,
    /// What a kept probability is multiplied by, 1/(1 − p).
    pub dropout_scale: f32,
    /// The call's dropout seed.
    pub seed: u32,
}

/// The host's side of [`Scalars`] before a launch: everything but the
/// chunk's first head.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HostScalars {
    /// Whether the call drops probabilities (the kernels' compile-time
    /// `use_dropout`).
    pub(crate) use_dropout: bool,
    scale: f32,
    heads: u32,
    offsets: [u32; 4],
    threshold: u32,
    drop_scale: f32,
    seed: u32,
}

impl HostScalars {
    /// `kv_offsets` and `dkv_offsets` in elements (see [`Scalars`]).
    pub(crate) fn new(
        scale: f64,
        heads: usize,
        kv_offsets: [usize; 2],
        dkv_offsets: [usize; 2],
        dropout: AttentionDropout,
    ) -> Self {
        let (use_dropout, threshold, drop_scale, seed) = dropout_args(dropout);
        let [k, v] = kv_offsets.map(element_offset);
        let [dk, dv] = dkv_offsets.map(element_offset);
        Self {
            use_dropout,
            scale: scale as f32,
            heads: heads as u32,
            offsets: [k, v, dk, dv],
            threshold,
            drop_scale,
            seed,
        }
    }

    /// The launch argument for the chunk of heads starting at `bh_offset`.
    pub(crate) fn launch<R: Runtime>(&self, bh_offset: u32) -> ScalarsLaunch<R> {
        let [k, v, dk, dv] = self.offsets;
        ScalarsLaunch::new(
            self.scale,
            self.heads,
            bh_offset,
            k,
            v,
            dk,
            dv,
            self.threshold,
            self.drop_scale,
            self.seed,
        )
    }
}

/// The operands every attention kernel reads, as one launch argument: Q, K
/// and V (`Q`, `K`: the elements a kernel reads them by), the packed
/// projection's bias (`B`; any tensor where the call has none) and each
/// key's validity (1 or 0, `[N, Tk]`). `launch.rs` builds it for each
/// launch (`operands`).
#[derive(CubeLaunch, CubeType)]
pub struct Operands<Q: CubePrimitive, K: CubePrimitive, B: CubePrimitive> {
    /// The queries.
    pub q: Tensor<Q>,
    /// The keys.
    pub k: Tensor<K>,
    /// The values.
    pub v: Tensor<K>,
    /// The bias added to Q, K and V as they are loaded.
    pub bias: Tensor<B>,
    /// Each key's validity.
    pub key_valid: Tensor<f32>,
}
