//! Every reference configuration in `fixtures/aam-state-dicts.txt` (17 state
//! dicts listed by the reference, copied from `shared/reference/`) maps
//! name-for-name and shape-for-shape through import: its architecture is
//! inferred from the names and shapes alone, the model is built, and the
//! model's own state dict lists exactly the same keys, shapes and order.

use std::collections::BTreeMap;
use std::path::Path;

use aam_models::import::{infer_config, ImportHints};
use aam_tests::config_json;
use burn::backend::NdArray;

struct Listing {
    name: String,
    tensors: usize,
    params: usize,
    keys: Vec<(String, Vec<usize>)>,
}

fn parse_listings() -> Vec<Listing> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/aam-state-dicts.txt");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut out: Vec<Listing> = Vec::new();
    for line in text.lines() {
        if let Some(header) = line.strip_prefix("### ") {
            // "name: 161 tensors, 2533639 params"
            let (name, rest) = header.split_once(": ").unwrap();
            let nums: Vec<usize> = rest
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|s| s.parse().ok())
                .collect();
            out.push(Listing {
                name: name.into(),
                tensors: nums[0],
                params: nums[1],
                keys: Vec::new(),
            });
        } else if let Some((key, shape)) = line.split_once('\t') {
            let shape = shape
                .trim_matches(|c| c == '(' || c == ')')
                .split(',')
                .filter_map(|s| s.trim().parse().ok())
                .collect();
            out.last_mut().unwrap().keys.push((key.into(), shape));
        }
    }
    out
}

#[test]
fn every_reference_state_dict_maps_name_for_name() {
    let listings = parse_listings();
    assert_eq!(listings.len(), 17, "the reference lists 17 configurations");
    let device = Default::default();
    for listing in listings {
        assert_eq!(
            listing.keys.len(),
            listing.tensors,
            "{}: listing size",
            listing.name
        );
        let shapes: BTreeMap<String, Vec<usize>> = listing.keys.iter().cloned().collect();
        let mut hints = ImportHints::default();
        if listing.name.starts_with("quantile3") {
            hints.num_quantiles = Some(3);
        }
        let config = infer_config(&shapes, &hints, Path::new(&listing.name))
            .unwrap_or_else(|e| panic!("{}: {e}", listing.name));
        let model = config.init::<NdArray<f32>>(&device).unwrap();
        let ours = model.state_dict_shapes(&config);
        let params: usize = ours.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        assert_eq!(params, listing.params, "{}: parameter count", listing.name);
        assert_eq!(
            ours,
            listing.keys,
            "{}: keys, shapes or order differ\nconfig: {}",
            listing.name,
            config_json(&config)
        );
    }
}
