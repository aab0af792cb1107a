//! BIOM 1.0 (JSON), sparse or dense.
//!
//! `data` is streamed into one flat `Vec<f64>` plus per-entry lengths (no
//! `serde_json::Value` tree), because its meaning depends on `matrix_type`,
//! which may come after it in the object. Row/column metadata is skipped.

use std::fmt;
use std::path::Path;

use serde::de::{DeserializeSeed, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::biom::BiomTable;
use crate::error::{Error, Result};

#[derive(Deserialize)]
struct JsonTable {
    rows: Vec<Entry>,
    columns: Vec<Entry>,
    matrix_type: String,
    #[serde(default)]
    matrix_element_type: Option<String>,
    shape: [u64; 2],
    data: Data,
}

#[derive(Deserialize)]
struct Entry {
    id: String,
}

/// `data`: a list of lists of numbers, flattened.
struct Data {
    values: Vec<f64>,
    lengths: Vec<u32>,
}

impl<'de> Deserialize<'de> for Data {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Outer;
        impl<'de> Visitor<'de> for Outer {
            type Value = Data;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of lists of numbers")
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<Data, A::Error> {
                let mut data = Data {
                    values: Vec::new(),
                    lengths: Vec::new(),
                };
                while let Some(n) = seq.next_element_seed(Row(&mut data.values))? {
                    data.lengths.push(n);
                }
                Ok(data)
            }
        }
        d.deserialize_seq(Outer)
    }
}

/// One inner list, appended to the flat vector; yields its length.
struct Row<'a>(&'a mut Vec<f64>);

impl<'de> DeserializeSeed<'de> for Row<'_> {
    type Value = u32;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<u32, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Row<'_> {
    type Value = u32;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of numbers")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<u32, A::Error> {
        let mut n = 0u32;
        while let Some(v) = seq.next_element::<f64>()? {
            self.0.push(v);
            n = n.saturating_add(1);
        }
        Ok(n)
    }
}

pub(super) fn read(bytes: &[u8], path: &Path) -> Result<BiomTable> {
    let table: JsonTable = serde_json::from_slice(bytes).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })?;
    let invalid = |reason: String| Error::InvalidTable {
        path: path.to_path_buf(),
        reason,
    };
    let observation_ids: Vec<String> = table.rows.into_iter().map(|e| e.id).collect();
    let sample_ids: Vec<String> = table.columns.into_iter().map(|e| e.id).collect();
    let [n_rows, n_cols] = table.shape;
    if n_rows != observation_ids.len() as u64 || n_cols != sample_ids.len() as u64 {
        return Err(invalid(format!(
            "shape is [{n_rows}, {n_cols}] but there are {} rows and {} columns",
            observation_ids.len(),
            sample_ids.len()
        )));
    }
    if let Some(kind) = table.matrix_element_type.as_deref() {
        if kind != "int" && kind != "float" {
            return Err(invalid(format!(
                "matrix_element_type {kind:?} is not a count type (int or float)"
            )));
        }
    }
    let Data { values, lengths } = table.data;
    let (mut observations, mut samples, mut counts) = (Vec::new(), Vec::new(), Vec::new());
    match table.matrix_type.as_str() {
        "sparse" => {
            observations.reserve(lengths.len());
            samples.reserve(lengths.len());
            counts.reserve(lengths.len());
            for (k, &len) in lengths.iter().enumerate() {
                if len != 3 {
                    return Err(invalid(format!(
                        "sparse data entry {k} has {len} numbers, expected [row, column, value]"
                    )));
                }
                let entry = &values[3 * k..3 * k + 3];
                let row = index(entry[0], n_rows).ok_or_else(|| {
                    invalid(format!("sparse data entry {k}: bad row index {}", entry[0]))
                })?;
                let col = index(entry[1], n_cols).ok_or_else(|| {
                    invalid(format!(
                        "sparse data entry {k}: bad column index {}",
                        entry[1]
                    ))
                })?;
                observations.push(row);
                samples.push(col);
                counts.push(entry[2]);
            }
        }
        "dense" => {
            if lengths.len() as u64 != n_rows || lengths.iter().any(|&l| l as u64 != n_cols) {
                return Err(invalid(format!(
                    "dense data is not {n_rows} rows of {n_cols} values"
                )));
            }
            for (k, &v) in values.iter().enumerate() {
                if v != 0.0 {
                    observations.push((k as u64 / n_cols) as u32);
                    samples.push((k as u64 % n_cols) as u32);
                    counts.push(v);
                }
            }
        }
        other => {
            return Err(invalid(format!(
                "matrix_type {other:?} is neither \"sparse\" nor \"dense\""
            )))
        }
    }
    BiomTable::from_triplets(
        path,
        sample_ids,
        observation_ids,
        &observations,
        &samples,
        &counts,
    )
}

/// A whole, in-range index stored as a JSON number.
fn index(v: f64, n: u64) -> Option<u32> {
    (v >= 0.0 && v.fract() == 0.0 && (v as u64) < n && v <= u32::MAX as f64).then_some(v as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<BiomTable> {
        BiomTable::from_bytes(text.as_bytes(), Path::new("t.json"))
    }

    const SPARSE: &str = r#"{"id": null, "format": "1.0.0", "type": "OTU table",
        "rows": [{"id": "o1", "metadata": null}, {"id": "o2", "metadata": {"taxonomy": ["k__B"]}}],
        "columns": [{"id": "s1", "metadata": null}, {"id": "s2", "metadata": null}],
        "matrix_type": "sparse", "matrix_element_type": "int", "shape": [2, 2],
        "data": [[0, 1, 5], [1, 0, 2], [1, 1, 3.5]]}"#;

    #[test]
    fn sparse_json() {
        let t = parse(SPARSE).unwrap();
        assert_eq!(t.sample_ids(), &["s1".to_string(), "s2".to_string()]);
        assert_eq!(t.sample(0).observations, &[1]);
        assert_eq!(t.sample(1).observations, &[0, 1]);
        assert_eq!(t.sample(1).counts, &[5.0, 3.5]);
    }

    #[test]
    fn leading_bom_and_whitespace_are_accepted() {
        let t = parse(&format!("\u{feff}\n  {SPARSE}")).unwrap();
        assert_eq!(t.nnz(), 3);
    }

    #[test]
    fn dense_json_matches_sparse() {
        let dense = r#"{"rows": [{"id": "o1"}, {"id": "o2"}], "columns": [{"id": "s1"}, {"id": "s2"}],
            "data": [[0, 5], [2, 3.5]], "shape": [2, 2], "matrix_type": "dense", "matrix_element_type": "float"}"#;
        let (d, s) = (parse(dense).unwrap(), parse(SPARSE).unwrap());
        for i in 0..2 {
            assert_eq!(d.sample(i).observations, s.sample(i).observations);
            assert_eq!(d.sample(i).counts, s.sample(i).counts);
        }
    }

    #[test]
    fn syntax_error_reports_line_and_column() {
        let err = parse("{\"rows\": [\n  {\"id\": \"o1\"},\n  {\"id\": }]}").unwrap_err();
        match &err {
            Error::Json { line, .. } => assert_eq!(*line, 3, "{err}"),
            other => panic!("unexpected {other}"),
        }
        assert!(err.to_string().contains("t.json"));
    }

    #[test]
    fn structural_errors_are_reported() {
        let bad_index = SPARSE.replace("[1, 1, 3.5]", "[1, 7, 3.5]");
        assert!(parse(&bad_index)
            .unwrap_err()
            .to_string()
            .contains("entry 2: bad column index 7"));
        let bad_shape = SPARSE.replace("\"shape\": [2, 2]", "\"shape\": [3, 2]");
        assert!(parse(&bad_shape)
            .unwrap_err()
            .to_string()
            .contains("shape is [3, 2]"));
        let unicode = SPARSE.replace("\"int\"", "\"unicode\"");
        assert!(parse(&unicode).unwrap_err().to_string().contains("unicode"));
        let short = SPARSE.replace("[0, 1, 5]", "[0, 1]");
        assert!(parse(&short)
            .unwrap_err()
            .to_string()
            .contains("entry 0 has 2 numbers"));
        let negative = SPARSE.replace("[0, 1, 5]", "[0, 1, -5]");
        assert!(matches!(
            parse(&negative).unwrap_err(),
            Error::InvalidCount { .. }
        ));
        let dup = SPARSE.replace("{\"id\": \"s2\"", "{\"id\": \"s1\"");
        assert!(matches!(
            parse(&dup).unwrap_err(),
            Error::DuplicateId { kind: "sample", .. }
        ));
    }
}
