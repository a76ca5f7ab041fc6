//! A document's substrings as an automaton over the vocabulary: for outputs that copy from
//! the document they were given. A JSON Schema matcher uses it two ways: as the lexeme of
//! free strings (verbatim: a copy or nothing), and as a prior (the tokens that continue a run
//! copied from the document, which the sampler may favour).

use std::sync::{Arc, OnceLock};

use crate::dfa::{ByteDfa, StateId, DEAD};
use crate::vocab::TokenVocab;

pub struct DocumentSpans {
    dfa: ByteDfa,
    vocab: Arc<TokenVocab>,
    /// Per state, the tokens whose every byte continues the copy; computed on first use.
    masks: Vec<OnceLock<Arc<[u32]>>>,
    /// The same less the tokens of whitespace alone, for the copy prior.
    priors: Vec<OnceLock<Arc<[u32]>>>,
}

/// Bytes that start a new copy: JSON's punctuation, which separates the values being copied.
fn restarts(b: u8) -> bool {
    matches!(b, b'"' | b':' | b',' | b'{' | b'}' | b'[' | b']')
}

/// Longest document the copy automaton is built for, in characters: its dense table grows
/// with the document (hundreds of MiB for this many CJK characters), so a longer one gets
/// neither verbatim strings nor the copy prior.
pub const MAX_DOCUMENT_CHARS: usize = 32 * 1024;

impl DocumentSpans {
    /// `document`'s runs of whole characters, spelled as JSON strings spell them; `None` past
    /// `MAX_DOCUMENT_CHARS`.
    pub fn new(document: &str, vocab: Arc<TokenVocab>) -> Option<Self> {
        if document.chars().nth(MAX_DOCUMENT_CHARS).is_some() {
            return None;
        }
        let dfa = ByteDfa::json_substrings(document);
        let masks = (0..dfa.num_states()).map(|_| OnceLock::new()).collect();
        let priors = (0..dfa.num_states()).map(|_| OnceLock::new()).collect();
        Some(DocumentSpans {
            dfa,
            vocab,
            masks,
            priors,
        })
    }

    pub fn dfa(&self) -> &ByteDfa {
        &self.dfa
    }

    /// The state of a copy that has just begun.
    pub fn start(&self) -> StateId {
        self.dfa.start()
    }

    /// The tokens whose every byte continues a copy in `state` (none once it left the
    /// document).
    pub fn continuing(&self, state: StateId) -> &[u32] {
        self.masks[state as usize].get_or_init(|| crate::regex::dfa_token_mask(&self.dfa, state, &self.vocab).into())
    }

    /// `continuing` less the tokens of whitespace alone: copying a space is no evidence of
    /// copying a value, and between JSON tokens it is only layout.
    pub fn prior(&self, state: StateId) -> &[u32] {
        self.priors[state as usize].get_or_init(|| {
            let mut mask = self.continuing(state).to_vec();
            for t in crate::bitmask::allowed_tokens(self.continuing(state)) {
                if self.vocab.token_bytes(t).iter().all(u8::is_ascii_whitespace) {
                    mask[t as usize / 32] &= !(1 << (t % 32));
                }
            }
            mask.into()
        })
    }

    /// Where a copy stands after `bytes` of output: each piece of JSON punctuation starts a
    /// new one; any other byte extends the current one, or leaves the document for good
    /// (`DEAD`) until the next punctuation.
    pub fn advance(&self, mut state: StateId, bytes: &[u8]) -> StateId {
        for &b in bytes {
            state = if restarts(b) {
                self.dfa.start()
            } else if state == DEAD {
                DEAD
            } else {
                self.dfa.next(state, b)
            };
        }
        state
    }
}
