//! Samples as JSON, the body of `aam-rs serve`'s `/embed` and `/predict`:
//! `{"samples": [{"id": "s1", "counts": {"TACG...": 12, ...}}, ...]}`, the
//! counts either an object (reads per sequence, in the document's order) or,
//! for clients whose JSON objects sort or shuffle their keys, a list of
//! pairs `[["TACG...", 12], ...]`, and optionally a `"metadata"` object
//! (column → value) per sample. Unknown fields are refused. Here so that
//! the format has one parser, fuzzed with the other readers
//! (`crates/data/fuzz`); the sample checks (sequences, counts, duplicates)
//! are [`Dataset::from_samples`](crate::Dataset::from_samples)'.

use std::fmt;

use serde::de::{MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::{Metadata, SampleReads};

/// A body that is not such a document: where (a JSON path such as
/// `samples[2].counts`, empty at the top) and what.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplesJsonError {
    /// The JSON path of the fault (`samples[0].id`), empty for the document.
    pub path: String,
    /// What is wrong there.
    pub message: String,
}

impl fmt::Display for SamplesJsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

impl std::error::Error for SamplesJsonError {}

/// A parsed samples document: the samples, and their metadata where any
/// sample carried a `"metadata"` object.
#[derive(Debug, Clone)]
pub struct SamplesDocument {
    /// In the document's order.
    pub samples: Vec<SampleReads>,
    /// One row per sample (in the same order), every column any sample
    /// named; `None` when no sample carried metadata.
    pub metadata: Option<Metadata>,
}

/// Parses a samples document (see the module doc); the samples keep the
/// document's order, and each sample's reads theirs (a sequence given twice
/// stays twice, for the sample check to name). A sample's `"metadata"` is an
/// object of column → value (a string, number or boolean; `null` for
/// missing), as a row of a metadata file.
pub fn parse_samples_json(body: &[u8]) -> Result<SamplesDocument, SamplesJsonError> {
    let request: Request = serde_path_to_error::deserialize(
        &mut serde_json::Deserializer::from_slice(body),
    )
    .map_err(|e| {
        let path = e.path().to_string();
        SamplesJsonError {
            path: if path == "." { String::new() } else { path },
            message: e.inner().to_string(),
        }
    })?;
    let with_metadata = request.samples.iter().any(|s| s.metadata.is_some());
    let mut columns: Vec<String> = Vec::new();
    for sample in &request.samples {
        for column in sample.metadata.iter().flat_map(|m| m.keys()) {
            if !columns.contains(column) {
                columns.push(column.clone());
            }
        }
    }
    let mut rows = Vec::new();
    let mut samples = Vec::with_capacity(request.samples.len());
    for sample in request.samples {
        if with_metadata {
            let values = columns
                .iter()
                .map(|c| {
                    sample
                        .metadata
                        .as_ref()
                        .and_then(|m| m.get(c))
                        .and_then(|v| v.0.clone())
                })
                .collect();
            rows.push((sample.id.clone(), values));
        }
        samples.push(SampleReads {
            id: sample.id,
            reads: sample.counts.0,
        });
    }
    let metadata = if with_metadata {
        let table = Metadata::from_rows(
            PathBuf::from("the request's metadata"),
            "sample_id".into(),
            columns,
            rows,
        )
        .map_err(|e| SamplesJsonError {
            path: "samples".into(),
            message: e.to_string(),
        })?;
        Some(table)
    } else {
        None
    };
    Ok(SamplesDocument { samples, metadata })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Request {
    samples: Vec<RequestSample>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestSample {
    id: String,
    counts: Counts,
    #[serde(default)]
    metadata: Option<BTreeMap<String, Cell>>,
}

/// A metadata value: text, a number or a boolean as text, `null` missing.
struct Cell(Option<String>);

impl<'de> Deserialize<'de> for Cell {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match serde_json::Value::deserialize(deserializer)? {
            serde_json::Value::Null => Ok(Cell(None)),
            serde_json::Value::String(s) => Ok(Cell(Some(s))),
            serde_json::Value::Number(n) => Ok(Cell(Some(n.to_string()))),
            serde_json::Value::Bool(b) => Ok(Cell(Some(b.to_string()))),
            _ => Err(serde::de::Error::custom(
                "a metadata value is a string, number, boolean or null",
            )),
        }
    }
}

/// Reads per sequence in the document's order, from an object or a list of
/// pairs.
struct Counts(Vec<(String, f64)>);

impl<'de> Deserialize<'de> for Counts {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Ordered;
        impl<'de> Visitor<'de> for Ordered {
            type Value = Counts;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "reads per ASV sequence: {\"TACG...\": 12, ...} or [[\"TACG...\", 12], ...]",
                )
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Counts, A::Error> {
                let mut reads = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(pair) = seq.next_element::<(String, f64)>()? {
                    reads.push(pair);
                }
                Ok(Counts(reads))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Counts, A::Error> {
                let mut reads = Vec::with_capacity(map.size_hint().unwrap_or(0).min(4096));
                while let Some(entry) = map.next_entry::<String, f64>()? {
                    reads.push(entry);
                }
                Ok(Counts(reads))
            }
        }
        deserializer.deserialize_any(Ordered)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_and_pairs_keep_their_order_and_faults_are_located() {
        let body = br#"{"samples": [{"id": "a", "counts": {"TT": 2, "AC": 1}},
                                     {"id": "b", "counts": [["GG", 3], ["AA", 4]]}]}"#;
        let document = parse_samples_json(body).unwrap();
        assert!(document.metadata.is_none());
        let samples = document.samples;
        assert_eq!(samples[0].reads, [("TT".into(), 2.0), ("AC".into(), 1.0)]);
        assert_eq!(samples[1].reads, [("GG".into(), 3.0), ("AA".into(), 4.0)]);
        let err = parse_samples_json(br#"{"samples": [{"id": "a", "counts": {"TT": "x"}}]}"#)
            .unwrap_err();
        assert_eq!(err.path, "samples[0].counts.TT");
        let err = parse_samples_json(br#"{"samples": [], "extra": 1}"#).unwrap_err();
        assert!(err.message.contains("extra"), "{err}");
        assert!(parse_samples_json(b"").unwrap_err().path.is_empty());
    }

    #[test]
    fn metadata_becomes_a_table_of_every_named_column() {
        let body = br#"{"samples": [
            {"id": "a", "counts": {"TT": 2}, "metadata": {"site": "tongue", "age": 31}},
            {"id": "b", "counts": {"GG": 3}, "metadata": {"site": null, "smoker": true}},
            {"id": "c", "counts": {"AA": 1}}]}"#;
        let meta = parse_samples_json(body).unwrap().metadata.unwrap();
        assert_eq!(meta.sample_ids(), ["a", "b", "c"]);
        assert_eq!(meta.columns(), ["age", "site", "smoker"]);
        let (age, site, smoker) = (0, 1, 2);
        assert_eq!(meta.value(0, age), Some("31"));
        assert_eq!(meta.value(0, site), Some("tongue"));
        assert_eq!(meta.value(1, site), None);
        assert_eq!(meta.value(1, smoker), Some("true"));
        assert_eq!(meta.value(2, age), None);
        let err = parse_samples_json(
            br#"{"samples": [{"id": "a", "counts": {"TT": 2}, "metadata": {"x": [1]}}]}"#,
        )
        .unwrap_err();
        assert_eq!(err.path, "samples[0].metadata.x");
        let err = parse_samples_json(
            br#"{"samples": [{"id": "a", "counts": {"TT": 2}, "metadata": {}},
                             {"id": "a", "counts": {"TT": 2}}]}"#,
        )
        .unwrap_err();
        assert!(err.message.contains("\"a\""), "{err}");
    }
}
