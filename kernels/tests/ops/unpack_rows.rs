//! `unpack_rows` (packed rows back in their slots, a fill row elsewhere) on
//! the GPU backend against ndarray, through autodiff as the ASV encoder uses
//! it: the output and the gradients of the packed rows and of the fill row,
//! for batches with empty slots between, before and after the packed rows,
//! with every slot filled and with none.
//!
//! Runs on CUDA when built with `--features cuda` (the device machine), else on
//! wgpu: in CI through Mesa's lavapipe. With `fusion` the op is a custom op
//! of Burn's fusion stream that uploads its indices when it runs.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use crate::common::*;
use aam_kernels::{unpack_rows, AttentionBackend, RowSlots};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

/// `[out, dpacked, dfill]` for the loss `Σ out ⊙ weights` (`dpacked` empty
/// without packed rows).
fn run<Ad: AutodiffBackend + AttentionBackend>(
    [packed, fill, weights]: [&[f32]; 3],
    slots: &RowSlots,
    width: usize,
) -> [Vec<f32>; 3] {
    let device = Default::default();
    let tensor = |values: &[f32], rows: usize| {
        Tensor::<Ad, 2>::from_data(TensorData::new(values.to_vec(), [rows, width]), &device)
    };
    let packed = tensor(packed, slots.rows()).require_grad();
    let fill = tensor(fill, 1).require_grad();
    let out = unpack_rows(packed.clone(), fill.clone(), slots);
    let grads = (out.clone() * tensor(weights, slots.slots()))
        .sum()
        .backward();
    let dpacked = packed.grad(&grads).map(values).unwrap_or_default();
    [
        values(out),
        dpacked,
        values(fill.grad(&grads).expect("dfill")),
    ]
}

#[test]
fn unpack_rows_matches_the_cpu() {
    let mut rng = Rng::new(21);
    let width = 37;
    // (slots, non-empty): gaps everywhere, as a batch's samples leave them;
    // every slot filled; none; one row at the end.
    let cases: [(usize, Vec<i64>); 4] = [
        (
            1_024,
            (0..1_024).filter(|s| s % 128 < 40 && s % 7 != 3).collect(),
        ),
        (300, (0..300).collect()),
        (64, Vec::new()),
        (9, vec![8]),
    ];
    for (n, non_empty) in cases {
        let slots = RowSlots::new(n, non_empty);
        let mut normals = |len: usize| (0..len).map(|_| rng.normal()).collect::<Vec<f32>>();
        let inputs = [
            normals(slots.rows() * width),
            normals(width),
            normals(n * width),
        ];
        let inputs = [&inputs[0][..], &inputs[1], &inputs[2]];
        let got = run::<GpuAd>(inputs, &slots, width);
        let want = run::<CpuAd>(inputs, &slots, width);
        for (i, name) in ["out", "dpacked", "dfill"].iter().enumerate() {
            assert_eq!(got[i].len(), want[i].len(), "{n} slots: {name}'s size");
            // Gathers are exact; dfill sums over the empty slots in another order.
            let err = rel(&got[i], &want[i]);
            assert!(
                err <= 1e-5,
                "{n} slots, {} rows: {name} off by {err:e}",
                slots.rows()
            );
        }
    }
}
