//! Text distance matrices: `.csv` (comma) and `.tsv`/`.txt` (tab; scikit-bio's
//! lsmat, as QIIME writes `*_dm.txt`).
//!
//! Layout: a header row whose first cell is ignored and whose other cells are
//! column sample IDs; then one row per sample, its ID first. Unlike the
//! reference (which ignores the header and assumes the columns follow the
//! rows), column IDs are used: a different order is permuted into the row
//! order, a different set is an error naming the column.

use std::collections::HashMap;
use std::path::Path;

use crate::error::{Error, Result};

/// A parsed text matrix: row IDs and row-major values, columns already in row order.
#[derive(Debug)]
pub(crate) struct TextMatrix {
    pub ids: Vec<String>,
    pub rows: usize,
    pub cols: usize,
    pub values: Vec<f64>,
}

fn cell(s: &str) -> &str {
    let s = s.trim();
    s.strip_prefix('"')
        .and_then(|x| x.strip_suffix('"'))
        .unwrap_or(s)
}

/// Parse a text matrix; with `square`, columns named like the rows are
/// permuted into row order (a one-column file, such as `faithpd`'s output,
/// is read as it is).
pub(crate) fn parse(
    bytes: &[u8],
    path: &Path,
    delimiter: char,
    square: bool,
) -> Result<TextMatrix> {
    let err = |line: usize, reason: String| Error::MatrixText {
        path: path.to_path_buf(),
        line,
        reason,
    };
    let text = std::str::from_utf8(bytes).map_err(|e| {
        let line = bytes[..e.valid_up_to()]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1;
        err(line, "the file is not UTF-8 text".into())
    })?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l))
        .filter(|(_, l)| !l.trim().is_empty());
    let (header_line, header) = lines
        .next()
        .ok_or_else(|| err(1, "no header line".into()))?;
    let col_ids: Vec<&str> = header.split(delimiter).skip(1).map(cell).collect();
    if col_ids.is_empty() {
        return Err(err(
            header_line,
            format!("the header has no column IDs (is the delimiter {delimiter:?}?)"),
        ));
    }
    let mut ids = Vec::new();
    let mut values = Vec::new();
    for (line_no, line) in lines {
        let mut fields = line.split(delimiter);
        let id = cell(fields.next().unwrap_or(""));
        if id.is_empty() {
            return Err(err(line_no, "empty sample ID in the first column".into()));
        }
        let before = values.len();
        for (k, field) in fields.enumerate() {
            let field = cell(field);
            let Some(col) = col_ids.get(k) else {
                return Err(err(
                    line_no,
                    format!(
                        "sample {id:?}: more values than the {} header columns",
                        col_ids.len()
                    ),
                ));
            };
            let v: f64 = field.parse().map_err(|_| {
                err(
                    line_no,
                    format!("sample {id:?}, column {col:?}: {field:?} is not a number"),
                )
            })?;
            values.push(v);
        }
        if values.len() - before != col_ids.len() {
            return Err(err(
                line_no,
                format!(
                    "sample {id:?}: {} values for {} header columns",
                    values.len() - before,
                    col_ids.len()
                ),
            ));
        }
        ids.push(id.to_string());
    }
    let rows = ids.len();
    let cols = col_ids.len();
    if square && rows == cols && col_ids.iter().zip(&ids).any(|(c, r)| *c != r.as_str()) {
        // Same size, different order or set: permute columns into row order.
        let row_of: HashMap<&str, usize> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.as_str(), i))
            .collect();
        let mut col_to_row = vec![0usize; cols];
        let mut seen = vec![false; rows];
        for (c, col) in col_ids.iter().enumerate() {
            let r = *row_of.get(col).ok_or_else(|| {
                err(
                    header_line,
                    format!("column {col:?} is not one of the row sample IDs"),
                )
            })?;
            if seen[r] {
                return Err(err(header_line, format!("column {col:?} appears twice")));
            }
            seen[r] = true;
            col_to_row[c] = r;
        }
        let mut permuted = vec![0f64; values.len()];
        for r in 0..rows {
            for c in 0..cols {
                permuted[r * cols + col_to_row[c]] = values[r * cols + c];
            }
        }
        values = permuted;
    }
    Ok(TextMatrix {
        ids,
        rows,
        cols,
        values,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsmat_with_empty_corner_and_crlf() {
        let m = parse(
            b"\ta\tb\r\na\t0\t0.5\r\nb\t0.5\t0\r\n",
            Path::new("d.txt"),
            '\t',
            true,
        )
        .unwrap();
        assert_eq!(m.ids, vec!["a", "b"]);
        assert_eq!(m.values, vec![0.0, 0.5, 0.5, 0.0]);
    }

    #[test]
    fn columns_in_another_order_are_permuted() {
        let m = parse(b"id,b,a\na,0.5,0\nb,0,0.5\n", Path::new("d.csv"), ',', true).unwrap();
        assert_eq!(m.values, vec![0.0, 0.5, 0.5, 0.0]);
    }

    #[test]
    fn errors_name_line_sample_and_column() {
        let p = Path::new("d.csv");
        let msg = parse(b",a,b\na,0,x\nb,1,0\n", p, ',', true)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("d.csv:2")
                && msg.contains("\"a\"")
                && msg.contains("\"b\"")
                && msg.contains("\"x\""),
            "{msg}"
        );
        let msg = parse(b",a,b\na,0,1\nb,1\n", p, ',', true)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("d.csv:3") && msg.contains("1 values for 2"),
            "{msg}"
        );
        let msg = parse(b",a,c\na,0,1\nb,1,0\n", p, ',', true)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("d.csv:1") && msg.contains("\"c\""), "{msg}");
        let msg = parse(b"a\tb\n", p, ',', true).unwrap_err().to_string();
        assert!(msg.contains("delimiter"), "{msg}");
    }
}
