//! SmolLM2's extraction records on the GPU against the CPU's, for every ready-made schema and
//! sample document, with the extraction defaults (greedy, DRY, the copy bias). Where two records
//! differ, the runs parted at a near-tie, shown from both runs' log-probabilities at the token
//! where they parted: the CPU chose a, the GPU b. Up to that token the two histories are the
//! same, so the mask, the copy bias and DRY's penalty (all additive) are the same on both: call
//! their difference between a and b `P`. The CPU's choice means its margin
//! `M = L_cpu(a) - L_cpu(b) + P >= 0`, the GPU's that `L_gpu(b) - L_gpu(a) - P >= 0`; so
//! `M <= (L_cpu(a) - L_cpu(b)) - (L_gpu(a) - L_gpu(b))`, where L are the log-probabilities
//! each run reports (after the mask and the bias). That bound must be a near-tie. Contrast
//! (`Task::contrast`, weight w) draws from `(1 + w) * L - w * L'` (L' the logits without the
//! document), which scales the backends' difference in either by at most `1 + 2w`: so does the
//! near-tie. Skipped, with a message, where there is no GPU.

mod common;

use std::sync::Arc;

use quarry::engine::{EngineClient, EngineConfig, EngineCore};
use quarry::extract::{Extractor, Task};
use quarry::runtime::{DeviceChoice, LoadOptions};
use quarry::sampling::{SampledToken, MAX_LOGPROBS};
use quarry::tokenizer::Tokenizer;

/// tests/engine_client.rs's near-tie: the CUDA backend's spread against llama.cpp.
const NEAR_TIE: f32 = 0.5;

fn extractor(backend: Box<dyn quarry::runtime::Backend>, tok: Arc<Tokenizer>) -> Arc<Extractor> {
    let engine = EngineCore::new(backend, tok.clone(), EngineConfig::default());
    Arc::new(Extractor::new(EngineClient::start(engine), tok))
}

/// The log-probability `run` gave token `t` at its step `i`: its own, or from the alternatives.
fn logprob_of(run: &SampledToken, t: u32) -> Option<f32> {
    if run.token == t {
        return run.logprob;
    }
    run.top.iter().find(|x| x.token == t).map(|x| x.logprob)
}

#[test]
fn gpu_extraction_records_part_from_the_cpus_only_at_near_ties() {
    let Some(path) = common::model_path() else { return };
    if quarry::runtime::device::cuda_for_test().is_none() {
        return;
    }
    let (cpu, tok) = common::load(16384).unwrap();
    let tok = Arc::new(tok);
    let options = LoadOptions {
        kv_cache_tokens: Some(16384),
        max_num_batched_tokens: 2048,
        max_num_seqs: 16,
        ..Default::default()
    };
    let gpu = quarry::runtime::load(DeviceChoice::Cuda(0), &path, options).expect("load on the GPU");
    let (on_cpu, on_gpu) = (extractor(Box::new(cpu), tok.clone()), extractor(gpu, tok.clone()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // Tests run in the package's root (scripts/gpu-check too).
    let files = |dir: &str, ext: &str| -> Vec<std::path::PathBuf> {
        let entries = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path());
        entries.filter(|p| p.extension().is_some_and(|e| e == ext)).collect()
    };
    let (mut schemas, mut documents) = (files("schemas", "json"), files("examples/documents", "txt"));
    schemas.sort();
    documents.sort();
    let (mut same, mut total) = (0, 0);
    for schema in &schemas {
        for document in &documents {
            let task = || Task {
                logprobs: Some(MAX_LOGPROBS),
                ..Task::new(
                    serde_json::from_str(&std::fs::read_to_string(schema).unwrap()).unwrap(),
                    std::fs::read_to_string(document).unwrap(),
                )
            };
            let a = rt.block_on(on_cpu.run(task())).unwrap();
            let b = rt.block_on(on_gpu.run(task())).unwrap();
            total += 1;
            let name = format!(
                "{} on {}",
                schema.file_name().unwrap().to_string_lossy(),
                document.file_name().unwrap().to_string_lossy()
            );
            let Some(i) = (0..a.sampled.len().min(b.sampled.len())).find(|&i| a.sampled[i].token != b.sampled[i].token)
            else {
                assert_eq!(a.text, b.text, "{name}: one output is a prefix of the other");
                same += 1;
                println!("same  {name}");
                continue;
            };
            let (x, y) = (&a.sampled[i], &b.sampled[i]);
            assert!(
                !x.forced && !y.forced,
                "{name}: the grammar forced different tokens at {i}"
            );
            let (ta, tb) = (x.token, y.token);
            let cpu_gap = logprob_of(x, ta).unwrap()
                - logprob_of(x, tb).unwrap_or_else(|| panic!("{name}: b not in the CPU's top"));
            let gpu_gap = logprob_of(y, ta).unwrap_or_else(|| panic!("{name}: a not in the GPU's top"))
                - logprob_of(y, tb).unwrap();
            let bound = cpu_gap - gpu_gap;
            println!(
                "DIFF  {name}: parted at token {i}: cpu {ta} {:?}, gpu {tb} {:?}; the CPU's margin is at most {bound:.3}",
                tok.decode(&[ta], false).unwrap_or_default(),
                tok.decode(&[tb], false).unwrap_or_default()
            );
            let near_tie = NEAR_TIE * (1.0 + 2.0 * task().contrast);
            assert!(
                bound < near_tie,
                "{name}: parted at token {i} with a margin up to {bound:.3}"
            );
        }
    }
    println!("{same} of {total} records identical; the others parted at near-ties");
}
