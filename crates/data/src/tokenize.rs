//! §2.3 Tokenisation (`SequenceTokenizer` + `pad_sequences`).
//!
//! A sequence becomes `L = max_bp + 1` tokens: START (5), then its first
//! `max_bp` characters mapped A/C/G/T -> 1/2/3/4 (case-insensitive) and
//! anything else -> 0, then zero padding. MASK (6) is never produced here.
//!
//! [`TokenCache`] tokenises each distinct ASV once (the reference's sequence
//! cache) and keeps the rows as bytes, `n_asv * L` of them (75k ASVs x 151 =
//! 11 MB); batches widen them to the model's `i64` only when they are built.

/// Padding, and every character other than A/C/G/T.
pub const PAD: u8 = 0;
/// Prepended to every ASV.
pub const START: u8 = 5;
/// Written by the model's masked-nucleotide corruption only.
pub const MASK: u8 = 6;
/// Vocabulary size used by the CLIs (0..=6).
pub const VOCAB_SIZE: usize = 7;
/// Default `max_bp` of the CLIs (L = 151).
pub const DEFAULT_MAX_BP: usize = 150;

/// The token of one nucleotide character.
#[inline]
pub fn nucleotide_token(c: char) -> u8 {
    match c {
        'A' | 'a' => 1,
        'C' | 'c' => 2,
        'G' | 'g' => 3,
        'T' | 't' => 4,
        _ => PAD,
    }
}

/// Write the `out.len()` tokens of `sequence` into `out` (`out.len()` = L =
/// max_bp + 1): START, the first L - 1 characters, zero padding.
///
/// # Panics
/// If `out` is empty (a programmer error: L >= 1).
pub fn tokenize_into(sequence: &str, out: &mut [u8]) {
    out[0] = START;
    let body = &mut out[1..];
    let mut n = 0;
    for (slot, c) in body.iter_mut().zip(sequence.chars()) {
        *slot = nucleotide_token(c);
        n += 1;
    }
    body[n..].fill(PAD);
}

/// The `max_bp + 1` tokens of one sequence.
pub fn tokenize(sequence: &str, max_bp: usize) -> Vec<u8> {
    let mut row = vec![0u8; max_bp + 1];
    tokenize_into(sequence, &mut row);
    row
}

/// Token rows of a fixed set of sequences, computed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenCache {
    seq_len: usize,
    tokens: Vec<u8>,
}

impl TokenCache {
    /// Tokenise every sequence with `max_bp` (rows of L = max_bp + 1).
    pub fn new<S: AsRef<str>>(sequences: &[S], max_bp: usize) -> Self {
        let seq_len = max_bp + 1;
        let mut tokens = vec![0u8; sequences.len() * seq_len];
        for (row, seq) in tokens.chunks_exact_mut(seq_len).zip(sequences) {
            tokenize_into(seq.as_ref(), row);
        }
        Self { seq_len, tokens }
    }

    /// L, tokens per row (max_bp + 1).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.tokens.len() / self.seq_len
    }

    /// True when there is no row.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Row `i`.
    ///
    /// # Panics
    /// If `i >= len()` (a programmer error).
    pub fn row(&self, i: usize) -> &[u8] {
        &self.tokens[i * self.seq_len..(i + 1) * self.seq_len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_case_insensitively_and_prepends_start() {
        assert_eq!(tokenize("ACGTacgt", 8), vec![5, 1, 2, 3, 4, 1, 2, 3, 4]);
    }

    #[test]
    fn ambiguous_bases_become_zero_inside_the_sequence() {
        assert_eq!(tokenize("ANRT-g", 6), vec![5, 1, 0, 0, 4, 0, 3]);
    }

    #[test]
    fn truncates_to_max_bp_and_pads_with_zero() {
        assert_eq!(tokenize("ACGTACGT", 3), vec![5, 1, 2, 3]);
        assert_eq!(tokenize("AC", 5), vec![5, 1, 2, 0, 0, 0]);
        assert_eq!(tokenize("", 2), vec![5, 0, 0]);
    }

    #[test]
    fn cache_rows_equal_direct_tokenisation_and_reused_buffers_are_cleared() {
        let seqs = ["ACGTTT", "G", "TTTTTTTTTTTTT"];
        let cache = TokenCache::new(&seqs, 4);
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.seq_len(), 5);
        for (i, s) in seqs.iter().enumerate() {
            let expected = tokenize(s, 4);
            assert_eq!(cache.row(i), expected.as_slice());
        }
        let mut buf = [9u8; 6];
        tokenize_into("AC", &mut buf);
        assert_eq!(buf, [5, 1, 2, 0, 0, 0]);
    }
}
