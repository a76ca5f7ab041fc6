//! A model directory's tokenizer (tokenizer.json, tokenizer_config.json) against the GGUF's:
//! the default model's tokenizer written out as Hugging Face files and read back encodes,
//! renders chat prompts and ends generations exactly as the GGUF's does; and the tokens of a
//! text after a given token, as jump-forward asks for them.

mod common;

use quarry::tokenizer::{ChatMessage, Tokenizer};

#[test]
fn a_tokenizer_written_as_hugging_face_files_reads_back_the_same() {
    let Some(path) = common::model_path() else { return };
    let gguf = quarry::runtime::gguf::GgufFile::open(&path).unwrap();
    let template = gguf.string("tokenizer.chat_template").ok();
    let original = Tokenizer::from_gguf(&gguf).unwrap();
    let dir = std::env::temp_dir().join(format!("quarry-hf-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    original.save_to_dir(&dir, template.as_deref()).unwrap();
    let copy = Tokenizer::from_model_file(&dir).unwrap();
    assert_eq!(copy.vocab_size(), original.vocab_size());
    let sorted = |t: &Tokenizer| {
        let mut ids = t.end_of_generation_ids().to_vec();
        ids.sort_unstable();
        ids
    };
    assert_eq!(sorted(&copy), sorted(&original));
    let golden = common::golden();
    for case in &golden.tokenization {
        assert_eq!(copy.encode(&case.text, false).unwrap(), case.tokens, "{:?}", case.text);
    }
    let messages = [
        ChatMessage::new("system", "Extract the record."),
        ChatMessage::new("user", "Invoice <|im_end|> 2291, total 55.50 EUR"),
    ];
    assert_eq!(
        copy.encode_chat(&messages).unwrap(),
        original.encode_chat(&messages).unwrap()
    );

    // Without `add_bos_token`, a post-processor that puts BOS first decides (Llama 3's
    // directories do it this way).
    let config_path = dir.join("tokenizer_config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("add_bos_token");
    config["bos_token"] = serde_json::json!("<|im_start|>");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let path = dir.join("tokenizer.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let bos_id = copy.encode_fragment("<|im_start|>", true).unwrap()[0];
    json["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [bos_id], "tokens": ["<|im_start|>"]}}
    });
    std::fs::write(&path, json.to_string()).unwrap();
    let with_bos = Tokenizer::from_model_file(&dir).unwrap();
    let ids = with_bos.encode("hello", false).unwrap();
    assert_eq!(ids[0], bos_id, "BOS first: {ids:?}");
    assert_eq!(&ids[1..], &copy.encode("hello", false).unwrap()[..]);

    // A SentencePiece-style decoder: its spellings (`▁word`, `<0x0A>`) are not byte-level
    // text, which the grammar's vocabulary assumes, so the directory is refused.
    json["decoder"] =
        serde_json::json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true});
    std::fs::write(&path, json.to_string()).unwrap();
    let err = Tokenizer::from_model_file(&dir).err().expect("refused").to_string();
    assert!(err.contains("byte-level"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Jump-forward's tokens after a request's last token: the remembered answer is the one a
/// fresh tokenization gives, a token that would merge with the text gives none, and a text
/// whose tokens all stand apart from `last` gives them.
#[test]
fn text_after_a_token_is_its_tokenization_with_the_token_and_remembered_alike() {
    let Some(path) = common::model_path() else { return };
    let tok = Tokenizer::from_model_file(&path).unwrap();
    let fresh = |last: u32, text: &str| -> Vec<u32> {
        let before = tok.decode(&[last], false).unwrap();
        let all = tok.encode_fragment(&format!("{before}{text}"), false).unwrap();
        match all.split_first() {
            Some((&first, rest)) if first == last => rest.to_vec(),
            _ => Vec::new(),
        }
    };
    let quote = tok.encode_fragment("\"", false).unwrap();
    let name = tok.encode_fragment("name", false).unwrap();
    let space_total = tok.encode_fragment(" total", false).unwrap();
    assert_eq!(quote.len(), 1, "{quote:?}");
    let cases = [
        (quote[0], "name\":\""),
        (quote[0], ",\"total\":"),
        (name[0], "\":"),
        (space_total[0], "\": 55.50}"),
        (quote[0], "\u{e9}t\u{e9}"),
    ];
    for round in 0..2 {
        for &(last, text) in &cases {
            assert_eq!(
                tok.encode_after(last, text),
                fresh(last, text),
                "round {round}: {last} then {text:?}"
            );
        }
    }
    // `last`'s text must stay a token of its own: " tot" before "al" merges into " total".
    let tot = tok.encode_fragment(" tot", false).unwrap();
    assert_eq!((tot.len(), space_total.len()), (1, 1), "{tot:?} {space_total:?}");
    assert!(
        tok.encode_after(tot[0], "al").is_empty(),
        "a merged token gives no tokens"
    );
    let after_quote = tok.encode_after(quote[0], "name\":\"");
    assert!(!after_quote.is_empty());
    assert_eq!(tok.decode(&after_quote, false).unwrap(), "name\":\"");
}
