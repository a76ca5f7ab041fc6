//! What a matcher has accepted, kept for rollback (speculative decoding): one entry per
//! accepted token, the first being the start, and whether an EOS ended the output.

use crate::error::GrammarError;

pub(crate) struct History<T> {
    entries: Vec<T>,
    finished: bool,
}

impl<T> History<T> {
    pub fn new(start: T) -> Self {
        History {
            entries: vec![start],
            finished: false,
        }
    }

    pub fn current(&self) -> &T {
        self.entries.last().expect("the start is never removed")
    }

    pub fn push(&mut self, entry: T) {
        self.entries.push(entry);
    }

    pub fn finish(&mut self) {
        self.finished = true;
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Undoes the last `n` accepted tokens; an accepted EOS counts as one.
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        let available = self.entries.len() - 1 + self.finished as usize;
        if n > available {
            return Err(GrammarError::RollbackTooFar {
                requested: n,
                available,
            });
        }
        let mut n = n;
        if n > 0 && self.finished {
            self.finished = false;
            n -= 1;
        }
        self.entries.truncate(self.entries.len() - n);
        Ok(())
    }
}
