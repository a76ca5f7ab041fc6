//! One request's position in a JSON Schema constraint.

use std::sync::Arc;

use super::grammar::JsonGrammar;
use super::machine::{Arena, Frame, Stack};
use crate::dedup::Scratch;
use crate::dfa::StateId;
use crate::error::GrammarError;
use crate::history::History;
use crate::matcher::Matcher;
use crate::stacks::{StackMachine, Stacks};
use crate::vocab::{TokenId, TokenVocab};

pub struct JsonMatcher {
    stacks: Stacks<JsonGrammar>,
    /// With a document: where the run being copied from it stands after each accepted token.
    copy: Option<History<StateId>>,
}

impl StackMachine for JsonGrammar {
    type Arena = Arena;
    type Mark = (usize, usize);
    fn new_arena(&self) -> Arena {
        Arena::default()
    }
    fn mark(arena: &Arena) -> (usize, usize) {
        arena.mark()
    }
    fn reset_to(arena: &mut Arena, mark: (usize, usize)) {
        arena.reset_to(mark)
    }
    fn vocab(&self) -> &Arc<TokenVocab> {
        &self.vocab
    }
    fn start(&self, arena: &mut Arena) -> Stack {
        JsonGrammar::start(self, arena)
    }
    fn step(&self, arena: &mut Arena, s: Stack, b: u8, out: &mut Vec<Stack>) {
        JsonGrammar::step(self, arena, s, b, out)
    }
    fn dedup(&self, arena: &Arena, stacks: &mut Vec<Stack>, scratch: &mut Scratch) {
        JsonGrammar::dedup(self, arena, stacks, scratch)
    }
    fn can_finish(&self, arena: &Arena, s: Stack) -> bool {
        JsonGrammar::can_finish(self, arena, s)
    }
    fn completion_cost(&self, arena: &Arena, s: Stack) -> Option<u64> {
        Some(JsonGrammar::completion_cost(self, arena, s))
    }
}

impl JsonMatcher {
    pub fn new(grammar: Arc<JsonGrammar>) -> Self {
        let copy = grammar.document.as_ref().map(|d| History::new(d.start()));
        JsonMatcher {
            stacks: Stacks::new(grammar),
            copy,
        }
    }

    pub fn can_finish(&self) -> bool {
        self.stacks.can_finish()
    }

    pub fn is_finished(&self) -> bool {
        self.stacks.is_finished()
    }

    pub fn accept(&mut self, token: TokenId) -> Result<(), GrammarError> {
        self.stacks.accept(token)?;
        if let (Some(copy), Some(doc)) = (self.copy.as_mut(), self.stacks.grammar.document.as_ref()) {
            if self.stacks.is_finished() {
                copy.finish();
            } else {
                copy.push(doc.advance(*copy.current(), self.stacks.grammar.vocab.token_bytes(token)));
            }
        }
        Ok(())
    }

    /// Undoes the last `n` accepted tokens (an accepted EOS counts as one).
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        self.stacks.rollback(n)?;
        if let Some(copy) = self.copy.as_mut() {
            copy.rollback(n).expect("kept in step with the stacks");
        }
        Ok(())
    }

    /// The tokens that continue the run being copied from the document (after JSON
    /// punctuation, any run of it), when the grammar has a document.
    pub fn copy_mask(&self) -> Option<&[u32]> {
        let (copy, doc) = (self.copy.as_ref()?, self.stacks.grammar.document.as_ref()?);
        let state = *copy.current();
        (state != crate::dfa::DEAD).then(|| doc.prior(state))
    }

    /// Whether every way the output can go on is inside a closed choice of strings.
    pub fn in_choice(&self) -> bool {
        let current = self.stacks.current();
        !current.is_empty()
            && current.iter().all(|&s| {
                matches!(self.stacks.arena.top(s), Frame::Lexeme { lex, .. } if self.stacks.grammar.choice[lex as usize])
            })
    }

    /// The bytes the schema alone decides from here: while exactly one byte can follow and
    /// the value cannot end, that byte.
    pub fn forced_bytes(&mut self) -> Vec<u8> {
        self.stacks.forced_bytes()
    }

    /// Sets the bits of every token allowed next; clears the rest.
    ///
    /// Inside a string body, a token either stays inside (which depends on the body's DFA
    /// state alone: cached) or contains a quote, the only way out; so only the few tokens
    /// with a quote are walked against the whole stack. Other stacks walk the full trie.
    pub fn fill_bitmask(&mut self, mask: &mut [u32]) {
        if !self.stacks.begin_mask(mask) {
            return;
        }
        let grammar = self.stacks.grammar.clone();
        let current = self.stacks.current().to_vec();
        // Stacks inside a string body, or inside a key whose inner tokens do not depend on the
        // properties already seen.
        let shortcut = |arena: &Arena, s: Stack| match arena.top(s) {
            Frame::Str { .. } => true,
            Frame::Key { node, state, .. } => grammar.keys[node as usize]
                .as_ref()
                .is_some_and(|k| k.any_key || k.seen_free[state as usize]),
            _ => false,
        };
        let (in_string, other): (Vec<Stack>, Vec<Stack>) =
            current.iter().partition(|&&s| shortcut(&self.stacks.arena, s));
        for &s in &in_string {
            match self.stacks.arena.top(s) {
                Frame::Str { lex, state } => grammar.or_body_mask(mask, lex, state),
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
            self.stacks.walk(&grammar.quote_trie, in_string, mask);
        }
        if !other.is_empty() {
            self.stacks.walk(grammar.vocab.trie(), other, mask);
        }
    }

    /// The fewest bytes that complete the value from here (0 once it is complete).
    pub fn completion_cost(&self) -> u64 {
        self.stacks.completion_cost().unwrap_or(0)
    }

    /// The tokens of `fill_bitmask` after which the value can still be completed within
    /// `budget` bytes (hence tokens). Walks every stack against the whole trie: it runs only
    /// when a request is near the end of its budget.
    pub fn fill_bitmask_within(&mut self, mask: &mut [u32], budget: usize) {
        if self.stacks.begin_mask(mask) {
            let grammar = self.stacks.grammar.clone();
            let current = self.stacks.current().to_vec();
            self.stacks
                .walk_within(grammar.vocab.trie(), current, mask, Some(budget as u64));
        }
    }

    /// `fill_bitmask` without the string shortcut: every stack against the whole trie. The
    /// reference the shortcut is tested against.
    #[doc(hidden)]
    pub fn fill_bitmask_exhaustive(&mut self, mask: &mut [u32]) {
        if self.stacks.begin_mask(mask) {
            let grammar = self.stacks.grammar.clone();
            let current = self.stacks.current().to_vec();
            self.stacks.walk(grammar.vocab.trie(), current, mask);
        }
    }
}

fn or_into(mask: &mut [u32], bits: &[u32]) {
    for (m, b) in mask.iter_mut().zip(bits) {
        *m |= b;
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
    fn completion_cost(&mut self) -> Option<usize> {
        Some(JsonMatcher::completion_cost(self).min(usize::MAX as u64) as usize)
    }
    fn fill_bitmask_within(&mut self, mask: &mut [u32], budget: usize) {
        JsonMatcher::fill_bitmask_within(self, mask, budget)
    }
    fn copy_mask(&mut self) -> Option<&[u32]> {
        JsonMatcher::copy_mask(self)
    }

    fn in_choice(&mut self) -> bool {
        JsonMatcher::in_choice(self)
    }
}
