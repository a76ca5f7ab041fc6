//! The tokenizer of a Hugging Face model directory: `tokenizer.json` (the `tokenizers` crate
//! reads it as is) and `tokenizer_config.json` (chat template, BOS and EOS, whether BOS is
//! added), with `generation_config.json`'s end-of-generation ids where there is one.

use std::path::Path;

use serde_json::Value;

use super::{ChatTemplate, Tokenizer, TokenizerError, END_OF_GENERATION_NAMES};

/// A token named in `tokenizer_config.json`: a plain string or `{"content": ...}`.
fn token_name(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

fn read_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| TokenizerError::Metadata(format!("{}: {e}", path.display()))),
        Err(_) => Ok(None),
    }
}

/// Whether a tokenizer.json is byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2): the grammar
/// reads token spellings as byte-level text. SentencePiece vocabularies (`▁word`, `<0x0A>`)
/// would be read wrongly, so they are refused.
fn is_byte_level(json: &Value) -> bool {
    let is_bl = |v: &Value| v.get("type").and_then(|t| t.as_str()) == Some("ByteLevel");
    let decoder = json.get("decoder").is_some_and(|d| {
        is_bl(d)
            || d.get("decoders")
                .and_then(|l| l.as_array())
                .is_some_and(|l| l.iter().any(is_bl))
    });
    json.pointer("/model/type").and_then(|t| t.as_str()) == Some("BPE") && decoder
}

/// Whether a `TemplateProcessing` post-processor puts `bos` before a single sequence.
fn post_processor_adds(json: Option<&Value>, bos: Option<&str>) -> bool {
    let (Some(json), Some(bos)) = (json, bos) else {
        return false;
    };
    let processors: Vec<&Value> = match json.get("post_processor") {
        Some(p) if p.get("type").and_then(|t| t.as_str()) == Some("Sequence") => p
            .get("processors")
            .and_then(|l| l.as_array())
            .map(|l| l.iter().collect())
            .unwrap_or_default(),
        Some(p) => vec![p],
        None => Vec::new(),
    };
    processors.iter().any(|p| {
        p.get("type").and_then(|t| t.as_str()) == Some("TemplateProcessing")
            && p.pointer("/single/0/SpecialToken/id").and_then(|i| i.as_str()) == Some(bos)
    })
}

pub fn load(dir: &Path) -> Result<Tokenizer, TokenizerError> {
    let file = dir.join("tokenizer.json");
    let json = read_json(&file)?;
    if let Some(json) = &json {
        if !is_byte_level(json) {
            return Err(TokenizerError::Unsupported(format!(
                "{}: only byte-level BPE tokenizers are supported",
                file.display()
            )));
        }
    }
    let tokenizer = tokenizers::Tokenizer::from_file(&file)
        .map_err(|e| TokenizerError::Unsupported(format!("{}: {e}", file.display())))?;
    let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
    let vocab = tokenizer.get_vocab(true);
    let size = vocab.values().map(|&i| i as usize + 1).max().unwrap_or(0);
    let mut tokens = vec![String::new(); size];
    for (text, &id) in &vocab {
        tokens[id as usize] = text.clone();
    }
    let mut control_ids: Vec<u32> = tokenizer
        .get_added_tokens_decoder()
        .iter()
        .filter(|(_, t)| t.special)
        .map(|(&id, _)| id)
        .collect();
    control_ids.sort_unstable();
    let id_of = |name: &Option<String>| name.as_ref().and_then(|n| vocab.get(n).copied());
    let (bos, eos) = (token_name(config.get("bos_token")), token_name(config.get("eos_token")));
    let bos_id = id_of(&bos);
    // Llama 3 directories leave `add_bos_token` out and add BOS in tokenizer.json's
    // post-processor; we encode without it, so it is read from there.
    let add_bos = config
        .get("add_bos_token")
        .and_then(|v| v.as_bool())
        .unwrap_or_else(|| post_processor_adds(json.as_ref(), bos.as_deref()));
    let mut end_of_generation: Vec<u32> = id_of(&eos).into_iter().collect();
    if let Some(g) = read_json(&dir.join("generation_config.json"))? {
        let ids: Vec<u32> = match g.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().into_iter().map(|v| v as u32).collect(),
            Some(Value::Array(a)) => a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32).collect(),
            _ => Vec::new(),
        };
        end_of_generation.extend(ids);
    }
    for &c in &control_ids {
        if END_OF_GENERATION_NAMES.contains(&tokens[c as usize].as_str()) {
            end_of_generation.push(c);
        }
    }
    end_of_generation.sort_unstable();
    end_of_generation.dedup();
    let template = match config.get("chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        // A list of named templates: the default one.
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template").and_then(|s| s.as_str()))
            .map(str::to_string),
        // Newer checkpoints keep it in a file of its own.
        _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
    };
    let chat_template = match template {
        Some(src) => Some(ChatTemplate::new(
            &src,
            bos.as_deref().unwrap_or(""),
            eos.as_deref().unwrap_or(""),
        )?),
        None => None,
    };
    let mut plain = tokenizer.clone();
    plain.set_encode_special_tokens(true);
    Ok(Tokenizer {
        with_special: tokenizer,
        plain,
        tokens,
        bos_id,
        add_bos,
        end_of_generation,
        control_ids,
        chat_template,
        after: Default::default(),
    })
}

/// Writes `tokenizer.json` and `tokenizer_config.json` for `tokenizer` into `dir`: a model
/// directory made elsewhere (a seeded random model saved by transformers) gets the default
/// model's tokenizer.
pub fn save(tokenizer: &Tokenizer, dir: &Path, chat_template: Option<&str>) -> Result<(), TokenizerError> {
    let io = |e: &dyn std::fmt::Display| TokenizerError::Metadata(format!("{}: {e}", dir.display()));
    tokenizer
        .with_special
        .save(dir.join("tokenizer.json"), false)
        .map_err(|e| io(&e))?;
    let name = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).map(str::to_string);
    let config = serde_json::json!({
        "bos_token": name(tokenizer.bos_id),
        "eos_token": name(tokenizer.end_of_generation.first().copied()),
        "add_bos_token": tokenizer.add_bos,
        "chat_template": chat_template,
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).map_err(|e| io(&e))
}
