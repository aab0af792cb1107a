//! `.npy` arrays (format 1.0-3.0) and `.npz` archives of them.
//!
//! Only what distance matrices and their IDs need: little/big-endian f4/f8
//! (and integer arrays, widened to f64), fixed-width unicode (`<U`) and byte
//! (`|S`) strings. Object arrays are refused: loading them would mean
//! unpickling, which the reference allows and we do not.

use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};

/// The values of an array.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Values {
    /// 4-byte floats.
    F32(Vec<f32>),
    /// 8-byte floats (and integers, widened).
    F64(Vec<f64>),
    /// Strings.
    Str(Vec<String>),
}

/// A parsed array, always in C (row-major) order.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Array {
    pub shape: Vec<usize>,
    pub values: Values,
}

/// Parse one `.npy` image; `what` names it in errors (the file, or an archive key).
pub(crate) fn parse(bytes: &[u8], path: &Path, what: &str) -> Result<Array> {
    let err = |reason: String| Error::Npy {
        path: path.to_path_buf(),
        what: what.to_string(),
        reason,
    };
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(err("not a .npy array (missing the \\x93NUMPY magic)".into()));
    }
    let (header_len, header_start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10usize),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err(err("truncated header".into()));
            }
            (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            )
        }
        v => return Err(err(format!("unsupported .npy format version {v}"))),
    };
    let data_start = header_start
        .checked_add(header_len)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| err("truncated header".into()))?;
    let header = std::str::from_utf8(&bytes[header_start..data_start])
        .map_err(|_| err("header is not text".into()))?;
    let descr = header_value(header, "descr")
        .ok_or_else(|| err(format!("no 'descr' in header {header:?}")))?;
    let descr = unquote(descr).ok_or_else(|| {
        err(format!(
            "unsupported dtype {descr} (structured arrays are not distance matrices)"
        ))
    })?;
    let fortran = match header_value(header, "fortran_order") {
        Some(v) if v.starts_with("True") => true,
        Some(v) if v.starts_with("False") => false,
        _ => return Err(err(format!("no 'fortran_order' in header {header:?}"))),
    };
    let shape = header_value(header, "shape")
        .and_then(parse_shape)
        .ok_or_else(|| err(format!("bad 'shape' in header {header:?}")))?;
    let count = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| err("shape overflows".into()))?;
    let data = &bytes[data_start..];

    if descr
        .trim_start_matches(['<', '>', '|', '='])
        .starts_with('O')
    {
        return Err(err(format!(
            "unsupported dtype {descr:?} (object arrays would need unpickling)"
        )));
    }
    let (order, kind, width) =
        split_descr(descr).ok_or_else(|| err(format!("unsupported dtype {descr:?}")))?;
    let expected = count
        .checked_mul(width)
        .ok_or_else(|| err("shape overflows".into()))?;
    if data.len() != expected {
        return Err(err(format!(
            "{} data bytes for shape {shape:?} of {descr} (expected {expected})",
            data.len()
        )));
    }
    let big = order == '>';
    let values = match (kind, width) {
        ('f', 4) => Values::F32(
            data.chunks_exact(4)
                .map(|c| {
                    let b = [c[0], c[1], c[2], c[3]];
                    if big {
                        f32::from_be_bytes(b)
                    } else {
                        f32::from_le_bytes(b)
                    }
                })
                .collect(),
        ),
        ('f', 8) => Values::F64(
            data.chunks_exact(8)
                .map(|c| {
                    let b: [u8; 8] = [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]];
                    if big {
                        f64::from_be_bytes(b)
                    } else {
                        f64::from_le_bytes(b)
                    }
                })
                .collect(),
        ),
        ('i' | 'u', 1 | 2 | 4 | 8) => Values::F64(
            data.chunks_exact(width)
                .map(|c| int_value(c, kind == 'i', big))
                .collect(),
        ),
        ('U', _) if width % 4 == 0 => {
            let mut out = Vec::with_capacity(count);
            for c in data.chunks_exact(width.max(4)).take(count) {
                let mut s = String::new();
                for u in c.chunks_exact(4) {
                    let b = [u[0], u[1], u[2], u[3]];
                    let code = if big {
                        u32::from_be_bytes(b)
                    } else {
                        u32::from_le_bytes(b)
                    };
                    if code == 0 {
                        break;
                    }
                    s.push(
                        char::from_u32(code)
                            .ok_or_else(|| err(format!("invalid unicode code point {code:#x}")))?,
                    );
                }
                out.push(s);
            }
            if width == 0 {
                out = vec![String::new(); count];
            }
            Values::Str(out)
        }
        ('S', _) => {
            let mut out = Vec::with_capacity(count);
            if width == 0 {
                out = vec![String::new(); count];
            } else {
                for c in data.chunks_exact(width) {
                    let end = c.iter().position(|&b| b == 0).unwrap_or(c.len());
                    out.push(
                        String::from_utf8(c[..end].to_vec())
                            .map_err(|_| err("a byte string is not UTF-8".into()))?,
                    );
                }
            }
            Values::Str(out)
        }
        _ => {
            return Err(err(format!(
                "unsupported dtype {descr:?} (object arrays would need unpickling)"
            )))
        }
    };
    let mut array = Array { shape, values };
    if fortran && array.shape.len() > 1 {
        to_c_order(&mut array);
    }
    Ok(array)
}

/// Read every member of a `.npz` archive: (key without ".npy", array).
pub(crate) fn parse_npz(bytes: &[u8], path: &Path) -> Result<Vec<(String, Array)>> {
    let zip_err = |reason: String| Error::Npy {
        path: path.to_path_buf(),
        what: "archive".into(),
        reason,
    };
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(bytes))
        .map_err(|e| zip_err(format!("not a valid .npz (zip) archive: {e}")))?;
    let mut out = Vec::with_capacity(archive.len());
    for i in 0..archive.len() {
        let mut entry = archive
            .by_index(i)
            .map_err(|e| zip_err(format!("member {i}: {e}")))?;
        let name = entry.name().to_string();
        let key = name.strip_suffix(".npy").unwrap_or(&name).to_string();
        let what = format!("archive key {key:?}");
        // The declared size is only a capacity hint (bounded, so a lying header cannot exhaust memory up front).
        let mut buf = Vec::with_capacity((entry.size() as usize).min(1 << 24));
        entry.read_to_end(&mut buf).map_err(|e| Error::Npy {
            path: path.to_path_buf(),
            what: what.clone(),
            reason: format!("cannot decompress: {e}"),
        })?;
        out.push((key, parse(&buf, path, &what)?));
    }
    Ok(out)
}

fn int_value(c: &[u8], signed: bool, big: bool) -> f64 {
    let mut b = [0u8; 8];
    let n = c.len();
    if big {
        b[8 - n..].copy_from_slice(c);
        b.reverse();
    } else {
        b[..n].copy_from_slice(c);
    }
    // Sign-extend.
    if signed && b[n - 1] & 0x80 != 0 {
        for x in &mut b[n..] {
            *x = 0xff;
        }
    }
    if signed {
        i64::from_le_bytes(b) as f64
    } else {
        u64::from_le_bytes(b) as f64
    }
}

/// Transpose an N-d Fortran-order array into C order (2-D is all we need).
fn to_c_order(array: &mut Array) {
    if array.shape.len() != 2 {
        return;
    }
    let (rows, cols) = (array.shape[0], array.shape[1]);
    fn transpose<T: Clone>(v: &[T], rows: usize, cols: usize) -> Vec<T> {
        // Fortran: element (r, c) at c * rows + r.
        let mut out = Vec::with_capacity(v.len());
        for r in 0..rows {
            for c in 0..cols {
                out.push(v[c * rows + r].clone());
            }
        }
        out
    }
    array.values = match &array.values {
        Values::F32(v) => Values::F32(transpose(v, rows, cols)),
        Values::F64(v) => Values::F64(transpose(v, rows, cols)),
        Values::Str(v) => Values::Str(transpose(v, rows, cols)),
    };
}

/// `'<f8'` -> ('<', 'f', 8); `'<U12'` -> ('<', 'U', 48).
fn split_descr(descr: &str) -> Option<(char, char, usize)> {
    let mut chars = descr.chars();
    let mut order = chars.next()?;
    let kind;
    if matches!(order, '<' | '>' | '|' | '=') {
        kind = chars.next()?;
    } else {
        kind = order;
        order = '=';
    }
    let n: usize = chars.as_str().parse().ok()?;
    let order = if order == '=' || order == '|' {
        if cfg!(target_endian = "big") {
            '>'
        } else {
            '<'
        }
    } else {
        order
    };
    let width = if kind == 'U' { n.checked_mul(4)? } else { n };
    Some((order, kind, width))
}

/// The raw text after `'key':` up to the next top-level comma or brace.
fn header_value<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let at = header
        .find(&format!("'{key}'"))
        .or_else(|| header.find(&format!("\"{key}\"")))?;
    let rest = &header[at + key.len() + 2..];
    let rest = rest.trim_start().strip_prefix(':')?.trim_start();
    Some(rest)
}

fn unquote(v: &str) -> Option<&str> {
    let q = v.chars().next()?;
    if q != '\'' && q != '"' {
        return None;
    }
    let end = v[1..].find(q)?;
    Some(&v[1..1 + end])
}

fn parse_shape(v: &str) -> Option<Vec<usize>> {
    let inner = v.strip_prefix('(')?;
    let inner = &inner[..inner.find(')')?];
    inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches('L').parse().ok())
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Build a version-1.0 .npy image.
    pub(crate) fn npy(descr: &str, fortran: bool, shape: &[usize], data: &[u8]) -> Vec<u8> {
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        let shape_text = if shape.len() == 1 {
            format!("({},)", dims[0])
        } else {
            format!("({})", dims.join(", "))
        };
        let mut header = format!(
            "{{'descr': '{descr}', 'fortran_order': {}, 'shape': {shape_text}, }}",
            if fortran { "True" } else { "False" }
        );
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    pub(crate) fn f64_bytes(v: &[f64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn reads_f8_f4_big_endian_and_fortran_order() {
        let p = Path::new("m.npy");
        let a = parse(
            &npy("<f8", false, &[2, 2], &f64_bytes(&[0.0, 1.0, 2.0, 0.0])),
            p,
            "m",
        )
        .unwrap();
        assert_eq!(a.shape, vec![2, 2]);
        assert_eq!(a.values, Values::F64(vec![0.0, 1.0, 2.0, 0.0]));
        let f4: Vec<u8> = [0.5f32, 1.5].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(
            parse(&npy("<f4", false, &[2], &f4), p, "m").unwrap().values,
            Values::F32(vec![0.5, 1.5])
        );
        let be: Vec<u8> = [3.0f64].iter().flat_map(|x| x.to_be_bytes()).collect();
        assert_eq!(
            parse(&npy(">f8", false, &[1], &be), p, "m").unwrap().values,
            Values::F64(vec![3.0])
        );
        // Fortran order: stored column by column.
        let a = parse(
            &npy("<f8", true, &[2, 2], &f64_bytes(&[0.0, 1.0, 2.0, 0.0])),
            p,
            "m",
        )
        .unwrap();
        assert_eq!(a.values, Values::F64(vec![0.0, 2.0, 1.0, 0.0]));
        let ints: Vec<u8> = [-2i32, 7].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(
            parse(&npy("<i4", false, &[2], &ints), p, "m")
                .unwrap()
                .values,
            Values::F64(vec![-2.0, 7.0])
        );
    }

    #[test]
    fn reads_unicode_and_byte_strings() {
        let p = Path::new("ids.npy");
        let mut data = Vec::new();
        for s in ["ab", "c"] {
            let mut units: Vec<u32> = s.chars().map(|c| c as u32).collect();
            units.resize(3, 0);
            data.extend(units.iter().flat_map(|u| u.to_le_bytes()));
        }
        assert_eq!(
            parse(&npy("<U3", false, &[2], &data), p, "k")
                .unwrap()
                .values,
            Values::Str(vec!["ab".into(), "c".into()])
        );
        assert_eq!(
            parse(&npy("|S2", false, &[2], b"x\0yz"), p, "k")
                .unwrap()
                .values,
            Values::Str(vec!["x".into(), "yz".into()])
        );
    }

    #[test]
    fn malformed_arrays_are_errors_naming_the_file() {
        let p = Path::new("bad.npy");
        for (bytes, expect) in [
            (b"\x93NUMPY".to_vec(), "missing the"),
            (b"PK\x03\x04xxxxxxxxxxxxxxxx".to_vec(), "missing the"),
            (
                npy("<f8", false, &[3, 3], &f64_bytes(&[0.0; 4])),
                "32 data bytes",
            ),
            (npy("|O", false, &[2], &[0u8; 16]), "object arrays"),
            (npy("<c16", false, &[1], &[0u8; 16]), "unsupported dtype"),
        ] {
            let err = parse(&bytes, p, "bad.npy").unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains("bad.npy") && msg.contains(expect), "{msg}");
        }
        let mut header_too_long = npy("<f8", false, &[1], &f64_bytes(&[1.0]));
        header_too_long[8] = 0xff;
        header_too_long[9] = 0xff;
        assert!(parse(&header_too_long, p, "x")
            .unwrap_err()
            .to_string()
            .contains("truncated header"));
    }
}
