//! The JSON matcher's state: a set of stacks of frames (several while `anyOf` alternatives
//! are all still possible), stored persistently in an arena so that stepping one byte only
//! appends the frames that change and a trie walk can fork states for free.

use std::cell::RefCell;

use super::grammar::{JsonGrammar, KeyAutomaton, LexId, Lexeme};
use super::ir::{Node, NodeId};
use super::lexemes::Whitespace;
use crate::dedup::{dedup_stacks, Scratch};
use crate::dfa::{StateId, DEAD};

/// Index of a stack's top frame in the arena; `BOTTOM` is the empty stack (value complete).
pub use crate::stacks::Stack;
pub const BOTTOM: Stack = 0;

/// Guards against `anyOf` aliases that refer to each other without ever consuming a byte.
const MAX_EXPANSION: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ObjPhase {
    /// After `{`: a key or `}`.
    Open,
    /// Inside a key (a `Key` frame is on top).
    InKey,
    /// After a key: `:`. Carries the value schema and the declared property, if any.
    AfterKey { value: NodeId, prop: Option<u32> },
    /// After `:`: the value.
    Colon { value: NodeId, prop: Option<u32> },
    /// Inside a value (its frames are on top).
    InValue { prop: Option<u32> },
    /// After a value: `,` or `}`.
    AfterValue,
    /// After `,`: a key.
    Comma,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArrPhase {
    Open,
    InValue,
    AfterValue,
    Comma,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Frame {
    Bottom,
    /// A value of `node`, not started yet.
    Value {
        node: NodeId,
    },
    /// Inside a scalar lexeme.
    Lexeme {
        lex: LexId,
        state: StateId,
    },
    /// Inside a string's body (after its opening quote).
    Str {
        lex: LexId,
        state: StateId,
    },
    Object {
        node: NodeId,
        phase: ObjPhase,
        ws: u8,
        count: u32,
        seen: u32,
    },
    /// Inside a key of the object frame below. `body` follows the same bytes through the
    /// plain string body lexeme when the object takes any key: which tokens stay inside such a
    /// key depends on that state alone.
    Key {
        node: NodeId,
        state: StateId,
        body: StateId,
    },
    Array {
        node: NodeId,
        phase: ArrPhase,
        ws: u8,
        index: u32,
    },
}

/// The empty set of seen properties.
pub const NO_PROPS: u32 = u32::MAX;

/// Frames with parent links, and the declared properties each object has seen: bitsets of
/// the object's word count, never changed once written (adding a property copies the set),
/// so forked stacks share them.
pub struct Arena {
    frames: Vec<(Frame, Stack)>,
    seen: Vec<u64>,
    /// Per frame, the completion cost of the stack it tops, once asked for: frames never
    /// change once written, so a token's check prices only the frames it pushed.
    costs: RefCell<Vec<u64>>,
}

impl Default for Arena {
    fn default() -> Self {
        Arena {
            frames: vec![(Frame::Bottom, BOTTOM)],
            seen: Vec::new(),
            costs: RefCell::new(vec![0]),
        }
    }
}

/// A frame's completion cost not worked out yet.
pub(crate) const UNKNOWN_COST: u64 = u64::MAX;

impl Arena {
    pub fn mark(&self) -> (usize, usize) {
        (self.frames.len(), self.seen.len())
    }

    pub fn reset_to(&mut self, mark: (usize, usize)) {
        self.frames.truncate(mark.0);
        self.seen.truncate(mark.1);
        self.costs.get_mut().truncate(mark.0);
    }

    /// The cost remembered for the stack topped by frame `s`.
    pub(crate) fn known_cost(&self, s: Stack) -> Option<u64> {
        self.costs
            .borrow()
            .get(s as usize)
            .copied()
            .filter(|&c| c != UNKNOWN_COST)
    }

    pub(crate) fn remember_cost(&self, s: Stack, cost: u64) {
        let mut costs = self.costs.borrow_mut();
        if costs.len() <= s as usize {
            costs.resize(self.frames.len().max(s as usize + 1), UNKNOWN_COST);
        }
        costs[s as usize] = cost;
    }

    pub fn push(&mut self, parent: Stack, frame: Frame) -> Stack {
        self.frames.push((frame, parent));
        (self.frames.len() - 1) as Stack
    }

    pub fn top(&self, s: Stack) -> Frame {
        self.frames[s as usize].0
    }

    pub fn parent(&self, s: Stack) -> Stack {
        self.frames[s as usize].1
    }

    fn replace(&mut self, s: Stack, frame: Frame) -> Stack {
        let parent = self.parent(s);
        self.push(parent, frame)
    }

    pub(crate) fn has_seen(&self, set: u32, prop: u32) -> bool {
        set != NO_PROPS && self.seen[set as usize + (prop / 64) as usize] >> (prop % 64) & 1 == 1
    }

    /// The highest property index in the set.
    fn max_seen(&self, set: u32, words: usize) -> Option<u32> {
        if set == NO_PROPS {
            return None;
        }
        let w = &self.seen[set as usize..set as usize + words];
        (0..words)
            .rev()
            .find(|&i| w[i] != 0)
            .map(|i| i as u32 * 64 + 63 - w[i].leading_zeros())
    }

    fn seen_count(&self, set: u32, words: usize) -> u32 {
        if set == NO_PROPS {
            return 0;
        }
        self.seen[set as usize..set as usize + words]
            .iter()
            .map(|w| w.count_ones())
            .sum()
    }

    fn add_seen(&mut self, set: u32, prop: u32, words: usize) -> u32 {
        let at = self.seen.len();
        if set == NO_PROPS {
            self.seen.resize(at + words, 0);
        } else {
            self.seen.extend_from_within(set as usize..set as usize + words);
        }
        self.seen[at + (prop / 64) as usize] |= 1 << (prop % 64);
        at as u32
    }
}

/// Whether declared property `p` may no longer come, given what is written (`written`, and
/// the highest index written): not twice, and, with properties in schema order, not before
/// one already written nor past a required one still missing (that one could then never come).
pub(crate) fn prop_blocked(
    ordered: bool,
    keys: &KeyAutomaton,
    p: u32,
    written: impl Fn(u32) -> bool,
    last: impl FnOnce() -> Option<u32>,
) -> bool {
    written(p)
        || ordered
            && (last().is_some_and(|m| p < m)
                || keys
                    .required_sorted
                    .iter()
                    .take_while(|&&r| r < p)
                    .any(|&r| !written(r)))
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl JsonGrammar {
    pub fn start(&self, arena: &mut Arena) -> Stack {
        arena.push(BOTTOM, Frame::Value { node: self.graph.root })
    }

    /// Appends a stack's content, top to bottom, to `out`: equal for stacks that behave the
    /// same on every input, wherever their frames and seen sets live in the arena.
    pub fn encode(&self, arena: &Arena, mut s: Stack, out: &mut Vec<u32>) {
        let opt = |p: Option<u32>| p.map_or(u32::MAX, |p| p);
        while s != BOTTOM {
            match arena.top(s) {
                Frame::Bottom => {}
                Frame::Value { node } => out.extend([1, node]),
                Frame::Lexeme { lex, state } => out.extend([2, lex, state]),
                Frame::Str { lex, state } => out.extend([3, lex, state]),
                Frame::Key { node, state, body } => out.extend([4, node, state, body]),
                Frame::Array { node, phase, ws, index } => out.extend([5, node, phase as u32, ws as u32, index]),
                Frame::Object {
                    node,
                    phase,
                    ws,
                    count,
                    seen,
                } => {
                    let (p, a, b) = match phase {
                        ObjPhase::Open => (0, 0, 0),
                        ObjPhase::InKey => (1, 0, 0),
                        ObjPhase::AfterKey { value, prop } => (2, value, opt(prop)),
                        ObjPhase::Colon { value, prop } => (3, value, opt(prop)),
                        ObjPhase::InValue { prop } => (4, 0, opt(prop)),
                        ObjPhase::AfterValue => (5, 0, 0),
                        ObjPhase::Comma => (6, 0, 0),
                    };
                    out.extend([6, node, p, a, b, ws as u32, count]);
                    let words = self.seen_words(node);
                    if seen == NO_PROPS {
                        out.extend(std::iter::repeat_n(0, 2 * words));
                    } else {
                        for &w in &arena.seen[seen as usize..seen as usize + words] {
                            out.extend([w as u32, (w >> 32) as u32]);
                        }
                    }
                }
            }
            s = arena.parent(s);
        }
        out.push(0);
    }

    /// Drops stacks whose content equals an earlier one's. Large `anyOf`s of similar objects
    /// otherwise multiply into thousands of copies of the same state.
    pub fn dedup(&self, arena: &Arena, stacks: &mut Vec<Stack>, scratch: &mut Scratch) {
        dedup_stacks(stacks, scratch, |s, words| self.encode(arena, s, words));
    }

    /// Words in the seen-property bitset of object `node`.
    fn seen_words(&self, node: NodeId) -> usize {
        self.keys[node as usize]
            .as_ref()
            .map_or(0, |k| k.num_props.div_ceil(64) as usize)
    }

    /// The count past which an object's property count, or an array's item index, no longer
    /// changes what may follow: counting stops there, so that the states of, say, every item of
    /// a long array compare equal.
    pub(crate) fn count_cap(&self, node: NodeId) -> u32 {
        let cap = match self.graph.node(node) {
            Node::Object(r) => r.min_properties.max(r.max_properties.unwrap_or(0)),
            Node::Array(r) => (r.prefix.len() as u64).max(r.min_items).max(r.max_items.unwrap_or(0)),
            _ => 0,
        };
        cap.min(u32::MAX as u64 - 1) as u32
    }

    fn max_ws(&self) -> u8 {
        match self.whitespace {
            Whitespace::Compact => 0,
            Whitespace::Flexible { max_run } => max_run,
        }
    }

    /// The stack is a complete value (EOS may follow).
    pub fn can_finish(&self, arena: &Arena, s: Stack) -> bool {
        if s == BOTTOM {
            return true;
        }
        match arena.top(s) {
            Frame::Lexeme { lex, state } => arena.parent(s) == BOTTOM && self.lexeme(lex).is_accepting(state),
            _ => false,
        }
    }

    /// Every stack `s` can become after `b`, appended to `out`.
    pub fn step(&self, arena: &mut Arena, s: Stack, b: u8, out: &mut Vec<Stack>) {
        self.step_at(arena, s, b, out, 0)
    }

    fn step_at(&self, arena: &mut Arena, s: Stack, b: u8, out: &mut Vec<Stack>, depth: usize) {
        if depth > MAX_EXPANSION {
            return;
        }
        match arena.top(s) {
            Frame::Bottom => {}
            Frame::Value { node } => self.start_value(arena, s, node, b, out, depth),
            Frame::Lexeme { lex, state } => {
                let dfa = self.lexeme(lex);
                let next = dfa.next(state, b);
                if next != DEAD {
                    let t = arena.replace(s, Frame::Lexeme { lex, state: next });
                    if dfa.is_accepting(next) && !dfa.has_next(next) {
                        // A closed string or literal: the value is done right away.
                        self.finish_value(arena, t, out);
                    } else {
                        out.push(t);
                    }
                }
                // A number ends only where the next byte cannot continue it.
                if dfa.is_accepting(state) && dfa.has_next(state) {
                    if let Some(p) = self.value_done(arena, arena.parent(s)) {
                        self.step_at(arena, p, b, out, depth + 1);
                    }
                }
            }
            Frame::Str { lex, state } => {
                let dfa = self.body(lex);
                // The body takes the byte first: a quote inside an escape (`\"`) is text. A
                // quote the body cannot take closes the string, if the body is complete there
                // (mid-escape it never is, so the two cannot both apply).
                let next = dfa.next(state, b);
                if next != DEAD {
                    out.push(arena.replace(s, Frame::Str { lex, state: next }));
                } else if b == b'"' && dfa.is_accepting(state) {
                    self.finish_value(arena, s, out);
                }
            }
            Frame::Object {
                node,
                phase,
                ws,
                count,
                seen,
            } => self.step_object(arena, s, (node, phase, ws, count, seen), b, out, depth),
            Frame::Key { node, state, body } => self.step_key(arena, s, (node, state, body), b, out),
            Frame::Array { node, phase, ws, index } => {
                self.step_array(arena, s, (node, phase, ws, index), b, out, depth)
            }
        }
    }

    fn start_value(&self, arena: &mut Arena, s: Stack, node: NodeId, b: u8, out: &mut Vec<Stack>, depth: usize) {
        match self.graph.node(node) {
            Node::AnyOf(alts) => {
                let strings = self.lexeme_of(node);
                if let Some(Lexeme::StringBody(lex)) = strings {
                    let state = self.body(lex).start();
                    if b == b'"' && state != DEAD {
                        out.push(arena.replace(s, Frame::Str { lex, state }));
                    }
                }
                for &alt in alts {
                    if strings.is_some() && matches!(self.graph.node(alt), Node::String(_)) {
                        continue;
                    }
                    let t = arena.replace(s, Frame::Value { node: alt });
                    self.step_at(arena, t, b, out, depth + 1);
                }
            }
            Node::Object(_) if b == b'{' => {
                out.push(arena.replace(
                    s,
                    Frame::Object {
                        node,
                        phase: ObjPhase::Open,
                        ws: 0,
                        count: 0,
                        seen: NO_PROPS,
                    },
                ));
            }
            Node::Array(_) if b == b'[' => {
                out.push(arena.replace(
                    s,
                    Frame::Array {
                        node,
                        phase: ArrPhase::Open,
                        ws: 0,
                        index: 0,
                    },
                ));
            }
            _ => match self.lexeme_of(node) {
                Some(Lexeme::Whole(lex)) => {
                    let start = self.lexeme(lex).start();
                    let t = arena.replace(s, Frame::Lexeme { lex, state: start });
                    self.step_at(arena, t, b, out, depth + 1);
                }
                Some(Lexeme::StringBody(lex)) if b == b'"' => {
                    let state = self.body(lex).start();
                    if state != DEAD {
                        out.push(arena.replace(s, Frame::Str { lex, state }));
                    }
                }
                _ => {}
            },
        }
    }

    /// The value on top of `s` is finished: its parent moves past it, if it can.
    fn finish_value(&self, arena: &mut Arena, s: Stack, out: &mut Vec<Stack>) {
        if let Some(p) = self.value_done(arena, arena.parent(s)) {
            out.push(p);
        }
    }

    /// The parent of a finished value moves past it; `None` when it cannot.
    fn value_done(&self, arena: &mut Arena, p: Stack) -> Option<Stack> {
        match arena.top(p) {
            Frame::Bottom => Some(BOTTOM),
            Frame::Object {
                node,
                phase: ObjPhase::InValue { prop },
                count,
                seen,
                ..
            } => {
                let seen = match prop {
                    Some(i) => arena.add_seen(seen, i, self.seen_words(node)),
                    None => seen,
                };
                Some(arena.replace(
                    p,
                    Frame::Object {
                        node,
                        phase: ObjPhase::AfterValue,
                        ws: 0,
                        count: (count + 1).min(self.count_cap(node)),
                        seen,
                    },
                ))
            }
            Frame::Array {
                node,
                phase: ArrPhase::InValue,
                index,
                ..
            } => Some(arena.replace(
                p,
                Frame::Array {
                    node,
                    phase: ArrPhase::AfterValue,
                    ws: 0,
                    index: (index + 1).min(self.count_cap(node)),
                },
            )),
            _ => None,
        }
    }

    fn step_object(
        &self,
        arena: &mut Arena,
        s: Stack,
        f: (NodeId, ObjPhase, u8, u32, u32),
        b: u8,
        out: &mut Vec<Stack>,
        depth: usize,
    ) {
        let (node, phase, ws, count, seen) = f;
        let keys = self.keys[node as usize].as_ref().expect("object nodes have keys");
        let Node::Object(rules) = self.graph.node(node) else {
            return;
        };
        let ws_allowed = !matches!(phase, ObjPhase::InKey | ObjPhase::InValue { .. });
        if ws_allowed && is_ws(b) && ws < self.max_ws() {
            out.push(arena.replace(
                s,
                Frame::Object {
                    node,
                    phase,
                    ws: ws + 1,
                    count,
                    seen,
                },
            ));
            return;
        }
        let closable = keys.required.iter().all(|&r| arena.has_seen(seen, r)) && count as u64 >= rules.min_properties;
        let words = self.seen_words(node);
        let declared_left = if self.ordered {
            // In schema order only properties after the last one written can still come.
            arena.max_seen(seen, words).map_or(0, |m| m + 1) < keys.num_props
        } else {
            arena.seen_count(seen, words) < keys.num_props
        };
        let more = rules.max_properties.is_none_or(|m| (count as u64) < m) && (keys.open || declared_left);
        match phase {
            // A key may open after `{` only if the object may have one at all.
            ObjPhase::Open | ObjPhase::Comma if b == b'"' && (phase == ObjPhase::Comma || more) => {
                let state = keys.dfa.start();
                if self.key_viable(arena, node, seen, state) {
                    let o = arena.replace(
                        s,
                        Frame::Object {
                            node,
                            phase: ObjPhase::InKey,
                            ws: 0,
                            count,
                            seen,
                        },
                    );
                    let body = match (keys.any_key, self.any_string) {
                        (true, Some(lex)) => self.lexeme(lex).start(),
                        _ => DEAD,
                    };
                    out.push(arena.push(o, Frame::Key { node, state, body }));
                }
            }
            ObjPhase::Open | ObjPhase::AfterValue if b == b'}' && closable => {
                self.finish_value(arena, s, out);
            }
            ObjPhase::AfterValue if b == b',' && more => {
                out.push(arena.replace(
                    s,
                    Frame::Object {
                        node,
                        phase: ObjPhase::Comma,
                        ws: 0,
                        count,
                        seen,
                    },
                ));
            }
            ObjPhase::AfterKey { value, prop } if b == b':' => {
                out.push(arena.replace(
                    s,
                    Frame::Object {
                        node,
                        phase: ObjPhase::Colon { value, prop },
                        ws: 0,
                        count,
                        seen,
                    },
                ));
            }
            ObjPhase::Colon { value, prop } => {
                let o = arena.replace(
                    s,
                    Frame::Object {
                        node,
                        phase: ObjPhase::InValue { prop },
                        ws: 0,
                        count,
                        seen,
                    },
                );
                let v = arena.push(o, Frame::Value { node: value });
                self.step_at(arena, v, b, out, depth + 1);
            }
            _ => {}
        }
    }

    /// Some key this state can still become is allowed: a declared property not yet seen, or
    /// a pattern property or other key.
    fn key_viable(&self, arena: &Arena, node: NodeId, seen: u32, state: StateId) -> bool {
        let keys = self.keys[node as usize].as_ref().expect("object nodes have keys");
        state != DEAD
            && keys
                .dfa
                .reachable(state)
                .iter()
                .any(|&p| p >= keys.num_props || !self.blocked(arena, node, seen, p))
    }

    /// Whether declared property `p` can no longer be written to an object with `seen`.
    fn blocked(&self, arena: &Arena, node: NodeId, seen: u32, p: u32) -> bool {
        let keys = self.keys[node as usize].as_ref().expect("object nodes have keys");
        prop_blocked(
            self.ordered,
            keys,
            p,
            |q| arena.has_seen(seen, q),
            || arena.max_seen(seen, self.seen_words(node)),
        )
    }

    fn step_key(&self, arena: &mut Arena, s: Stack, f: (NodeId, StateId, StateId), b: u8, out: &mut Vec<Stack>) {
        let (node, state, body) = f;
        let keys = self.keys[node as usize].as_ref().expect("object nodes have keys");
        let obj = arena.parent(s);
        let Frame::Object { count, seen, .. } = arena.top(obj) else {
            return;
        };
        // As in string bodies: the key's DFA takes the byte first (`\"` inside an escape), and
        // only a quote it cannot take closes the key.
        let next = keys.dfa.next(state, b);
        if next != DEAD || b != b'"' {
            if self.key_viable(arena, node, seen, next) {
                let body = match self.any_string {
                    Some(lex) if body != DEAD => self.lexeme(lex).next(body, b),
                    _ => DEAD,
                };
                out.push(arena.replace(
                    s,
                    Frame::Key {
                        node,
                        state: next,
                        body,
                    },
                ));
            }
            return;
        }
        // The closing quote: a declared name wins over patterns and other keys.
        let matched = keys.dfa.matches(state);
        let (value, prop) = match matched.iter().find(|&&p| p < keys.num_props) {
            Some(&p) if self.blocked(arena, node, seen, p) => return,
            Some(&p) => (keys.values[p as usize], Some(p)),
            None => match matched.first() {
                Some(&p) => (keys.values[p as usize], None),
                None => return,
            },
        };
        out.push(arena.replace(
            obj,
            Frame::Object {
                node,
                phase: ObjPhase::AfterKey { value, prop },
                ws: 0,
                count,
                seen,
            },
        ));
    }

    fn step_array(
        &self,
        arena: &mut Arena,
        s: Stack,
        f: (NodeId, ArrPhase, u8, u32),
        b: u8,
        out: &mut Vec<Stack>,
        depth: usize,
    ) {
        let (node, phase, ws, index) = f;
        let Node::Array(rules) = self.graph.node(node) else {
            return;
        };
        if phase != ArrPhase::InValue && is_ws(b) && ws < self.max_ws() {
            out.push(arena.replace(
                s,
                Frame::Array {
                    node,
                    phase,
                    ws: ws + 1,
                    index,
                },
            ));
            return;
        }
        let item = |i: u32| rules.prefix.get(i as usize).copied().unwrap_or(rules.items);
        let may_add =
            rules.max_items.is_none_or(|m| (index as u64) < m) && !matches!(self.graph.node(item(index)), Node::Never);
        let may_close = index as u64 >= rules.min_items;
        match phase {
            ArrPhase::Open | ArrPhase::AfterValue if b == b']' && may_close => {
                self.finish_value(arena, s, out);
            }
            ArrPhase::AfterValue if b == b',' && may_add => {
                out.push(arena.replace(
                    s,
                    Frame::Array {
                        node,
                        phase: ArrPhase::Comma,
                        ws: 0,
                        index,
                    },
                ));
            }
            ArrPhase::Open | ArrPhase::Comma if may_add => {
                let a = arena.replace(
                    s,
                    Frame::Array {
                        node,
                        phase: ArrPhase::InValue,
                        ws: 0,
                        index,
                    },
                );
                let v = arena.push(a, Frame::Value { node: item(index) });
                self.step_at(arena, v, b, out, depth + 1);
            }
            _ => {}
        }
    }
}
