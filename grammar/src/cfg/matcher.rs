//! One request's position in a context-free grammar.

use std::sync::Arc;

use super::machine::Arena;
use super::CfgGrammar;
use crate::dedup::Scratch;
use crate::error::GrammarError;
use crate::matcher::Matcher;
use crate::stacks::{Stack, StackMachine, Stacks};
use crate::vocab::{TokenId, TokenVocab};

pub struct CfgMatcher(Stacks<CfgGrammar>);

impl CfgMatcher {
    pub fn new(grammar: Arc<CfgGrammar>) -> Self {
        CfgMatcher(Stacks::new(grammar))
    }
}

impl StackMachine for CfgGrammar {
    type Arena = Arena;
    type Mark = usize;
    fn new_arena(&self) -> Arena {
        Arena::new()
    }
    fn mark(arena: &Arena) -> usize {
        arena.mark()
    }
    fn reset_to(arena: &mut Arena, mark: usize) {
        arena.reset_to(mark)
    }
    fn vocab(&self) -> &Arc<TokenVocab> {
        &self.vocab
    }
    fn start(&self, arena: &mut Arena) -> Stack {
        CfgGrammar::start(self, arena)
    }
    fn step(&self, arena: &mut Arena, s: Stack, b: u8, out: &mut Vec<Stack>) {
        CfgGrammar::step(self, arena, s, b, out)
    }
    fn dedup(&self, arena: &Arena, stacks: &mut Vec<Stack>, scratch: &mut Scratch) {
        arena.dedup(stacks, scratch)
    }
    fn can_finish(&self, arena: &Arena, s: Stack) -> bool {
        CfgGrammar::can_finish(self, arena, s)
    }
}

impl Matcher for CfgMatcher {
    fn fill_bitmask(&mut self, mask: &mut [u32]) {
        if self.0.begin_mask(mask) {
            let grammar = self.0.grammar.clone();
            let current = self.0.current().to_vec();
            self.0.walk(grammar.vocab.trie(), current, mask);
        }
    }

    fn accept(&mut self, token: TokenId) -> Result<(), GrammarError> {
        self.0.accept(token)
    }

    fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        self.0.rollback(n)
    }

    fn is_finished(&self) -> bool {
        self.0.is_finished()
    }

    fn can_finish(&self) -> bool {
        self.0.can_finish()
    }

    fn forced_bytes(&mut self) -> Vec<u8> {
        self.0.forced_bytes()
    }
}
