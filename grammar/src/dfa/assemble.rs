//! DFAs assembled without regex-automata: a set of literal words as a trie, the union of
//! several DFAs as their product, and the substrings of a document (a suffix automaton). An object's keys are exactly this (its declared names, its
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

    /// The DFA of the bodies of JSON strings that are substrings of `text`: any run of whole
    /// characters of the document, each spelled as serde_json escapes it inside a string (`\"`,
    /// `\\`, `\n`, `\u001f`, other characters as their UTF-8 bytes). A run starts and ends on
    /// whole characters, so no copy can start inside an escape (`\\n` holds `\n`, which is
    /// another character). Every state but those inside a character's spelling accepts: the
    /// empty string is a substring too.
    ///
    /// A suffix automaton over the document's characters (at most twice as many states as
    /// characters), each character's transition spelled out byte by byte through the states of
    /// a small trie per state.
    pub fn json_substrings(text: &str) -> ByteDfa {
        let mut spelling: Vec<Vec<u8>> = Vec::new();
        let mut by_char: FxHashMap<char, u32> = FxHashMap::default();
        let units: Vec<u32> = text
            .chars()
            .map(|c| {
                *by_char.entry(c).or_insert_with(|| {
                    spelling.push(json_escaped(c));
                    (spelling.len() - 1) as u32
                })
            })
            .collect();
        let sam = SuffixAutomaton::build(&units);
        let mut classes = [0u8; 256];
        let mut num_classes = 1;
        for &b in spelling.iter().flatten() {
            if classes[b as usize] == 0 {
                classes[b as usize] = num_classes as u8;
                num_classes += 1;
            }
        }
        // Row 0 is DEAD; the automaton's state i is row i + 1; spelling states come after.
        let n = sam.next.len();
        let mut trans = vec![DEAD; (n + 1) * num_classes];
        let mut accepting = vec![false; n + 1];
        accepting[1..].iter_mut().for_each(|a| *a = true);
        for (i, next) in sam.next.iter().enumerate() {
            for (&unit, &to) in next {
                let bytes = &spelling[unit as usize];
                let mut s = i + 1;
                for &b in &bytes[..bytes.len() - 1] {
                    let at = s * num_classes + classes[b as usize] as usize;
                    if trans[at] == DEAD {
                        trans[at] = accepting.len() as StateId;
                        trans.extend(std::iter::repeat_n(DEAD, num_classes));
                        accepting.push(false);
                    }
                    s = trans[at] as usize;
                }
                let last = bytes[bytes.len() - 1];
                trans[s * num_classes + classes[last as usize] as usize] = to + 1;
            }
        }
        let matches: Vec<Vec<u32>> = accepting
            .iter()
            .map(|&a| if a { vec![0] } else { Vec::new() })
            .collect();
        let mut reachable = vec![vec![0]; accepting.len()];
        reachable[DEAD as usize].clear();
        ByteDfa::from_parts(classes, num_classes, trans, matches, reachable, 1, 1)
    }

    /// The DFA of every pattern of every part, numbered in order: part 0's patterns first, then
    /// part 1's, and so on.
    pub fn union(parts: &[&ByteDfa], max_states: usize) -> Result<ByteDfa, GrammarError> {
        let p = Product::build(parts, max_states, |t| t.iter().any(|&s| s != DEAD))?;
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
        // Each part is pruned, so a tuple with a live part is live, and a tuple reaches a
        // pattern exactly when its part's state does.
        let matches = p.tuples.iter().map(|t| collect(t, ByteDfa::matches)).collect();
        let reachable = p.tuples.iter().map(|t| collect(t, ByteDfa::reachable)).collect();
        let num_patterns = parts.iter().map(|p| p.num_patterns).sum();
        Ok(ByteDfa::from_parts(
            p.classes,
            p.num_classes,
            p.trans,
            matches,
            reachable,
            p.start,
            num_patterns,
        ))
    }

    /// The DFA of the inputs every part accepts, as one pattern (a bounded number that must
    /// also be a multiple of something, say).
    pub fn intersection(parts: &[&ByteDfa], max_states: usize) -> Result<ByteDfa, GrammarError> {
        let p = Product::build(parts, max_states, |t| t.iter().all(|&s| s != DEAD))?;
        let matches = p
            .tuples
            .iter()
            .map(|t| {
                let all = !t.is_empty() && parts.iter().zip(t).all(|(p, &s)| s != DEAD && p.is_accepting(s));
                if all {
                    vec![0]
                } else {
                    Vec::new()
                }
            })
            .collect();
        Ok(ByteDfa::pruned(p.classes, p.num_classes, p.trans, matches, p.start, 1))
    }

    /// The unsigned decimal spellings (`[0-9]+`, leading zeros allowed: the number syntax is
    /// another part's job) of the multiples of `k`, with an optional `-` in front: one state per
    /// remainder. `k` must be at least 1.
    pub fn multiples_of(k: u32) -> ByteDfa {
        let k = k.max(1) as usize;
        // Class 0: other bytes; 1: `-`; 2 + d: digit d.
        let mut classes = [0u8; 256];
        classes[b'-' as usize] = 1;
        for d in 0..10u8 {
            classes[(b'0' + d) as usize] = 2 + d;
        }
        let num_classes = 12;
        // Rows: 0 dead, 1 start, 2 after `-`, 3 + r remainder r.
        let rows = 3 + k;
        let mut trans = vec![DEAD; rows * num_classes];
        let rem = |r: usize| (3 + r) as StateId;
        trans[num_classes + 1] = 2;
        for d in 0..10usize {
            trans[num_classes + 2 + d] = rem(d % k);
            trans[2 * num_classes + 2 + d] = rem(d % k);
            for r in 0..k {
                trans[(3 + r) * num_classes + 2 + d] = rem((r * 10 + d) % k);
            }
        }
        let mut matches = vec![Vec::new(); rows];
        matches[3] = vec![0];
        ByteDfa::pruned(classes, num_classes, trans, matches, 1, 1)
    }
}

/// The product of several DFAs, as far as `live` tuples of their states reach.
struct Product {
    classes: [u8; 256],
    num_classes: usize,
    trans: Vec<StateId>,
    /// The parts' states of each product state; row 0 (dead) is all `DEAD`.
    tuples: Vec<Vec<StateId>>,
    start: StateId,
}

impl Product {
    fn build(parts: &[&ByteDfa], max_states: usize, live: impl Fn(&[StateId]) -> bool) -> Result<Self, GrammarError> {
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
        let start: Vec<StateId> = parts.iter().map(|p| p.start).collect();
        let mut index: FxHashMap<Vec<StateId>, StateId> = FxHashMap::default();
        let mut tuples: Vec<Vec<StateId>> = vec![vec![DEAD; parts.len()]];
        let mut trans = vec![DEAD; num_classes];
        let start_id = if !live(&start) {
            DEAD
        } else {
            index.insert(start.clone(), 1);
            tuples.push(start);
            trans.extend(std::iter::repeat_n(DEAD, num_classes));
            1
        };
        let mut i = 1;
        while i < tuples.len() {
            for (c, &b) in reps.iter().enumerate() {
                let to: Vec<StateId> = parts.iter().zip(&tuples[i]).map(|(p, &s)| p.next(s, b)).collect();
                if !live(&to) {
                    continue;
                }
                let id = match index.get(&to) {
                    Some(&id) => id,
                    None => {
                        if tuples.len() >= max_states {
                            return Err(GrammarError::TooLarge {
                                what: "product of automata".into(),
                                reason: format!("more than {max_states} DFA states"),
                            });
                        }
                        let id = tuples.len() as StateId;
                        index.insert(to.clone(), id);
                        tuples.push(to);
                        trans.extend(std::iter::repeat_n(DEAD, num_classes));
                        id
                    }
                };
                trans[i * num_classes + c] = id;
            }
            i += 1;
        }
        Ok(Product {
            classes,
            num_classes,
            trans,
            tuples,
            start: start_id,
        })
    }
}

/// A character as serde_json spells it inside a string.
fn json_escaped(c: char) -> Vec<u8> {
    match c {
        '"' => b"\\\"".to_vec(),
        '\\' => b"\\\\".to_vec(),
        '\n' => b"\\n".to_vec(),
        '\r' => b"\\r".to_vec(),
        '\t' => b"\\t".to_vec(),
        '\u{8}' => b"\\b".to_vec(),
        '\u{c}' => b"\\f".to_vec(),
        c if (c as u32) < 0x20 => format!("\\u{:04x}", c as u32).into_bytes(),
        c => c.to_string().into_bytes(),
    }
}

/// The suffix automaton of a sequence: the smallest DFA accepting its substrings (every state
/// accepts). `next[s]` maps a symbol to the next state; state 0 is the empty string.
struct SuffixAutomaton {
    next: Vec<FxHashMap<u32, u32>>,
}

impl SuffixAutomaton {
    /// The classic online construction (Blumer et al.), one symbol at a time.
    fn build(symbols: &[u32]) -> Self {
        let mut next: Vec<FxHashMap<u32, u32>> = vec![FxHashMap::default()];
        let mut link: Vec<Option<u32>> = vec![None];
        let mut len: Vec<usize> = vec![0];
        let mut last = 0u32;
        for &c in symbols {
            let cur = next.len() as u32;
            next.push(FxHashMap::default());
            link.push(None);
            len.push(len[last as usize] + 1);
            let mut p = Some(last);
            while let Some(q) = p {
                if next[q as usize].contains_key(&c) {
                    break;
                }
                next[q as usize].insert(c, cur);
                p = link[q as usize];
            }
            link[cur as usize] = Some(match p {
                None => 0,
                Some(p) => {
                    let q = next[p as usize][&c];
                    if len[p as usize] + 1 == len[q as usize] {
                        q
                    } else {
                        let clone = next.len() as u32;
                        next.push(next[q as usize].clone());
                        link.push(link[q as usize]);
                        len.push(len[p as usize] + 1);
                        let mut p = Some(p);
                        while let Some(r) = p {
                            if next[r as usize].get(&c) != Some(&q) {
                                break;
                            }
                            next[r as usize].insert(c, clone);
                            p = link[r as usize];
                        }
                        link[q as usize] = Some(clone);
                        clone
                    }
                }
            });
            last = cur;
        }
        SuffixAutomaton { next }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dfa::DfaLimits;

    fn run(d: &ByteDfa, s: &str) -> StateId {
        d.run(d.start(), s.as_bytes())
    }

    /// Against every string up to a length: accepted exactly when it is the JSON spelling of a
    /// run of whole characters of the document.
    #[test]
    fn json_substrings_are_exactly_the_escaped_runs_of_the_document() {
        // Quotes, a backslash before `t` (and no tab), a newline, a control, multi-byte text.
        let doc = "Ann \"Bo\" O'Neil C:\\temp\nx\u{1}é日";
        let d = ByteDfa::json_substrings(doc);
        let chars: Vec<char> = doc.chars().collect();
        let mut runs = std::collections::HashSet::new();
        for i in 0..=chars.len() {
            for j in i..=chars.len() {
                let run: String = chars[i..j].iter().collect();
                let quoted = serde_json::to_string(&run).unwrap();
                runs.insert(quoted.as_bytes()[1..quoted.len() - 1].to_vec());
            }
        }
        let accepts = |bytes: &[u8]| {
            let s = d.run(d.start(), bytes);
            s != DEAD && d.is_accepting(s)
        };
        for r in &runs {
            assert!(accepts(r), "{:?}", String::from_utf8_lossy(r));
        }
        // Every byte string of up to 3 bytes over the document's bytes and a few others.
        let mut alphabet: Vec<u8> = runs.iter().flatten().copied().collect();
        alphabet.extend_from_slice(b"zqn\"\\u");
        alphabet.sort();
        alphabet.dedup();
        let mut strings: Vec<Vec<u8>> = vec![Vec::new()];
        let mut level: Vec<Vec<u8>> = vec![Vec::new()];
        for _ in 0..3 {
            level = level
                .iter()
                .flat_map(|s| alphabet.iter().map(move |&b| [s.as_slice(), &[b]].concat()))
                .collect();
            strings.extend(level.iter().cloned());
        }
        for s in &strings {
            assert_eq!(accepts(s), runs.contains(s), "{:?}", String::from_utf8_lossy(s));
        }
        // Nothing ends inside an escape, and the `t` after the document's backslash (spelled
        // `\\t`) starts no `\t`, which would be a tab.
        assert!(!accepts(b"\\"));
        assert!(!accepts(b"\\t"));
        assert!(accepts(b"\\\\t") && accepts(b"t") && accepts(b"\\n"));
        // The suffix automaton's states, plus one spelling state per escape or multi-byte
        // transition at most.
        assert!(
            d.num_states() <= 1 + 2 * chars.len() + 3 * chars.len() * 2,
            "{}",
            d.num_states()
        );
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
    fn bounded_multiples_are_the_intersection() {
        let range = ByteDfa::from_regex(
            &crate::lexeme::int_range_regex(Some(-50), Some(60)).unwrap(),
            DfaLimits::default(),
        )
        .unwrap();
        let seven = ByteDfa::multiples_of(7);
        let both = ByteDfa::intersection(&[&range, &seven], 10_000).unwrap();
        for n in -200i64..=200 {
            let text = n.to_string();
            let want = (-50..=60).contains(&n) && n % 7 == 0;
            assert_eq!(both.is_accepting(run(&both, &text)), want, "{n}");
            // Pruned: a prefix stays live exactly when some match still extends it.
            let s = run(&both, &text[..text.len() - 1]);
            assert_eq!(s != DEAD, both.reachable(s) == [0], "{n}");
        }
        assert_eq!(run(&both, "61"), DEAD, "no multiple of 7 in range starts with 61");
        assert_eq!(run(&both, "-0"), DEAD);
        let empty = ByteDfa::intersection(&[&ByteDfa::literals(&[b"5"]), &seven], 100).unwrap();
        assert_eq!(empty.start(), DEAD);
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
