//! `quarry-grammar`: constraints (JSON Schema, regex, choice lists, CFGs) compiled to
//! token-level automata that fill a token bitmask per decoding step.
//!
//! The crate knows nothing of models or HTTP; see shared/design.md. It is built out in
//! its own issue; until then it only fixes the mask layout every other part relies on.

/// Number of `u32` words a bitmask over `vocab_size` tokens needs (one bit per token id).
pub fn bitmask_words(vocab_size: usize) -> usize {
    vocab_size.div_ceil(32)
}

/// Whether `token` is allowed by `mask`.
pub fn is_allowed(mask: &[u32], token: u32) -> bool {
    mask.get((token / 32) as usize)
        .is_some_and(|w| w & (1 << (token % 32)) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_layout_is_one_bit_per_token() {
        assert_eq!(bitmask_words(49152), 1536);
        assert_eq!(bitmask_words(33), 2);
        let mut mask = vec![0u32; bitmask_words(64)];
        mask[1] = 1 << 3;
        assert!(is_allowed(&mask, 35));
        assert!(!is_allowed(&mask, 34));
        assert!(!is_allowed(&mask, 3));
        assert!(!is_allowed(&mask, 1000));
    }
}
