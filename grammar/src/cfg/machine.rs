//! Stepping a grammar's call stacks one byte at a time. A stack's top is a position in a
//! rule's NFA or inside a terminal; below it, the positions the enclosing rules return to.

use super::{CfgGrammar, Edge};
use crate::dedup::{dedup_stacks, Scratch};
use crate::dfa::{StateId, DEAD};

pub use crate::stacks::Stack;
pub const BOTTOM: Stack = 0;

/// Guards the eager expansion of calls (left recursion is refused at compile time; this
/// bounds what remains, such as long chains of nullable calls).
const MAX_DEPTH: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame {
    Bottom,
    At {
        rule: u32,
        node: u32,
    },
    /// Inside terminal `term`, which then goes on to `to` in `rule`.
    Term {
        rule: u32,
        term: u32,
        state: StateId,
        to: u32,
    },
}

/// Frames with parent links, shared by every stack; plus the positions one step has already
/// expanded (free moves can loop).
#[derive(Default)]
pub struct Arena {
    frames: Vec<(Frame, Stack)>,
    visited: Vec<(u32, u32, Stack)>,
}

impl Arena {
    pub fn new() -> Self {
        Arena {
            frames: vec![(Frame::Bottom, BOTTOM)],
            ..Default::default()
        }
    }

    pub fn mark(&self) -> usize {
        self.frames.len()
    }

    pub fn reset_to(&mut self, mark: usize) {
        self.frames.truncate(mark);
    }

    fn push(&mut self, parent: Stack, frame: Frame) -> Stack {
        self.frames.push((frame, parent));
        (self.frames.len() - 1) as Stack
    }

    fn top(&self, s: Stack) -> Frame {
        self.frames[s as usize].0
    }

    fn parent(&self, s: Stack) -> Stack {
        self.frames[s as usize].1
    }

    fn replace(&mut self, s: Stack, frame: Frame) -> Stack {
        let parent = self.parent(s);
        self.push(parent, frame)
    }

    /// Drops stacks whose frames equal an earlier stack's.
    pub fn dedup(&self, stacks: &mut Vec<Stack>, scratch: &mut Scratch) {
        let frames = &self.frames;
        dedup_stacks(stacks, scratch, |mut t, words| {
            while t != BOTTOM {
                let (frame, parent) = frames[t as usize];
                match frame {
                    Frame::At { rule, node } => words.extend([1, rule, node]),
                    Frame::Term { rule, term, state, to } => words.extend([2, rule, term, state, to]),
                    Frame::Bottom => {}
                }
                t = parent;
            }
        });
    }
}

impl CfgGrammar {
    pub fn start(&self, arena: &mut Arena) -> Stack {
        arena.push(
            BOTTOM,
            Frame::At {
                rule: self.root,
                node: 0,
            },
        )
    }

    /// Every stack `s` can become after byte `b`, appended to `out`.
    pub fn step(&self, arena: &mut Arena, s: Stack, b: u8, out: &mut Vec<Stack>) {
        arena.visited.clear();
        match arena.top(s) {
            Frame::Bottom => {}
            Frame::At { .. } => self.advance(arena, s, b, out, 0),
            Frame::Term { rule, term, state, to } => {
                let dfa = &self.terms[term as usize];
                let next = dfa.next(state, b);
                if next != DEAD {
                    out.push(arena.replace(
                        s,
                        Frame::Term {
                            rule,
                            term,
                            state: next,
                            to,
                        },
                    ));
                }
                if dfa.is_accepting(state) {
                    let a = arena.replace(s, Frame::At { rule, node: to });
                    self.advance(arena, a, b, out, 0);
                }
            }
        }
    }

    /// From a position (`At` on top): every way to read `b`, following free moves, calls and
    /// returns first.
    fn advance(&self, arena: &mut Arena, s: Stack, b: u8, out: &mut Vec<Stack>, depth: usize) {
        let Frame::At { rule, node } = arena.top(s) else {
            return;
        };
        let key = (rule, node, arena.parent(s));
        if depth > MAX_DEPTH || arena.visited.contains(&key) {
            return;
        }
        arena.visited.push(key);
        let nfa = &self.rules[rule as usize];
        for &e in &nfa.edges[node as usize] {
            match e {
                Edge::Eps(m) => {
                    let t = arena.replace(s, Frame::At { rule, node: m });
                    self.advance(arena, t, b, out, depth + 1);
                }
                Edge::Term(term, to) => {
                    let dfa = &self.terms[term as usize];
                    let state = dfa.next(dfa.start(), b);
                    if state != DEAD {
                        out.push(arena.replace(s, Frame::Term { rule, term, state, to }));
                    }
                }
                Edge::Call(callee, to) => {
                    let ret = arena.replace(s, Frame::At { rule, node: to });
                    let c = arena.push(ret, Frame::At { rule: callee, node: 0 });
                    self.advance(arena, c, b, out, depth + 1);
                }
            }
        }
        if node == nfa.end {
            let p = arena.parent(s);
            if p != BOTTOM {
                self.advance(arena, p, b, out, depth + 1);
            }
        }
    }

    /// The stack may end here: the root rule can complete without reading more.
    pub fn can_finish(&self, arena: &Arena, s: Stack) -> bool {
        let mut visited = Vec::new();
        match arena.top(s) {
            Frame::Bottom => true,
            Frame::At { rule, node } => self.ends(arena, rule, node, arena.parent(s), &mut visited),
            Frame::Term { rule, term, state, to } => {
                self.terms[term as usize].is_accepting(state)
                    && self.ends(arena, rule, to, arena.parent(s), &mut visited)
            }
        }
    }

    fn ends(&self, arena: &Arena, rule: u32, node: u32, parent: Stack, visited: &mut Vec<(u32, u32, Stack)>) -> bool {
        if visited.contains(&(rule, node, parent)) || visited.len() > MAX_DEPTH * 16 {
            return false;
        }
        visited.push((rule, node, parent));
        let nfa = &self.rules[rule as usize];
        if node == nfa.end {
            match arena.top(parent) {
                Frame::Bottom => return true,
                Frame::At { rule: r, node: n } => {
                    if self.ends(arena, r, n, arena.parent(parent), visited) {
                        return true;
                    }
                }
                Frame::Term { .. } => {}
            }
        }
        nfa.edges[node as usize].iter().any(|&e| match e {
            Edge::Eps(m) => self.ends(arena, rule, m, parent, visited),
            Edge::Call(c, to) => self.nullable[c as usize] && self.ends(arena, rule, to, parent, visited),
            Edge::Term(..) => false,
        })
    }
}
