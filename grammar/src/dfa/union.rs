//! DFAs assembled without regex-automata: a set of literal words as a trie, and the union of
//! several DFAs as their product. An object's keys are exactly this (its declared names, its
//! pattern properties, maybe any string), and building them directly costs microseconds where
//! determinizing the combined regex costs milliseconds.

use rustc_hash::FxHashMap;

use super::{ByteDfa, StateId, DEAD};
use crate::error::GrammarError;

impl ByteDfa {
    /// The DFA matching exactly `words`; pattern `i` is `words[i]`.
    pub fn literals(words: &[&[u8]]) -> ByteDfa {
        // Each byte some word uses is its own class; every other byte shares class 0. (Callers
        // pass JSON-encoded text, which never uses all 256 bytes.)
        let mut classes = [0u8; 256];
        let mut num_classes = 1;
        for &b in words.iter().flat_map(|w| w.iter()) {
            if classes[b as usize] == 0 {
                classes[b as usize] = num_classes as u8;
                num_classes += 1;
            }
        }
        // Row 0 is DEAD, row 1 the root; rows are added as the trie grows.
        let mut trans = vec![DEAD; 2 * num_classes];
        let mut matches: Vec<Vec<u32>> = vec![Vec::new(), Vec::new()];
        for (i, w) in words.iter().enumerate() {
            let mut s = 1usize;
            for &b in w.iter() {
                let at = s * num_classes + classes[b as usize] as usize;
                if trans[at] == DEAD {
                    trans[at] = matches.len() as StateId;
                    trans.extend(std::iter::repeat_n(DEAD, num_classes));
                    matches.push(Vec::new());
                }
                s = trans[at] as usize;
            }
            matches[s].push(i as u32);
        }
        let mut reachable = matches.clone();
        // Children always come after their parent, so one backward pass collects subtrees.
        for s in (1..matches.len()).rev() {
            let mut acc = std::mem::take(&mut reachable[s]);
            for c in 0..num_classes {
                let t = trans[s * num_classes + c];
                if t != DEAD {
                    acc.extend_from_slice(&reachable[t as usize]);
                }
            }
            acc.sort_unstable();
            acc.dedup();
            reachable[s] = acc;
        }
        let start = if words.is_empty() { DEAD } else { 1 };
        ByteDfa::from_parts(classes, num_classes, trans, matches, reachable, start, words.len())
    }

    /// The DFA of every pattern of every part, numbered in order: part 0's patterns first, then
    /// part 1's, and so on.
    pub fn union(parts: &[&ByteDfa], max_states: usize) -> Result<ByteDfa, GrammarError> {
        // A byte's class is the tuple of its classes in the parts.
        let mut classes = [0u8; 256];
        let mut by_tuple: FxHashMap<Vec<u8>, u8> = FxHashMap::default();
        let mut reps = Vec::new();
        for b in 0..=255u8 {
            let tuple: Vec<u8> = parts.iter().map(|p| p.classes[b as usize]).collect();
            let n = by_tuple.len();
            let c = *by_tuple.entry(tuple).or_insert_with(|| {
                reps.push(b);
                n as u8
            });
            classes[b as usize] = c;
        }
        let num_classes = reps.len();
        let offsets: Vec<u32> = parts
            .iter()
            .scan(0, |acc, p| {
                let at = *acc;
                *acc += p.num_patterns as u32;
                Some(at)
            })
            .collect();
        let collect = |tuple: &[StateId], of: fn(&ByteDfa, StateId) -> &[u32]| -> Vec<u32> {
            let mut out = Vec::new();
            for ((p, &s), &off) in parts.iter().zip(tuple).zip(&offsets) {
                out.extend(of(p, s).iter().map(|&m| m + off));
            }
            out
        };
        let start: Vec<StateId> = parts.iter().map(|p| p.start).collect();
        let mut index: FxHashMap<Vec<StateId>, StateId> = FxHashMap::default();
        let mut order: Vec<Vec<StateId>> = vec![vec![DEAD; parts.len()]];
        let mut trans = vec![DEAD; num_classes];
        let start_id = if start.iter().all(|&s| s == DEAD) {
            DEAD
        } else {
            index.insert(start.clone(), 1);
            order.push(start);
            trans.extend(std::iter::repeat_n(DEAD, num_classes));
            1
        };
        let mut i = 1;
        while i < order.len() {
            for (c, &b) in reps.iter().enumerate() {
                let to: Vec<StateId> = parts.iter().zip(&order[i]).map(|(p, &s)| p.next(s, b)).collect();
                if to.iter().all(|&s| s == DEAD) {
                    continue;
                }
                let id = match index.get(&to) {
                    Some(&id) => id,
                    None => {
                        if order.len() >= max_states {
                            return Err(GrammarError::TooLarge {
                                what: "union of key patterns".into(),
                                reason: format!("more than {max_states} DFA states"),
                            });
                        }
                        let id = order.len() as StateId;
                        index.insert(to.clone(), id);
                        order.push(to);
                        trans.extend(std::iter::repeat_n(DEAD, num_classes));
                        id
                    }
                };
                trans[i * num_classes + c] = id;
            }
            i += 1;
        }
        // Each part is pruned, so a tuple with a live part is live, and a tuple reaches a
        // pattern exactly when its part's state does.
        let matches = order.iter().map(|t| collect(t, ByteDfa::matches)).collect();
        let reachable = order.iter().map(|t| collect(t, ByteDfa::reachable)).collect();
        let num_patterns = parts.iter().map(|p| p.num_patterns).sum();
        Ok(ByteDfa::from_parts(
            classes,
            num_classes,
            trans,
            matches,
            reachable,
            start_id,
            num_patterns,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dfa::DfaLimits;

    fn run(d: &ByteDfa, s: &str) -> StateId {
        d.run(d.start(), s.as_bytes())
    }

    #[test]
    fn literals_match_exactly_their_words() {
        let d = ByteDfa::literals(&[b"name", b"nam", b"age", b""]);
        assert_eq!(d.matches(run(&d, "name")), &[0]);
        assert_eq!(d.matches(run(&d, "nam")), &[1]);
        assert_eq!(d.matches(run(&d, "")), &[3]);
        assert_eq!(run(&d, "names"), DEAD);
        assert_eq!(run(&d, "x"), DEAD);
        assert_eq!(d.reachable(run(&d, "na")), &[0, 1]);
        assert_eq!(d.reachable(d.start()), &[0, 1, 2, 3]);
        assert!(!d.has_next(run(&d, "age")));
        assert_eq!(ByteDfa::literals(&[]).start(), DEAD);
    }

    #[test]
    fn union_agrees_with_regex_automata_on_the_same_patterns() {
        let regexes = ["[a-z]+_id", "[0-9]{2}", "(?:[^\"\\\\]|\\\\.)*"];
        let words: [&[u8]; 3] = [b"name", b"user_id", b"12"];
        let lit = ByteDfa::literals(&words);
        let parts: Vec<ByteDfa> = regexes
            .iter()
            .map(|r| ByteDfa::from_regex(r, DfaLimits::default()).unwrap())
            .collect();
        let mut refs = vec![&lit];
        refs.extend(parts.iter());
        let u = ByteDfa::union(&refs, 10_000).unwrap();
        let all: Vec<String> = ["name", "user_id", "12"]
            .iter()
            .map(|w| w.to_string())
            .chain(regexes.iter().map(|r| r.to_string()))
            .collect();
        let refs: Vec<&str> = all.iter().map(|s| s.as_str()).collect();
        let reference = ByteDfa::from_regexes(&refs, DfaLimits::default()).unwrap();
        for input in [
            "", "name", "nam", "user_id", "12", "123", "x_id", "a\\\"b", "\"", "é", "_id",
        ] {
            let (a, b) = (run(&u, input), run(&reference, input));
            assert_eq!(a == DEAD, b == DEAD, "{input:?}");
            assert_eq!(u.matches(a), reference.matches(b), "{input:?}");
            assert_eq!(u.reachable(a), reference.reachable(b), "{input:?}");
        }
    }
}
