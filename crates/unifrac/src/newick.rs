//! Newick trees as real pipelines write them.
//!
//! Insertion trees (SEPP, Greengenes2) have 200k+ tips and 160+ levels, so the
//! parser keeps its own stack instead of recursing per level, and the tree is
//! stored flat, in postorder (children before their parent, the root last).
//! It reads quoted labels (`'...'` with `''` for a quote, and `"..."`),
//! unquoted labels, internal node names and support values (a label is kept
//! as written; only tips are matched to table IDs), missing branch lengths
//! (0, as `ssu` and scikit-bio take them), `[...]` comments anywhere between
//! tokens, and whitespace and line breaks between tokens. A malformed tree is
//! an error naming the byte offset.
//!
//! Branch lengths are rounded to single precision when read, as `ssu` reads
//! them: matrices then agree with `ssu`'s to ~1e-12 instead of ~1e-8. Trees
//! give lengths to 5-6 significant digits, so nothing a study reports changes.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A rooted tree, flat in postorder.
#[derive(Debug, Clone, PartialEq)]
pub struct Tree {
    source: PathBuf,
    names: Vec<String>,
    lengths: Vec<f64>,
    children: Vec<u32>,
}

impl Tree {
    /// Read a Newick file (one tree; text after its `;` is an error).
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&bytes, path)
    }

    /// Parse Newick text; `source` names it in errors.
    pub fn parse(text: &[u8], source: &Path) -> Result<Self> {
        Parser {
            text,
            pos: 0,
            source,
        }
        .tree()
    }

    /// Build a tree from its postorder arrays: per node its label, branch
    /// length (the root's is ignored) and number of children, children before
    /// their parent, the root last.
    pub fn from_postorder(
        names: Vec<String>,
        lengths: Vec<f64>,
        children: Vec<u32>,
        source: &Path,
    ) -> Result<Self> {
        let bad = |message: String| Error::Newick {
            path: source.to_path_buf(),
            offset: 0,
            message,
        };
        if names.is_empty() || names.len() != lengths.len() || names.len() != children.len() {
            return Err(bad(
                "the postorder arrays are empty or of different lengths".into(),
            ));
        }
        let mut open = 0usize;
        for (i, &c) in children.iter().enumerate() {
            if c as usize > open {
                return Err(bad(format!(
                    "node {i} has {c} children but only {open} precede it"
                )));
            }
            open = open - c as usize + 1;
        }
        if open != 1 {
            return Err(bad(format!("the arrays describe {open} trees, not one")));
        }
        Ok(Self {
            source: source.to_path_buf(),
            names,
            lengths,
            children,
        })
    }

    /// The file the tree came from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Number of nodes, tips and internal nodes, the root included.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Always false: a tree has at least its root.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Node labels in postorder ("" where the tree has none).
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Branch lengths above each node, in postorder (the root's last).
    pub fn lengths(&self) -> &[f64] {
        &self.lengths
    }

    /// Number of children of each node, in postorder (0 for a tip).
    pub fn children(&self) -> &[u32] {
        &self.children
    }

    /// Number of tips.
    pub fn n_tips(&self) -> usize {
        self.children.iter().filter(|&&c| c == 0).count()
    }

    /// The subtree spanned by the tips `keep` accepts, with every internal
    /// node left with one child merged into it (lengths add; the root stays),
    /// as UniFrac shears a tree to a table. None when no tip is kept.
    pub fn sheared(&self, keep: impl Fn(&str) -> bool) -> Option<Tree> {
        let mut out = Tree {
            source: self.source.clone(),
            names: Vec::new(),
            lengths: Vec::new(),
            children: Vec::new(),
        };
        // Per finished subtree: the new index of its top node, if it kept a tip.
        let mut stack: Vec<Option<usize>> = Vec::new();
        let root = self.len() - 1;
        for node in 0..self.len() {
            let c = self.children[node] as usize;
            let kept: Vec<usize> = if c == 0 {
                if !keep(&self.names[node]) {
                    stack.push(None);
                    continue;
                }
                Vec::new()
            } else {
                stack
                    .split_off(stack.len() - c)
                    .into_iter()
                    .flatten()
                    .collect()
            };
            if c > 0 && kept.is_empty() {
                stack.push(None);
            } else if kept.len() == 1 && node != root {
                out.lengths[kept[0]] += self.lengths[node];
                stack.push(Some(kept[0]));
            } else {
                out.names.push(self.names[node].clone());
                out.lengths.push(self.lengths[node]);
                out.children.push(kept.len() as u32);
                stack.push(Some(out.names.len() - 1));
            }
        }
        (!out.names.is_empty()).then_some(out)
    }

    /// The tree as Newick text, children in order or reversed (to check that
    /// a result does not depend on the order of children).
    pub fn to_newick(&self, reverse_children: bool) -> String {
        // Rebuild child lists from the postorder counts, then write iteratively.
        let n = self.len();
        let mut kids: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut stack: Vec<usize> = Vec::new();
        for i in 0..n {
            let c = self.children[i] as usize;
            kids[i] = stack.split_off(stack.len() - c);
            if reverse_children {
                kids[i].reverse();
            }
            stack.push(i);
        }
        enum Step {
            Open(usize),
            Close(usize),
            Comma,
        }
        let mut out = String::new();
        let mut todo = vec![Step::Open(n - 1)];
        while let Some(step) = todo.pop() {
            match step {
                Step::Open(i) if kids[i].is_empty() => label(&mut out, self, i),
                Step::Open(i) => {
                    out.push('(');
                    todo.push(Step::Close(i));
                    for (j, &k) in kids[i].iter().enumerate().rev() {
                        todo.push(Step::Open(k));
                        if j > 0 {
                            todo.push(Step::Comma);
                        }
                    }
                }
                Step::Close(i) => {
                    out.push(')');
                    label(&mut out, self, i);
                }
                Step::Comma => out.push(','),
            }
        }
        out.push(';');
        out
    }
}

fn label(out: &mut String, tree: &Tree, i: usize) {
    let name = &tree.names[i];
    if !name.is_empty() {
        out.push('\'');
        out.push_str(&name.replace('\'', "''"));
        out.push('\'');
    }
    // Lengths are read at single precision, so this loses nothing.
    out.push_str(&format!(":{}", tree.lengths[i] as f32));
}

struct Parser<'a> {
    text: &'a [u8],
    pos: usize,
    source: &'a Path,
}

impl Parser<'_> {
    fn error(&self, offset: usize, message: impl Into<String>) -> Error {
        Error::Newick {
            path: self.source.to_path_buf(),
            offset,
            message: message.into(),
        }
    }

    /// Skip whitespace and `[...]` comments.
    fn skip(&mut self) -> Result<()> {
        while self.pos < self.text.len() {
            match self.text[self.pos] {
                b' ' | b'\t' | b'\n' | b'\r' => self.pos += 1,
                b'[' => {
                    let start = self.pos;
                    match self.text[start..].iter().position(|&b| b == b']') {
                        Some(end) => self.pos = start + end + 1,
                        None => return Err(self.error(start, "a '[' comment is never closed")),
                    }
                }
                _ => break,
            }
        }
        Ok(())
    }

    fn peek(&self) -> Option<u8> {
        self.text.get(self.pos).copied()
    }

    fn tree(mut self) -> Result<Tree> {
        let mut names = Vec::new();
        let mut lengths = Vec::new();
        let mut children = Vec::new();
        // Per open '(' : its byte offset and the children closed so far.
        let mut open: Vec<(usize, u32)> = Vec::new();
        self.skip()?;
        if self.pos == self.text.len() {
            return Err(self.error(0, "the file holds no tree"));
        }
        loop {
            // A node starts: '(' opens an internal node, anything else is a tip.
            self.skip()?;
            if self.peek() == Some(b'(') {
                open.push((self.pos, 0));
                self.pos += 1;
                continue;
            }
            let (name, length) = self.label_and_length()?;
            names.push(name);
            lengths.push(length);
            children.push(0);
            // After a node: ',' starts a sibling, ')' closes the parent, ';' ends.
            loop {
                self.skip()?;
                match self.peek() {
                    Some(b',') => {
                        let Some(top) = open.last_mut() else {
                            return Err(self.error(self.pos, "',' outside any parentheses"));
                        };
                        top.1 += 1;
                        self.pos += 1;
                        break;
                    }
                    Some(b')') => {
                        let Some((_, count)) = open.pop() else {
                            return Err(self.error(self.pos, "')' without a matching '('"));
                        };
                        self.pos += 1;
                        let (name, length) = self.label_and_length()?;
                        names.push(name);
                        lengths.push(length);
                        children.push(count + 1);
                    }
                    Some(b';') | None => {
                        if let Some(&(at, _)) = open.last() {
                            return Err(self.error(at, "this '(' is never closed"));
                        }
                        if self.peek().is_some() {
                            self.pos += 1;
                            self.skip()?;
                            if self.pos < self.text.len() {
                                return Err(self.error(
                                    self.pos,
                                    "text after the tree's ';' (one tree per file)",
                                ));
                            }
                        }
                        return Ok(Tree {
                            source: self.source.to_path_buf(),
                            names,
                            lengths,
                            children,
                        });
                    }
                    Some(other) => {
                        return Err(self.error(
                            self.pos,
                            format!(
                                "expected ',', ')' or ';' after a node, found {:?}",
                                other as char
                            ),
                        ))
                    }
                }
            }
        }
    }

    /// A node's optional label and optional `:length`.
    fn label_and_length(&mut self) -> Result<(String, f64)> {
        self.skip()?;
        let name = match self.peek() {
            Some(q @ (b'\'' | b'"')) => self.quoted(q)?,
            _ => {
                let start = self.pos;
                while let Some(b) = self.peek() {
                    if matches!(
                        b,
                        b'(' | b')' | b',' | b':' | b';' | b'[' | b' ' | b'\t' | b'\n' | b'\r'
                    ) {
                        break;
                    }
                    if b == b'\'' || b == b'"' {
                        return Err(self.error(self.pos, "a quote inside an unquoted label"));
                    }
                    self.pos += 1;
                }
                self.utf8(start, self.pos)?
            }
        };
        self.skip()?;
        let mut length = 0.0;
        if self.peek() == Some(b':') {
            self.pos += 1;
            self.skip()?;
            let start = self.pos;
            while let Some(b) = self.peek() {
                if !(b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'+' | b'e' | b'E')) {
                    break;
                }
                self.pos += 1;
            }
            let token = std::str::from_utf8(&self.text[start..self.pos]).unwrap_or_default();
            length = match token.parse::<f64>() {
                // Rounded to f32 as ssu stores them; beyond f32's range a
                // length would be infinite.
                Ok(v) if (v as f32).is_finite() => v as f32 as f64,
                Ok(v) if v.is_finite() => {
                    return Err(self.error(
                        start,
                        format!("branch length {token} is beyond the range of a 32-bit float"),
                    ));
                }
                _ => {
                    let shown: String = String::from_utf8_lossy(
                        &self.text[start..(start + 20).min(self.text.len())],
                    )
                    .chars()
                    .take_while(|c| !matches!(c, ',' | ')' | ';'))
                    .collect();
                    return Err(
                        self.error(start, format!("branch length {shown:?} is not a number"))
                    );
                }
            };
        }
        Ok((name, length))
    }

    fn quoted(&mut self, quote: u8) -> Result<String> {
        let start = self.pos;
        self.pos += 1;
        let mut bytes = Vec::new();
        loop {
            match self.peek() {
                None => return Err(self.error(start, "a quoted label is never closed")),
                Some(b) if b == quote => {
                    if self.text.get(self.pos + 1) == Some(&quote) {
                        bytes.push(quote);
                        self.pos += 2;
                    } else {
                        self.pos += 1;
                        break;
                    }
                }
                Some(b) => {
                    bytes.push(b);
                    self.pos += 1;
                }
            }
        }
        String::from_utf8(bytes).map_err(|_| self.error(start, "the label is not UTF-8"))
    }

    fn utf8(&self, start: usize, end: usize) -> Result<String> {
        std::str::from_utf8(&self.text[start..end])
            .map(str::to_string)
            .map_err(|_| self.error(start, "the label is not UTF-8"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Tree> {
        Tree::parse(s.as_bytes(), Path::new("t.nwk"))
    }

    #[test]
    fn reads_labels_lengths_and_structure_in_postorder() {
        let t = parse("((a:1,'b c':2)0.95:0.5,\"d\",e:3e-1)root;").unwrap();
        assert_eq!(t.names(), ["a", "b c", "0.95", "d", "e", "root"]);
        assert_eq!(t.lengths(), [1.0, 2.0, 0.5, 0.0, 0.3f32 as f64, 0.0]);
        assert_eq!(t.children(), [0, 0, 2, 0, 0, 3]);
        assert_eq!(t.n_tips(), 4);
    }

    #[test]
    fn reads_comments_whitespace_escaped_quotes_and_empty_tips() {
        let t = parse("[&R] ( 'it''s' [note] : 1 ,\n (,) :2 ) ;\n").unwrap();
        assert_eq!(t.names(), ["it's", "", "", "", ""]);
        assert_eq!(t.lengths(), [1.0, 0.0, 0.0, 2.0, 0.0]);
        assert_eq!(t.children(), [0, 0, 0, 2, 2]);
        // A single tip is a tree; a missing ';' at the end is tolerated.
        assert_eq!(parse("a:1").unwrap().children(), [0]);
    }

    #[test]
    fn a_deep_tree_needs_no_recursion() {
        let depth = 200_000;
        let text = format!("{}a:1{};", "(".repeat(depth), "):1".repeat(depth));
        let t = parse(&text).unwrap();
        assert_eq!(t.len(), depth + 1);
        // Writing it back is iterative too, and reads back the same.
        let again = parse(&t.to_newick(true)).unwrap();
        assert_eq!(again.children(), t.children());
    }

    #[test]
    fn malformed_trees_name_the_byte_offset() {
        let cases = [
            ("((a,b);", 0, "never closed"),
            ("(a,b));", 5, "without a matching"),
            ("a,b;", 1, "outside any parentheses"),
            ("(a:x,b);", 3, "not a number"),
            // Found by fuzzing: finite as f64, infinite once rounded to f32.
            ("(((a:1,b:1):1,c:5):2e46,d:4);", 19, "beyond the range"),
            ("(a,b);(c,d);", 6, "one tree per file"),
            ("('a,b);", 1, "never closed"),
            ("(a[x,b);", 2, "never closed"),
            ("(a b,c);", 3, "expected ','"),
            ("", 0, "no tree"),
        ];
        for (text, offset, what) in cases {
            let err = parse(text).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains(&format!("byte {offset}")) && msg.contains(what),
                "{text:?}: {msg}"
            );
            assert!(msg.contains("t.nwk"), "{msg}");
        }
    }

    #[test]
    fn shears_to_kept_tips_and_merges_single_children() {
        let t = parse("(((a:1,b:2)x:1,c:3)y:1,(d:1,e:1)z:2)r;").unwrap();
        let s = t.sheared(|n| n == "a" || n == "c" || n == "d").unwrap();
        // b goes, so x merges into a (1 + 1); e goes, so z merges into d (1 + 2).
        assert_eq!(s.names(), ["a", "c", "y", "d", "r"]);
        assert_eq!(s.lengths(), [2.0, 3.0, 1.0, 3.0, 0.0]);
        assert_eq!(s.children(), [0, 0, 2, 0, 2]);
        assert!(t.sheared(|_| false).is_none());
        // The root stays even with one child left.
        let one = t.sheared(|n| n == "e").unwrap();
        assert_eq!(one.children(), [0, 1]);
        assert_eq!(one.lengths(), [3.0, 0.0]);
    }

    #[test]
    fn writes_newick_that_reads_back() {
        let t = parse("((a:1,'b''s':2)x:0.5,c:0.25);").unwrap();
        let back = parse(&t.to_newick(false)).unwrap();
        assert_eq!(back, t);
        let rev = parse(&t.to_newick(true)).unwrap();
        assert_eq!(rev.names(), ["c", "b's", "a", "x", ""]);
    }
}
