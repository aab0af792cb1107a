//! `aam-rs forward`: run a model in eval mode on raw token tensors and write
//! every output as NumPy arrays, for comparing activations across platforms.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use aam_data::write_atomic;
use aam_models::import::load_model_dir;
use aam_models::model::ModelConfig;
use aam_models::output::ModelInput;
use anyhow::{bail, ensure, Context, Result};
use burn::prelude::*;
use clap::Args;
use ndarray::{ArrayD, IxDyn};
use ndarray_npy::{NpzReader, NpzWriter, ReadNpyExt};

use aam_cli::backend::BackendKind;

/// Inputs are the model's raw tensors (tokens as the tokenizer makes them:
/// START=5, A/C/G/T=1..4, 0 = padding).
#[derive(Args, Debug)]
pub struct ForwardArgs {
    /// Model directory (from `aam-rs convert` or training).
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// Tokens, int64 (or int32) .npy of shape [B, S, L].
    #[arg(long, value_name = "NPY")]
    tokens: PathBuf,
    /// Per-ASV counts, float .npy of shape [B, S] or [B, S, 1] (needed with a count embedding).
    #[arg(long, value_name = "NPY")]
    counts: Option<PathBuf>,
    /// Categorical ids: int .npy [B, n_columns] in the model's (sorted) column
    /// order, or .npz with one [B] array per column name.
    #[arg(long, value_name = "NPY|NPZ")]
    categorical: Option<PathBuf>,
    /// Output .npz (one array per model output).
    #[arg(long, value_name = "NPZ")]
    out: PathBuf,
    /// Compute backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Ndarray)]
    backend: BackendKind,
    /// Skip the nucleotide logits (they are the largest output).
    #[arg(long)]
    no_nucleotides: bool,
}

/// Runs the forward pass on the chosen backend.
pub fn run(args: ForwardArgs) -> Result<()> {
    aam_cli::with_backend!(args.backend, |B, device| run_on::<B>(&args, &device))
}

fn run_on<B: aam_models::AttentionBackend>(args: &ForwardArgs, device: &B::Device) -> Result<()> {
    let (config, model) = load_model_dir::<B>(&args.model, device)
        .with_context(|| format!("loading the model from {}", args.model.display()))?;
    let input = read_inputs::<B>(args, &config, device)?;
    let outputs = model.forward_named(input, !args.no_nucleotides);
    let mut buffer = std::io::Cursor::new(Vec::new());
    {
        let mut npz = NpzWriter::new(&mut buffer);
        for (name, tensor) in &outputs {
            let shape = tensor.shape();
            let data = tensor.to_data();
            if name == &"mask_indices" {
                let values: Vec<u8> = data
                    .convert::<bool>()
                    .to_vec::<bool>()
                    .expect("bool")
                    .into_iter()
                    .map(u8::from)
                    .collect();
                npz.add_array(*name, &ArrayD::from_shape_vec(IxDyn(&shape), values)?)?;
            } else {
                let values = data.convert::<f32>().to_vec::<f32>().expect("f32");
                npz.add_array(*name, &ArrayD::from_shape_vec(IxDyn(&shape), values)?)?;
            }
        }
        npz.finish()?;
    }
    write_atomic(&args.out, buffer.get_ref()).context("writing the outputs")?;
    let names: Vec<String> = outputs
        .iter()
        .map(|(n, t)| format!("{n} {:?}", t.shape()))
        .collect();
    tracing::info!("wrote {}: {}", args.out.display(), names.join(", "));
    Ok(())
}

fn read_inputs<B: aam_models::AttentionBackend>(
    args: &ForwardArgs,
    config: &ModelConfig,
    device: &B::Device,
) -> Result<ModelInput<B>> {
    let base = config.base();
    let tokens = read_int_array(&args.tokens)?;
    let shape = tokens.shape().to_vec();
    ensure!(
        shape.len() == 3,
        "{}: tokens must have shape [B, S, L], got {shape:?}",
        args.tokens.display()
    );
    let [b, s, l] = [shape[0], shape[1], shape[2]];
    let max_len = base.sample.asv.max_bp + 1;
    ensure!(
        l <= max_len,
        "{}: L = {l} tokens per ASV, but the model's max_bp + 1 is {max_len}",
        args.tokens.display()
    );
    let max_slots = base.sample.token_limit + 5;
    ensure!(
        s <= max_slots,
        "{}: S = {s} ASV slots, but the model's position table has {max_slots} rows",
        args.tokens.display()
    );
    let vocab = base.sample.asv.vocab_size as i64;
    if let Some((i, v)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &v)| v < 0 || v >= vocab)
    {
        let idx = [i / (s * l), (i / l) % s, i % l];
        bail!(
            "{}: token {v} at index {idx:?} is outside the vocabulary 0..{vocab}",
            args.tokens.display()
        );
    }
    let tokens = Tensor::<B, 3, Int>::from_data(
        TensorData::new(tokens.into_raw_vec_and_offset().0, shape),
        device,
    );

    let uses_counts = base.sample.count_embedding;
    let counts = match (&args.counts, uses_counts) {
        (Some(path), _) => Some(read_counts::<B>(path, b, s, device)?),
        (None, true) => bail!("this model embeds counts: pass --counts <[B, S] .npy>"),
        (None, false) => None,
    };
    let categorical_ids = match (&args.categorical, config) {
        (Some(path), ModelConfig::SequencePredictor(p)) => {
            let cards = p.categorical_cardinalities.clone().with_context(|| {
                format!("{}: this model has no categorical columns", path.display())
            })?;
            Some(read_categorical::<B>(path, &cards, b, device)?)
        }
        (Some(path), ModelConfig::SequenceEncoder(_)) => {
            bail!(
                "{}: a SequenceEncoder takes no categorical input",
                path.display()
            )
        }
        (None, _) => None,
    };
    Ok(ModelInput {
        tokens: tokens.into(),
        counts,
        categorical_ids,
    })
}

fn read_int_array(path: &Path) -> Result<ArrayD<i64>> {
    let open = || File::open(path).with_context(|| format!("opening {}", path.display()));
    if let Ok(a) = ArrayD::<i64>::read_npy(open()?) {
        return Ok(a);
    }
    let a = ArrayD::<i32>::read_npy(open()?)
        .with_context(|| format!("{}: expected an int64 or int32 .npy array", path.display()))?;
    Ok(a.mapv(i64::from))
}

fn read_counts<B: Backend>(
    path: &Path,
    b: usize,
    s: usize,
    device: &B::Device,
) -> Result<Tensor<B, 3>> {
    let open = || File::open(path).with_context(|| format!("opening {}", path.display()));
    let counts = match ArrayD::<f32>::read_npy(open()?) {
        Ok(a) => a,
        Err(_) => ArrayD::<f64>::read_npy(open()?)
            .with_context(|| {
                format!(
                    "{}: expected a float32 or float64 .npy array",
                    path.display()
                )
            })?
            .mapv(|x| x as f32),
    };
    let shape = counts.shape().to_vec();
    ensure!(
        shape == [b, s] || shape == [b, s, 1],
        "{}: counts must have shape [{b}, {s}] or [{b}, {s}, 1] to match the tokens, got {shape:?}",
        path.display()
    );
    if let Some(v) = counts.iter().find(|v| !v.is_finite() || **v < 0.0) {
        bail!(
            "{}: counts must be finite and non-negative, found {v}",
            path.display()
        );
    }
    Ok(Tensor::from_data(
        TensorData::new(counts.into_raw_vec_and_offset().0, [b, s, 1]),
        device,
    ))
}

fn read_categorical<B: Backend>(
    path: &Path,
    cards: &BTreeMap<String, usize>,
    b: usize,
    device: &B::Device,
) -> Result<BTreeMap<String, Tensor<B, 1, Int>>> {
    let mut columns: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    if path.extension().is_some_and(|e| e == "npz") {
        let mut npz = NpzReader::new(
            File::open(path).with_context(|| format!("opening {}", path.display()))?,
        )?;
        for name in npz.names()? {
            let column = name.trim_end_matches(".npy").to_string();
            ensure!(
                cards.contains_key(&column),
                "{}: unknown column '{column}' (model columns: {:?})",
                path.display(),
                cards.keys()
            );
            let a: ArrayD<i64> = npz
                .by_name(&name)
                .with_context(|| format!("{}: column '{column}' must be int64", path.display()))?;
            columns.insert(column, a.into_raw_vec_and_offset().0);
        }
    } else {
        let a = read_int_array(path)?;
        let shape = a.shape().to_vec();
        ensure!(
            shape == [b, cards.len()],
            "{}: expected shape [{b}, {}] (columns in order {:?}), got {shape:?}",
            path.display(),
            cards.len(),
            cards.keys()
        );
        for (j, column) in cards.keys().enumerate() {
            columns.insert(
                column.clone(),
                a.index_axis(ndarray::Axis(1), j).iter().copied().collect(),
            );
        }
    }
    columns
        .into_iter()
        .map(|(column, ids)| {
            ensure!(
                ids.len() == b,
                "{}: column '{column}' has {} ids for {b} samples",
                path.display(),
                ids.len()
            );
            let card = cards[&column] as i64;
            if let Some(v) = ids.iter().find(|&&v| v < 0 || v >= card) {
                bail!(
                    "{}: column '{column}' has id {v}, outside 0..{card}",
                    path.display()
                );
            }
            Ok((column, Tensor::from_data(TensorData::new(ids, [b]), device)))
        })
        .collect()
}
