//! A model directory's tokenizer (tokenizer.json, tokenizer_config.json) against the GGUF's:
//! the default model's tokenizer written out as Hugging Face files and read back encodes,
//! renders chat prompts and ends generations exactly as the GGUF's does.

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
    std::fs::remove_dir_all(&dir).unwrap();
}
