//! The constraint's forced tokens as drafts: where the grammar alone decides the next text, the
//! tokens that spell it are as good a guess as there is.

use crate::engine::contained::ContainedMatcher;
use crate::tokenizer::Tokenizer;

/// The tokens the grammar alone decides after `last`, where appending them keeps the output's
/// tokenization canonical: the forced text is tokenized together with `last`, and used only
/// if `last` survives unmerged (the matcher also drops the last forced token, which could
/// merge with what follows). At most `room` of them.
pub fn forced_after(tokenizer: &Tokenizer, matcher: &mut ContainedMatcher, last: u32, room: usize) -> Vec<u32> {
    if room == 0 {
        return Vec::new();
    }
    // Called only when the grammar forces some text, so most steps tokenize nothing here.
    let mut forced = matcher.forced_tokens(&|text: &str| tokenizer.encode_after(last, text));
    forced.truncate(room);
    forced
}
