//! A grammar matcher whose panics stay with its request. Masks are filled on worker threads
//! and tokens accepted on the engine thread: a bug in the grammar (an `expect` that fires on
//! some schema) must end that one request as `internal`, not take the engine and every request
//! in flight with it. After a panic the matcher refuses every token, which the engine already
//! treats as an internal failure of that request.

use std::panic::{catch_unwind, AssertUnwindSafe};

use quarry_grammar::{GrammarError, Matcher, TokenId};

pub struct ContainedMatcher {
    inner: Box<dyn Matcher + Send>,
    /// What the grammar panicked with, once it has.
    failure: Option<String>,
}

impl ContainedMatcher {
    pub fn new(inner: Box<dyn Matcher + Send>) -> Self {
        ContainedMatcher { inner, failure: None }
    }

    /// The panic message, if the grammar failed under this request.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// Runs `f` on the matcher unless it failed before; a panic inside marks it failed.
    fn guard<T>(&mut self, f: impl FnOnce(&mut dyn Matcher) -> T) -> Option<T> {
        if self.failure.is_some() {
            return None;
        }
        match catch_unwind(AssertUnwindSafe(|| f(&mut *self.inner))) {
            Ok(v) => Some(v),
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "the grammar panicked".into());
                self.failure = Some(message);
                None
            }
        }
    }

    pub fn fill_bitmask(&mut self, mask: &mut [u32]) {
        // A failed matcher allows everything: the token drawn is then refused by `accept`.
        if self.guard(|m| m.fill_bitmask(mask)).is_none() {
            mask.fill(u32::MAX);
        }
    }

    pub fn fill_bitmask_within(&mut self, mask: &mut [u32], budget: usize) {
        if self.guard(|m| m.fill_bitmask_within(mask, budget)).is_none() {
            mask.fill(u32::MAX);
        }
    }

    pub fn accept(&mut self, token: TokenId) -> Result<(), GrammarError> {
        self.guard(|m| m.accept(token))
            .unwrap_or(Err(GrammarError::TokenRejected { token }))
    }

    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        self.guard(|m| m.rollback(n)).unwrap_or(Ok(()))
    }

    pub fn is_finished(&self) -> bool {
        self.failure.is_none() && self.inner.is_finished()
    }

    /// Runs grammar code on the engine thread, so a panic in it counts as the matcher failing
    /// too (reported by the next `accept`).
    pub fn can_finish(&mut self) -> bool {
        self.guard(|m| m.can_finish()).unwrap_or(false)
    }

    /// The fewest tokens that complete the output from here; `None` when the constraint
    /// cannot tell (or has failed).
    pub fn completion_cost(&mut self) -> Option<usize> {
        self.guard(|m| m.completion_cost()).flatten()
    }

    /// The tokens that continue a run copied from the request's document, if it has one.
    pub fn copy_mask(&mut self) -> Option<Vec<u32>> {
        self.guard(|m| m.copy_mask().map(<[u32]>::to_vec)).flatten()
    }

    /// Whether the output is inside a closed choice of strings (see `Matcher::in_choice`).
    pub fn in_choice(&mut self) -> bool {
        self.guard(|m| m.in_choice()).unwrap_or(false)
    }

    /// Whether the constraint decides no text from here (no forced bytes).
    pub fn forced_bytes_empty(&mut self) -> bool {
        self.guard(|m| m.forced_bytes().is_empty()).unwrap_or(true)
    }

    /// The text the constraint alone decides from here.
    pub fn forced_bytes(&mut self) -> Vec<u8> {
        self.guard(|m| m.forced_bytes()).unwrap_or_default()
    }

    pub fn forced_tokens(&mut self, tokenize: &dyn Fn(&str) -> Vec<TokenId>) -> Vec<TokenId> {
        self.guard(|m| m.forced_tokens(tokenize)).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A matcher with a bug: it panics once it has seen token 3.
    struct Buggy(Vec<TokenId>);

    impl Matcher for Buggy {
        fn fill_bitmask(&mut self, mask: &mut [u32]) {
            assert!(!self.0.contains(&3), "grammar state corrupted");
            mask.fill(u32::MAX);
        }
        fn accept(&mut self, token: TokenId) -> Result<(), GrammarError> {
            self.0.push(token);
            Ok(())
        }
        fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
            self.0.truncate(self.0.len() - n);
            Ok(())
        }
        fn is_finished(&self) -> bool {
            false
        }
        fn can_finish(&self) -> bool {
            true
        }
        fn forced_bytes(&mut self) -> Vec<u8> {
            Vec::new()
        }
    }

    #[test]
    fn a_panic_fails_the_matcher_and_every_later_token() {
        let mut m = ContainedMatcher::new(Box::new(Buggy(Vec::new())));
        let mut mask = vec![0u32; 2];
        m.fill_bitmask(&mut mask);
        assert!(m.accept(3).is_ok());
        assert!(m.failure().is_none());
        m.fill_bitmask(&mut mask);
        assert_eq!(m.failure(), Some("grammar state corrupted"));
        assert_eq!(mask, vec![u32::MAX; 2], "a failed matcher's mask lets the draw through");
        assert!(m.accept(1).is_err(), "and its accept refuses it");
        assert!(!m.can_finish() && !m.is_finished());
        assert_eq!(m.completion_cost(), None);
    }
}
