//! Newick trees (`aam-rs unifrac --tree`, `--tree`): any bytes give a tree
//! or an error, never a panic; a parsed tree writes back to Newick that
//! parses to the same tree.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    if let Ok(tree) = aam_unifrac::newick::Tree::parse(data, Path::new("fuzz.nwk")) {
        let text = tree.to_newick(false);
        let again = aam_unifrac::newick::Tree::parse(text.as_bytes(), Path::new("again.nwk"))
            .expect("a written tree parses");
        assert_eq!(again.names(), tree.names());
        assert_eq!(again.children(), tree.children());
    }
});
