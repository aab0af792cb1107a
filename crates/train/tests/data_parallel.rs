//! Data parallel on the CPU: two replicas on one device, each running half of
//! every batch, train as one device on the whole batch (dropout and masking
//! off): the same losses and weights after six optimiser steps, in `global`
//! UniFrac-pairs mode; and a run moves between device counts through its
//! checkpoint. Real data: the bundled demo. (In debug builds `fit` also
//! checks after every epoch that the replicas' weights are bit-identical.)

use std::collections::BTreeMap;
use std::path::Path;

use aam_models::model::ModelConfig;
use aam_train::checkpoint::{read_checkpoint, Checkpoint};
use aam_train::config::RunConfig;
use aam_train::parallel::UnifracPairs;
use aam_train::run::{files, fit, Observer, Silent};
use aam_train::world::World;
use burn::backend::ndarray::NdArrayDevice;

use crate::resume::{data, model_config, run_config, StopAfter, AB};

/// Dropout and nucleotide masking off: a step is then a function of the
/// weights and the batch only.
fn deterministic() -> ModelConfig {
    model_config().without_dropout()
}

/// AdamW (the default), one optimiser step per batch: six per epoch on the
/// 48 training samples.
fn config(epochs: usize, pairs: UnifracPairs) -> RunConfig {
    RunConfig {
        epochs,
        gradient_accumulation_steps: 1,
        unifrac_pairs: pairs,
        ..run_config()
    }
}

/// [`config`] with SGD. Adam divides each gradient by its running RMS, so
/// for the parameters whose exact gradient is zero (attention key biases,
/// the bias of the LayerNorm before the pooling scores: softmax ignores a
/// constant) it turns rounding noise of ~1e-9 into steps of ±lr, and two
/// runs that add the same numbers in another order part there by lr per
/// step. Weights are compared under SGD, whose steps keep noise as noise.
fn sgd(epochs: usize, pairs: UnifracPairs) -> RunConfig {
    let mut run = config(epochs, pairs);
    run.optimizer.kind = aam_train::optim::OptimizerKind::Sgd;
    run.scheduler.lr = 0.05;
    run
}

fn train(
    out: &Path,
    replicas: usize,
    run: RunConfig,
    resume: Option<&Path>,
    observer: &mut dyn Observer,
) -> Checkpoint {
    let _guard = crate::one_run_at_a_time();
    let devices = vec![NdArrayDevice::Cpu; replicas];
    let ckpt = resume.map(|p| read_checkpoint(p).unwrap());
    let config = deterministic();
    let model = match &ckpt {
        Some(c) => c.model::<AB>(&devices[0]).unwrap(),
        None => {
            <AB as burn::tensor::backend::Backend>::seed(&devices[0], 3);
            config.init::<AB>(&devices[0]).unwrap()
        }
    };
    fit::<AB>(
        &devices,
        &World::single(),
        config,
        model,
        run,
        data(),
        out,
        ckpt.as_ref(),
        observer,
    )
    .unwrap();
    read_checkpoint(&out.join(files::LAST)).unwrap()
}

/// The largest difference of two checkpoints' weights, relative to the
/// largest weight of its tensor, over every tensor. Tensors whose weights
/// all stay below 1e-3 count as of scale 1e-3: zero-initialised biases
/// whose exact gradient is zero (the LayerNorm bias before the pooling
/// scores) hold rounding noise of ~1e-10 only.
fn weight_difference(a: &Checkpoint, b: &Checkpoint) -> f64 {
    let mut worst = 0.0f64;
    for (key, t) in &a.model {
        let u = &b.model[key];
        let scale = t
            .values
            .iter()
            .fold(0.0f32, |m, v| m.max(v.abs()))
            .max(1e-3) as f64;
        let diff = t
            .values
            .iter()
            .zip(&u.values)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) as f64;
        worst = worst.max(diff / scale);
    }
    worst
}

/// Every training loss of every epoch of `a` within `tolerance` (relative)
/// of `b`'s.
fn assert_same_losses(a: &Checkpoint, b: &Checkpoint, tolerance: f64) {
    let losses = |c: &Checkpoint| -> Vec<BTreeMap<String, f64>> {
        c.meta
            .progress
            .history
            .iter()
            .map(|r| r.train.clone())
            .collect()
    };
    let (x, y) = (losses(a), losses(b));
    assert_eq!(x.len(), y.len());
    for (epoch, (x, y)) in x.iter().zip(&y).enumerate() {
        assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>());
        for (name, v) in x {
            let w = y[name];
            assert!(
                (v - w).abs() <= tolerance * v.abs().max(1e-12),
                "epoch {epoch} {name}: {v} on one device, {w} data parallel"
            );
        }
    }
}

#[test]
fn two_replicas_take_the_steps_of_one_device() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, replicas, config| {
        train(&dir.path().join(name), replicas, config, None, &mut Silent)
    };
    let one = run("one", 1, sgd(1, UnifracPairs::Global));
    let two = run("two", 2, sgd(1, UnifracPairs::Global));
    assert_eq!(one.meta.progress.global_step, 6);
    assert_eq!(two.meta.progress.global_step, 6);
    let losses = &one.meta.progress.history[0].train;
    for term in ["unifrac_loss", "nuc_loss", "grad_norm", "nuc_accuracy"] {
        assert!(losses.contains_key(term), "{term} missing: {losses:?}");
    }
    assert_same_losses(&one, &two, 1e-5);
    let diff = weight_difference(&one, &two);
    assert!(diff <= 1e-5, "weights differ by {diff:e} (relative)");
    // The steps moved the weights far more than the tolerance.
    let initial = {
        let _guard = crate::one_run_at_a_time();
        <AB as burn::tensor::backend::Backend>::seed(&NdArrayDevice::Cpu, 3);
        deterministic().init::<AB>(&NdArrayDevice::Cpu).unwrap()
    };
    let moved = one
        .model
        .iter()
        .zip(initial.state_dict(&deterministic()))
        .any(|((_, t), (_, s))| {
            t.values
                .iter()
                .zip(&s.values)
                .any(|(a, b)| (a - b).abs() > 1e-3)
        });
    assert!(moved, "six steps must move the weights");

    // AdamW: the same losses.
    let one = run("adam_one", 1, config(1, UnifracPairs::Global));
    let two = run("adam_two", 2, config(1, UnifracPairs::Global));
    assert_same_losses(&one, &two, 1e-5);

    // Pairs within each shard only: another loss.
    let local = run("local", 2, config(1, UnifracPairs::Local));
    let (g, l) = (
        two.meta.progress.history[0].train["unifrac_loss"],
        local.meta.progress.history[0].train["unifrac_loss"],
    );
    assert!((g - l).abs() > 1e-4 * g, "local {l} vs global {g}");
}

/// A run started on two replicas and resumed on one device ends where the
/// run on one device throughout ends.
#[test]
fn a_run_resumes_on_another_number_of_devices() {
    let dir = tempfile::tempdir().unwrap();
    let whole = train(
        &dir.path().join("whole"),
        1,
        sgd(2, UnifracPairs::Global),
        None,
        &mut Silent,
    );
    let part = dir.path().join("part");
    train(
        &part,
        2,
        sgd(2, UnifracPairs::Global),
        None,
        &mut StopAfter(1, 0),
    );
    let resumed = train(
        &part,
        1,
        sgd(2, UnifracPairs::Global),
        Some(&part.join(files::LAST)),
        &mut Silent,
    );
    assert_eq!(resumed.meta.progress.epochs_done, 2);
    assert_same_losses(&whole, &resumed, 1e-5);
    let diff = weight_difference(&whole, &resumed);
    assert!(diff <= 1e-5, "weights differ by {diff:e} (relative)");
}
