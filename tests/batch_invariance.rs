//! A request's output does not depend on what runs beside it (`--batch-invariant`). The
//! development set's extraction cases (../shared/data/extract-dev.jsonl), with `quarry extract`'s
//! defaults (context-aware decoding's twin, DRY, the copy bias, jump-forward), run together,
//! repeated to fill a batch in a shuffled order, also with prompts in small chunks, in a pool
//! that preempts, and speculating: each record is byte for byte the one its case gets alone.
//! So are greedy completions of the llama.cpp golden prompts.
//!
//! On the CPU, whose rows never depend on the batch, two cases at a batch of 4; on the GPU
//! (`QUARRY_TEST_DEVICE=cuda`, which scripts/gpu-check sets), the backend is loaded
//! batch-invariant and all 40 cases run at a batch of 256.

mod common;

use std::sync::Arc;

use quarry::engine::{BlockPool, EngineClient, EngineConfig, EngineCore, SpeculativeConfig};
use quarry::extract::{Extractor, Task};
use quarry::runtime::{Backend, DeviceChoice, LoadOptions};
use quarry::tokenizer::Tokenizer;
use serde_json::Value;

/// Requests in one batch: the GPU's, and the CPU's (whose runs are slow).
const GPU_BATCH: usize = 256;
const CPU_BATCH: usize = 4;

fn on_gpu() -> bool {
    common::test_device() != DeviceChoice::Cpu
}

/// The model on the test device, batch-invariant, with room for `GPU_BATCH` requests of the
/// development set at once on the GPU.
fn load() -> Option<(Box<dyn Backend>, Tokenizer)> {
    if !on_gpu() {
        let (backend, tok) = common::load(32768)?;
        return Some((Box::new(backend), tok));
    }
    let path = common::model_path()?;
    quarry::runtime::device::cuda_for_test()?;
    let options = LoadOptions {
        kv_cache_tokens: Some(GPU_BATCH * 2048),
        max_num_batched_tokens: 2048,
        max_num_seqs: GPU_BATCH,
        batch_invariant: true,
        ..Default::default()
    };
    let backend = quarry::runtime::load(common::test_device(), &path, options).expect("load on the GPU");
    let tok = Tokenizer::from_model_file(&path).expect("load the tokenizer");
    Some((backend, tok))
}

/// The development set's cases (`QUARRY_TEST_DEV_CASES`, else ../shared's): all on the GPU,
/// the two shortest on the CPU. `None` (with a message) where the file is absent.
fn cases() -> Option<Vec<(String, Value, String)>> {
    let path = std::env::var("QUARRY_TEST_DEV_CASES")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/data/extract-dev.jsonl").into());
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!("skipping: {path} not found");
        return None;
    };
    let mut cases: Vec<(String, Value, String)> = text
        .lines()
        .map(|line| {
            let case: Value = serde_json::from_str(line).expect("a case is JSON");
            let document = case["document"].as_str().expect("a document").to_string();
            (
                case["id"].as_str().unwrap_or("?").to_string(),
                case["schema"].clone(),
                document,
            )
        })
        .collect();
    if !on_gpu() {
        cases.sort_by_key(|(_, schema, document)| document.len() + schema.to_string().len());
        cases.truncate(2);
    }
    Some(cases)
}

/// `n` indices into `len` items, every item at least once when `n >= len`, in an order
/// shuffled by `seed` (a small LCG: the test needs a fixed order, not a good one).
fn shuffled(len: usize, n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).map(|i| i % len).collect();
    let mut state = seed;
    for i in (1..order.len()).rev() {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        order.swap(i, (state >> 33) as usize % (i + 1));
    }
    order
}

/// The tokens a request held in the cache, for itself and its twin (context-aware decoding's,
/// which runs the request's output after a prompt of its own).
#[derive(Clone, Copy)]
struct Held {
    prompts: [usize; 2],
    output: usize,
}

impl Held {
    /// Blocks of `block_size` tokens the request and its twin hold when admitted (their
    /// prompts), and at their peak (the output too: a block more than they need at most, as
    /// the last token drawn is never computed).
    fn blocks(&self, block_size: usize, at_peak: bool) -> usize {
        let output = if at_peak { self.output } else { 0 };
        self.prompts
            .iter()
            .filter(|&&p| p > 0)
            .map(|p| (p + output).div_ceil(block_size))
            .sum()
    }
}

/// Each case's generated text and what its request held, the tasks submitted in `order` all
/// at once (`together`) or one after another; then the engine back, checked for leaked blocks.
fn extract(
    core: EngineCore,
    tok: &Arc<Tokenizer>,
    cases: &[(String, Value, String)],
    order: &[usize],
    together: bool,
) -> (Vec<(String, Held)>, EngineCore) {
    let extractor = Arc::new(Extractor::new(EngineClient::start(core), tok.clone()));
    let texts = common::runtime().block_on(async {
        let mut handles = Vec::new();
        let mut texts = Vec::new();
        for &i in order {
            let (_, schema, document) = &cases[i];
            let task = Task::new(schema.clone(), document.clone());
            let e = extractor.clone();
            handles.push(tokio::spawn(async move {
                let done = e.run(task).await.expect("the extraction ran");
                let m = &done.metrics;
                let held = Held {
                    prompts: [m.prompt_tokens, m.twin_prompt_tokens],
                    output: m.output_tokens,
                };
                (done.text, held)
            }));
            if !together {
                texts.push(handles.pop().unwrap().await.unwrap());
            }
        }
        for h in handles {
            texts.push(h.await.unwrap());
        }
        texts
    });
    let extractor = Arc::into_inner(extractor).expect("no task holds the extractor");
    let core = extractor
        .client
        .shutdown()
        .expect("the engine thread returns the engine");
    assert_eq!(core.kv().num_free_blocks(), core.kv().pool().total(), "blocks leaked");
    (texts, core)
}

#[test]
fn records_are_byte_identical_alone_and_in_any_batch() {
    let Some(cases) = cases() else { return };
    let Some((backend, tok)) = load() else { return };
    assert!(
        backend.batch_invariant(),
        "{} was asked to be batch-invariant",
        backend.device_name()
    );
    eprintln!("device: {}", backend.device_name());
    let tok = Arc::new(tok);
    let batch = if on_gpu() { GPU_BATCH } else { CPU_BATCH };
    let mut config = EngineConfig::default();
    config.scheduler.max_num_seqs = batch;
    let block_size = backend.kv_layout().block_size;

    let every: Vec<usize> = (0..cases.len()).collect();
    let (alone, mut core) = extract(common::engine(backend, &tok, config, None), &tok, &cases, &every, false);
    let held: Vec<Held> = alone.iter().map(|(_, held)| *held).collect();
    let alone: Vec<String> = alone.into_iter().map(|(text, _)| text).collect();
    let mut chunked = config;
    chunked.scheduler.max_num_batched_tokens = 64;
    let speculating = EngineConfig {
        // Drafts checked every step, not only where the cost model expects them to pay.
        speculative: Some(SpeculativeConfig {
            adaptive: false,
            ..SpeculativeConfig::default()
        }),
        ..config
    };
    // Each prompt computed for itself (no prefix cache) in a pool, counted from what the
    // requests held alone, that preempts whatever the timing of their arrivals. On the GPU,
    // room for four of the largest beside 256 requests. On the CPU, room for the largest to
    // finish alone and for any two to be admitted together, but not for one to reach its peak
    // while another holds its prompt: two that overlap cannot both finish unpreempted.
    let blocks = |at_peak| held.iter().map(move |h| h.blocks(block_size, at_peak));
    eprintln!(
        "blocks held alone, admitted and at the peak: {:?}",
        held.iter()
            .map(|h| (h.blocks(block_size, false), h.blocks(block_size, true)))
            .collect::<Vec<_>>()
    );
    let room = if on_gpu() {
        4 * blocks(true).max().unwrap()
    } else {
        let room = blocks(true).max().unwrap().max(2 * blocks(false).max().unwrap());
        let least = blocks(true).min().unwrap() + blocks(false).min().unwrap();
        // The peak counts up to a block too many for each of a request's two sequences.
        assert!(
            room + 2 < least,
            "no pool both admits any two requests and preempts one of two that overlap ({room} blocks against {least})"
        );
        room
    };
    let small = || BlockPool::new(room);
    // Repeated cases find their prompts cached; without the cache every prompt is computed in
    // the batch.
    let uncached = EngineConfig {
        prefix_caching: false,
        ..config
    };
    let runs: [(&str, EngineConfig, bool); 5] = [
        ("together", config, false),
        ("together, no prefix cache", uncached, false),
        ("prompts in chunks of 64 tokens", chunked, false),
        ("a pool that preempts", uncached, true),
        ("speculating", speculating, false),
    ];
    for (seed, (what, config, preempting)) in runs.into_iter().enumerate() {
        let order = shuffled(cases.len(), batch, seed as u64 + 1);
        let pool = preempting.then(small);
        let (texts, done) = extract(
            common::engine(core.into_backend(), &tok, config, pool),
            &tok,
            &cases,
            &order,
            true,
        );
        let stats = done.stats();
        if preempting {
            assert!(stats.preemptions > 0, "{what}: the small pool never preempted");
        }
        if config.speculative.is_some() {
            assert!(stats.drafts.checks > 0, "{what}: no draft was checked");
        }
        let parted: Vec<&str> = order
            .iter()
            .zip(&texts)
            .filter(|(&i, (text, _))| *text != alone[i])
            .map(|(&i, _)| cases[i].0.as_str())
            .collect();
        assert!(
            parted.is_empty(),
            "{what}: {} of {} records differ from their case's alone: {parted:?}",
            parted.len(),
            texts.len()
        );
        eprintln!("{what}: {} records in a batch of {batch}, each as alone", texts.len());
        core = done;
    }
}

#[test]
fn greedy_completions_are_the_same_alone_and_in_any_batch() {
    let Some((backend, tok)) = load() else { return };
    assert!(
        backend.batch_invariant(),
        "{} was asked to be batch-invariant",
        backend.device_name()
    );
    let tok = Arc::new(tok);
    let golden = common::golden();
    let prompts: Vec<Vec<u32>> = golden.prompts.iter().map(|p| p.prompt_tokens.clone()).collect();
    let batch = if on_gpu() { GPU_BATCH } else { CPU_BATCH };
    // Without the prefix cache, the batch computes every prompt again, beside the others.
    let mut config = EngineConfig {
        prefix_caching: false,
        ..EngineConfig::default()
    };
    config.scheduler.max_num_seqs = batch;
    let client = EngineClient::start(common::engine(backend, &tok, config, None));
    let alone = common::run_prompts(&client, &prompts, golden.gen_tokens, false);
    let order = shuffled(prompts.len(), batch, 7);
    let filled: Vec<Vec<u32>> = order.iter().map(|&i| prompts[i].clone()).collect();
    let together = common::run_prompts(&client, &filled, golden.gen_tokens, true);
    for (&i, got) in order.iter().zip(&together) {
        assert_eq!(
            got, &alone[i],
            "golden prompt {} differs in a batch of {batch} from alone",
            golden.prompts[i].name
        );
    }
    eprintln!("{} completions in a batch of {batch}, each as alone", together.len());
}
