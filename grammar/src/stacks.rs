//! The matcher core of the grammars that run as sets of stacks in an arena (JSON Schema and
//! CFG): the live stacks after each token (for rollback), a token accepted byte by byte, the
//! trie walk behind masks and the forced-byte probe. Each grammar supplies its byte step.

use std::sync::Arc;

use crate::bitmask::allow;
use crate::dedup::Scratch;
use crate::error::GrammarError;
use crate::history::History;
use crate::matcher::MAX_FORCED_BYTES;
use crate::trie::{TokTrie, TrieVisitor};
use crate::vocab::{TokenId, TokenVocab};

/// A stack: the index of its top frame in the arena.
pub type Stack = u32;

/// A grammar run as a set of stacks.
pub(crate) trait StackMachine {
    type Arena;
    /// How far the arena had grown: resetting to it drops every frame pushed since.
    type Mark: Copy;
    fn new_arena(&self) -> Self::Arena;
    fn mark(arena: &Self::Arena) -> Self::Mark;
    fn reset_to(arena: &mut Self::Arena, mark: Self::Mark);
    fn vocab(&self) -> &Arc<TokenVocab>;
    fn start(&self, arena: &mut Self::Arena) -> Stack;
    /// Every stack `s` can become after byte `b`, appended to `out`.
    fn step(&self, arena: &mut Self::Arena, s: Stack, b: u8, out: &mut Vec<Stack>);
    /// Drops stacks equal in content to an earlier one.
    fn dedup(&self, arena: &Self::Arena, stacks: &mut Vec<Stack>, scratch: &mut Scratch);
    /// The stack is a complete output (EOS may follow).
    fn can_finish(&self, arena: &Self::Arena, s: Stack) -> bool;
    /// The fewest bytes that make the stack a complete output, where the grammar can tell.
    fn completion_cost(&self, _arena: &Self::Arena, _s: Stack) -> Option<u64> {
        None
    }
}

pub(crate) struct Stacks<M: StackMachine> {
    pub(crate) grammar: Arc<M>,
    pub(crate) arena: M::Arena,
    /// The live stacks after each accepted token, with the arena mark to return to.
    history: History<(Vec<Stack>, M::Mark)>,
    scratch: Scratch,
}

impl<M: StackMachine> Stacks<M> {
    pub fn new(grammar: Arc<M>) -> Self {
        let mut arena = grammar.new_arena();
        let start = grammar.start(&mut arena);
        let mark = M::mark(&arena);
        Stacks {
            grammar,
            arena,
            history: History::new((vec![start], mark)),
            scratch: Scratch::default(),
        }
    }

    pub fn current(&self) -> &[Stack] {
        &self.history.current().0
    }

    pub fn is_finished(&self) -> bool {
        self.history.is_finished()
    }

    pub fn can_finish(&self) -> bool {
        !self.history.is_finished() && self.current().iter().any(|&s| self.grammar.can_finish(&self.arena, s))
    }

    pub fn accept(&mut self, token: TokenId) -> Result<(), GrammarError> {
        if self.history.is_finished() {
            return Err(GrammarError::AlreadyFinished);
        }
        let vocab = self.grammar.vocab().clone();
        if vocab.is_eos(token) && self.can_finish() {
            self.history.finish();
            return Ok(());
        }
        let bytes = vocab.token_bytes(token);
        if vocab.is_special(token) || bytes.is_empty() {
            return Err(GrammarError::TokenRejected { token });
        }
        let before = M::mark(&self.arena);
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
                M::reset_to(&mut self.arena, before);
                return Err(GrammarError::TokenRejected { token });
            }
        }
        let mark = M::mark(&self.arena);
        self.history.push((states, mark));
        Ok(())
    }

    /// Undoes the last `n` accepted tokens (an accepted EOS counts as one).
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        self.history.rollback(n)?;
        let mark = self.history.current().1;
        M::reset_to(&mut self.arena, mark);
        Ok(())
    }

    /// The bytes the grammar alone decides from here: while exactly one byte can follow and
    /// the output cannot end, that byte. Probes all 256 bytes per step.
    pub fn forced_bytes(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        if self.history.is_finished() {
            return out;
        }
        let mark = M::mark(&self.arena);
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
        M::reset_to(&mut self.arena, mark);
        out
    }

    /// The fewest bytes that complete the output from here: the cheapest live stack's.
    pub fn completion_cost(&self) -> Option<u64> {
        if self.history.is_finished() {
            return Some(0);
        }
        self.current()
            .iter()
            .map(|&s| self.grammar.completion_cost(&self.arena, s))
            .try_fold(u64::MAX, |m, c| c.map(|c| m.min(c)))
    }

    /// Clears `mask` and sets EOS where allowed; false when nothing more may come.
    pub fn begin_mask(&self, mask: &mut [u32]) -> bool {
        mask.fill(0);
        if self.history.is_finished() {
            return false;
        }
        if self.can_finish() {
            for &e in self.grammar.vocab().eos_tokens() {
                allow(mask, e);
            }
        }
        true
    }

    /// Allows every token of `trie` that some stack of `stacks` takes whole.
    pub fn walk(&mut self, trie: &TokTrie, stacks: Vec<Stack>, mask: &mut [u32]) {
        self.walk_within(trie, stacks, mask, None)
    }

    /// `walk`, keeping with a `budget` only the tokens after which some stack can still
    /// complete within that many bytes.
    pub fn walk_within(&mut self, trie: &TokTrie, stacks: Vec<Stack>, mask: &mut [u32], budget: Option<u64>) {
        let mark = M::mark(&self.arena);
        let mut walk = Walk {
            grammar: &*self.grammar,
            arena: &mut self.arena,
            states: vec![Vec::new(); trie.max_depth() + 1],
            mask,
            scratch: &mut self.scratch,
        };
        walk.states[0] = stacks;
        match budget {
            // The plain walk is the hot path of every mask: it keeps no depth and checks no cost.
            None => trie.walk(&mut walk),
            Some(budget) => trie.walk(&mut Within { walk, depth: 0, budget }),
        }
        M::reset_to(&mut self.arena, mark);
    }
}

/// Steps every live stack along the trie path; a byte that leaves none prunes the subtree.
struct Walk<'a, M: StackMachine> {
    grammar: &'a M,
    arena: &'a mut M::Arena,
    states: Vec<Vec<Stack>>,
    mask: &'a mut [u32],
    scratch: &'a mut Scratch,
}

/// A walk that allows only the tokens after which some stack can still complete within
/// `budget` bytes.
struct Within<'a, M: StackMachine> {
    walk: Walk<'a, M>,
    /// The depth of the node just entered.
    depth: usize,
    budget: u64,
}

impl<M: StackMachine> TrieVisitor for Within<'_, M> {
    fn enter(&mut self, depth: usize, byte: u8) -> bool {
        self.depth = depth;
        self.walk.enter(depth, byte)
    }

    fn tokens(&mut self, tokens: &[TokenId]) {
        let w = &self.walk;
        let fits = w.states[self.depth]
            .iter()
            .any(|&s| w.grammar.completion_cost(w.arena, s).is_none_or(|c| c <= self.budget));
        if fits {
            self.walk.tokens(tokens);
        }
    }
}

impl<M: StackMachine> TrieVisitor for Walk<'_, M> {
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
