//! Rebuilds the model's Hugging Face tokenizer from GGUF metadata (`tokenizer.ggml.*`): the BPE
//! vocabulary and merges, the pre-tokenizer named by `tokenizer.ggml.pre`, and the control
//! tokens as special tokens. Only byte-level BPE (`model = gpt2`) is supported.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::TokenizerError;
use crate::runtime::gguf::GgufFile;

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Splits numbers and words the way Llama 3 / Qwen 2 style vocabularies were trained.
const QWEN2_LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub struct GgufVocab {
    pub tokenizer: Tokenizer,
    pub tokens: Vec<String>,
    pub special_ids: Vec<u32>,
}

pub fn build(gguf: &GgufFile) -> Result<GgufVocab, TokenizerError> {
    let model = gguf.string("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(TokenizerError::Unsupported(format!(
            "tokenizer model `{model}` (only byte-level BPE, `gpt2`)"
        )));
    }
    let tokens: Vec<String> = gguf
        .array("tokenizer.ggml.tokens")?
        .iter()
        .map(|v| v.to_string().cloned())
        .collect::<Result<_, _>>()
        .map_err(|e| TokenizerError::Metadata(format!("tokenizer.ggml.tokens: {e}")))?;
    let merges: Vec<(String, String)> = gguf
        .array("tokenizer.ggml.merges")?
        .iter()
        .map(|v| {
            let s = v
                .to_string()
                .map_err(|e| TokenizerError::Metadata(e.to_string()))?;
            s.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| TokenizerError::Metadata(format!("merge `{s}` has no space")))
        })
        .collect::<Result<_, _>>()?;
    let types: Vec<i32> = match gguf.value("tokenizer.ggml.token_type") {
        Some(v) => v
            .to_vec()
            .map_err(|e| TokenizerError::Metadata(e.to_string()))?
            .iter()
            .map(|t| t.to_i32().unwrap_or(1))
            .collect(),
        None => vec![1; tokens.len()],
    };

    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| TokenizerError::Metadata(format!("BPE: {e}")))?;
    let mut tokenizer = Tokenizer::new(bpe);
    let pre = gguf
        .string("tokenizer.ggml.pre")
        .unwrap_or_else(|_| "default".into());
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer(&pre)?));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    if pre == "qwen2" {
        tokenizer.with_normalizer(Some(NFC));
    }

    let mut special_ids = Vec::new();
    let added: Vec<AddedToken> = types
        .iter()
        .enumerate()
        .filter(|(_, &ty)| ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED)
        .map(|(i, &ty)| {
            if ty == TOKEN_TYPE_CONTROL {
                special_ids.push(i as u32);
            }
            AddedToken::from(tokens[i].clone(), ty == TOKEN_TYPE_CONTROL)
        })
        .collect();
    tokenizer.add_special_tokens(&added);
    Ok(GgufVocab {
        tokenizer,
        tokens,
        special_ids,
    })
}

/// llama.cpp names each vocabulary's pre-tokenizer; these are the Hugging Face equivalents.
fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    let byte_level =
        |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    let split = |pattern: &str| -> Result<PreTokenizerWrapper, TokenizerError> {
        Split::new(
            SplitPattern::Regex(pattern.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map(PreTokenizerWrapper::Split)
        .map_err(|e| TokenizerError::Metadata(format!("pre-tokenizer regex: {e}")))
    };
    Ok(match pre {
        "gpt2" | "default" | "gpt-2" => byte_level(true),
        // SmolLM: every digit on its own, then GPT-2's byte-level split.
        "smollm" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level(true),
        ])),
        "qwen2" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            split(QWEN2_LLAMA3_SPLIT)?,
            byte_level(false),
        ])),
        "llama-bpe" | "llama3" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            split(&QWEN2_LLAMA3_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|"))?,
            byte_level(false),
        ])),
        other => {
            return Err(TokenizerError::Unsupported(format!(
                "pre-tokenizer `{other}`"
            )))
        }
    })
}
