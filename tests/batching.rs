//! The engine must not change results: a request's greedy output is the same whether it runs
//! alone, with many others in one flattened batch, joining while others decode, with its KV
//! blocks scattered across the pool, with every prompt split into chunks, sharing a cached
//! prefix, or preempted and recomputed because the pool is too small. And every block comes
//! back.

mod common;

use std::sync::Arc;

use quarry::engine::{BlockPool, Completions, EngineConfig, EngineCore, EngineRequest, FinishReason};
use quarry::runtime::Backend;
use quarry::sampling::SamplingParams;
use quarry::tokenizer::Tokenizer;

const PROMPTS: [&str; 8] = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def add(a, b):",
    "Invoice #991\nCustomer: Globex\nAmount: $42.00\nDue: 2025-01-31\n\nJSON:",
    "1, 2, 3, 5, 8, 13,",
    "Q: What is the boiling point of water at sea level in Celsius?\nA:",
    "Dear hiring manager, I am writing to apply for the position of senior data engineer at your company, which I learned about",
    "{\"name\": \"Ada\", \"languages\": [",
];

const GEN: usize = 24;

/// A long shared preamble: requests with it share prefix blocks.
const PREAMBLE: &str = "You are a careful assistant that extracts structured data from business documents. \
    Read the document, find every field the schema asks for, and answer with JSON only. \
    Dates are ISO 8601, amounts are numbers without currency symbols, and unknown fields are null.\n\n";

struct Job {
    prompt: Vec<u32>,
    max_tokens: usize,
    arrival_step: usize,
}

fn jobs(tok: &Tokenizer, arrival: impl Fn(usize) -> usize) -> Vec<Job> {
    PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let text = if i % 2 == 0 {
                format!("{PREAMBLE}{p}")
            } else {
                p.to_string()
            };
            Job {
                prompt: tok.encode(&text, false).unwrap(),
                max_tokens: GEN + i,
                arrival_step: arrival(i),
            }
        })
        .collect()
}

/// Runs `jobs` through an engine; returns each job's tokens, the backend (for the next run)
/// and the number of preemptions. Checks that every block is free at the end.
fn run(
    backend: Box<dyn Backend>,
    tok: &Arc<Tokenizer>,
    config: EngineConfig,
    pool: Option<BlockPool>,
    jobs: &[Job],
) -> (Vec<Vec<u32>>, Box<dyn Backend>, usize) {
    let mut engine = match pool {
        Some(p) => EngineCore::with_pool(backend, tok.clone(), config, p),
        None => EngineCore::new(backend, tok.clone(), config),
    };
    let mut all = Completions::default();
    let mut step = 0;
    let mut preemptions = 0;
    while all.done.len() < jobs.len() {
        for (i, j) in jobs.iter().enumerate() {
            if j.arrival_step == step {
                let params = SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(j.max_tokens)
                };
                engine
                    .add_request(EngineRequest {
                        id: i as u64,
                        prompt: j.prompt.clone(),
                        params,
                        priority: 0,
                        constraint: None,
                    })
                    .unwrap();
            }
        }
        for out in engine.step().unwrap() {
            all.push(&out);
        }
        step += 1;
        assert!(step < 10_000, "no progress");
    }
    let mut done = all.done;
    for c in &done {
        assert_eq!(c.finish, FinishReason::Length);
        preemptions += c.metrics.preemptions;
    }
    let kv = engine.kv();
    assert_eq!(kv.num_free_blocks(), kv.pool().total(), "blocks leaked");
    done.sort_by_key(|c| c.id);
    let tokens = done.into_iter().map(|c| c.tokens).collect();
    (tokens, engine.into_backend(), preemptions)
}

#[test]
fn every_schedule_gives_the_outputs_of_one_request_at_a_time() {
    let Some((backend, tok)) = common::load(2048) else {
        return;
    };
    let tok = Arc::new(tok);
    let mut backend: Box<dyn Backend> = Box::new(backend);
    let num_blocks = backend.kv_layout().num_blocks;
    let block_size = backend.kv_layout().block_size;
    let all = jobs(&tok, |_| 0);
    let defaults = EngineConfig::default();
    let no_cache = EngineConfig {
        prefix_caching: false,
        ..defaults
    };

    let mut alone = Vec::new();
    for j in &all {
        let one = [Job {
            prompt: j.prompt.clone(),
            ..*j
        }];
        let (mut out, b, _) = run(backend, &tok, no_cache, None, &one);
        backend = b;
        alone.push(out.remove(0));
    }
    for (i, a) in alone.iter().enumerate() {
        assert_eq!(a.len(), GEN + i);
    }

    let (together, b, _) = run(backend, &tok, no_cache, None, &all);
    assert_eq!(together, alone, "eight prompts in one flattened batch");
    let (cached, b, _) = run(b, &tok, defaults, None, &all);
    assert_eq!(cached, alone, "shared preamble from the prefix cache");
    // Arrivals every 3 steps: each new prompt prefills in the same pass as others' decodes.
    let (staggered, b, _) = run(b, &tok, defaults, None, &jobs(&tok, |i| 3 * i));
    assert_eq!(staggered, alone, "prefill mixed with decode");
    let (scattered, b, _) = run(b, &tok, defaults, Some(BlockPool::scattered(num_blocks, 17)), &all);
    assert_eq!(scattered, alone, "blocks scattered over the pool");

    let mut chunked = defaults;
    chunked.scheduler.max_num_batched_tokens = 7;
    let (out, b, _) = run(b, &tok, chunked, None, &jobs(&tok, |i| 2 * (7 - i)));
    assert_eq!(out, alone, "every prompt in chunks of at most 7 tokens, staggered");

    // Room for about three requests at a time: the others wait or get preempted.
    let longest = all.iter().map(|j| j.prompt.len() + j.max_tokens).max().unwrap();
    let small = BlockPool::new(3 * longest.div_ceil(block_size));
    let (out, b, preemptions) = run(b, &tok, defaults, Some(small), &all);
    assert_eq!(out, alone, "a pool too small for everyone");
    assert!(preemptions > 0, "the small pool never preempted");
    eprintln!("small pool: {preemptions} preemptions");
    drop(b);
}
