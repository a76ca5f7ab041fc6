//! Prompt lookup: an extraction copies spans of its document, so the tokens that followed the
//! last few output tokens where they occur earlier in the context are a good guess of what
//! comes next. The longest suffix of the context, from `max_n` tokens down to `min_n`, that
//! occurs earlier is looked up. A short suffix (one token of a value just begun) occurs in many
//! places; where its occurrences disagree, the guess is the token that follows most of them,
//! and none where no token does. Replayed over the development set's greedy outputs (`bench
//! latency` prints this replay), a first token so guessed was right 72-89% of the time where
//! every occurrence agreed and 6-31% where they split.

#[derive(Debug, Clone, Copy)]
pub struct NgramProposer {
    pub min_n: usize,
    pub max_n: usize,
}

impl Default for NgramProposer {
    fn default() -> Self {
        NgramProposer { min_n: 1, max_n: 5 }
    }
}

impl NgramProposer {
    /// Up to `k` tokens to follow `context` (the prompt, then the output so far); none where
    /// no suffix of at least `min_n` tokens occurs earlier. One pass over the context finds
    /// every earlier occurrence of its last token and how many tokens before it match the
    /// context's end (at most `max_n`): the occurrences of each suffix, longest first, without a
    /// pass per suffix length (a speculating engine asks this of every request every step).
    pub fn propose(&self, context: &[u32], k: usize) -> Vec<u32> {
        let len = context.len();
        let longest = self.max_n.min(len.saturating_sub(1));
        let shortest = self.min_n.max(1);
        if k == 0 || shortest > longest {
            return Vec::new();
        }
        let last = context[len - 1];
        // (tokens matched, where what follows starts), in the context's order; an occurrence
        // ends before the context does, so something follows each.
        let occurrences: Vec<(usize, usize)> = context[..len - 1]
            .iter()
            .enumerate()
            .filter(|&(_, &t)| t == last)
            .map(|(end, _)| {
                let matched = 1
                    + (1..longest.min(end + 1))
                        .take_while(|&back| context[end - back] == context[len - 1 - back])
                        .count();
                (matched, end + 1)
            })
            .collect();
        let mut votes = Vec::with_capacity(occurrences.len());
        for n in (shortest..=longest).rev() {
            let before = votes.len();
            votes.clear();
            votes.extend(
                occurrences
                    .iter()
                    .filter(|&&(matched, _)| matched >= n)
                    .map(|&(_, f)| (context[f], f)),
            );
            // The same occurrences as the longer suffix's: the same vote, which found nothing.
            if votes.len() == before && n < longest {
                continue;
            }
            if let Some(from) = most_common_next(&mut votes) {
                return context[from..(from + k).min(len)].to_vec();
            }
        }
        Vec::new()
    }

    /// The model steps that would produce `output` after `prompt` if up to `k` of this
    /// proposer's drafts were checked at every step, at no cost: its ceiling on a workload,
    /// whatever the checks cost on a device. The first token comes from the prefill.
    pub fn replay_steps(&self, prompt: &[u32], output: &[u32], k: usize) -> usize {
        let mut context = prompt.to_vec();
        context.extend_from_slice(output.get(..1).unwrap_or_default());
        let mut steps = 0;
        while context.len() < prompt.len() + output.len() {
            let at = context.len() - prompt.len();
            let kept = self
                .propose(&context, k)
                .iter()
                .zip(&output[at..])
                .take_while(|(draft, truth)| draft == truth)
                .count();
            let next = (at + kept + 1).min(output.len());
            context.extend_from_slice(&output[at..next]);
            steps += 1;
        }
        steps
    }
}

/// Of the occurrences `votes` (the token that followed each, and where), the first place of
/// the token that followed more than half of them; `None` where none did (the context does not
/// say what comes next). Sorted rather than counted in a map: there are few, and this runs for
/// every request every step.
fn most_common_next(votes: &mut [(u32, usize)]) -> Option<usize> {
    votes.sort_unstable();
    // (how often, where first) of the most common token, the earliest of equals.
    let mut best: Option<(usize, usize)> = None;
    for run in votes.chunk_by(|a, b| a.0 == b.0) {
        let (count, first) = (run.len(), run[0].1);
        if best.is_none_or(|(c, f)| count > c || (count == c && first < f)) {
            best = Some((count, first));
        }
    }
    let (count, first) = best?;
    (2 * count > votes.len()).then_some(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn the_longest_suffix_seen_before_proposes_what_followed_it() {
        let p = NgramProposer::default();
        // "1 2 3 4 5 ... 1 2 3": what followed "1 2 3" first.
        assert_eq!(p.propose(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2), vec![4, 5]);
        // Short of k tokens before the end of the context: what there is.
        assert_eq!(p.propose(&[1, 2, 3, 4, 1, 2, 3], 10), vec![4, 1, 2, 3]);
        // The longest match wins over an earlier, shorter one: "7 2 3" occurs at 4..7.
        assert_eq!(p.propose(&[2, 3, 8, 8, 7, 2, 3, 6, 7, 2, 3], 1), vec![6]);
        // A single shared token is enough.
        assert_eq!(p.propose(&[5, 6, 5], 3), vec![6, 5]);
        assert!(p.propose(&[1, 2, 3], 3).is_empty());
        assert!(p.propose(&[], 3).is_empty());
        assert!(p.propose(&[1, 2, 1, 2], 0).is_empty());
        // Two tokens at least, when asked.
        assert!(NgramProposer { min_n: 2, max_n: 5 }.propose(&[5, 6, 5], 3).is_empty());
    }

    #[test]
    fn occurrences_that_disagree_guess_only_what_most_of_them_agree_on() {
        let p = NgramProposer::default();
        // "7" is followed by 1 once, then by 2 twice: 2 wins, from its first occurrence.
        assert_eq!(p.propose(&[7, 1, 9, 7, 2, 8, 7, 2, 6, 7], 2), vec![2, 8]);
        // No token follows most of them: no guess.
        assert!(p.propose(&[7, 1, 9, 7, 2, 8, 7], 2).is_empty());
        let split = [1, 7, 2, 3, 7, 2, 4, 7, 5, 6, 7, 5, 9, 7];
        assert!(p.propose(&split, 2).is_empty(), "2 of 4 is not most");
        // The vote is among the longest suffix's occurrences only: "3 7" occurs once, before 1.
        assert_eq!(p.propose(&[3, 7, 1, 7, 2, 7, 2, 3, 7], 1), vec![1]);
    }

    #[test]
    fn a_replay_counts_the_steps_a_free_checker_would_take() {
        let p = NgramProposer::default();
        // Nothing to copy: one step per token after the first.
        assert_eq!(p.replay_steps(&[9, 8], &[1, 2, 3, 4], 8), 3);
        // "5 6 7 8" is in the prompt: after 5, one step keeps 6 7 8 and samples 1.
        assert_eq!(p.replay_steps(&[5, 6, 7, 8, 0], &[5, 6, 7, 8, 1], 8), 1);
        // At most k drafts a step: 6 7 kept with 8 sampled, then 1 sampled.
        assert_eq!(p.replay_steps(&[5, 6, 7, 8, 0], &[5, 6, 7, 8, 1], 2), 2);
        assert_eq!(p.replay_steps(&[1], &[], 8), 0);
    }

    #[test]
    fn a_loop_proposes_its_own_continuation() {
        let p = NgramProposer { min_n: 1, max_n: 3 };
        // "a b a b a": the suffix "a b a" first occurs at 0; "b a" followed it.
        assert_eq!(p.propose(&[1, 2, 1, 2, 1], 2), vec![2, 1]);
    }

    /// The definition `propose` implements: each suffix, longest first, looked up by comparing
    /// it with every window of the context before its last token.
    fn by_windows(p: &NgramProposer, context: &[u32], k: usize) -> Vec<u32> {
        let len = context.len();
        if k == 0 {
            return Vec::new();
        }
        for n in (p.min_n.max(1)..=p.max_n.min(len.saturating_sub(1))).rev() {
            let suffix = &context[len - n..];
            let follows: Vec<usize> = context[..len - 1]
                .windows(n)
                .enumerate()
                .filter(|(_, w)| *w == suffix)
                .map(|(at, _)| at + n)
                .collect();
            // token -> (how often, where first); the earliest of equals.
            let mut votes: HashMap<u32, (usize, usize)> = HashMap::new();
            for &f in &follows {
                votes.entry(context[f]).or_insert((0, f)).0 += 1;
            }
            let best = votes.into_values().max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            if let Some((_, first)) = best.filter(|&(count, _)| 2 * count > follows.len()) {
                return context[first..(first + k).min(len)].to_vec();
            }
        }
        Vec::new()
    }

    proptest::proptest! {
        /// Over few distinct tokens, so that suffixes recur at every length and their
        /// followers split and agree.
        #[test]
        fn one_pass_finds_what_comparing_every_window_does(
            context in proptest::collection::vec(0u32..4, 0..80),
            min_n in 0usize..4,
            max_n in 0usize..7,
            k in 0usize..10,
        ) {
            let p = NgramProposer { min_n, max_n };
            proptest::prop_assert_eq!(p.propose(&context, k), by_windows(&p, &context, k));
        }

        /// Longer contexts over more tokens, as a document's: long matches, rare splits.
        #[test]
        fn one_pass_finds_what_comparing_every_window_does_in_long_contexts(
            context in proptest::collection::vec(0u32..40, 0..400),
            k in 1usize..10,
        ) {
            let p = NgramProposer::default();
            proptest::prop_assert_eq!(p.propose(&context, k), by_windows(&p, &context, k));
        }
    }
}
