//! `docs/cli.md` is the `--help` of every command and subcommand of the
//! `aam-rs` binary. This test renders it from the binary and fails when the
//! file differs, so the reference cannot drift from the flags. After changing
//! a flag, rewrite the file with
//! `AAM_UPDATE_CLI_DOCS=1 cargo test -p aam-cli --test cli_docs`.
//!
//! The backends listed under `--backend` depend on the cargo features the
//! binary was built with; those lines are compared without the backend list.

use std::path::Path;
use std::process::Command;

/// `aam-rs <path> --help`.
fn help(path: &[String]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_aam-rs"))
        .args(path)
        .arg("--help")
        .output()
        .expect("runs");
    assert!(out.status.success(), "aam-rs {path:?} --help failed");
    String::from_utf8(out.stdout).expect("UTF-8 help")
}

/// The subcommands a help text lists under `Commands:` (without `help`).
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| l.trim_end() != "Commands:")
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_string)
        .collect()
}

/// The markdown for `path` and every command under it.
fn render(path: Vec<String>, out: &mut String) {
    let text = help(&path);
    let title = std::iter::once("aam-rs".to_string())
        .chain(path.iter().cloned())
        .collect::<Vec<_>>()
        .join(" ");
    let level = "#".repeat(path.len().clamp(1, 2) + 1);
    out.push_str(&format!(
        "{level} `{title}`\n\n```text\n{}\n```\n\n",
        text.trim_end()
    ));
    for sub in subcommands(&text) {
        let mut next = path.clone();
        next.push(sub);
        render(next, out);
    }
}

/// Drops the lines that depend on which backends were compiled in.
fn without_backend_lists(text: &str) -> String {
    const BACKENDS: [&str; 7] = [
        "ndarray", "candle", "wgpu", "cuda", "rocm", "tch", "tch-gpu",
    ];
    text.lines()
        .filter(|l| {
            let item = l.trim_start().strip_prefix("- ").unwrap_or("");
            !BACKENDS
                .iter()
                .any(|b| item.starts_with(&format!("{b}:")) || item == *b)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn docs_cli_md_is_the_binarys_help() {
    let mut doc = String::from(
        "# Command-line reference\n\n\
         Every command of `aam-rs` and its options, as `aam-rs <command> --help` prints them.\n\
         Generated from the binary by `crates/cli/tests/cli_docs.rs`, which fails when this file\n\
         is out of date; the backends under `--backend` are those of a build with the features\n\
         of `.ci/run` (`aam-rs backends` lists a binary's own).\n\n",
    );
    render(Vec::new(), &mut doc);
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/cli.md");
    if std::env::var_os("AAM_UPDATE_CLI_DOCS").is_some() {
        std::fs::write(&file, &doc).expect("writes docs/cli.md");
        return;
    }
    let current = std::fs::read_to_string(&file).unwrap_or_default();
    let (want, have) = (without_backend_lists(&doc), without_backend_lists(&current));
    if want != have {
        let first = want
            .lines()
            .zip(have.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(want.lines().count().min(have.lines().count()));
        panic!(
            "docs/cli.md differs from the binary's help from line {} of the comparison \
             (binary: {:?}, file: {:?}); rewrite it with \
             AAM_UPDATE_CLI_DOCS=1 cargo test -p aam-cli --test cli_docs",
            first + 1,
            want.lines().nth(first),
            have.lines().nth(first)
        );
    }
    assert!(
        doc.contains("## `aam-rs pretrain`") && doc.contains("### `aam-rs diagnose attention`")
    );
}
