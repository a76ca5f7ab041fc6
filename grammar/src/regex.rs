//! A regex constraint: the output must match the pattern in full. The allowed tokens depend on
//! the DFA state alone, so each state's mask is computed once by a trie walk, cached in the
//! shared compiled grammar, and copied out on every later visit.

use std::sync::{Arc, OnceLock};

use crate::bitmask::{allow, bitmask_words};
use crate::dfa::{ByteDfa, DfaLimits, StateId, DEAD};
use crate::error::GrammarError;
use crate::history::History;
use crate::matcher::{Matcher, MAX_FORCED_BYTES};
use crate::trie::TrieVisitor;
use crate::vocab::{TokenId, TokenVocab};

pub struct RegexGrammar {
    dfa: ByteDfa,
    vocab: Arc<TokenVocab>,
    /// Per DFA state, the non-EOS tokens allowed there; filled on first use.
    masks: Vec<OnceLock<Box<[u32]>>>,
}

impl RegexGrammar {
    pub fn compile(pattern: &str, vocab: Arc<TokenVocab>) -> Result<Arc<Self>, GrammarError> {
        let dfa = ByteDfa::from_regex(pattern, DfaLimits::default())?;
        let masks = (0..dfa.num_states()).map(|_| OnceLock::new()).collect();
        Ok(Arc::new(RegexGrammar { dfa, vocab, masks }))
    }

    /// A choice constraint: the output is exactly one of `options`.
    pub fn choice(options: &[String], vocab: Arc<TokenVocab>) -> Result<Arc<Self>, GrammarError> {
        if options.is_empty() {
            return Err(GrammarError::Regex {
                pattern: String::new(),
                reason: "a choice needs at least one option".into(),
            });
        }
        let alternation: Vec<String> = options.iter().map(|o| literal(o)).collect();
        Self::compile(&format!("(?:{})", alternation.join("|")), vocab)
    }

    pub fn vocab(&self) -> &Arc<TokenVocab> {
        &self.vocab
    }

    pub fn dfa(&self) -> &ByteDfa {
        &self.dfa
    }

    fn token_mask(&self, state: StateId) -> &[u32] {
        self.masks[state as usize].get_or_init(|| dfa_token_mask(&self.dfa, state, &self.vocab))
    }
}

/// `text` as a regex matching itself only: every character but ASCII letters and digits escaped.
pub fn literal(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_string()
            } else {
                format!("\\x{{{:X}}}", c as u32)
            }
        })
        .collect()
}

/// The tokens whose every byte `dfa` accepts from `state` (the end need not be accepting).
pub(crate) fn dfa_token_mask(dfa: &ByteDfa, state: StateId, vocab: &TokenVocab) -> Box<[u32]> {
    let mut mask = vec![0u32; bitmask_words(vocab.vocab_size())];
    if state != DEAD {
        let mut walk = DfaWalk {
            dfa,
            states: vec![DEAD; vocab.trie().max_depth() + 1],
            mask: &mut mask,
        };
        walk.states[0] = state;
        vocab.trie().walk(&mut walk);
    }
    mask.into_boxed_slice()
}

/// Steps the DFA along the trie: a byte that kills the DFA prunes every token below it.
struct DfaWalk<'a> {
    dfa: &'a ByteDfa,
    /// DFA state after each depth of the current trie path.
    states: Vec<StateId>,
    mask: &'a mut [u32],
}

impl TrieVisitor for DfaWalk<'_> {
    #[inline]
    fn enter(&mut self, depth: usize, byte: u8) -> bool {
        let s = self.dfa.next(self.states[depth - 1], byte);
        self.states[depth] = s;
        s != DEAD
    }

    fn tokens(&mut self, tokens: &[TokenId]) {
        for &t in tokens {
            allow(self.mask, t);
        }
    }
}

/// One request's position in a regex constraint.
pub struct RegexMatcher {
    grammar: Arc<RegexGrammar>,
    /// The DFA state after each accepted token.
    history: History<StateId>,
}

impl RegexMatcher {
    pub fn new(grammar: Arc<RegexGrammar>) -> Self {
        let start = grammar.dfa.start();
        RegexMatcher {
            grammar,
            history: History::new(start),
        }
    }

    fn state(&self) -> StateId {
        *self.history.current()
    }

    /// Sets the bits of every token allowed next (EOS when the output may end here); clears
    /// all others.
    pub fn fill_bitmask(&self, mask: &mut [u32]) {
        if self.history.is_finished() {
            mask.fill(0);
            return;
        }
        mask.copy_from_slice(self.grammar.token_mask(self.state()));
        if self.can_finish() {
            for &e in self.grammar.vocab.eos_tokens() {
                allow(mask, e);
            }
        }
    }

    pub fn accept(&mut self, token: TokenId) -> Result<(), GrammarError> {
        if self.history.is_finished() {
            return Err(GrammarError::AlreadyFinished);
        }
        let vocab = &self.grammar.vocab;
        if vocab.is_eos(token) && self.can_finish() {
            self.history.finish();
            return Ok(());
        }
        let bytes = vocab.token_bytes(token);
        let next = self.grammar.dfa.run(self.state(), bytes);
        if vocab.is_special(token) || bytes.is_empty() || next == DEAD {
            return Err(GrammarError::TokenRejected { token });
        }
        self.history.push(next);
        Ok(())
    }

    /// Undoes the last `n` accepted tokens (an accepted EOS counts as one).
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        self.history.rollback(n)
    }

    /// EOS has been accepted.
    pub fn is_finished(&self) -> bool {
        self.history.is_finished()
    }

    /// The output so far is complete as it is (EOS would be accepted).
    pub fn can_finish(&self) -> bool {
        !self.history.is_finished() && self.grammar.dfa.is_accepting(self.state())
    }

    /// The bytes the grammar alone decides from here, up to the first choice.
    pub fn forced_bytes(&self) -> Vec<u8> {
        let dfa = &self.grammar.dfa;
        let mut s = self.state();
        let mut out = Vec::new();
        while let Some(b) = dfa.forced_byte(s) {
            out.push(b);
            s = dfa.next(s, b);
            if out.len() >= MAX_FORCED_BYTES {
                break;
            }
        }
        out
    }
}

impl Matcher for RegexMatcher {
    fn fill_bitmask(&mut self, mask: &mut [u32]) {
        RegexMatcher::fill_bitmask(self, mask)
    }
    fn accept(&mut self, token: TokenId) -> Result<(), GrammarError> {
        RegexMatcher::accept(self, token)
    }
    fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        RegexMatcher::rollback(self, n)
    }
    fn is_finished(&self) -> bool {
        RegexMatcher::is_finished(self)
    }
    fn can_finish(&self) -> bool {
        RegexMatcher::can_finish(self)
    }
    fn forced_bytes(&mut self) -> Vec<u8> {
        RegexMatcher::forced_bytes(self)
    }
    fn completion_cost(&mut self) -> Option<usize> {
        if self.history.is_finished() {
            return Some(0);
        }
        let d = self.grammar.dfa.distance_to_accept(self.state());
        Some(if d == crate::dfa::UNREACHABLE {
            usize::MAX
        } else {
            d as usize
        })
    }
}
