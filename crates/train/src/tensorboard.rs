//! TensorBoard event files: a run's scalars in `<output-dir>/tensorboard/`,
//! under the reference's tags, readable by `tensorboard --logdir`.
//!
//! The format is small enough to write by hand, so no protobuf or
//! TensorFlow crate is pulled in: a file is a sequence of TFRecords
//! (`u64` length, masked CRC-32C of the length, the bytes, masked CRC-32C of
//! the bytes), each holding one `tensorflow.Event` protobuf message. The
//! first event carries `file_version = "brain.Event:2"`; each later one a
//! wall time, a step and a `Summary` of `simple_value` scalars.
//!
//! **Tags** (the reference's, `aam/training/trainer.py`): per epoch, x-axis
//! the epoch, `train/<key>` and `val/<key>` for every training mean and
//! validation metric (`total_loss`, `unifrac_loss`, `nuc_loss`,
//! `nuc_accuracy`, `mae`, `r2`, ...), `train/learning_rate`,
//! `perf/epoch_duration_sec`, `perf/samples_per_sec` and
//! `checkpoint/best_model_saved` (epochs that improved); per optimiser
//! step, x-axis the step, `step/total_loss` and `step/learning_rate`
//! (aam-rs's own: the reference logs only the gradient norm per step,
//! which here is the epoch mean `train/grad_norm`).
//!
//! Each process writes its own file (named by time, host and process), so
//! a resumed run adds a file beside the first; TensorBoard reads a folder's
//! files as one run.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::checkpoint::EpochRecord;
use crate::error::{Result, TrainError};

/// The folder of the event files inside a run's output directory.
pub const DIR: &str = "tensorboard";

/// Writes scalars to one event file.
pub struct EventWriter {
    path: PathBuf,
    file: BufWriter<File>,
}

impl EventWriter {
    /// Creates a new event file in `dir` (created if missing).
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty() && !h.contains('/'))
            .unwrap_or_else(|| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{host}.{}.{}",
            now.as_secs(),
            std::process::id(),
            now.subsec_nanos()
        );
        let path = dir.join(name);
        let file = File::create(&path).map_err(|e| TrainError::io(&path, e))?;
        let mut writer = EventWriter {
            path,
            file: BufWriter::new(file),
        };
        let mut event = Vec::new();
        field_double(&mut event, 1, wall_time());
        field_bytes(&mut event, 3, b"brain.Event:2");
        writer.record(&event)?;
        writer.flush()?;
        Ok(writer)
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event at `step` holding `scalars` (tag, value); non-finite values
    /// are written too (TensorBoard shows them as gaps).
    pub fn scalars<'a>(
        &mut self,
        step: u64,
        scalars: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> Result<()> {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut v = Vec::new();
            field_bytes(&mut v, 1, tag.as_bytes());
            key(&mut v, 2, 5);
            v.extend_from_slice(&(value as f32).to_le_bytes());
            field_bytes(&mut summary, 1, &v);
        }
        if summary.is_empty() {
            return Ok(());
        }
        let mut event = Vec::new();
        field_double(&mut event, 1, wall_time());
        key(&mut event, 2, 0);
        varint(&mut event, step);
        field_bytes(&mut event, 5, &summary);
        self.record(&event)
    }

    /// An epoch's scalars under the reference's tags, at x = the epoch (1-based).
    pub fn epoch(&mut self, record: &EpochRecord, improved: bool) -> Result<()> {
        let mut tags: Vec<(String, f64)> = Vec::new();
        tags.extend(record.train.iter().map(|(k, v)| (format!("train/{k}"), *v)));
        tags.extend(
            record
                .validation
                .iter()
                .map(|(k, v)| (format!("val/{k}"), *v)),
        );
        tags.push(("train/learning_rate".into(), record.lr));
        tags.push(("perf/epoch_duration_sec".into(), record.seconds));
        tags.push(("perf/samples_per_sec".into(), record.samples_per_sec));
        if improved {
            tags.push(("checkpoint/best_model_saved".into(), 1.0));
        }
        self.scalars(
            record.epoch as u64 + 1,
            tags.iter().map(|(k, v)| (k.as_str(), *v)),
        )?;
        self.flush()
    }

    /// Writes buffered events to the file.
    pub fn flush(&mut self) -> Result<()> {
        self.file.flush().map_err(|e| TrainError::io(&self.path, e))
    }

    fn record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut out = Vec::with_capacity(data.len() + 16);
        out.extend_from_slice(&len);
        out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
        out.extend_from_slice(data);
        out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
        self.file
            .write_all(&out)
            .map_err(|e| TrainError::io(&self.path, e))
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        let _ = self.file.flush();
    }
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(out: &mut Vec<u8>, field: u64, wire: u64) {
    varint(out, (field << 3) | wire);
}

fn field_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    key(out, field, 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn field_double(out: &mut Vec<u8>, field: u64, v: f64) {
    key(out, field, 1);
    out.extend_from_slice(&v.to_le_bytes());
}

/// CRC-32C (Castagnoli), as TFRecord uses.
fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    0x82F6_3B78 ^ (c >> 1)
                } else {
                    c >> 1
                };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// The scalars of an event file, `(step, tag, value)` in file order, its
/// records' lengths and checksums verified: what TensorBoard would read.
pub fn read_scalars(path: &Path) -> Result<Vec<(u64, String, f32)>> {
    let bytes = std::fs::read(path).map_err(|e| TrainError::io(path, e))?;
    let bad = |reason: String| {
        TrainError::io(
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidData, reason),
        )
    };
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let header = bytes
            .get(at..at + 12)
            .ok_or_else(|| bad(format!("truncated record header at byte {at}")))?;
        let len_bytes = &header[..8];
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
        if u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"))
            != masked_crc32c(len_bytes)
        {
            return Err(bad(format!("length checksum mismatch at byte {at}")));
        }
        let data = bytes
            .get(at + 12..at + 12 + len)
            .ok_or_else(|| bad(format!("truncated record at byte {at}")))?;
        let crc = bytes
            .get(at + 12 + len..at + 16 + len)
            .ok_or_else(|| bad(format!("truncated record checksum at byte {at}")))?;
        if u32::from_le_bytes(crc.try_into().expect("4 bytes")) != masked_crc32c(data) {
            return Err(bad(format!("data checksum mismatch at byte {at}")));
        }
        let mut step = 0;
        let mut values = Vec::new();
        for (field, value) in fields(data).map_err(&bad)? {
            match (field, value) {
                (2, Field::Varint(s)) => step = s,
                (5, Field::Bytes(summary)) => {
                    for (f, v) in fields(summary).map_err(&bad)? {
                        if let (1, Field::Bytes(v)) = (f, v) {
                            let (mut tag, mut value) = (String::new(), f32::NAN);
                            for (f, x) in fields(v).map_err(&bad)? {
                                match (f, x) {
                                    (1, Field::Bytes(t)) => {
                                        tag = String::from_utf8_lossy(t).into_owned()
                                    }
                                    (2, Field::Fixed32(x)) => value = f32::from_bits(x),
                                    _ => {}
                                }
                            }
                            values.push((tag, value));
                        }
                    }
                }
                _ => {}
            }
        }
        out.extend(values.into_iter().map(|(tag, v)| (step, tag, v)));
        at += 16 + len;
    }
    Ok(out)
}

enum Field<'a> {
    Varint(u64),
    Fixed64,
    Fixed32(u32),
    Bytes(&'a [u8]),
}

fn fields(mut data: &[u8]) -> std::result::Result<Vec<(u64, Field<'_>)>, String> {
    fn read_varint(data: &mut &[u8]) -> std::result::Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = data.split_first().ok_or("truncated varint")?;
            *data = rest;
            v |= ((b & 0x7f) as u64) << shift;
            if b < 0x80 {
                return Ok(v);
            }
        }
        Err("varint too long".into())
    }
    let mut out = Vec::new();
    while !data.is_empty() {
        let k = read_varint(&mut data)?;
        let field = match k & 7 {
            0 => Field::Varint(read_varint(&mut data)?),
            1 => {
                data = data.get(8..).ok_or("truncated fixed64")?;
                Field::Fixed64
            }
            5 => {
                let b = data.get(..4).ok_or("truncated fixed32")?;
                let v = u32::from_le_bytes(b.try_into().expect("4 bytes"));
                data = &data[4..];
                Field::Fixed32(v)
            }
            2 => {
                let n = read_varint(&mut data)? as usize;
                let b = data.get(..n).ok_or("truncated bytes field")?;
                data = &data[n..];
                Field::Bytes(b)
            }
            w => return Err(format!("unknown wire type {w}")),
        };
        out.push((k >> 3, field));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_of_the_standard_check_string() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }
}
