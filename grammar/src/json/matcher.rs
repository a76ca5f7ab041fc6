//! One request's position in a JSON Schema constraint.

use std::sync::Arc;

use super::grammar::JsonGrammar;
use super::machine::{Arena, Frame, Stack};
use crate::bitmask::allow;
use crate::dedup::Scratch;
use crate::error::GrammarError;
use crate::history::History;
use crate::matcher::{Matcher, MAX_FORCED_BYTES};
use crate::trie::{TokTrie, TrieVisitor};
use crate::vocab::TokenId;

pub struct JsonMatcher {
    grammar: Arc<JsonGrammar>,
    arena: Arena,
    /// The live stacks after each accepted token, with the arena size to return to when
    /// rolling back to them.
    history: History<(Vec<Stack>, (usize, usize))>,
    scratch: Scratch,
}

impl JsonMatcher {
    pub fn new(grammar: Arc<JsonGrammar>) -> Self {
        let mut arena = Arena::default();
        let start = grammar.start(&mut arena);
        let mark = arena.mark();
        JsonMatcher {
            grammar,
            arena,
            history: History::new((vec![start], mark)),
            scratch: Scratch::default(),
        }
    }

    fn current(&self) -> &[Stack] {
        &self.history.current().0
    }

    pub fn can_finish(&self) -> bool {
        !self.history.is_finished() && self.current().iter().any(|&s| self.grammar.can_finish(&self.arena, s))
    }

    pub fn is_finished(&self) -> bool {
        self.history.is_finished()
    }

    pub fn accept(&mut self, token: TokenId) -> Result<(), GrammarError> {
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
        let mut states = self.current().to_vec();
        let mut next = Vec::new();
        for &b in bytes {
            next.clear();
            for &s in &states {
                self.grammar.step(&mut self.arena, s, b, &mut next);
            }
            self.grammar.dedup(&self.arena, &mut next, &mut self.scratch);
            std::mem::swap(&mut states, &mut next);
            if states.is_empty() {
                self.arena.reset_to(before);
                return Err(GrammarError::TokenRejected { token });
            }
        }
        let mark = self.arena.mark();
        self.history.push((states, mark));
        Ok(())
    }

    /// Undoes the last `n` accepted tokens (an accepted EOS counts as one).
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        self.history.rollback(n)?;
        let mark = self.history.current().1;
        self.arena.reset_to(mark);
        Ok(())
    }

    /// Sets the bits of every token allowed next; clears the rest.
    ///
    /// Inside a string body, a token either stays inside (which depends on the body's DFA
    /// state alone: cached) or contains a quote, the only way out; so only the few tokens
    /// with a quote are walked against the whole stack. Other stacks walk the full trie.
    pub fn fill_bitmask(&mut self, mask: &mut [u32]) {
        if !self.begin_mask(mask) {
            return;
        }
        let grammar = self.grammar.clone();
        let current = self.current().to_vec();
        // Stacks inside a string body, or inside a key whose inner tokens do not depend on the
        // properties already seen.
        let shortcut = |arena: &Arena, s: Stack| match arena.top(s) {
            Frame::Str { .. } => true,
            Frame::Key { node, state, .. } => grammar.keys[node as usize]
                .as_ref()
                .is_some_and(|k| k.any_key || k.seen_free[state as usize]),
            _ => false,
        };
        let (in_string, other): (Vec<Stack>, Vec<Stack>) = current.iter().partition(|&&s| shortcut(&self.arena, s));
        for &s in &in_string {
            match self.arena.top(s) {
                Frame::Str { lex, state } => or_into(mask, grammar.inner_mask(lex, state)),
                Frame::Key { node, state, body } => {
                    let keys = grammar.keys[node as usize].as_ref().expect("object nodes have keys");
                    match grammar.any_string {
                        Some(lex) if keys.any_key => or_into(mask, grammar.inner_mask(lex, body)),
                        _ => or_into(mask, grammar.key_inner_mask(keys, state)),
                    }
                }
                _ => {}
            }
        }
        if !in_string.is_empty() {
            self.walk(&grammar.quote_trie, in_string, mask);
        }
        if !other.is_empty() {
            self.walk(grammar.vocab.trie(), other, mask);
        }
    }

    /// The bytes the schema alone decides from here: while exactly one byte can follow and
    /// the value cannot end, that byte.
    pub fn forced_bytes(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        if self.history.is_finished() {
            return out;
        }
        let mark = self.arena.mark();
        let mut states = self.current().to_vec();
        let (mut next, mut only) = (Vec::new(), Vec::new());
        while out.len() < MAX_FORCED_BYTES && !states.iter().any(|&s| self.grammar.can_finish(&self.arena, s)) {
            let mut forced = None;
            for b in 0..=255u8 {
                next.clear();
                for &s in &states {
                    self.grammar.step(&mut self.arena, s, b, &mut next);
                }
                if next.is_empty() {
                    continue;
                }
                if forced.is_some() {
                    forced = None;
                    break;
                }
                forced = Some(b);
                std::mem::swap(&mut only, &mut next);
            }
            let Some(b) = forced else { break };
            out.push(b);
            self.grammar.dedup(&self.arena, &mut only, &mut self.scratch);
            std::mem::swap(&mut states, &mut only);
        }
        self.arena.reset_to(mark);
        out
    }

    /// `fill_bitmask` without the string shortcut: every stack against the whole trie. The
    /// reference the shortcut is tested against.
    #[doc(hidden)]
    pub fn fill_bitmask_exhaustive(&mut self, mask: &mut [u32]) {
        if !self.begin_mask(mask) {
            return;
        }
        let grammar = self.grammar.clone();
        let current = self.current().to_vec();
        self.walk(grammar.vocab.trie(), current, mask);
    }

    /// Clears `mask` and sets EOS where allowed; false when nothing more may come.
    fn begin_mask(&self, mask: &mut [u32]) -> bool {
        mask.fill(0);
        if self.history.is_finished() {
            return false;
        }
        if self.can_finish() {
            for &e in self.grammar.vocab.eos_tokens() {
                allow(mask, e);
            }
        }
        true
    }

    fn walk(&mut self, trie: &TokTrie, stacks: Vec<Stack>, mask: &mut [u32]) {
        let mark = self.arena.mark();
        let mut walk = Walk {
            grammar: &self.grammar,
            arena: &mut self.arena,
            states: vec![Vec::new(); trie.max_depth() + 1],
            mask,
            scratch: &mut self.scratch,
        };
        walk.states[0] = stacks;
        trie.walk(&mut walk);
        self.arena.reset_to(mark);
    }
}

fn or_into(mask: &mut [u32], bits: &[u32]) {
    for (m, b) in mask.iter_mut().zip(bits) {
        *m |= b;
    }
}

/// Steps every live stack along the trie path; a byte that leaves none prunes the subtree.
struct Walk<'a> {
    grammar: &'a JsonGrammar,
    arena: &'a mut Arena,
    states: Vec<Vec<Stack>>,
    mask: &'a mut [u32],
    scratch: &'a mut Scratch,
}

impl TrieVisitor for Walk<'_> {
    fn enter(&mut self, depth: usize, byte: u8) -> bool {
        let (before, after) = self.states.split_at_mut(depth);
        let out = &mut after[0];
        out.clear();
        for &s in &before[depth - 1] {
            self.grammar.step(self.arena, s, byte, out);
        }
        self.grammar.dedup(self.arena, out, self.scratch);
        !out.is_empty()
    }

    fn tokens(&mut self, tokens: &[TokenId]) {
        for &t in tokens {
            allow(self.mask, t);
        }
    }
}

impl Matcher for JsonMatcher {
    fn fill_bitmask(&mut self, mask: &mut [u32]) {
        JsonMatcher::fill_bitmask(self, mask)
    }
    fn accept(&mut self, token: TokenId) -> Result<(), GrammarError> {
        JsonMatcher::accept(self, token)
    }
    fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        JsonMatcher::rollback(self, n)
    }
    fn is_finished(&self) -> bool {
        JsonMatcher::is_finished(self)
    }
    fn can_finish(&self) -> bool {
        JsonMatcher::can_finish(self)
    }
    fn forced_bytes(&mut self) -> Vec<u8> {
        JsonMatcher::forced_bytes(self)
    }
}
