//! Byte-level DFAs for lexemes and regex constraints, in our own compact form. regex-automata
//! parses and determinizes; we copy its automaton into a dense table over its byte classes and
//! fold every state that can no longer reach a match into the dead state, so a mask walk never
//! descends into a branch that is doomed anyway.

use std::collections::HashMap;
use std::sync::OnceLock;

use regex_automata::dfa::{dense, Automaton, StartKind};
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind};

use crate::error::GrammarError;

mod assemble;

pub type StateId = u32;

/// The state from which nothing matches; every transition out of it returns to it.
pub const DEAD: StateId = 0;

/// Bounds that keep a pathological pattern from taking the process down.
#[derive(Debug, Clone, Copy)]
pub struct DfaLimits {
    /// Bytes regex-automata may use while building (NFA and determinization each).
    pub build_bytes: usize,
    pub max_states: usize,
}

impl Default for DfaLimits {
    fn default() -> Self {
        DfaLimits {
            build_bytes: 64 << 20,
            max_states: 100_000,
        }
    }
}

#[derive(Clone)]
pub struct ByteDfa {
    classes: [u8; 256],
    num_classes: usize,
    /// `trans[state * num_classes + class]`; row 0 is the dead state.
    trans: Vec<StateId>,
    /// Whether the input may end in this state.
    accepting: Vec<bool>,
    /// For a DFA of several patterns: per state, the patterns that match if the input ends here.
    matches: Vec<Vec<u32>>,
    /// Per state, the patterns some continuation can still match.
    reachable: Vec<Vec<u32>>,
    /// Per state, whether any byte leads on (a closed string or literal has none).
    has_next: Vec<bool>,
    start: StateId,
    num_patterns: usize,
    /// Per state, the fewest bytes to an accepting state (`UNREACHABLE` for the dead state),
    /// computed on first use.
    to_accept: OnceLock<Box<[u32]>>,
}

/// The distance of a state from which no input is accepted.
pub const UNREACHABLE: u32 = u32::MAX;

impl ByteDfa {
    /// A DFA accepting exactly the byte strings that `pattern` matches in full.
    pub fn from_regex(pattern: &str, limits: DfaLimits) -> Result<Self, GrammarError> {
        Self::from_regexes(&[pattern], limits)
    }

    /// A DFA of several patterns at once; `matches(state)` says which of them an input ending
    /// in `state` matches, in full.
    pub fn from_regexes(patterns: &[&str], limits: DfaLimits) -> Result<Self, GrammarError> {
        let pattern = patterns.join(" | ");
        let bad = |e: &dyn std::fmt::Display| GrammarError::Regex {
            pattern: pattern.clone(),
            reason: e.to_string(),
        };
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .start_kind(StartKind::Anchored)
                    // All: keep every way the input can still match, not just the leftmost-first.
                    .match_kind(MatchKind::All)
                    .dfa_size_limit(Some(limits.build_bytes))
                    .determinize_size_limit(Some(limits.build_bytes)),
            )
            .thompson(regex_automata::nfa::thompson::Config::new().nfa_size_limit(Some(limits.build_bytes)))
            .build_many(patterns)
            .map_err(|e| bad(&e))?;
        let start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .map_err(|e| bad(&e))?;
        Self::copy(&dfa, start, limits.max_states, patterns.len()).map_err(|reason| GrammarError::TooLarge {
            what: format!("regex {pattern:?}"),
            reason,
        })
    }

    fn copy(
        dfa: &dense::DFA<Vec<u32>>,
        start: regex_automata::util::primitives::StateID,
        max_states: usize,
        num_patterns: usize,
    ) -> Result<Self, String> {
        let bc = dfa.byte_classes();
        let mut classes = [0u8; 256];
        for b in 0..=255u8 {
            classes[b as usize] = bc.get(b);
        }
        let num_classes = bc.alphabet_len() - 1; // the last class is end-of-input
        let reps: Vec<u8> = (0..num_classes)
            .map(|c| (0..=255u8).find(|&b| classes[b as usize] as usize == c).unwrap_or(0))
            .collect();

        // Breadth-first copy; index 0 stays the dead state.
        let mut index: HashMap<regex_automata::util::primitives::StateID, StateId> = HashMap::new();
        let mut order = vec![None, Some(start)];
        index.insert(start, 1);
        let mut trans = vec![DEAD; 2 * num_classes];
        let eoi_matches = |s| {
            let end = dfa.next_eoi_state(s);
            if !dfa.is_match_state(end) {
                return Vec::new();
            }
            (0..dfa.match_len(end))
                .map(|i| dfa.match_pattern(end, i).as_u32())
                .collect::<Vec<u32>>()
        };
        let mut matches = vec![Vec::new(), eoi_matches(start)];
        let mut i = 1;
        while i < order.len() {
            let from = order[i].expect("only the dead row is None");
            for (c, &b) in reps.iter().enumerate() {
                let to = dfa.next_state(from, b);
                if dfa.is_dead_state(to) || dfa.is_quit_state(to) {
                    continue;
                }
                let id = match index.get(&to) {
                    Some(&id) => id,
                    None => {
                        if order.len() >= max_states {
                            return Err(format!("more than {max_states} DFA states"));
                        }
                        let id = order.len() as StateId;
                        index.insert(to, id);
                        order.push(Some(to));
                        trans.extend(std::iter::repeat_n(DEAD, num_classes));
                        matches.push(eoi_matches(to));
                        id
                    }
                };
                trans[i * num_classes + c] = id;
            }
            i += 1;
        }
        Ok(Self::pruned(classes, num_classes, trans, matches, 1, num_patterns))
    }

    /// A DFA from its tables, with transitions into states that cannot reach acceptance sent
    /// to `DEAD` and the derived per-state facts computed.
    fn pruned(
        classes: [u8; 256],
        num_classes: usize,
        trans: Vec<StateId>,
        matches: Vec<Vec<u32>>,
        start: StateId,
        num_patterns: usize,
    ) -> ByteDfa {
        let mut d = Self::from_parts(classes, num_classes, trans, matches, Vec::new(), start, num_patterns);
        d.prune_dead_ends();
        d.reachable = d.reachable_patterns();
        d.has_next = d.states_with_next();
        d
    }

    /// A DFA from its tables; the derived per-state facts are computed here.
    fn from_parts(
        classes: [u8; 256],
        num_classes: usize,
        trans: Vec<StateId>,
        matches: Vec<Vec<u32>>,
        reachable: Vec<Vec<u32>>,
        start: StateId,
        num_patterns: usize,
    ) -> ByteDfa {
        let mut d = ByteDfa {
            classes,
            num_classes,
            trans,
            accepting: matches.iter().map(|m| !m.is_empty()).collect(),
            matches,
            reachable,
            has_next: Vec::new(),
            start,
            num_patterns,
            to_accept: OnceLock::new(),
        };
        d.has_next = d.states_with_next();
        d
    }

    /// The fewest bytes that take `s` to an accepting state: how far a lexeme is from being
    /// complete. `UNREACHABLE` for `DEAD` and for pruned states nothing leads to any more.
    pub fn distance_to_accept(&self, s: StateId) -> u32 {
        self.to_accept.get_or_init(|| self.distances_to_accept())[s as usize]
    }

    /// Breadth-first from every accepting state, along transitions reversed.
    fn distances_to_accept(&self) -> Box<[u32]> {
        let n = self.num_states();
        let mut into: Vec<Vec<StateId>> = vec![Vec::new(); n];
        for s in 1..n {
            for t in self.successors(s as StateId) {
                into[t as usize].push(s as StateId);
            }
        }
        let mut dist = vec![UNREACHABLE; n];
        let mut queue = std::collections::VecDeque::new();
        for (s, d) in dist.iter_mut().enumerate().skip(1) {
            if self.accepting[s] {
                *d = 0;
                queue.push_back(s as StateId);
            }
        }
        while let Some(t) = queue.pop_front() {
            for &s in &into[t as usize] {
                if dist[s as usize] == UNREACHABLE {
                    dist[s as usize] = dist[t as usize] + 1;
                    queue.push_back(s);
                }
            }
        }
        dist.into()
    }

    /// Per state, whether any byte leads on.
    fn states_with_next(&self) -> Vec<bool> {
        (0..self.num_states())
            .map(|s| self.row(s as StateId).iter().any(|&t| t != DEAD))
            .collect()
    }

    /// Sends every transition into a state that cannot reach acceptance to `DEAD`.
    fn prune_dead_ends(&mut self) {
        let n = self.accepting.len();
        let mut live = self.accepting.clone();
        loop {
            let mut changed = false;
            for s in 1..n {
                if !live[s] && self.row(s as StateId).iter().any(|&t| live[t as usize]) {
                    live[s] = true;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        live[DEAD as usize] = false;
        for t in self.trans.iter_mut() {
            if !live[*t as usize] {
                *t = DEAD;
            }
        }
        if !live[self.start as usize] {
            self.start = DEAD;
        }
    }

    /// Per state, the sorted set of patterns matched at some state reachable from it.
    fn reachable_patterns(&self) -> Vec<Vec<u32>> {
        let mut reach: Vec<Vec<u32>> = self.matches.clone();
        loop {
            let mut changed = false;
            for s in 1..reach.len() {
                let mut acc = reach[s].clone();
                for &t in self.row(s as StateId) {
                    if t != DEAD {
                        acc.extend_from_slice(&reach[t as usize]);
                    }
                }
                acc.sort_unstable();
                acc.dedup();
                if acc.len() != reach[s].len() {
                    reach[s] = acc;
                    changed = true;
                }
            }
            if !changed {
                return reach;
            }
        }
    }

    /// The live states one byte away from `s`.
    pub fn successors(&self, s: StateId) -> impl Iterator<Item = StateId> + '_ {
        self.row(s).iter().copied().filter(|&t| t != DEAD)
    }

    /// Whether some byte continues from `s`.
    pub fn has_next(&self, s: StateId) -> bool {
        self.has_next[s as usize]
    }

    /// The patterns an input ending in `s` matches.
    pub fn matches(&self, s: StateId) -> &[u32] {
        &self.matches[s as usize]
    }

    /// The patterns some continuation from `s` can still match, sorted.
    pub fn reachable(&self, s: StateId) -> &[u32] {
        &self.reachable[s as usize]
    }

    fn row(&self, s: StateId) -> &[StateId] {
        &self.trans[s as usize * self.num_classes..][..self.num_classes]
    }

    pub fn start(&self) -> StateId {
        self.start
    }

    #[inline]
    pub fn next(&self, s: StateId, byte: u8) -> StateId {
        self.trans[s as usize * self.num_classes + self.classes[byte as usize] as usize]
    }

    /// Runs `bytes` from `s`; `DEAD` as soon as a byte is refused.
    pub fn run(&self, mut s: StateId, bytes: &[u8]) -> StateId {
        for &b in bytes {
            s = self.next(s, b);
            if s == DEAD {
                break;
            }
        }
        s
    }

    pub fn is_accepting(&self, s: StateId) -> bool {
        self.accepting[s as usize]
    }

    /// Roughly the heap memory this DFA holds, for caches that bound their size in bytes.
    pub fn heap_bytes(&self) -> usize {
        let lists: usize = self
            .matches
            .iter()
            .chain(&self.reachable)
            .map(|v| 24 + 4 * v.len())
            .sum();
        4 * self.trans.len() + 2 * self.accepting.len() + lists
    }

    pub fn num_states(&self) -> usize {
        self.accepting.len()
    }

    /// The only byte `s` can continue with, when there is exactly one and the input may not
    /// end here: a byte the automaton alone decides.
    pub fn forced_byte(&self, s: StateId) -> Option<u8> {
        if s == DEAD || self.is_accepting(s) {
            return None;
        }
        let mut live = self.row(s).iter().enumerate().filter(|(_, &t)| t != DEAD);
        let (class, _) = live.next()?;
        if live.next().is_some() {
            return None;
        }
        let mut bytes = (0..=255u8).filter(|&b| self.classes[b as usize] as usize == class);
        let b = bytes.next()?;
        bytes.next().is_none().then_some(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dfa(p: &str) -> ByteDfa {
        ByteDfa::from_regex(p, DfaLimits::default()).unwrap()
    }

    fn accepts(d: &ByteDfa, s: &str) -> bool {
        let end = d.run(d.start(), s.as_bytes());
        end != DEAD && d.is_accepting(end)
    }

    #[test]
    fn matches_whole_input_with_every_alternative_kept() {
        let d = dfa("a|ab|[0-9]{2,3}");
        for yes in ["a", "ab", "12", "123"] {
            assert!(accepts(&d, yes), "{yes}");
        }
        for no in ["", "abc", "1", "1234", "b"] {
            assert!(!accepts(&d, no), "{no}");
        }
    }

    #[test]
    fn doomed_states_are_dead_and_forced_bytes_are_found() {
        // After `x` comes an empty class that can never match: `x` is pruned at once.
        let d = dfa(r"x[a&&b]|yz");
        assert_eq!(d.next(d.start(), b'q'), DEAD);
        assert_eq!(d.next(d.start(), b'x'), DEAD);
        let y = d.next(d.start(), b'y');
        assert_eq!(d.forced_byte(y), Some(b'z'));
        assert_eq!(d.forced_byte(d.start()), Some(b'y'), "the pruned branch is no choice");
        let two = dfa("ab|ac");
        assert_eq!(two.forced_byte(two.start()), Some(b'a'));
        assert_eq!(two.forced_byte(two.next(two.start(), b'a')), None, "two ways to go");
        assert_eq!(d.forced_byte(d.next(y, b'z')), None, "may end here");
    }

    #[test]
    fn several_patterns_report_which_matched_and_which_remain_reachable() {
        let d = ByteDfa::from_regexes(&["name", "nam[a-z]+", "[0-9]+"], DfaLimits::default()).unwrap();
        let after = |s: &str| d.run(d.start(), s.as_bytes());
        assert_eq!(d.reachable(d.start()), &[0, 1, 2]);
        assert_eq!(d.reachable(after("na")), &[0, 1]);
        assert_eq!(d.matches(after("name")), &[0, 1]);
        assert_eq!(d.matches(after("namex")), &[1]);
        assert_eq!(d.reachable(after("12")), &[2]);
        assert!(d.matches(after("nam")).is_empty());
    }

    #[test]
    fn distances_count_the_fewest_bytes_to_a_match() {
        let d = dfa(r"abc|x[0-9]{2,}|\p{Greek}");
        let at = |s: &str| d.distance_to_accept(d.run(d.start(), s.as_bytes()));
        assert_eq!(at(""), 2, "a Greek letter is two bytes");
        assert_eq!((at("a"), at("ab"), at("abc")), (2, 1, 0));
        assert_eq!((at("x"), at("x1"), at("x12"), at("x123")), (2, 1, 0, 0));
        assert_eq!(d.distance_to_accept(DEAD), UNREACHABLE);
        // Some byte always lowers the distance by one: following them is a shortest completion.
        for s in 1..d.num_states() as StateId {
            let here = d.distance_to_accept(s);
            if here > 0 && here != UNREACHABLE {
                assert!(
                    (0..=255u8).any(|b| d.distance_to_accept(d.next(s, b)) == here - 1),
                    "state {s} at {here}: {:?}",
                    d.successors(s).map(|t| d.distance_to_accept(t)).collect::<Vec<_>>()
                );
            }
        }
    }

    #[test]
    fn unicode_classes_work_on_utf8_bytes() {
        let d = dfa(r"\p{Greek}+");
        assert!(accepts(&d, "αβγ"));
        assert!(!accepts(&d, "abc"));
        // A two-byte character split across tokens: the first byte alone is a live prefix.
        assert_ne!(d.next(d.start(), "α".as_bytes()[0]), DEAD);
    }

    #[test]
    fn oversized_patterns_are_typed_errors() {
        let limits = DfaLimits {
            build_bytes: 1 << 16,
            max_states: 1000,
        };
        assert!(matches!(
            ByteDfa::from_regex("[a-z]{1,5000}", limits),
            Err(GrammarError::Regex { .. } | GrammarError::TooLarge { .. })
        ));
        assert!(matches!(
            ByteDfa::from_regex("(", DfaLimits::default()),
            Err(GrammarError::Regex { .. })
        ));
    }
}
