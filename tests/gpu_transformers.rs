//! The CUDA backend against transformers on seeded random Llama and Qwen2 models saved with
//! `save_pretrained` (scripts/peers/transformers_reference.py, run by scripts/gpu-check on the
//! GPU machine, which points QUARRY_HF_REFERENCE at its output). Skipped, with a message,
//! without a GPU or without the reference.

mod hf_reference;

use quarry::runtime::{DeviceChoice, LoadOptions};

#[test]
fn last_logits_and_greedy_continuations_match_transformers() {
    let Some(dirs) = hf_reference::reference_dirs() else {
        return;
    };
    for dir in dirs {
        let options = LoadOptions {
            kv_cache_tokens: Some(4096),
            max_num_batched_tokens: 1024,
            max_num_seqs: 8,
            ..Default::default()
        };
        let mut backend =
            quarry::runtime::load(DeviceChoice::Cuda(0), &dir, options).expect("load the model directory");
        hf_reference::check_against_reference(&mut *backend, &dir);
    }
}
