//! The model's Hugging Face tokenizer, rebuilt from GGUF metadata by candle
//! (`TokenizerFromGguf`: BPE vocabulary and merges, special tokens, BOS/EOS template). candle
//! knows the `gpt2`, `qwen2` and `llama3` pre-tokenizers; the ones llama.cpp names otherwise
//! and candle would treat as plain GPT-2 are set here.

use candle_core::quantized::tokenizer::TokenizerFromGguf;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{SplitDelimiterBehavior, Tokenizer};

use super::TokenizerError;
use crate::runtime::gguf::GgufFile;

/// llama.cpp's token type for control tokens (`<|im_end|>`, ...).
const TOKEN_TYPE_CONTROL: i32 = 3;

/// Llama 3's split: numbers in groups of up to three digits.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub struct GgufVocab {
    pub tokenizer: Tokenizer,
    pub tokens: Vec<String>,
    pub control_ids: Vec<u32>,
}

pub fn build(gguf: &GgufFile) -> Result<GgufVocab, TokenizerError> {
    let mut tokenizer = Tokenizer::from_gguf(gguf.content()).map_err(|e| TokenizerError::Unsupported(e.to_string()))?;
    let pre = gguf.string("tokenizer.ggml.pre").unwrap_or_default();
    if let Some(p) = pre_tokenizer_candle_lacks(&pre)? {
        tokenizer.with_pre_tokenizer(Some(p));
    }
    let tokens: Vec<String> = gguf
        .array("tokenizer.ggml.tokens")?
        .iter()
        .map(|v| v.to_string().cloned())
        .collect::<Result<_, _>>()
        .map_err(|e| TokenizerError::Metadata(format!("tokenizer.ggml.tokens: {e}")))?;
    let control_ids = match gguf.value("tokenizer.ggml.token_type") {
        Some(v) => v
            .to_vec()
            .map_err(|e| TokenizerError::Metadata(e.to_string()))?
            .iter()
            .enumerate()
            .filter(|(_, t)| t.to_i32().is_ok_and(|t| t == TOKEN_TYPE_CONTROL))
            .map(|(i, _)| i as u32)
            .collect(),
        None => Vec::new(),
    };
    Ok(GgufVocab {
        tokenizer,
        tokens,
        control_ids,
    })
}

fn pre_tokenizer_candle_lacks(pre: &str) -> Result<Option<PreTokenizerWrapper>, TokenizerError> {
    let byte_level = |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    Ok(match pre {
        // SmolLM: every digit on its own, then GPT-2's byte-level split.
        "smollm" => Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level(true),
        ]))),
        // What llama.cpp's converter writes for Llama 3 (candle knows it as `llama3`).
        "llama-bpe" => {
            let split = Split::new(
                SplitPattern::Regex(LLAMA3_SPLIT.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| TokenizerError::Metadata(format!("pre-tokenizer regex: {e}")))?;
            Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Split(split),
                byte_level(false),
            ])))
        }
        _ => None,
    })
}
