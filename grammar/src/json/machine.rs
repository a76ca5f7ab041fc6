//! The JSON matcher's state: a set of stacks of frames (several while `anyOf` alternatives
//! are all still possible), stored persistently in an arena so that stepping one byte only
//! appends the frames that change and a trie walk can fork states for free.

use super::grammar::{JsonGrammar, LexId, Lexeme};
use super::ir::{Node, NodeId};
use super::lexemes::Whitespace;
use crate::dfa::{StateId, DEAD};

/// Index of a stack's top frame in the arena; `BOTTOM` is the empty stack (value complete).
pub type Stack = u32;
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
    /// Inside a key of the object frame below.
    Key {
        node: NodeId,
        state: StateId,
    },
    Array {
        node: NodeId,
        phase: ArrPhase,
        ws: u8,
        index: u32,
    },
}

/// Frames with parent links, and the declared properties each object has seen (a persistent
/// list: `seen` is the head index, 0 the empty list).
pub struct Arena {
    frames: Vec<(Frame, Stack)>,
    seen: Vec<(u32, u32)>,
}

impl Default for Arena {
    fn default() -> Self {
        Arena {
            frames: vec![(Frame::Bottom, BOTTOM)],
            seen: vec![(u32::MAX, 0)],
        }
    }
}

impl Arena {
    pub fn mark(&self) -> (usize, usize) {
        (self.frames.len(), self.seen.len())
    }

    pub fn reset_to(&mut self, mark: (usize, usize)) {
        self.frames.truncate(mark.0);
        self.seen.truncate(mark.1);
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

    /// The properties of a seen list, sorted: two lists are the same set whatever their order
    /// or where in the arena they live.
    fn seen_set(&self, mut list: u32) -> Vec<u32> {
        let mut out = Vec::new();
        while list != 0 {
            let (p, next) = self.seen[list as usize];
            out.push(p);
            list = next;
        }
        out.sort_unstable();
        out
    }

    /// A stack's content from top to bottom, seen lists by their sets: equal for stacks that
    /// behave the same on every input.
    fn content(&self, mut s: Stack) -> Vec<(Frame, Vec<u32>)> {
        let mut out = Vec::new();
        while s != BOTTOM {
            let (frame, parent) = self.frames[s as usize];
            out.push(match frame {
                Frame::Object {
                    node,
                    phase,
                    ws,
                    count,
                    seen,
                } => (
                    Frame::Object {
                        node,
                        phase,
                        ws,
                        count,
                        seen: 0,
                    },
                    self.seen_set(seen),
                ),
                f => (f, Vec::new()),
            });
            s = parent;
        }
        out
    }

    /// Drops stacks whose content equals an earlier one's. Large `anyOf`s of similar objects
    /// otherwise multiply into thousands of copies of the same state.
    pub fn dedup(&self, stacks: &mut Vec<Stack>) {
        if stacks.len() < 2 {
            return;
        }
        let mut seen: std::collections::HashSet<Vec<(Frame, Vec<u32>)>> =
            std::collections::HashSet::with_capacity(stacks.len());
        stacks.retain(|&s| seen.insert(self.content(s)));
    }

    fn has_seen(&self, mut list: u32, prop: u32) -> bool {
        while list != 0 {
            let (p, next) = self.seen[list as usize];
            if p == prop {
                return true;
            }
            list = next;
        }
        false
    }

    fn add_seen(&mut self, list: u32, prop: u32) -> u32 {
        self.seen.push((prop, list));
        (self.seen.len() - 1) as u32
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl JsonGrammar {
    pub fn start(&self, arena: &mut Arena) -> Stack {
        arena.push(BOTTOM, Frame::Value { node: self.graph.root })
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
            Frame::Lexeme { lex, state } => arena.parent(s) == BOTTOM && self.lexemes[lex as usize].is_accepting(state),
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
                let dfa = &self.lexemes[lex as usize];
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
                let dfa = &self.lexemes[lex as usize];
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
            Frame::Key { node, state } => self.step_key(arena, s, node, state, b, out),
            Frame::Array { node, phase, ws, index } => {
                self.step_array(arena, s, (node, phase, ws, index), b, out, depth)
            }
        }
    }

    fn start_value(&self, arena: &mut Arena, s: Stack, node: NodeId, b: u8, out: &mut Vec<Stack>, depth: usize) {
        match self.graph.node(node) {
            Node::AnyOf(alts) => {
                for &alt in alts {
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
                        seen: 0,
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
            _ => match self.node_lexeme[node as usize] {
                Some(Lexeme::Whole(lex)) => {
                    let start = self.lexemes[lex as usize].start();
                    let t = arena.replace(s, Frame::Lexeme { lex, state: start });
                    self.step_at(arena, t, b, out, depth + 1);
                }
                Some(Lexeme::StringBody(lex)) if b == b'"' => {
                    let state = self.lexemes[lex as usize].start();
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
                    Some(i) => arena.add_seen(seen, i),
                    None => seen,
                };
                Some(arena.replace(
                    p,
                    Frame::Object {
                        node,
                        phase: ObjPhase::AfterValue,
                        ws: 0,
                        count: count + 1,
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
                    index: index + 1,
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
        let more = rules.max_properties.is_none_or(|m| (count as u64) < m)
            && (keys.open || (0..keys.num_props).any(|p| !arena.has_seen(seen, p)));
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
                    out.push(arena.push(o, Frame::Key { node, state }));
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
                .any(|&p| p >= keys.num_props || !arena.has_seen(seen, p))
    }

    fn step_key(&self, arena: &mut Arena, s: Stack, node: NodeId, state: StateId, b: u8, out: &mut Vec<Stack>) {
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
                out.push(arena.replace(s, Frame::Key { node, state: next }));
            }
            return;
        }
        // The closing quote: a declared name wins over patterns and other keys.
        let matched = keys.dfa.matches(state);
        let (value, prop) = match matched.iter().find(|&&p| p < keys.num_props) {
            Some(&p) if arena.has_seen(seen, p) => return,
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
