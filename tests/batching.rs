//! Batching must not change results: a request's greedy output is the same whether it runs
//! alone, in one flattened batch with seven others, joining while others decode (prefill and
//! decode rows mixed in one pass), or with its KV blocks scattered across the pool.

mod common;

use quarry::engine::{BlockPool, GenerateRequest, Generator};
use quarry::runtime::Backend;
use quarry::sampling::SamplingParams;

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

fn requests(tok: &quarry::tokenizer::Tokenizer, arrival: impl Fn(usize) -> usize) -> Vec<GenerateRequest> {
    PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| GenerateRequest {
            prompt: tok.encode(p, false).unwrap(),
            params: SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(GEN + i)
            },
            arrival_step: arrival(i),
        })
        .collect()
}

fn run(generator: &mut Generator, reqs: &[GenerateRequest]) -> Vec<Vec<u32>> {
    let out = generator.run(reqs, |_, _, _| {}).unwrap();
    assert_eq!(generator.pool().num_free(), generator.pool().total(), "blocks leaked");
    out.into_iter().map(|c| c.tokens).collect()
}

#[test]
fn batched_mixed_and_scattered_runs_equal_one_at_a_time() {
    let Some((mut backend, tok)) = common::load(2048) else {
        return;
    };
    let num_blocks = backend.kv_layout().num_blocks;
    let reqs = requests(&tok, |_| 0);

    let mut generator = Generator::new(&mut backend, &tok);
    let alone: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| run(&mut generator, std::slice::from_ref(r)).remove(0))
        .collect();
    for (i, a) in alone.iter().enumerate() {
        assert_eq!(a.len(), GEN + i);
    }

    let together = run(&mut generator, &reqs);
    assert_eq!(together, alone, "eight prompts in one flattened batch");

    // Arrivals every 3 steps: each new prompt prefills in the same pass as others' decodes.
    let staggered = run(&mut generator, &requests(&tok, |i| 3 * i));
    assert_eq!(staggered, alone, "prefill mixed with decode");

    let mut scattered = Generator::with_pool(&mut backend, &tok, BlockPool::scattered(num_blocks, 17));
    assert_eq!(run(&mut scattered, &reqs), alone, "blocks scattered over the pool");
    let mut scattered = Generator::with_pool(&mut backend, &tok, BlockPool::scattered(num_blocks, 18));
    assert_eq!(
        run(&mut scattered, &requests(&tok, |i| 2 * (7 - i))),
        alone,
        "scattered and staggered"
    );
}

#[test]
fn a_full_cache_is_an_error_and_leaks_nothing() {
    // 8 blocks of 16 tokens cannot hold eight prompts and their continuations at once.
    let Some((mut backend, tok)) = common::load(8 * 16) else {
        return;
    };
    let mut generator = Generator::new(&mut backend, &tok);
    let err = generator.run(&requests(&tok, |_| 0), |_, _, _| {}).unwrap_err();
    assert!(
        matches!(err, quarry::engine::GenerateError::OutOfKvBlocks { .. }),
        "{err}"
    );
    assert_eq!(generator.pool().num_free(), generator.pool().total());
}
