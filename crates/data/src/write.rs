//! Writing files so that nothing is lost: a reader, or a job killed at any
//! moment, sees either the old file or the whole new one, never a part.

use std::io::Write;
use std::path::Path;

use crate::error::{Error, Result};

/// Writes `bytes` to `path` atomically: into a temporary file in the same
/// directory, flushed to disk, then renamed over `path` (and the directory
/// entry flushed where the platform allows it). On failure the temporary
/// file is removed and `path` is left as it was; the error names `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |w| w.write_all(bytes))
}

/// As [`write_atomic`], with the bytes streamed by `write` (for files too
/// large to hold twice in memory).
pub fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<()> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension(format!(
        "{}.tmp{}",
        path.extension().and_then(|e| e.to_str()).unwrap_or(""),
        std::process::id()
    ));
    let written = (|| {
        let start = std::time::Instant::now();
        let mut w = std::io::BufWriter::new(Writeback::new(std::fs::File::create(&tmp)?));
        write(&mut w)?;
        let file = w.into_inner().map_err(|e| e.into_error())?.file;
        let written = start.elapsed();
        file.sync_all()?;
        tracing::debug!(
            "{}: written in {written:.2?}, on disk after {:.2?}",
            path.display(),
            start.elapsed()
        );
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    // The rename is durable once the directory is flushed; a file system that
    // cannot flush a directory (some network ones) still has the whole file.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// Bytes between two starts of the kernel's writeback ([`Writeback`]).
const WRITEBACK_BYTES: u64 = 32 << 20;

/// A file whose written bytes the kernel starts writing to disk every
/// [`WRITEBACK_BYTES`], without waiting (Linux `sync_file_range`; a plain
/// file elsewhere), as RocksDB's `bytes_per_sync` does. The kernel would
/// otherwise hold a file of gigabytes (a 20,000-sample UniFrac matrix is
/// 3.2 GB) in memory until the final `fsync`, which then writes it all
/// while the caller waits: measured on an H200 machine's disk, 1.1-1.5 s
/// after 0.8-1.2 s of writing.
struct Writeback {
    file: std::fs::File,
    written: u64,
    started: u64,
}

impl Writeback {
    fn new(file: std::fs::File) -> Self {
        Writeback {
            file,
            written: 0,
            started: 0,
        }
    }
}

impl Write for Writeback {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // At most up to the next start, so that a large write is cut there.
        let room = (self.started + WRITEBACK_BYTES - self.written) as usize;
        let n = self.file.write(&buf[..buf.len().min(room)])?;
        self.written += n as u64;
        if self.written - self.started >= WRITEBACK_BYTES {
            start_writeback(&self.file, self.started, self.written - self.started);
            self.started = self.written;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// Asks the kernel to start writing `len` bytes of `file` from `offset` to
/// disk, without waiting for it. Only a hint: the final `fsync` is what
/// makes the file durable, so a failure here is ignored.
#[cfg(target_os = "linux")]
fn start_writeback(file: &std::fs::File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor is open for the call's duration; the kernel
    // reads only the three integers.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn start_writeback(_: &std::fs::File, _: u64, _: u64) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.tsv");
        write_atomic(&path, b"one\n").unwrap();
        write_atomic(&path, b"two\n").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two\n");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// A file of several writeback spans, written in pieces that cross
    /// their boundaries and in one large write, reads back whole.
    #[test]
    fn files_larger_than_a_writeback_span_read_back_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.bin");
        let bytes: Vec<u8> = (0..(2 * WRITEBACK_BYTES + 12_345))
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        write_atomic_with(&path, |w| {
            for piece in bytes.chunks(5_000_011) {
                w.write_all(piece)?;
            }
            Ok(())
        })
        .unwrap();
        assert!(std::fs::read(&path).unwrap() == bytes);
        write_atomic(&path, &bytes[1..]).unwrap();
        assert!(std::fs::read(&path).unwrap() == bytes[1..]);
    }

    #[test]
    fn a_failed_write_names_the_file_and_keeps_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing").join("out.tsv");
        let err = write_atomic(&path, b"x").unwrap_err().to_string();
        assert!(err.contains("out.tsv"), "{err}");
        assert!(!dir.path().join("missing").exists());
    }
}
