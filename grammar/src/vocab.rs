//! A tokenizer's vocabulary as the grammar sees it: the bytes each token stands for, which
//! tokens are special (never produced by a grammar) and which end the output.

use std::sync::Arc;

use crate::trie::TokTrie;

pub type TokenId = u32;

pub struct TokenVocab {
    bytes: Vec<Vec<u8>>,
    special: Vec<bool>,
    eos: Vec<TokenId>,
    trie: TokTrie,
}

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
        })
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
}
