//! Checkpoints under the reference's names, in PyTorch's format:
//! `checkpoints/best_model.pt` (a trainer checkpoint: the model's state dict
//! under `model_state_dict`, with `epoch`) and the `pretrain` command's
//! `pretrained_encoder.pt` (a plain state dict), so that a reference user's
//! scripts find the files they name and PyTorch loads them
//! (`torch.load(path, weights_only=True)` then `load_state_dict`).
//!
//! A trainer checkpoint written here also holds, under `aam_rs`, the JSON
//! [`CheckpointMeta`] of the checkpoint it was made from (architecture, data
//! transforms, class labels), so `aam-rs predict` gives the same predictions
//! in original units from it as from the `.safetensors` file; PyTorch sees
//! one more string entry.
//!
//! **The format.** A zip archive (entries stored, not compressed) of
//! `<name>/data.pkl` (a protocol-2 pickle of the dict, each tensor as
//! `torch._utils._rebuild_tensor_v2` of a `torch.FloatStorage` persistent
//! id), `<name>/data/<i>` (each storage's little-endian f32 bytes),
//! `<name>/version` (`3`) and `<name>/byteorder` (`little`): what
//! `torch.save` writes, with only the globals that `weights_only` loading
//! allows.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use aam_models::model::StateTensor;

use crate::checkpoint::{Checkpoint, CheckpointMeta, FORMAT_VERSION};
use crate::error::{Result, TrainError};

/// The key of the [`CheckpointMeta`] JSON inside a trainer checkpoint.
pub const META_KEY: &str = "aam_rs";

/// A value of the pickled dict.
enum Value<'a> {
    StateDict(Vec<(&'a str, &'a StateTensor)>),
    Str(String),
    Int(i64),
}

/// Writes `checkpoint`'s model as the reference's trainer checkpoint
/// (`best_model.pt`): `model_state_dict`, `epoch` (the best epoch, 0-based
/// as the reference counts) and the metadata under [`META_KEY`].
pub fn write_trainer_checkpoint(path: &Path, checkpoint: &Checkpoint) -> Result<()> {
    let meta = serde_json::to_string(&checkpoint.meta).map_err(|e| TrainError::Checkpoint {
        path: checkpoint.path.clone(),
        reason: format!("metadata does not serialise: {e}"),
    })?;
    let epoch = checkpoint.meta.progress.best.as_ref().map_or(
        checkpoint.meta.progress.epochs_done.saturating_sub(1),
        |b| b.epoch,
    );
    write(
        path,
        vec![
            (
                "model_state_dict",
                Value::StateDict(sorted(&checkpoint.model, "")),
            ),
            ("epoch", Value::Int(epoch as i64)),
            (META_KEY, Value::Str(meta)),
        ],
    )
}

/// Writes the tensors of `model` under `prefix` (stripped), as a plain state
/// dict: the reference's `pretrained_encoder.pt` is the encoder's.
pub fn write_state_dict(
    path: &Path,
    model: &HashMap<String, StateTensor>,
    prefix: &str,
) -> Result<()> {
    let tensors = sorted(model, prefix);
    let mut out = Vec::new();
    pickle_dict(&mut out, &tensors);
    write_archive(path, out, &tensors)
}

/// The [`CheckpointMeta`] of a trainer checkpoint written by
/// [`write_trainer_checkpoint`]; None for any other PyTorch file.
pub fn read_meta(path: &Path) -> Result<Option<CheckpointMeta>> {
    use burn_store::pytorch::reader::PickleValue;
    use burn_store::pytorch::PytorchReader;
    let Ok(PickleValue::String(json)) = PytorchReader::read_pickle_data(path, Some(META_KEY))
    else {
        return Ok(None);
    };
    let meta: CheckpointMeta = serde_json::from_str(&json).map_err(|e| TrainError::Checkpoint {
        path: path.to_path_buf(),
        reason: format!("its `{META_KEY}` entry does not parse ({e})"),
    })?;
    if meta.format != FORMAT_VERSION {
        return Err(TrainError::Checkpoint {
            path: path.to_path_buf(),
            reason: format!(
                "format version {} (this aam-rs reads {FORMAT_VERSION})",
                meta.format
            ),
        });
    }
    Ok(Some(meta))
}

/// A trainer checkpoint written by [`write_trainer_checkpoint`], read back
/// as the checkpoint it was made from (without optimiser state); None for
/// any other PyTorch file.
pub fn read_trainer_checkpoint(path: &Path) -> Result<Option<Checkpoint>> {
    let Some(meta) = read_meta(path)? else {
        return Ok(None);
    };
    // The file is opened a second time: burn-store reads a pickle's values
    // and its tensors through separate calls. Only the pickle (kilobytes)
    // is parsed twice; the tensors' data is read once, here.
    let tensors = aam_models::import::TorchCheckpoint::read(path)?.tensors;
    Ok(Some(Checkpoint {
        path: path.to_path_buf(),
        meta,
        model: tensors,
        optimizer: Default::default(),
    }))
}

/// The tensors under `prefix`, prefix stripped, in key order.
fn sorted<'a>(
    model: &'a HashMap<String, StateTensor>,
    prefix: &str,
) -> Vec<(&'a str, &'a StateTensor)> {
    let mut tensors: Vec<(&str, &StateTensor)> = model
        .iter()
        .filter_map(|(k, t)| Some((k.strip_prefix(prefix)?, t)))
        .collect();
    tensors.sort_by_key(|(k, _)| *k);
    tensors
}

fn write(path: &Path, entries: Vec<(&str, Value<'_>)>) -> Result<()> {
    let mut out = Vec::new();
    let mut storages: Vec<(&str, &StateTensor)> = Vec::new();
    out.extend_from_slice(b"\x80\x02}(");
    for (key, value) in &entries {
        unicode(&mut out, key);
        match value {
            Value::Str(s) => unicode(&mut out, s),
            Value::Int(i) => int(&mut out, *i),
            Value::StateDict(tensors) => {
                ordered_dict(&mut out, tensors, storages.len());
                storages.extend(tensors.iter().copied());
            }
        }
    }
    out.extend_from_slice(b"u.");
    write_archive(path, out, &storages)
}

/// A pickle whose top object is the state dict itself.
fn pickle_dict(out: &mut Vec<u8>, tensors: &[(&str, &StateTensor)]) {
    out.extend_from_slice(b"\x80\x02");
    ordered_dict(out, tensors, 0);
    out.push(b'.');
}

/// `collections.OrderedDict` of `tensors`, storages numbered from `first`.
fn ordered_dict(out: &mut Vec<u8>, tensors: &[(&str, &StateTensor)], first: usize) {
    out.extend_from_slice(b"ccollections\nOrderedDict\n)R(");
    for (i, (key, t)) in tensors.iter().enumerate() {
        unicode(out, key);
        tensor(out, t, first + i);
    }
    out.push(b'u');
}

/// `torch._utils._rebuild_tensor_v2(storage, 0, shape, stride, False, OrderedDict())`.
fn tensor(out: &mut Vec<u8>, t: &StateTensor, storage: usize) {
    out.extend_from_slice(b"ctorch._utils\n_rebuild_tensor_v2\n(");
    // The persistent id: ('storage', torch.FloatStorage, key, 'cpu', numel).
    out.push(b'(');
    unicode(out, "storage");
    out.extend_from_slice(b"ctorch\nFloatStorage\n");
    unicode(out, &storage.to_string());
    unicode(out, "cpu");
    int(out, t.values.len() as i64);
    out.extend_from_slice(b"tQ");
    int(out, 0);
    ints(out, &t.shape);
    let mut stride = vec![1usize; t.shape.len()];
    for d in (0..t.shape.len().saturating_sub(1)).rev() {
        stride[d] = stride[d + 1] * t.shape[d + 1];
    }
    ints(out, &stride);
    out.push(0x89); // NEWFALSE: requires_grad
    out.extend_from_slice(b"ccollections\nOrderedDict\n)R");
    out.extend_from_slice(b"tR");
}

fn ints(out: &mut Vec<u8>, values: &[usize]) {
    if values.is_empty() {
        out.push(b')');
        return;
    }
    out.push(b'(');
    for &v in values {
        int(out, v as i64);
    }
    out.push(b't');
}

fn int(out: &mut Vec<u8>, v: i64) {
    match i32::try_from(v) {
        Ok(v) => {
            out.push(b'J');
            out.extend_from_slice(&v.to_le_bytes());
        }
        Err(_) => {
            // LONG1: 8 little-endian two's-complement bytes.
            out.extend_from_slice(&[0x8a, 8]);
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

fn unicode(out: &mut Vec<u8>, s: &str) {
    out.push(b'X');
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// The zip archive: `data.pkl`, one record per storage, `version`, `byteorder`.
fn write_archive(path: &Path, pickle: Vec<u8>, storages: &[(&str, &StateTensor)]) -> Result<()> {
    let name = path
        .file_stem()
        .and_then(|s| s.to_str())
        .filter(|s| !s.is_empty() && s.is_ascii())
        .unwrap_or("archive")
        .to_string();
    let io = |e: std::io::Error| TrainError::io(path, e);
    let zip_err = |e: zip::result::ZipError| TrainError::io(path, std::io::Error::other(e));
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let options = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .large_file(true);
    zip.start_file(format!("{name}/data.pkl"), options)
        .map_err(zip_err)?;
    zip.write_all(&pickle).map_err(io)?;
    zip.start_file(format!("{name}/byteorder"), options)
        .map_err(zip_err)?;
    zip.write_all(b"little").map_err(io)?;
    for (i, (_, t)) in storages.iter().enumerate() {
        zip.start_file(format!("{name}/data/{i}"), options)
            .map_err(zip_err)?;
        let bytes: Vec<u8> = t.values.iter().flat_map(|v| v.to_le_bytes()).collect();
        zip.write_all(&bytes).map_err(io)?;
    }
    zip.start_file(format!("{name}/version"), options)
        .map_err(zip_err)?;
    zip.write_all(b"3\n").map_err(io)?;
    let bytes = zip.finish().map_err(zip_err)?.into_inner();
    aam_data::write_atomic(path, &bytes)?;
    Ok(())
}
