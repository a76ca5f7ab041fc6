//! What every constraint's matcher offers the engine, whatever the constraint: one request's
//! position, its token mask, and the text the constraint alone decides.

use crate::error::GrammarError;
use crate::vocab::TokenId;

/// Longest run of forced bytes looked for at once.
pub const MAX_FORCED_BYTES: usize = 1024;

pub trait Matcher: Send {
    /// Sets the bits of every token allowed next (EOS where the output may end); clears the
    /// rest.
    fn fill_bitmask(&mut self, mask: &mut [u32]);
    fn accept(&mut self, token: TokenId) -> Result<(), GrammarError>;
    /// Undoes the last `n` accepted tokens (an accepted EOS counts as one).
    fn rollback(&mut self, n: usize) -> Result<(), GrammarError>;
    /// EOS has been accepted.
    fn is_finished(&self) -> bool;
    /// The output so far is complete as it is (EOS would be accepted).
    fn can_finish(&self) -> bool;
    /// The bytes the constraint alone decides from here, up to the first choice (or the
    /// first place the output could end).
    fn forced_bytes(&mut self) -> Vec<u8>;

    /// The fewest bytes that complete the output from here (0 once it may end), where the
    /// constraint can tell: with a byte-level vocabulary, as many tokens always suffice.
    fn completion_cost(&mut self) -> Option<usize> {
        None
    }

    /// The tokens that continue a run copied from the request's document, where the
    /// constraint was given one (a prior the sampler may favour; not a constraint).
    fn copy_mask(&mut self) -> Option<&[u32]> {
        None
    }

    /// Whether the output is inside a closed choice of strings (`enum`, `const`): there, a
    /// value the document spells out is strong evidence, and the copy prior may weigh more.
    fn in_choice(&mut self) -> bool {
        false
    }

    /// `fill_bitmask` without the tokens after which the output could not be completed within
    /// `budget` more tokens. This default tries each allowed token; matchers with a cheaper
    /// way override it.
    fn fill_bitmask_within(&mut self, mask: &mut [u32], budget: usize) {
        self.fill_bitmask(mask);
        if self.completion_cost().is_none() {
            return;
        }
        for t in crate::bitmask::allowed_tokens(mask).collect::<Vec<_>>() {
            if self.accept(t).is_err() {
                continue;
            }
            let fits = self.is_finished() || self.completion_cost().is_some_and(|c| c <= budget);
            self.rollback(1).expect("just accepted");
            if !fits {
                mask[t as usize / 32] &= !(1 << (t % 32));
            }
        }
    }

    /// Tokens to append without sampling (jump-forward decoding): the forced text as the
    /// tokenizer would spell it on its own, less its last token, which might have merged with
    /// whatever the model writes next, and cut where the matcher would refuse a token. The
    /// matcher is left where it was; the caller accepts the tokens it uses.
    fn forced_tokens(&mut self, tokenize: &dyn Fn(&str) -> Vec<TokenId>) -> Vec<TokenId> {
        let bytes = self.forced_bytes();
        let text = match std::str::from_utf8(&bytes) {
            Ok(t) => t,
            Err(e) => std::str::from_utf8(&bytes[..e.valid_up_to()]).expect("valid up to here"),
        };
        if text.is_empty() {
            return Vec::new();
        }
        let mut tokens = tokenize(text);
        tokens.pop();
        let accepted = tokens.iter().take_while(|&&t| self.accept(t).is_ok()).count();
        self.rollback(accepted).expect("just accepted");
        tokens.truncate(accepted);
        tokens
    }
}
