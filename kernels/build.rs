//! Names this build of the GPU kernels for their on-disk cache.
//!
//! CubeCL finds a compiled kernel on disk by its Rust type name and its
//! compile-time arguments, not by its code, so a kernel whose code changed
//! between two builds of aam-rs would load the older build's compiled code
//! from a shared cache (a stale kernel: wrong numbers or a crash). This
//! hashes what the compiled code depends on: the source of every crate of
//! the workspace that defines kernels (this one and `crates/unifrac`), the
//! patched CubeCL CUDA runtime in `vendor/`, this crate's manifest and
//! version, and, where the workspace's lock file is at hand, the CubeCL,
//! CubeK and Burn versions in it. `persist_compiled_kernels` keeps each
//! build's kernels in a folder of that name. Any edit of those sources (a
//! comment too) gives a new folder: the new build compiles once.

use std::fs;
use std::path::{Path, PathBuf};

/// The folders whose code becomes GPU kernels (relative to this crate; the
/// ones outside it are there in the workspace only).
const KERNEL_SOURCES: [&str; 3] = ["src", "../crates/unifrac/src", "../vendor/cubecl-cuda/src"];

fn main() {
    let mut hash = Fnv(0xcbf2_9ce4_8422_2325);
    hash.feed(env!("CARGO_PKG_VERSION").as_bytes());
    hash.feed(&fs::read("Cargo.toml").unwrap_or_default());
    println!("cargo:rerun-if-changed=Cargo.toml");
    let mut files = Vec::new();
    for dir in KERNEL_SOURCES {
        let dir = Path::new(dir);
        if dir.is_dir() {
            source_files(dir, &mut files);
            println!("cargo:rerun-if-changed={}", dir.display());
        }
    }
    files.sort();
    for file in &files {
        hash.feed(file.to_string_lossy().as_bytes());
        hash.feed(&fs::read(file).unwrap_or_default());
    }
    let lock = Path::new("../Cargo.lock");
    if let Ok(text) = fs::read_to_string(lock) {
        // `name = "…"` then `version = "…"` of each package that makes code.
        let mut name = "";
        for line in text.lines() {
            if let Some(n) = line.strip_prefix("name = ") {
                name = n;
            } else if let Some(version) = line.strip_prefix("version = ") {
                let n = name.trim_matches('"');
                if ["cubecl", "cubek", "burn"].iter().any(|p| n.starts_with(p)) {
                    hash.feed(format!("{n} {version}").as_bytes());
                }
            }
        }
        println!("cargo:rerun-if-changed=../Cargo.lock");
    }
    println!("cargo:rustc-env=AAM_KERNELS_BUILD={:016x}", hash.0);
}

/// Every file below `dir`.
fn source_files(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            source_files(&path, files);
        } else {
            files.push(path);
        }
    }
}

/// 64-bit FNV-1a.
struct Fnv(u64);

impl Fnv {
    fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}
