//! Names this build of the kernels for their on-disk cache.
//!
//! CubeCL finds a compiled kernel on disk by its Rust type name and its
//! compile-time arguments, not by its code, so a kernel whose code changed
//! between two builds of aam-rs would load the older build's compiled code
//! from a shared cache (a stale kernel: wrong numbers or a crash). This
//! hashes what the compiled code depends on (the crate's source and the
//! CubeCL, CubeK and Burn versions in the workspace's lock file), and
//! `persist_compiled_kernels` keeps each build's kernels in a folder of
//! that name.

use std::fs;
use std::path::{Path, PathBuf};

fn main() {
    let mut hash = Fnv(0xcbf2_9ce4_8422_2325);
    let mut files = Vec::new();
    source_files(Path::new("src"), &mut files);
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
    println!("cargo:rerun-if-changed=src");
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
