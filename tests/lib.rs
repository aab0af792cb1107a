//! Shared support for the workspace-level tests: reading the reference
//! fixtures (`fixtures/reference/<case>/`, made by `fixtures/generate_reference.py`)
//! and comparing tensors with named tolerances.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use aam_models::import::ImportHints;
use aam_models::model::ModelConfig;
use aam_models::output::ModelInput;
use aam_models::sequence_encoder::EncoderType;
use aam_models::sequence_predictor::OutputActivation;
use aam_models::Activation;
use burn::prelude::*;
use ndarray::ArrayD;
use ndarray_npy::NpzReader;
use serde_json::Value;

/// Forward outputs vs reference CPU fp32: both are fp32 implementations of the
/// same math (the reference itself agrees with float64 to ≤6e-7, §1.12).
pub const FORWARD_ATOL: f32 = 1e-5;
/// Parameter gradients, relative to the largest reference entry per tensor.
pub const GRAD_RTOL: f32 = 1e-4;

/// The fixtures folder: under `CARGO_MANIFEST_DIR` as cargo sets it when it
/// runs the tests, else as it was at build time. A test binary carried to
/// another machine (the GPU device) is pointed at the repository there with
/// `CARGO_MANIFEST_DIR=<repo>/tests`.
pub fn fixtures_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf())
        .join("fixtures/reference")
}

/// One reference case.
pub struct Case {
    /// Folder of the case.
    pub dir: PathBuf,
    /// `case.json`.
    pub meta: Value,
}

/// An npz file's arrays of element type `T` by name (the `.npy` suffix
/// dropped; arrays of other types are left out).
pub fn read_npz<T: ndarray_npy::ReadableElement>(path: &Path) -> BTreeMap<String, ArrayD<T>> {
    let mut npz =
        NpzReader::new(File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
            .unwrap();
    let names = npz.names().unwrap();
    names
        .into_iter()
        .filter_map(|n| {
            let arr: Result<ArrayD<T>, _> = npz.by_name(&n);
            arr.ok()
                .map(|a| (n.trim_end_matches(".npy").to_string(), a))
        })
        .collect()
}

/// An npz file's float32 arrays by name.
pub fn read_npz_f32(path: &Path) -> BTreeMap<String, ArrayD<f32>> {
    read_npz(path)
}

/// An npz file's int64 arrays by name.
pub fn read_npz_i64(path: &Path) -> BTreeMap<String, ArrayD<i64>> {
    read_npz(path)
}

impl Case {
    /// Loads `fixtures/reference/<name>`.
    pub fn load(name: &str) -> Case {
        let dir = fixtures_dir().join(name);
        let meta: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("case.json")).unwrap()).unwrap();
        Case { dir, meta }
    }

    /// The checkpoint file.
    pub fn checkpoint(&self) -> PathBuf {
        self.dir.join("state_dict.pt")
    }

    fn kwarg(&self, key: &str) -> Option<&Value> {
        self.meta["kwargs"].get(key)
    }

    /// What `aam-rs convert` would be told on its command line for this case:
    /// the fields that no tensor records.
    pub fn hints(&self) -> ImportHints {
        let mut hints = ImportHints::default();
        for stack in ["asv", "sample", "encoder", "count", "target"] {
            if let Some(h) = self
                .kwarg(&format!("{stack}_num_heads"))
                .and_then(Value::as_u64)
            {
                hints.stack_heads.insert(stack.into(), h as usize);
            }
            if let Some(a) = self
                .kwarg(&format!("{stack}_activation"))
                .and_then(Value::as_str)
            {
                let act: Activation = serde_json::from_value(Value::String(a.into())).unwrap();
                hints.stack_activations.insert(stack.into(), act);
            }
        }
        if let Some(h) = self.kwarg("cross_attn_heads").and_then(Value::as_u64) {
            hints.cross_attn_heads = h as usize;
        }
        if let Some(t) = self.kwarg("encoder_type").and_then(Value::as_str) {
            hints.encoder_type =
                Some(serde_json::from_value::<EncoderType>(Value::String(t.into())).unwrap());
        }
        hints.num_quantiles = self
            .kwarg("num_quantiles")
            .and_then(Value::as_u64)
            .map(|q| q as usize);
        hints.is_classifier = self
            .kwarg("is_classifier")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        hints.bounded_targets = self
            .kwarg("bounded_targets")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        if let Some(a) = self.kwarg("output_activation").and_then(Value::as_str) {
            hints.output_activation =
                serde_json::from_value::<OutputActivation>(Value::String(a.into())).unwrap();
        }
        if let Some(cols) = self.kwarg("conditional_scaling_columns") {
            hints.conditional_scaling_columns = serde_json::from_value(cols.clone()).unwrap();
        }
        hints
    }

    /// The case's inputs on `device`.
    pub fn inputs<B: Backend>(&self, device: &B::Device) -> ModelInput<B> {
        let ints = read_npz_i64(&self.dir.join("inputs.npz"));
        let floats = read_npz_f32(&self.dir.join("inputs.npz"));
        let tokens = &ints["tokens"];
        let tokens = Tensor::<B, 3, Int>::from_data(
            TensorData::new(
                tokens.iter().copied().collect::<Vec<i64>>(),
                tokens.shape().to_vec(),
            ),
            device,
        );
        let counts = floats.get("counts").map(|c| {
            Tensor::<B, 3>::from_data(
                TensorData::new(c.iter().copied().collect::<Vec<f32>>(), c.shape().to_vec()),
                device,
            )
        });
        let cats: BTreeMap<String, Tensor<B, 1, Int>> = ints
            .iter()
            .filter_map(|(k, v)| k.strip_prefix("cat.").map(|col| (col.to_string(), v)))
            .map(|(col, v)| {
                (
                    col,
                    Tensor::from_data(
                        TensorData::new(v.iter().copied().collect::<Vec<i64>>(), [v.len()]),
                        device,
                    ),
                )
            })
            .collect();
        ModelInput {
            tokens: tokens.into(),
            counts,
            categorical_ids: (!cats.is_empty()).then_some(cats),
        }
    }

    /// Whether the case asks for nucleotide outputs.
    pub fn return_nucleotides(&self) -> bool {
        self.meta["forward"]["return_nucleotides"]
            .as_bool()
            .unwrap_or(false)
    }

    /// Reference outputs.
    pub fn outputs(&self) -> BTreeMap<String, ArrayD<f32>> {
        read_npz_f32(&self.dir.join("outputs.npz"))
    }

    /// Whether gradients were stored.
    pub fn has_grads(&self) -> bool {
        self.meta["grads"].as_bool().unwrap_or(false)
    }

    /// `(param, shape)` in the reference's state-dict order.
    pub fn params(&self) -> Vec<(String, Vec<usize>)> {
        serde_json::from_value(self.meta["params"].clone()).unwrap()
    }

    /// Params the reference gave no gradient.
    pub fn no_grad_params(&self) -> Vec<String> {
        serde_json::from_value(self.meta["no_grad_params"].clone()).unwrap()
    }
}

/// Largest |a − b| over two equally shaped arrays.
pub fn max_abs_diff(actual: &[f32], expected: &[f32]) -> f32 {
    assert_eq!(actual.len(), expected.len(), "length mismatch");
    actual
        .iter()
        .zip(expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

/// Max-abs difference relative to the largest reference magnitude.
pub fn max_rel_diff(actual: &[f32], expected: &[f32]) -> f32 {
    let scale = expected
        .iter()
        .map(|x| x.abs())
        .fold(0.0, f32::max)
        .max(1e-12);
    max_abs_diff(actual, expected) / scale
}

/// A config's JSON, for readable assertion messages.
pub fn config_json(config: &ModelConfig) -> String {
    serde_json::to_string_pretty(config).unwrap()
}

/// Reference gradients by parameter name.
pub fn reference_grads(case: &Case) -> HashMap<String, ArrayD<f32>> {
    read_npz_f32(&case.dir.join("grads.npz"))
        .into_iter()
        .collect()
}

/// The weights `W_k` of the scalar test function `f = Σ_k Σ out_k ⊙ W_k`.
pub fn grad_weights(case: &Case) -> BTreeMap<String, ArrayD<f32>> {
    read_npz_f32(&case.dir.join("grad_weights.npz"))
}
