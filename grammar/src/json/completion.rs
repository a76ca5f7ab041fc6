//! How far a matcher state is from a complete value: the fewest bytes that finish it. Every
//! byte is a token of a byte-level vocabulary, so a request with that many tokens left can
//! always close; masks under a token budget keep only the tokens after which it still can.
//!
//! The cost of a stack is exact (the length of a shortest completion the matcher accepts), so
//! from every unfinished state some byte lowers it by one: following those bytes is a valid
//! ending, which is what makes the budget a guarantee rather than a heuristic. It is summed
//! frame by frame from the top: what finishes the value on top, then what its parent still
//! owes once that value is done (required properties not yet written, `minItems`, closing
//! brackets), and so on down.

use std::collections::VecDeque;

use super::grammar::{JsonGrammar, KeyAutomaton, Lexeme};
use super::ir::{Node, NodeId};
use super::machine::{prop_blocked, Arena, ArrPhase, Frame, ObjPhase, Stack, BOTTOM};
use crate::dfa::{StateId, DEAD, UNREACHABLE};

/// The cost of what can never complete.
pub const INF: u64 = u64::MAX / 4;

/// Per node, what its values cost at the least; computed once per grammar.
pub(crate) struct Costs {
    /// The fewest bytes of a complete value of each node.
    value: Vec<u64>,
    /// Per object node, per declared property: `"name":` and its cheapest value.
    props: Vec<Vec<u64>>,
    /// Per object node: the cheapest pair under a key that is not a declared name (a pattern
    /// property or an additional property), quotes and colon included.
    extra: Vec<u64>,
}

/// Where an object stands when the rest of it is priced.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ObjectAt {
    /// After `{`: no comma before the first pair.
    Open,
    /// After a value: a comma before each further pair.
    AfterValue,
    /// After a comma: a pair must follow.
    Comma,
}

fn add(a: u64, b: u64) -> u64 {
    a.saturating_add(b).min(INF)
}

fn dist(d: u32) -> u64 {
    if d == UNREACHABLE {
        INF
    } else {
        d as u64
    }
}

impl JsonGrammar {
    pub(crate) fn costs(&self) -> &Costs {
        self.costs.get_or_init(|| self.compute_costs())
    }

    /// Node costs by fixpoint: recursive schemas refer to themselves, and a node's cost only
    /// falls as its parts' costs become known, so repeating until nothing changes ends.
    fn compute_costs(&self) -> Costs {
        let n = self.graph.nodes.len();
        let mut c = Costs {
            value: vec![INF; n],
            props: vec![Vec::new(); n],
            extra: vec![INF; n],
        };
        loop {
            let mut changed = false;
            for id in 0..n {
                if let Some(keys) = &self.keys[id] {
                    c.props[id] = (0..keys.num_props as usize)
                        .map(|p| add(keys.name_len[p] as u64 + 3, c.value[keys.values[p] as usize]))
                        .collect();
                    c.extra[id] = self.extra_pair_cost(keys, &c);
                }
                let v = self.node_cost(id as NodeId, &c);
                if v < c.value[id] {
                    c.value[id] = v;
                    changed = true;
                }
            }
            if !changed {
                return c;
            }
        }
    }

    /// Costs are the schema's, shared by every request: a document's free strings cost what
    /// any free string costs (two quotes), so they are priced by the plain lexemes.
    fn node_cost(&self, id: NodeId, c: &Costs) -> u64 {
        let lexeme = |lex: u32| dist(self.lexemes[lex as usize].distance_to_accept(self.lexemes[lex as usize].start()));
        match (self.graph.node(id), self.node_lexeme[id as usize]) {
            (Node::AnyOf(alts), _) => alts.iter().map(|&a| c.value[a as usize]).min().unwrap_or(INF),
            (Node::Object(_), _) => add(1, self.object_rest(id, c, &[], 0, ObjectAt::Open)),
            (Node::Array(_), _) => add(1, self.array_rest(id, c, 0, ArrPhase::Open)),
            (_, Some(Lexeme::Whole(lex))) => lexeme(lex),
            (_, Some(Lexeme::StringBody(lex))) => add(lexeme(lex), 2),
            _ => INF,
        }
    }

    /// The cheapest pair under a key beyond the declared names: the shortest key the key
    /// automaton ends on such a pattern, its quotes, the colon and the pattern's cheapest value.
    fn extra_pair_cost(&self, keys: &KeyAutomaton, c: &Costs) -> u64 {
        if !keys.open {
            return INF;
        }
        let mut best = INF;
        key_distances(keys, keys.dfa.start(), |state, d| {
            let m = keys.dfa.matches(state);
            if !m.iter().any(|&p| p < keys.num_props) {
                if let Some(&p) = m.first() {
                    best = best.min(add(d + 3, c.value[keys.values[p as usize] as usize]));
                }
            }
            d + 3 < best
        });
        best
    }

    /// The fewest bytes that take stack `s` to a complete value (0 when it is one): each
    /// frame's share plus the cost of the stack below it, remembered per frame in the arena.
    pub(crate) fn completion_cost(&self, arena: &Arena, s: Stack) -> u64 {
        if let Some(known) = arena.known_cost(s) {
            return known;
        }
        // Down to the first frame whose cost is known, then back up, remembering each.
        let mut path = Vec::new();
        let mut below = s;
        let mut base = loop {
            if below == BOTTOM {
                break 0;
            }
            if let Some(known) = arena.known_cost(below) {
                break known;
            }
            let (here, next) = self.frame_share(arena, below);
            path.push((below, here));
            below = next;
        };
        for &(frame, here) in path.iter().rev() {
            base = add(base, here);
            arena.remember_cost(frame, base);
        }
        base
    }

    /// What frame `s` adds to the cost of the stack below it, and the frame that stack starts
    /// at (a key frame speaks for its object too).
    fn frame_share(&self, arena: &Arena, s: Stack) -> (u64, Stack) {
        let c = self.costs();
        let parent = arena.parent(s);
        match arena.top(s) {
            Frame::Bottom => (0, BOTTOM),
            Frame::Value { node } => (c.value[node as usize], parent),
            Frame::Lexeme { lex, state } => (dist(self.lexeme(lex).distance_to_accept(state)), parent),
            Frame::Str { lex, state } => (add(dist(self.body(lex).distance_to_accept(state)), 1), parent),
            Frame::Key { node, state, .. } => {
                let Frame::Object { count, seen, .. } = arena.top(parent) else {
                    return (INF, BOTTOM);
                };
                (self.key_rest(arena, node, state, seen, count), arena.parent(parent))
            }
            Frame::Object {
                node,
                phase,
                count,
                seen,
                ..
            } => {
                let mut written = self.seen_list(arena, node, seen);
                let here = match phase {
                    ObjPhase::Open => self.object_rest(node, c, &written, count, ObjectAt::Open),
                    ObjPhase::Comma => self.object_rest(node, c, &written, count, ObjectAt::Comma),
                    ObjPhase::AfterValue => self.object_rest(node, c, &written, count, ObjectAt::AfterValue),
                    ObjPhase::AfterKey { value, prop } | ObjPhase::Colon { value, prop } => {
                        let colon = matches!(phase, ObjPhase::AfterKey { .. }) as u64;
                        let count = self.pair_written(node, &mut written, count, prop);
                        add(
                            colon + c.value[value as usize],
                            self.object_rest(node, c, &written, count, ObjectAt::AfterValue),
                        )
                    }
                    ObjPhase::InValue { prop } => {
                        let count = self.pair_written(node, &mut written, count, prop);
                        self.object_rest(node, c, &written, count, ObjectAt::AfterValue)
                    }
                    // The key frame above prices the rest of the object.
                    ObjPhase::InKey => 0,
                };
                (here, parent)
            }
            Frame::Array { node, phase, index, .. } => {
                let here = match phase {
                    ArrPhase::InValue => self.array_rest(node, c, index + 1, ArrPhase::AfterValue),
                    p => self.array_rest(node, c, index, p),
                };
                (here, parent)
            }
        }
    }

    /// The declared properties an object has written, ascending.
    fn seen_list(&self, arena: &Arena, node: NodeId, seen: u32) -> Vec<u32> {
        let n = self.keys[node as usize].as_ref().map_or(0, |k| k.num_props);
        (0..n).filter(|&p| arena.has_seen(seen, p)).collect()
    }

    /// Adds the pair of `prop` (a declared property, or another key) to what an object has
    /// written; its new count.
    fn pair_written(&self, node: NodeId, written: &mut Vec<u32>, count: u32, prop: Option<u32>) -> u32 {
        if let Some(p) = prop {
            if let Err(at) = written.binary_search(&p) {
                written.insert(at, p);
            }
        }
        (count + 1).min(self.count_cap(node))
    }

    fn prop_blocked(&self, keys: &KeyAutomaton, written: &[u32], p: u32) -> bool {
        prop_blocked(
            self.ordered,
            keys,
            p,
            |q| written.binary_search(&q).is_ok(),
            || written.last().copied(),
        )
    }

    /// What an object still costs from `at`, given the declared properties it has written and
    /// its pair count: the required properties missing, enough further pairs for
    /// `minProperties` (the cheapest ones), separators and the closing brace.
    fn object_rest(&self, node: NodeId, c: &Costs, written: &[u32], count: u32, at: ObjectAt) -> u64 {
        let (Some(keys), Node::Object(rules)) = (&self.keys[node as usize], self.graph.node(node)) else {
            return INF;
        };
        let props = &c.props[node as usize];
        let mut pairs: Vec<u64> = keys
            .required_sorted
            .iter()
            .filter(|r| written.binary_search(r).is_err())
            .map(|&r| props.get(r as usize).copied().unwrap_or(INF))
            .collect();
        let mut owed = (rules.min_properties as usize).saturating_sub(count as usize + pairs.len());
        if owed == 0 && pairs.is_empty() && at == ObjectAt::Comma {
            owed = 1;
        }
        if owed > 0 {
            // Optional declared properties still allowed, each once, then the repeatable
            // cheapest other key.
            let mut optional: Vec<u64> = (0..keys.num_props)
                // In schema order an optional property may still come anywhere after the last
                // one written, before or after the required ones still missing.
                .filter(|p| {
                    !keys.required_sorted.contains(p)
                        && written.binary_search(p).is_err()
                        && !(self.ordered && written.last().is_some_and(|&m| *p < m))
                })
                .map(|p| props[p as usize])
                .collect();
            optional.sort_unstable();
            let extra = c.extra[node as usize];
            let mut optional = optional.into_iter().peekable();
            for _ in 0..owed {
                let pick = match optional.peek() {
                    Some(&o) if o <= extra => {
                        optional.next();
                        o
                    }
                    _ => extra,
                };
                pairs.push(pick);
            }
        }
        let k = pairs.len() as u64;
        let separators = match at {
            ObjectAt::Open | ObjectAt::Comma => k.saturating_sub(1),
            ObjectAt::AfterValue => k,
        };
        pairs.into_iter().fold(add(separators, 1), add)
    }

    /// What an array still costs from `phase` with `index` items written: the items
    /// `minItems` still asks for (at least one after a comma), their commas and the bracket.
    fn array_rest(&self, node: NodeId, c: &Costs, index: u32, phase: ArrPhase) -> u64 {
        let Node::Array(rules) = self.graph.node(node) else {
            return INF;
        };
        let item = |i: u64| c.value[rules.prefix.get(i as usize).copied().unwrap_or(rules.items) as usize];
        let from = index as u64;
        let mut to = rules.min_items.max(from);
        if phase == ArrPhase::Comma {
            to = to.max(from + 1);
        }
        let n = to - from;
        // Positions inside the prefix one by one, the rest at the items' cost.
        let prefix_end = (rules.prefix.len() as u64).clamp(from, to);
        let mut items = (from..prefix_end).map(item).fold(0, add);
        if to > prefix_end {
            items = add(
                items,
                c.value[rules.items as usize].saturating_mul(to - prefix_end).min(INF),
            );
        }
        let commas = match phase {
            ArrPhase::AfterValue => n,
            _ => n.saturating_sub(1),
        };
        add(items, add(commas, 1))
    }

    /// What the rest of an object costs from inside a key at key-automaton `state`: finish
    /// some key it may still write, its closing quote and colon, that key's cheapest value,
    /// then the rest of the object.
    fn key_rest(&self, arena: &Arena, node: NodeId, state: StateId, seen: u32, count: u32) -> u64 {
        let c = self.costs();
        let Some(keys) = &self.keys[node as usize] else {
            return INF;
        };
        let written = self.seen_list(arena, node, seen);
        let mut best = INF;
        // What follows a key depends only on its value and declared property: priced once each.
        let mut after: Vec<((NodeId, Option<u32>), u64)> = Vec::new();
        key_distances(keys, state, |end, d| {
            // As the matcher closes a key: a declared name wins over patterns.
            let m = keys.dfa.matches(end);
            let pair = match m.iter().find(|&&p| p < keys.num_props) {
                Some(&p) if self.prop_blocked(keys, &written, p) => None,
                Some(&p) => Some((keys.values[p as usize], Some(p))),
                None => m.first().map(|&p| (keys.values[p as usize], None)),
            };
            if let Some((value, prop)) = pair {
                let rest = match after.iter().find(|(k, _)| *k == (value, prop)) {
                    Some(&(_, r)) => r,
                    None => {
                        let mut w = written.clone();
                        let count = self.pair_written(node, &mut w, count, prop);
                        let r = add(
                            c.value[value as usize],
                            self.object_rest(node, c, &w, count, ObjectAt::AfterValue),
                        );
                        after.push(((value, prop), r));
                        r
                    }
                };
                best = best.min(add(d + 2, rest));
            }
            // Farther keys cost at least their distance, the quote and the colon.
            d + 3 < best
        });
        best
    }
}

/// Visits the accepting states of an object's key automaton reachable from `from`, with their
/// distance in bytes, nearest first, while `visit` asks for more.
fn key_distances(keys: &KeyAutomaton, from: StateId, mut visit: impl FnMut(StateId, u64) -> bool) {
    if from == DEAD {
        return;
    }
    let mut dist = vec![u64::MAX; keys.dfa.num_states()];
    let mut queue = VecDeque::from([from]);
    dist[from as usize] = 0;
    while let Some(s) = queue.pop_front() {
        let d = dist[s as usize];
        if keys.dfa.is_accepting(s) && !visit(s, d) {
            return;
        }
        for t in keys.dfa.successors(s) {
            if dist[t as usize] == u64::MAX {
                dist[t as usize] = d + 1;
                queue.push_back(t);
            }
        }
    }
}
