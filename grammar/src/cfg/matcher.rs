//! One request's position in a context-free grammar.

use std::sync::Arc;

use super::machine::{Arena, Stack};
use super::CfgGrammar;
use crate::bitmask::allow;
use crate::error::GrammarError;
use crate::history::History;
use crate::matcher::{Matcher, MAX_FORCED_BYTES};
use crate::trie::TrieVisitor;
use crate::vocab::TokenId;

pub struct CfgMatcher {
    grammar: Arc<CfgGrammar>,
    arena: Arena,
    /// The live stacks after each accepted token, with the arena size to return to.
    history: History<(Vec<Stack>, usize)>,
}

impl CfgMatcher {
    pub fn new(grammar: Arc<CfgGrammar>) -> Self {
        let mut arena = Arena::new();
        let start = grammar.start(&mut arena);
        let mark = arena.mark();
        CfgMatcher {
            grammar,
            arena,
            history: History::new((vec![start], mark)),
        }
    }

    fn current(&self) -> &[Stack] {
        &self.history.current().0
    }

    /// Every stack in `states` after `bytes`; empty when some byte leaves none.
    fn run(&mut self, mut states: Vec<Stack>, bytes: &[u8]) -> Vec<Stack> {
        let mut next = Vec::new();
        for &b in bytes {
            next.clear();
            for &s in &states {
                self.grammar.step(&mut self.arena, s, b, &mut next);
            }
            self.arena.dedup(&mut next);
            std::mem::swap(&mut states, &mut next);
            if states.is_empty() {
                break;
            }
        }
        states
    }
}

impl Matcher for CfgMatcher {
    fn fill_bitmask(&mut self, mask: &mut [u32]) {
        mask.fill(0);
        if self.history.is_finished() {
            return;
        }
        if self.can_finish() {
            for &e in self.grammar.vocab.eos_tokens() {
                allow(mask, e);
            }
        }
        let grammar = self.grammar.clone();
        let trie = grammar.vocab.trie();
        let mark = self.arena.mark();
        let mut walk = Walk {
            grammar: &grammar,
            arena: &mut self.arena,
            states: vec![Vec::new(); trie.max_depth() + 1],
            mask,
        };
        walk.states[0] = self.history.current().0.clone();
        trie.walk(&mut walk);
        self.arena.reset_to(mark);
    }

    fn accept(&mut self, token: TokenId) -> Result<(), GrammarError> {
        if self.history.is_finished() {
            return Err(GrammarError::AlreadyFinished);
        }
        let vocab = self.grammar.vocab.clone();
        if vocab.is_eos(token) && self.can_finish() {
            self.history.finish();
            return Ok(());
        }
        let bytes = vocab.token_bytes(token);
        if vocab.is_special(token) || bytes.is_empty() {
            return Err(GrammarError::TokenRejected { token });
        }
        let before = self.arena.mark();
        let states = self.run(self.current().to_vec(), bytes);
        if states.is_empty() {
            self.arena.reset_to(before);
            return Err(GrammarError::TokenRejected { token });
        }
        let mark = self.arena.mark();
        self.history.push((states, mark));
        Ok(())
    }

    fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        self.history.rollback(n)?;
        let mark = self.history.current().1;
        self.arena.reset_to(mark);
        Ok(())
    }

    fn is_finished(&self) -> bool {
        self.history.is_finished()
    }

    fn can_finish(&self) -> bool {
        !self.history.is_finished() && self.current().iter().any(|&s| self.grammar.can_finish(&self.arena, s))
    }

    fn forced_bytes(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        if self.history.is_finished() {
            return out;
        }
        let mark = self.arena.mark();
        let mut states = self.current().to_vec();
        while out.len() < MAX_FORCED_BYTES && !states.iter().any(|&s| self.grammar.can_finish(&self.arena, s)) {
            let mut forced = None;
            for b in 0..=255u8 {
                let next = self.run(states.clone(), &[b]);
                if next.is_empty() {
                    continue;
                }
                if forced.is_some() {
                    forced = None;
                    break;
                }
                forced = Some((b, next));
            }
            let Some((b, next)) = forced else { break };
            out.push(b);
            states = next;
        }
        self.arena.reset_to(mark);
        out
    }
}

/// Steps every live stack along the trie path; a byte that leaves none prunes the subtree.
struct Walk<'a> {
    grammar: &'a CfgGrammar,
    arena: &'a mut Arena,
    states: Vec<Vec<Stack>>,
    mask: &'a mut [u32],
}

impl TrieVisitor for Walk<'_> {
    fn enter(&mut self, depth: usize, byte: u8) -> bool {
        let (before, after) = self.states.split_at_mut(depth);
        let out = &mut after[0];
        out.clear();
        for &s in &before[depth - 1] {
            self.grammar.step(self.arena, s, byte, out);
        }
        self.arena.dedup(out);
        !out.is_empty()
    }

    fn tokens(&mut self, tokens: &[TokenId]) {
        for &t in tokens {
            allow(self.mask, t);
        }
    }
}
