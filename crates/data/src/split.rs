//! §2.11 Seeded train/validation split.
//!
//! As scikit-learn's `train_test_split`: a random permutation, the first
//! `ceil(test_size * N)` items go to validation, the rest to training (the
//! permutation comes from ChaCha8, not NumPy, so the membership differs from
//! the reference for the same seed). Both sides must be non-empty (the
//! reference's ticket "check for empty splits").

use rand::seq::SliceRandom;
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};

/// Positions (into the list that was split) of the two sides, each ascending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// Training positions.
    pub train: Vec<usize>,
    /// Validation positions.
    pub validation: Vec<usize>,
}

/// Split `n` items with validation fraction `test_size` in (0, 1).
pub fn train_val_split(n: usize, test_size: f64, seed: u64) -> Result<Split> {
    let invalid = |reason: &str| Error::InvalidSplit {
        samples: n,
        test_size,
        reason: reason.to_string(),
    };
    if !(test_size > 0.0 && test_size < 1.0) {
        return Err(invalid(
            "the validation fraction must be strictly between 0 and 1",
        ));
    }
    let n_val = (test_size * n as f64).ceil() as usize;
    if n_val == 0 || n_val >= n {
        return Err(invalid("one side of the split would be empty"));
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let mut validation = order[..n_val].to_vec();
    let mut train = order[n_val..].to_vec();
    validation.sort_unstable();
    train.sort_unstable();
    Ok(Split { train, validation })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_sklearn_and_sides_partition_the_items() {
        let s = train_val_split(101, 0.2, 7).unwrap();
        assert_eq!(s.validation.len(), 21); // ceil(20.2)
        assert_eq!(s.train.len(), 80);
        let mut all: Vec<usize> = s.train.iter().chain(&s.validation).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..101).collect::<Vec<_>>());
    }

    #[test]
    fn seeded() {
        assert_eq!(
            train_val_split(50, 0.3, 1).unwrap(),
            train_val_split(50, 0.3, 1).unwrap()
        );
        assert_ne!(
            train_val_split(50, 0.3, 1).unwrap(),
            train_val_split(50, 0.3, 2).unwrap()
        );
    }

    #[test]
    fn empty_sides_and_bad_fractions_are_errors() {
        assert!(train_val_split(1, 0.5, 0).is_err());
        assert!(train_val_split(0, 0.5, 0).is_err());
        assert!(train_val_split(10, 0.0, 0).is_err());
        assert!(train_val_split(10, 1.0, 0).is_err());
        assert!(train_val_split(10, f64::NAN, 0).is_err());
        let msg = train_val_split(3, 0.99, 0).unwrap_err().to_string();
        assert!(msg.contains("3 samples") && msg.contains("empty"), "{msg}");
    }
}
