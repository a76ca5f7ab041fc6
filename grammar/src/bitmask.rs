//! Token masks: one bit per token id, `u32` words, bit `id % 32` of word `id / 32`. The same
//! layout the runtime applies to logits on the device.

/// Number of `u32` words a bitmask over `vocab_size` tokens needs.
pub fn bitmask_words(vocab_size: usize) -> usize {
    vocab_size.div_ceil(32)
}

/// Whether `token` is allowed by `mask`.
pub fn is_allowed(mask: &[u32], token: u32) -> bool {
    mask.get((token / 32) as usize)
        .is_some_and(|w| w & (1 << (token % 32)) != 0)
}

#[inline]
pub fn allow(mask: &mut [u32], token: u32) {
    mask[(token / 32) as usize] |= 1 << (token % 32);
}

/// Token ids set in `mask`, ascending.
pub fn allowed_tokens(mask: &[u32]) -> impl Iterator<Item = u32> + '_ {
    mask.iter().enumerate().flat_map(|(w, &bits)| {
        let mut bits = bits;
        std::iter::from_fn(move || {
            (bits != 0).then(|| {
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                w as u32 * 32 + b
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_layout_is_one_bit_per_token() {
        assert_eq!(bitmask_words(49152), 1536);
        assert_eq!(bitmask_words(33), 2);
        let mut mask = vec![0u32; bitmask_words(64)];
        allow(&mut mask, 35);
        allow(&mut mask, 0);
        allow(&mut mask, 63);
        assert!(is_allowed(&mask, 35) && is_allowed(&mask, 0) && is_allowed(&mask, 63));
        assert!(!is_allowed(&mask, 34) && !is_allowed(&mask, 3) && !is_allowed(&mask, 1000));
        assert_eq!(allowed_tokens(&mask).collect::<Vec<_>>(), vec![0, 35, 63]);
    }
}
