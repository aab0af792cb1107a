//! §2.7 Sample metadata (tab-separated).
//!
//! The sample ID is the **first column, whatever its header** (`#SampleID` in
//! QIIME 1 mapping files, `sample_name` from Qiita, `sample_id`, `id`, ...);
//! the reference insists on a column literally named `sample_id`. A UTF-8 BOM
//! is stripped; header names and values are whitespace-trimmed; a value
//! wrapped in double quotes is unquoted. After the header, lines whose first
//! cell starts with `#` are skipped (QIIME 2's `#q2:types` directives and
//! comments). Short rows are padded with missing values; extra non-empty
//! fields are an error naming the line.
//!
//! Missing values: pandas' default NA strings (empty, `NA`, `NaN`, `nan`,
//! `N/A`, `null`, `None`, ...) and the INSDC/Qiita missing-value vocabulary
//! (`not applicable`, `not collected`, `not provided`, `restricted access`,
//! `missing: ...`, any case). The reference would fail on the latter with
//! `float()`; treating them as missing is deliberate.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// pandas' default NA strings (case-sensitive, as pandas).
const PANDAS_NA: [&str; 19] = [
    "", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
    "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null",
];

/// INSDC / Qiita missing-value terms (case-insensitive).
const INSDC_NA: [&str; 4] = [
    "not applicable",
    "not collected",
    "not provided",
    "restricted access",
];

/// True when a (trimmed) cell means "no value".
pub fn is_missing(value: &str) -> bool {
    if PANDAS_NA.contains(&value) {
        return true;
    }
    let lower = value.to_ascii_lowercase();
    INSDC_NA.contains(&lower.as_str()) || lower.starts_with("missing:")
}

/// A metadata table: one row per sample, string cells, missing values as `None`.
#[derive(Debug, Clone)]
pub struct Metadata {
    source: PathBuf,
    id_column: String,
    columns: Vec<String>,
    ids: Vec<String>,
    lines: Vec<usize>,
    cells: Vec<Option<String>>,
    index: HashMap<String, usize>,
}

fn unquote(s: &str) -> &str {
    let s = s.trim();
    s.strip_prefix('"')
        .and_then(|x| x.strip_suffix('"'))
        .map(str::trim)
        .unwrap_or(s)
}

impl Metadata {
    /// Read a metadata TSV.
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_bytes(&bytes, path)
    }

    /// Parse metadata held in memory; `path` is only used in error messages.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        let err = |line: usize, reason: String| Error::MetadataFormat {
            path: path.to_path_buf(),
            line,
            reason,
        };
        if bytes.is_empty() {
            return Err(Error::EmptyFile {
                path: path.to_path_buf(),
            });
        }
        let text = std::str::from_utf8(bytes).map_err(|e| {
            let line = bytes[..e.valid_up_to()]
                .iter()
                .filter(|&&b| b == b'\n')
                .count()
                + 1;
            err(line, "not UTF-8 text".into())
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
        let mut names: Vec<String> = header.split('\t').map(|h| unquote(h).to_string()).collect();
        // Trailing empty header cells (spreadsheet exports) are not columns.
        while names.len() > 1 && names.last().is_some_and(|n| n.is_empty()) {
            names.pop();
        }
        if names.len() < 2
            && !header.contains('\t')
            && (header.contains(',') || header.contains(';'))
        {
            return Err(err(
                header_line,
                "the header has no tab; metadata must be tab-separated".into(),
            ));
        }
        let id_column = names.remove(0);
        for (k, name) in names.iter_mut().enumerate() {
            if name.is_empty() {
                *name = format!("Unnamed: {}", k + 1);
            }
        }
        let mut seen = HashMap::new();
        for name in std::iter::once(&id_column).chain(&names) {
            if seen.insert(name.as_str(), ()).is_some() {
                return Err(err(
                    header_line,
                    format!("column {name:?} appears twice in the header"),
                ));
            }
        }
        let n_cols = names.len();
        let mut ids = Vec::new();
        let mut row_lines = Vec::new();
        let mut cells = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        for (line_no, line) in lines {
            let mut fields = line.split('\t');
            let id = unquote(fields.next().unwrap_or(""));
            if id.starts_with('#') {
                continue;
            }
            if id.is_empty() {
                return Err(err(line_no, "empty sample ID in the first column".into()));
            }
            let mut k = 0;
            for field in fields {
                let value = unquote(field);
                if k < n_cols {
                    cells.push(if is_missing(value) {
                        None
                    } else {
                        Some(value.to_string())
                    });
                } else if !value.is_empty() {
                    return Err(err(
                        line_no,
                        format!(
                            "sample {id:?}: more fields than the {} header columns",
                            n_cols + 1
                        ),
                    ));
                }
                k += 1;
            }
            for _ in k..n_cols {
                cells.push(None);
            }
            if let Some(&first) = index.get(id) {
                return Err(Error::DuplicateSample {
                    path: path.to_path_buf(),
                    id: id.to_string(),
                    first_line: row_lines[first],
                    line: line_no,
                });
            }
            index.insert(id.to_string(), ids.len());
            ids.push(id.to_string());
            row_lines.push(line_no);
        }
        Ok(Self {
            source: path.to_path_buf(),
            id_column,
            columns: names,
            ids,
            lines: row_lines,
            cells,
            index,
        })
    }

    /// A table built in memory (a service's request): `rows` of a sample ID
    /// and, per column of `columns`, a value or `None`; values that read as
    /// missing in a file (`NA`, empty, ...) are missing here too. `source`
    /// names it in errors; a sample ID given twice is an error.
    pub fn from_rows(
        source: PathBuf,
        id_column: String,
        columns: Vec<String>,
        rows: Vec<(String, Vec<Option<String>>)>,
    ) -> Result<Self> {
        let mut table = Self {
            source,
            id_column,
            columns,
            ids: Vec::with_capacity(rows.len()),
            lines: Vec::with_capacity(rows.len()),
            cells: Vec::new(),
            index: HashMap::new(),
        };
        for (k, (id, mut values)) in rows.into_iter().enumerate() {
            if let Some(&first) = table.index.get(&id) {
                return Err(Error::DuplicateSample {
                    path: table.source,
                    id,
                    first_line: table.lines[first],
                    line: k + 1,
                });
            }
            values.resize(table.columns.len(), None);
            table.cells.extend(
                values
                    .into_iter()
                    .map(|v| v.filter(|v| !is_missing(v.trim()))),
            );
            table.index.insert(id.clone(), table.ids.len());
            table.ids.push(id);
            table.lines.push(k + 1);
        }
        Ok(table)
    }

    /// The rows of `tables` in one table, in order: every column of any of
    /// them (in first-seen order), missing where a table lacks it. The ID
    /// column and source are the first table's. A sample in two tables is an
    /// error.
    pub fn concat(tables: &[&Metadata]) -> Result<Self> {
        let mut columns: Vec<String> = Vec::new();
        for table in tables {
            for c in &table.columns {
                if !columns.contains(c) {
                    columns.push(c.clone());
                }
            }
        }
        let rows = tables
            .iter()
            .flat_map(|table| {
                let at: Vec<Option<usize>> = columns
                    .iter()
                    .map(|c| table.columns.iter().position(|x| x == c))
                    .collect();
                (0..table.len()).map(move |row| {
                    let values = at
                        .iter()
                        .map(|c| c.and_then(|c| table.value(row, c)).map(str::to_string))
                        .collect();
                    (table.ids[row].clone(), values)
                })
            })
            .collect();
        let first = tables.first();
        Self::from_rows(
            first.map_or_else(PathBuf::new, |t| t.source.clone()),
            first.map_or_else(|| "sample_id".into(), |t| t.id_column.clone()),
            columns,
            rows,
        )
    }

    /// The file read.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The header of the first (ID) column, as written.
    pub fn id_column(&self) -> &str {
        &self.id_column
    }

    /// The other columns' names, trimmed.
    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// Sample IDs in file order.
    pub fn sample_ids(&self) -> &[String] {
        &self.ids
    }

    /// Number of samples (rows).
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True when there is no row.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The row of a sample.
    pub fn row(&self, sample_id: &str) -> Option<usize> {
        self.index.get(sample_id).copied()
    }

    /// The 1-based line of a row in the file.
    pub fn line(&self, row: usize) -> usize {
        self.lines[row]
    }

    /// The index of a column by name (the name is trimmed first); the error
    /// lists the columns present.
    pub fn column(&self, name: &str) -> Result<usize> {
        let name = name.trim();
        self.columns
            .iter()
            .position(|c| c == name)
            .ok_or_else(|| Error::ColumnNotFound {
                path: self.source.clone(),
                column: name.to_string(),
                available: self.columns.clone(),
            })
    }

    /// The value of a cell; `None` when missing.
    ///
    /// # Panics
    /// If `row` or `column` is out of range (a programmer error).
    pub fn value(&self, row: usize, column: usize) -> Option<&str> {
        assert!(column < self.columns.len(), "column {column} out of range");
        self.cells[row * self.columns.len() + column].as_deref()
    }

    /// A numeric column: one entry per row, `None` where missing. A value that
    /// is not a finite number is an error naming sample, column and line.
    pub fn numeric(&self, column: &str) -> Result<Vec<Option<f64>>> {
        let c = self.column(column)?;
        (0..self.len())
            .map(|row| match self.value(row, c) {
                None => Ok(None),
                Some(text) => match text.parse::<f64>() {
                    Ok(v) if v.is_finite() => Ok(Some(v)),
                    _ => Err(Error::NonNumericTarget {
                        path: self.source.clone(),
                        sample: self.ids[row].clone(),
                        column: self.columns[c].clone(),
                        line: self.lines[row],
                        value: text.to_string(),
                    }),
                },
            })
            .collect()
    }

    /// The per-category key of a row, `"col1=v1,col2=v2"` (§2.8; a missing
    /// value reads `nan`, as pandas' `astype(str)` writes it in the reference).
    pub fn category_key(&self, row: usize, columns: &[usize]) -> String {
        let mut key = String::new();
        for (k, &c) in columns.iter().enumerate() {
            if k > 0 {
                key.push(',');
            }
            key.push_str(&self.columns[c]);
            key.push('=');
            key.push_str(self.value(row, c).unwrap_or("nan"));
        }
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Metadata> {
        Metadata::from_bytes(text.as_bytes(), Path::new("meta.tsv"))
    }

    /// Tables built in memory: missing spellings read as missing; `concat`
    /// keeps the rows in order under every column of either table; a sample
    /// in both is an error.
    #[test]
    fn rows_in_memory_and_their_concatenation() {
        let a = Metadata::from_rows(
            "a".into(),
            "sample_id".into(),
            vec!["site".into(), "age".into()],
            vec![
                ("s1".into(), vec![Some("tongue".into()), Some("NA".into())]),
                ("s2".into(), vec![Some("gut".into())]),
            ],
        )
        .unwrap();
        assert_eq!(a.value(0, 1), None);
        assert_eq!(a.value(1, 1), None);
        let b = Metadata::from_rows(
            "b".into(),
            "sample_id".into(),
            vec!["smoker".into(), "site".into()],
            vec![("s3".into(), vec![Some("yes".into()), Some("skin".into())])],
        )
        .unwrap();
        let ab = Metadata::concat(&[&a, &b]).unwrap();
        assert_eq!(ab.sample_ids(), ["s1", "s2", "s3"]);
        assert_eq!(ab.columns(), ["site", "age", "smoker"]);
        assert_eq!(ab.value(2, 0), Some("skin"));
        assert_eq!(ab.value(2, 2), Some("yes"));
        assert_eq!(ab.value(0, 2), None);
        assert_eq!(ab.row("s2"), Some(1));
        assert!(matches!(
            Metadata::concat(&[&a, &a]),
            Err(Error::DuplicateSample { .. })
        ));
    }

    #[test]
    fn first_column_is_the_id_whatever_its_name() {
        for header in ["#SampleID", "sample_name", "sample_id", "id", ""] {
            let m = parse(&format!("{header}\tage\ns1\t3\ns2\t4\n")).unwrap();
            assert_eq!(m.id_column(), header);
            assert_eq!(m.sample_ids(), &["s1".to_string(), "s2".to_string()]);
            assert_eq!(m.numeric("age").unwrap(), vec![Some(3.0), Some(4.0)]);
        }
    }

    #[test]
    fn bom_whitespace_quotes_crlf_and_directives() {
        let m = parse("\u{feff} sample_id \t  age \t site\r\n#q2:types\tnumeric\tcategorical\r\n s1 \t 3.5 \t\"gut\"\r\n\r\ns2\tNA\tnot provided\r\n").unwrap();
        assert_eq!(m.id_column(), "sample_id");
        assert_eq!(m.columns(), &["age".to_string(), "site".to_string()]);
        assert_eq!(m.sample_ids(), &["s1".to_string(), "s2".to_string()]);
        assert_eq!(m.numeric(" age ").unwrap(), vec![Some(3.5), None]);
        let site = m.column("site").unwrap();
        assert_eq!(m.value(0, site), Some("gut"));
        assert_eq!(m.value(1, site), None);
        assert_eq!(m.line(1), 5);
    }

    #[test]
    fn short_rows_padded_trailing_tabs_tolerated() {
        let m = parse("id\ta\tb\t\ns1\t1\ns2\t1\t2\t\t\n").unwrap();
        assert_eq!(m.columns().len(), 2);
        assert_eq!(m.value(0, 1), None);
        assert_eq!(m.value(1, 1), Some("2"));
    }

    #[test]
    fn missing_value_vocabulary() {
        for v in [
            "",
            "NA",
            "nan",
            "NaN",
            "N/A",
            "null",
            "None",
            "Not Provided",
            "not applicable",
            "missing: not collected",
            "restricted access",
        ] {
            assert!(is_missing(v), "{v:?}");
        }
        for v in ["0", "none of these", "gut", "na"] {
            assert!(!is_missing(v), "{v:?}");
        }
    }

    #[test]
    fn non_numeric_target_names_sample_column_and_line() {
        let m = parse("#SampleID\tage\ns1\t3\ns2\tforty\n").unwrap();
        let err = m.numeric("age").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("meta.tsv:3")
                && msg.contains("\"s2\"")
                && msg.contains("\"age\"")
                && msg.contains("\"forty\""),
            "{msg}"
        );
        let m = parse("#SampleID\tage\ns1\tinf\n").unwrap();
        assert!(matches!(
            m.numeric("age"),
            Err(Error::NonNumericTarget { line: 2, .. })
        ));
    }

    #[test]
    fn structural_errors() {
        let err = parse("id\tage\ns1\t1\ns1\t2\n").unwrap_err();
        assert!(
            matches!(
                err,
                Error::DuplicateSample {
                    first_line: 2,
                    line: 3,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("\"s1\""));
        let err = parse("id\tage\ns1\t1\t7\n").unwrap_err();
        assert!(err.to_string().contains("meta.tsv:2"), "{err}");
        let err = parse("id\tage\tage\n").unwrap_err();
        assert!(err.to_string().contains("\"age\" appears twice"), "{err}");
        let err = parse("id,age\ns1,2\n").unwrap_err();
        assert!(err.to_string().contains("tab-separated"), "{err}");
        let err = parse("id\tage\n\t3\n").unwrap_err();
        assert!(
            err.to_string().contains("meta.tsv:2: empty sample ID"),
            "{err}"
        );
        let m = parse("id\tage\ns1\t1\n").unwrap();
        let err = m.column("agee").unwrap_err();
        assert!(
            err.to_string().contains("\"agee\"") && err.to_string().contains("[\"age\"]"),
            "{err}"
        );
        assert!(matches!(
            Metadata::from_bytes(b"", Path::new("m.tsv")),
            Err(Error::EmptyFile { .. })
        ));
    }

    #[test]
    fn category_keys() {
        let m = parse("id\tsite\tseason\ns1\tgut\tNA\n").unwrap();
        assert_eq!(m.category_key(0, &[0, 1]), "site=gut,season=nan");
    }
}
