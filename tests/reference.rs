//! Quarry against llama.cpp on the same GGUF. The golden file comes from llama-cpp-python:
//!     $(scripts/setup-peers) scripts/make-goldens.py > tests/golden/llamacpp-smollm2.json

mod common;

use quarry::engine::{GenerateRequest, Generator};
use quarry::sampling::SamplingParams;
use quarry::tokenizer::ChatMessage;

/// Log-probabilities may differ by this much: llama.cpp keeps K and V in f16 and we keep them
/// in f32; both quantize activations to Q8_1 the same way, so the rest agrees closely.
const LOGPROB_TOLERANCE: f64 = 0.05;

#[test]
fn tokenization_matches_llama_cpp_and_round_trips() {
    let Some(path) = common::model_path() else { return };
    let tok = quarry::tokenizer::Tokenizer::from_model_file(&path).unwrap();
    for case in common::golden().tokenization {
        let ids = tok.encode(&case.text, false).unwrap();
        assert_eq!(ids, case.tokens, "tokens of {:?}", case.text);
        assert_eq!(tok.decode(&ids, false).unwrap(), case.text, "round trip of {:?}", case.text);
    }
}

#[test]
fn chat_template_and_prompt_tokens_match_the_reference() {
    let Some(path) = common::model_path() else { return };
    let tok = quarry::tokenizer::Tokenizer::from_model_file(&path).unwrap();
    for p in common::golden().prompts {
        let text = match &p.user {
            Some(user) => tok.chat_prompt(&[ChatMessage::new("user", user)]).unwrap(),
            None => p.text.clone(),
        };
        assert_eq!(text, p.text, "rendered prompt of {}", p.name);
        assert_eq!(tok.encode(&text, p.chat).unwrap(), p.prompt_tokens, "prompt tokens of {}", p.name);
    }
}

#[test]
fn greedy_continuations_and_logprobs_match_llama_cpp() {
    let golden = common::golden();
    let Some(path) = common::model_path() else { return };
    assert_eq!(sha256(&path), golden.model_sha256, "goldens were made with another model file");
    let (mut backend, tok) = common::load(4096).unwrap();
    let mut generator = Generator::new(&mut backend, &tok);
    for p in &golden.prompts {
        let request = GenerateRequest {
            prompt: p.prompt_tokens.clone(),
            params: SamplingParams {
                logprobs: Some(20),
                ignore_eos: true,
                ..SamplingParams::greedy(golden.gen_tokens)
            },
            arrival_step: 0,
        };
        let c = generator.run(std::slice::from_ref(&request), |_, _, _| {}).unwrap().remove(0);
        assert_eq!(c.tokens, p.greedy_tokens, "greedy continuation of {}", p.name);
        for (pos, reference) in p.top_logprobs.iter().enumerate() {
            let ours = &c.sampled[pos].top;
            for &(token, want) in reference {
                let got = ours
                    .iter()
                    .find(|t| t.token == token)
                    .unwrap_or_else(|| panic!("{} pos {pos}: token {token} not in our top 20", p.name));
                assert!(
                    (got.logprob as f64 - want).abs() <= LOGPROB_TOLERANCE,
                    "{} pos {pos} token {token}: {} vs llama.cpp {want}",
                    p.name,
                    got.logprob
                );
            }
        }
    }
    assert_eq!(generator.pool().num_free(), generator.pool().total());
}

fn sha256(path: &std::path::Path) -> String {
    let out = std::process::Command::new("sha256sum").arg(path).output().expect("sha256sum");
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap_or_default().to_string()
}
