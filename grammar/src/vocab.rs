//! A tokenizer's vocabulary as the grammar sees it: the bytes each token stands for, which
//! tokens are special (never produced by a grammar) and which end the output.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::cache::GenerationalCache;
use crate::dfa::{ByteDfa, DfaLimits};
use crate::error::GrammarError;
use crate::trie::TokTrie;

pub type TokenId = u32;

/// Token masks by (lexeme regex, DFA state).
type MaskCache = GenerationalCache<(String, u32), Arc<[u32]>>;

pub struct TokenVocab {
    bytes: Vec<Vec<u8>>,
    special: Vec<bool>,
    eos: Vec<TokenId>,
    trie: TokTrie,
    /// Tries of the tokens containing a given byte, built on first use.
    with_byte: Mutex<HashMap<u8, Arc<TokTrie>>>,
    /// Token masks of lexeme DFA states, by (lexeme regex, state): shared by every grammar
    /// over this vocabulary, since most schemas reuse the same few lexemes.
    lexeme_masks: Mutex<MaskCache>,
    /// Lexeme DFAs by regex, shared by every grammar compiled against this vocabulary: real
    /// schemas use the same few (numbers, formats, plain strings) over and over.
    dfas: Mutex<DfaCache>,
}

type DfaCache = GenerationalCache<String, Arc<ByteDfa>>;

/// Bytes of cached DFAs, so a stream of one-off patterns cannot grow the cache without bound.
const MAX_CACHED_DFA_BYTES: usize = 256 << 20;

/// Bytes of cached lexeme masks (a grammar keeps the masks it already holds). A mask of
/// Qwen's 151k vocabulary is 19 KB, so this is ~13k masks.
const MAX_CACHED_MASK_BYTES: usize = 256 << 20;

impl TokenVocab {
    /// `bytes[id]` is what token `id` decodes to; special tokens (control tokens such as
    /// `<|im_end|>`) are listed in `special` and only ever allowed as end of output, when they
    /// are among `eos`.
    pub fn new(bytes: Vec<Vec<u8>>, special: &[TokenId], eos: &[TokenId]) -> Arc<Self> {
        let mut is_special = vec![false; bytes.len()];
        for &s in special.iter().chain(eos) {
            if let Some(f) = is_special.get_mut(s as usize) {
                *f = true;
            }
        }
        let trie = TokTrie::build(&bytes, &is_special);
        let eos = eos.iter().copied().filter(|&e| (e as usize) < bytes.len()).collect();
        Arc::new(TokenVocab {
            bytes,
            special: is_special,
            eos,
            trie,
            with_byte: Mutex::new(HashMap::new()),
            lexeme_masks: Mutex::new(GenerationalCache::new(MAX_CACHED_MASK_BYTES)),
            dfas: Mutex::new(GenerationalCache::new(MAX_CACHED_DFA_BYTES)),
        })
    }

    /// A vocabulary in byte-level BPE spelling (GPT-2's table: printable bytes stand for
    /// themselves, the others for U+0100 onwards in byte order), one spelling per token id. A
    /// spelling outside the table (`None`, or an unknown character) gets no bytes: never allowed.
    pub fn from_byte_level<S: AsRef<str>>(spellings: &[Option<S>], special: &[TokenId], eos: &[TokenId]) -> Arc<Self> {
        let decode = byte_level_decoder();
        let bytes = spellings
            .iter()
            .map(|s| {
                s.as_ref()
                    .and_then(|s| {
                        s.as_ref()
                            .chars()
                            .map(|c| decode.get(&c).copied())
                            .collect::<Option<Vec<u8>>>()
                    })
                    .unwrap_or_default()
            })
            .collect();
        Self::new(bytes, special, eos)
    }

    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    pub fn token_bytes(&self, id: TokenId) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], |b| b.as_slice())
    }

    pub fn is_special(&self, id: TokenId) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    pub fn eos_tokens(&self) -> &[TokenId] {
        &self.eos
    }

    pub fn is_eos(&self, id: TokenId) -> bool {
        self.eos.contains(&id)
    }

    pub fn trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The mask cached for `(regex, state)`, computed by `compute` the first time.
    pub fn lexeme_mask(&self, regex: &str, state: u32, compute: impl FnOnce() -> Box<[u32]>) -> Arc<[u32]> {
        let key = (regex.to_string(), state);
        if let Some(m) = self.lexeme_masks.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return m;
        }
        // Computed outside the lock: other threads' masks need not wait for this walk.
        let mask: Arc<[u32]> = compute().into();
        let bytes = std::mem::size_of_val(&*mask) + regex.len();
        self.lexeme_masks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, mask, bytes)
    }

    /// The DFA of `regex`, built on first use.
    pub fn dfa(&self, regex: &str) -> Result<Arc<ByteDfa>, GrammarError> {
        if let Some(d) = self.dfas.lock().unwrap_or_else(|e| e.into_inner()).get(regex) {
            return Ok(d);
        }
        let dfa = Arc::new(ByteDfa::from_regex(regex, DfaLimits::default())?);
        let bytes = dfa.heap_bytes() + regex.len();
        Ok(self
            .dfas
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(regex.to_string(), dfa, bytes))
    }

    /// The trie of the tokens containing `byte` (say, a quote: the only way out of a string).
    pub fn trie_with_byte(&self, byte: u8) -> Arc<TokTrie> {
        let mut cache = self.with_byte.lock().unwrap_or_else(|e| e.into_inner());
        cache
            .entry(byte)
            .or_insert_with(|| {
                Arc::new(TokTrie::build_filtered(&self.bytes, &self.special, |b| {
                    b.contains(&byte)
                }))
            })
            .clone()
    }
}

/// GPT-2's byte-level alphabet, reversed.
fn byte_level_decoder() -> HashMap<char, u8> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let mut extra = 0u32;
    (0..=255u8)
        .map(|b| {
            let c = if printable(b) {
                char::from(b)
            } else {
                extra += 1;
                char::from_u32(255 + extra).expect("valid code point")
            };
            (c, b)
        })
        .collect()
}
