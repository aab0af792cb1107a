//! BIOM 2.x (HDF5) through `hdf5-pure`.
//!
//! Reads `sample/ids`, `observation/ids` and the sample-major
//! `sample/matrix/{data,indices,indptr}`; a file with only
//! `observation/matrix` is read from that one instead. Metadata groups are
//! ignored (§2.1: the reference uses none). An empty `ids` dataset is an empty
//! list whatever its datatype (biom writes the ids of a 0 x 0 table as float64).
//!
//! Writes BIOM 2.1 with both matrices (`sample/matrix` and
//! `observation/matrix`, as `ssu` and the biom package read them) and the
//! root attributes the format defines.

use std::path::Path;

use crate::biom::BiomTable;
use crate::error::{Error, Result};
use crate::hdf5_util::{self, H5};

pub(super) fn read(bytes: Vec<u8>, path: &Path) -> Result<BiomTable> {
    let file = H5::open(bytes, path)?;
    let sample_ids = read_ids(&file, "sample/ids")?;
    let observation_ids = read_ids(&file, "observation/ids")?;
    if let Some(shape) = file.shape_attr()? {
        let expected = [observation_ids.len() as u64, sample_ids.len() as u64];
        if shape != expected {
            return Err(Error::InvalidTable {
                path: path.to_path_buf(),
                reason: format!(
                    "the shape attribute says {} x {} but there are {} observation and {} sample IDs",
                    shape[0], shape[1], expected[0], expected[1]
                ),
            });
        }
    }
    if file.has("sample/matrix/indptr") {
        let data = file.read_f64("sample/matrix/data")?;
        let indices = to_u32(
            &file,
            "sample/matrix/indices",
            file.read_i64("sample/matrix/indices")?,
        )?;
        let indptr = to_usize(
            &file,
            "sample/matrix/indptr",
            file.read_i64("sample/matrix/indptr")?,
        )?;
        BiomTable::from_csc(
            path.to_path_buf(),
            sample_ids,
            observation_ids,
            indptr,
            indices,
            data,
        )
    } else if file.has("observation/matrix/indptr") {
        // Observation-major only: expand to triplets and let from_triplets transpose.
        let data = file.read_f64("observation/matrix/data")?;
        let samples = to_u32(
            &file,
            "observation/matrix/indices",
            file.read_i64("observation/matrix/indices")?,
        )?;
        let indptr = to_usize(
            &file,
            "observation/matrix/indptr",
            file.read_i64("observation/matrix/indptr")?,
        )?;
        let invalid = |reason: String| Error::InvalidTable {
            path: path.to_path_buf(),
            reason,
        };
        if indptr.len() != observation_ids.len() + 1 {
            return Err(invalid(format!(
                "observation/matrix/indptr has {} entries for {} observations",
                indptr.len(),
                observation_ids.len()
            )));
        }
        if samples.len() != data.len() || indptr.last() != Some(&data.len()) {
            return Err(invalid(
                "observation/matrix arrays have inconsistent lengths".into(),
            ));
        }
        let mut observations = Vec::with_capacity(data.len());
        for o in 0..observation_ids.len() {
            let (start, end) = (indptr[o], indptr[o + 1]);
            if start > end || end > data.len() {
                return Err(invalid(format!(
                    "observation/matrix/indptr is not monotone at observation {o}"
                )));
            }
            observations.extend(std::iter::repeat_n(o as u32, end - start));
        }
        BiomTable::from_triplets(
            path,
            sample_ids,
            observation_ids,
            &observations,
            &samples,
            &data,
        )
    } else if sample_ids.is_empty() && observation_ids.is_empty() {
        BiomTable::from_csc(path.to_path_buf(), vec![], vec![], vec![0], vec![], vec![])
    } else {
        Err(Error::InvalidTable {
            path: path.to_path_buf(),
            reason: "neither sample/matrix nor observation/matrix is present".into(),
        })
    }
}

/// The table as a BIOM 2.1 HDF5 image.
pub(super) fn write(table: &BiomTable) -> Result<Vec<u8>> {
    let n_obs = table.observation_ids.len();
    let n_samples = table.sample_ids.len();
    let too_big = || Error::InvalidTable {
        path: table.source.clone(),
        reason: "more than 2^31 entries do not fit BIOM 2.1's int32 indices".into(),
    };
    let int = |v: usize| i32::try_from(v).map_err(|_| too_big());
    // Observation-major copy (CSR over observations).
    let mut obs_ptr = vec![0usize; n_obs + 1];
    for &o in &table.indices {
        obs_ptr[o as usize + 1] += 1;
    }
    for o in 0..n_obs {
        obs_ptr[o + 1] += obs_ptr[o];
    }
    let mut fill = obs_ptr.clone();
    let mut obs_indices = vec![0i32; table.indices.len()];
    let mut obs_data = vec![0f64; table.indices.len()];
    for s in 0..n_samples {
        for k in table.indptr[s]..table.indptr[s + 1] {
            let o = table.indices[k] as usize;
            obs_indices[fill[o]] = int(s)?;
            obs_data[fill[o]] = table.data[k];
            fill[o] += 1;
        }
    }
    let sample_indices: Vec<i32> = table.indices.iter().map(|&o| o as i32).collect();
    let sample_ptr = table
        .indptr
        .iter()
        .map(|&p| int(p))
        .collect::<Result<Vec<_>>>()?;
    let obs_ptr = obs_ptr.into_iter().map(int).collect::<Result<Vec<_>>>()?;
    use hdf5_pure::AttrValue;
    let mut b = hdf5_pure::FileBuilder::new();
    let name = table
        .source
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    b.set_attr("id", AttrValue::String(name));
    b.set_attr("type", AttrValue::String("OTU table".into()));
    b.set_attr(
        "format-url",
        AttrValue::String("http://biom-format.org".into()),
    );
    b.set_attr("format-version", AttrValue::I32Array(vec![2, 1]));
    b.set_attr("generated-by", AttrValue::String("aam-rs".into()));
    b.set_attr("creation-date", AttrValue::String(utc_now()));
    b.set_attr(
        "shape",
        AttrValue::I32Array(vec![int(n_obs)?, int(n_samples)?]),
    );
    b.set_attr("nnz", AttrValue::I32(int(table.data.len())?));
    let axes: [(&str, &[String], &[f64], &[i32], &[i32]); 2] = [
        (
            "observation",
            &table.observation_ids,
            &obs_data,
            &obs_indices,
            &obs_ptr,
        ),
        (
            "sample",
            &table.sample_ids,
            &table.data,
            &sample_indices,
            &sample_ptr,
        ),
    ];
    let mut groups = Vec::new();
    for (axis, axis_ids, data, indices, indptr) in axes {
        let mut g = b.create_group(axis);
        let axis_ids: Vec<&str> = axis_ids.iter().map(String::as_str).collect();
        g.create_dataset("ids").with_vlen_strings(&axis_ids);
        let mut m = g.create_group("matrix");
        m.create_dataset("data").with_f64_data(data);
        m.create_dataset("indices").with_i32_data(indices);
        m.create_dataset("indptr").with_i32_data(indptr);
        g.add_group(m.finish());
        groups.push(g.finish());
    }
    for g in groups {
        b.add_group(g);
    }
    b.finish().map_err(|e| Error::Hdf5 {
        path: table.source.clone(),
        object: "/".into(),
        message: format!("writing BIOM 2.1: {e}"),
    })
}

/// The current UTC time as ISO 8601 (`YYYY-MM-DDTHH:MM:SS`).
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn read_ids(file: &H5, object: &str) -> Result<Vec<String>> {
    if file.len(object)? == 0 {
        return Ok(Vec::new());
    }
    file.read_strings(object)
}

fn to_u32(file: &H5, object: &str, values: Vec<i64>) -> Result<Vec<u32>> {
    values
        .into_iter()
        .map(|v| u32::try_from(v).map_err(|_| hdf5_util::bad_value(file, object, v)))
        .collect()
}

fn to_usize(file: &H5, object: &str, values: Vec<i64>) -> Result<Vec<usize>> {
    values
        .into_iter()
        .map(|v| usize::try_from(v).map_err(|_| hdf5_util::bad_value(file, object, v)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BIOM 2.1-like image: ids, and one compressed matrix under `axis`
    /// ("sample" or "observation"); `matrix = None` writes no matrix at all.
    fn biom_h5(
        samples: &[&str],
        observations: &[&str],
        axis: &str,
        matrix: Option<(&[f64], &[i32], &[i32])>,
    ) -> Vec<u8> {
        let mut b = hdf5_pure::FileBuilder::new();
        let mut groups = Vec::new();
        for (name, ids) in [("sample", samples), ("observation", observations)] {
            let mut g = b.create_group(name);
            g.create_dataset("ids").with_vlen_strings(ids);
            if let (true, Some((data, indices, indptr))) = (name == axis, matrix) {
                let mut m = g.create_group("matrix");
                m.create_dataset("data").with_f64_data(data);
                m.create_dataset("indices").with_i32_data(indices);
                m.create_dataset("indptr").with_i32_data(indptr);
                g.add_group(m.finish());
            }
            groups.push(g.finish());
        }
        for g in groups {
            b.add_group(g);
        }
        b.finish().unwrap()
    }

    #[test]
    fn written_tables_read_back_and_carry_both_axes() {
        let t = BiomTable::from_triplets(
            "w.biom",
            vec!["s1".into(), "s2".into()],
            vec!["o1".into(), "o2".into(), "o3".into()],
            &[0, 2, 1, 2],
            &[0, 0, 1, 1],
            &[1.0, 2.0, 4.0, 8.0],
        )
        .unwrap();
        let bytes = write(&t).unwrap();
        let back = BiomTable::from_bytes(&bytes, Path::new("w.biom")).unwrap();
        assert_eq!(back.sample_ids(), t.sample_ids());
        assert_eq!(back.observation_ids(), t.observation_ids());
        for s in 0..2 {
            assert_eq!(back.sample(s).observations, t.sample(s).observations);
            assert_eq!(back.sample(s).counts, t.sample(s).counts);
        }
        let file = H5::open(bytes, Path::new("w.biom")).unwrap();
        assert_eq!(
            file.read_i64("observation/matrix/indptr").unwrap(),
            [0, 1, 2, 4]
        );
        assert_eq!(
            file.read_i64("observation/matrix/indices").unwrap(),
            [0, 1, 0, 1]
        );
        assert_eq!(
            file.read_f64("observation/matrix/data").unwrap(),
            [1.0, 4.0, 2.0, 8.0]
        );
        let date = utc_now();
        assert!(date.starts_with("20") && date.len() == 19, "{date}");
    }

    #[test]
    fn observation_major_only_files_are_transposed() {
        // o1 = {s1: 1, s3: 2}, o2 = {s2: 4}.
        let bytes = biom_h5(
            &["s1", "s2", "s3"],
            &["o1", "o2"],
            "observation",
            Some((&[1.0, 2.0, 4.0], &[0, 2, 1], &[0, 2, 3])),
        );
        let t = BiomTable::from_bytes(&bytes, Path::new("o.biom")).unwrap();
        assert_eq!(t.sample_ids(), &["s1", "s2", "s3"]);
        assert_eq!(t.sample(0).observations, &[0]);
        assert_eq!(t.sample(1).observations, &[1]);
        assert_eq!(t.sample(1).counts, &[4.0]);
        assert_eq!(t.sample(2).counts, &[2.0]);
    }

    #[test]
    fn inconsistent_arrays_are_errors_naming_the_file() {
        let bytes = biom_h5(
            &["s1", "s2"],
            &["o1"],
            "sample",
            Some((&[1.0, 2.0], &[0, 5], &[0, 1, 2])),
        );
        let err = BiomTable::from_bytes(&bytes, Path::new("bad.biom")).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("bad.biom")
                && msg.contains("\"s2\"")
                && msg.contains("index 5 out of range"),
            "{msg}"
        );

        let bytes = biom_h5(&["s1"], &["o1"], "sample", Some((&[1.0], &[-1], &[0, 1])));
        let err = BiomTable::from_bytes(&bytes, Path::new("neg.biom")).unwrap_err();
        assert!(
            matches!(err, Error::Hdf5 { .. }) && err.to_string().contains("neg.biom"),
            "{err}"
        );

        let bytes = biom_h5(&["s1"], &["o1"], "sample", Some((&[1.0], &[0], &[0, 2])));
        let err = BiomTable::from_bytes(&bytes, Path::new("indptr.biom")).unwrap_err();
        assert!(err.to_string().contains("indptr runs from 0 to 2"), "{err}");

        let bytes = biom_h5(&["s1"], &["o1"], "sample", None);
        let err = BiomTable::from_bytes(&bytes, Path::new("nomatrix.biom")).unwrap_err();
        assert!(
            err.to_string()
                .contains("neither sample/matrix nor observation/matrix"),
            "{err}"
        );
    }

    #[test]
    fn truncated_hdf5_is_an_error_not_a_panic() {
        let full = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/data/fixtures/biom-format/min_sparse_otu_table_hdf5.biom"
        ));
        let Ok(full) = full else {
            eprintln!("note: ../shared/data is absent; skipping");
            return;
        };
        for cut in [8usize, 64, 512, 2048, full.len() / 2] {
            let result = BiomTable::from_bytes(&full[..cut], Path::new("cut.biom"));
            let err = result.expect_err("a truncated file must not parse");
            assert!(err.to_string().contains("cut.biom"), "{err}");
        }
    }
}
