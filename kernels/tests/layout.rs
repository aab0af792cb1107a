//! The source layout of `kernels/` and `models/`: no two modules import each
//! other, directly or around a cycle, so that each can be read before the
//! ones that use it. A module's edges are the `crate::…` and `super::…`
//! paths in its code (comments and doc links left out), to the longest
//! module the path names; a module's use of its own ancestors or
//! descendants is the tree, not an edge.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module path (`a::b`, `""` for the crate root) of every `.rs` file under `src`.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("reads the source folder") {
            let path = entry.expect("a folder entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(src).unwrap().with_extension("");
                let mut parts: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
                    parts.pop();
                }
                out.insert(parts.join("::"), path);
            }
        }
    }
    out
}

/// The code of a file without its comments (line comments only: the
/// sources use no block comments).
fn code(path: &Path) -> String {
    std::fs::read_to_string(path)
        .expect("reads a source file")
        .lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths after each `prefix` in `code`: `crate::a::b::C` gives `[a, b, C]`.
fn paths_after<'a>(code: &'a str, prefix: &'a str) -> impl Iterator<Item = Vec<&'a str>> + 'a {
    code.match_indices(prefix).filter_map(move |(at, _)| {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            return None;
        }
        let rest = &code[at + prefix.len()..];
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(rest.len());
        Some(rest[..end].split("::").filter(|s| !s.is_empty()).collect())
    })
}

/// Each module's imports of other modules (not its ancestors or descendants).
fn edges(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mods = modules(src);
    let longest = |base: &[&str], path: &[&str]| -> Option<String> {
        (1..=path.len()).rev().find_map(|n| {
            let name = base
                .iter()
                .chain(&path[..n])
                .copied()
                .collect::<Vec<_>>()
                .join("::");
            mods.contains_key(&name).then_some(name)
        })
    };
    mods.iter()
        .map(|(name, path)| {
            let code = code(path);
            let parts: Vec<&str> = name.split("::").filter(|s| !s.is_empty()).collect();
            let parent = &parts[..parts.len().saturating_sub(1)];
            let deps = paths_after(&code, "crate::")
                .filter_map(|p| longest(&[], &p))
                .chain(paths_after(&code, "super::").filter_map(|p| longest(parent, &p)))
                .filter(|dep| {
                    let related =
                        |a: &str, b: &str| b.is_empty() || a.starts_with(&format!("{b}::"));
                    dep != name && !related(dep, name) && !related(name, dep)
                })
                .collect();
            (name.clone(), deps)
        })
        .collect()
}

/// A cycle of modules, if the graph has one.
fn cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            return Some(stack[at..].to_vec());
        }
        if !done.insert(node.to_string()) {
            return None;
        }
        stack.push(node.to_string());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, edges, done, stack) {
                return Some(found);
            }
        }
        stack.pop();
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|start| visit(start, edges, &mut done, &mut Vec::new()))
}

#[test]
fn no_module_imports_form_a_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for src in [root.join("src"), root.join("../models/src")] {
        let edges = edges(&src);
        assert!(
            edges.len() > 10,
            "{}: modules found: {edges:?}",
            src.display()
        );
        if let Some(cycle) = cycle(&edges) {
            panic!(
                "{}: modules import each other: {}",
                src.display(),
                cycle.join(" -> ")
            );
        }
    }
}

/// The checker finds a cycle where there is one: `mma` importing `tiled`,
/// which imports `mma_io`, which would import `mma`.
#[test]
fn a_cycle_is_found() {
    let edge = |a: &str, b: &[&str]| (a.to_string(), b.iter().map(|s| s.to_string()).collect());
    let edges = BTreeMap::from([
        edge("attention::mma", &["attention::tiled"]),
        edge("attention::tiled", &["attention::mma_io"]),
        edge("attention::mma_io", &["attention::mma"]),
        edge("attention::rows", &[]),
    ]);
    let found = cycle(&edges).expect("a cycle");
    assert_eq!(found.len(), 3, "{found:?}");
    let edges = BTreeMap::from([edge("a", &["b"]), edge("b", &[]), edge("c", &["a", "b"])]);
    assert_eq!(cycle(&edges), None);
}
