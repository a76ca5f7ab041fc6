//! Prompt lookup: an extraction copies spans of its document, so the tokens that followed the
//! last few output tokens where they occur earlier in the context (the document first) are a
//! good guess of what comes next. The longest suffix of the context, from `max_n` tokens down
//! to `min_n`, that occurs earlier is looked up; its first occurrence wins.

#[derive(Debug, Clone, Copy)]
pub struct NgramProposer {
    pub min_n: usize,
    pub max_n: usize,
}

impl Default for NgramProposer {
    fn default() -> Self {
        NgramProposer { min_n: 2, max_n: 5 }
    }
}

impl NgramProposer {
    /// Up to `k` tokens to follow `context` (the prompt, then the output so far); none where
    /// no suffix of at least `min_n` tokens occurs earlier.
    pub fn propose(&self, context: &[u32], k: usize) -> Vec<u32> {
        let len = context.len();
        if k == 0 {
            return Vec::new();
        }
        for n in (self.min_n.max(1)..=self.max_n.min(len.saturating_sub(1))).rev() {
            let suffix = &context[len - n..];
            // Occurrences that end before the suffix itself does, so something follows them.
            if let Some(at) = context[..len - 1].windows(n).position(|w| w == suffix) {
                let from = at + n;
                return context[from..(from + k).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_suffix_seen_before_proposes_what_followed_it() {
        let p = NgramProposer::default();
        // "1 2 3 4 5 ... 1 2 3": what followed "1 2 3" first.
        assert_eq!(p.propose(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2), vec![4, 5]);
        // Short of k tokens before the end of the context: what there is.
        assert_eq!(p.propose(&[1, 2, 3, 4, 1, 2, 3], 10), vec![4, 1, 2, 3]);
        // The longest match wins over an earlier, shorter one: "7 2 3" occurs at 4..7.
        assert_eq!(p.propose(&[2, 3, 8, 8, 7, 2, 3, 6, 7, 2, 3], 1), vec![6]);
        // A single shared token is not enough (min_n = 2); nothing matches.
        assert!(p.propose(&[5, 6, 5], 3).is_empty());
        assert!(p.propose(&[1, 2, 3], 3).is_empty());
        assert!(p.propose(&[], 3).is_empty());
        assert!(p.propose(&[1, 2, 1, 2], 0).is_empty());
    }

    #[test]
    fn a_loop_proposes_its_own_continuation() {
        let p = NgramProposer { min_n: 1, max_n: 3 };
        // "a b a b a": the suffix "a b a" first occurs at 0; "b a" followed it.
        assert_eq!(p.propose(&[1, 2, 1, 2, 1], 2), vec![2, 1]);
    }
}
