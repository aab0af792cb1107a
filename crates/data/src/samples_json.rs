//! Samples as JSON, the body of `aam-rs serve`'s `/embed` and `/predict`:
//! `{"samples": [{"id": "s1", "counts": {"TACG...": 12, ...}}, ...]}`, the
//! counts either an object (reads per sequence, in the document's order) or,
//! for clients whose JSON objects sort or shuffle their keys, a list of
//! pairs `[["TACG...", 12], ...]`. Unknown fields are refused. Here so that
//! the format has one parser, fuzzed with the other readers
//! (`crates/data/fuzz`); the sample checks (sequences, counts, duplicates)
//! are [`Dataset::from_samples`](crate::Dataset::from_samples)'.

use std::fmt;

use serde::de::{MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::SampleReads;

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

/// Parses a samples document (see the module doc); the samples keep the
/// document's order, and each sample's reads theirs (a sequence given twice
/// stays twice, for the sample check to name).
pub fn parse_samples_json(body: &[u8]) -> Result<Vec<SampleReads>, SamplesJsonError> {
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
    Ok(request
        .samples
        .into_iter()
        .map(|s| SampleReads {
            id: s.id,
            reads: s.counts.0,
        })
        .collect())
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
        let samples = parse_samples_json(body).unwrap();
        assert_eq!(samples[0].reads, [("TT".into(), 2.0), ("AC".into(), 1.0)]);
        assert_eq!(samples[1].reads, [("GG".into(), 3.0), ("AA".into(), 4.0)]);
        let err = parse_samples_json(br#"{"samples": [{"id": "a", "counts": {"TT": "x"}}]}"#)
            .unwrap_err();
        assert_eq!(err.path, "samples[0].counts.TT");
        let err = parse_samples_json(br#"{"samples": [], "extra": 1}"#).unwrap_err();
        assert!(err.message.contains("extra"), "{err}");
        assert!(parse_samples_json(b"").unwrap_err().path.is_empty());
    }
}
