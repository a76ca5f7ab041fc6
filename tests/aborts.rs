//! Property test with the real model: requests arrive at random steps with random prompts
//! (some sharing a prefix, some long enough to be chunked, some constrained) and random
//! lengths, and some are aborted at a random later step, mid-prefill or mid-decode, with and
//! without speculative decoding. Every block comes back, and every request that was not
//! aborted gets exactly the output it gets alone (without speculation).

mod common;

use std::sync::{Arc, Mutex, OnceLock};

use proptest::prelude::*;
use quarry::engine::{
    BlockPool, CompiledConstraint, Completions, Constraint, EngineConfig, EngineCore, EngineRequest, FinishReason,
    SpeculativeConfig, StructuredOutputs,
};
use quarry::runtime::Backend;
use quarry::sampling::SamplingParams;
use quarry::tokenizer::Tokenizer;
use quarry_grammar::json::Whitespace;

struct Model {
    backend: Mutex<Option<Box<dyn Backend>>>,
    tok: Arc<Tokenizer>,
    constraint: CompiledConstraint,
}

/// Loaded once for every case; `None` where the model was never fetched.
fn model() -> Option<&'static Model> {
    static MODEL: OnceLock<Option<Model>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let (backend, tok) = common::load(4096)?;
            let tok = Arc::new(tok);
            let schema = serde_json::json!({
                "type": "object",
                "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 6}},
                "required": ["id", "tag"],
                "additionalProperties": false
            });
            let constraint = StructuredOutputs::new(&tok)
                .compile(&Constraint::Json {
                    schema,
                    whitespace: Whitespace::Compact,
                    strict: true,
                    close_objects: false,
                    ordered_properties: false,
                })
                .unwrap();
            Some(Model {
                backend: Mutex::new(Some(Box::new(backend))),
                tok,
                constraint,
            })
        })
        .as_ref()
}

#[derive(Debug, Clone)]
struct Job {
    prompt: Vec<u32>,
    max_tokens: usize,
    arrival: usize,
    /// Steps after arrival.
    abort_after: Option<usize>,
    constrained: bool,
}

fn job() -> impl Strategy<Value = Job> {
    let shared: Vec<u32> = (0..40).map(|i| 300 + 37 * i).collect();
    (
        any::<bool>(),
        prop::collection::vec(100u32..40_000, 1..120),
        1usize..24,
        0usize..12,
        prop::option::weighted(0.4, 0usize..16),
        prop::bool::weighted(0.25),
    )
        .prop_map(
            move |(share, tail, max_tokens, arrival, abort_after, constrained)| Job {
                prompt: if share {
                    shared.iter().chain(&tail).copied().collect()
                } else {
                    tail
                },
                max_tokens,
                arrival,
                abort_after,
                constrained,
            },
        )
}

fn request(m: &Model, j: &Job) -> EngineRequest {
    // A constrained request gets at least its schema's shortest record ({"id":0,"tag":""}):
    // fewer tokens are refused at admission.
    let max_tokens = match j.constrained {
        true => j.max_tokens + m.constraint.matcher().completion_cost().unwrap_or(0),
        false => j.max_tokens,
    };
    EngineRequest {
        id: 0,
        prompt: j.prompt.clone(),
        params: SamplingParams {
            ignore_eos: !j.constrained,
            ..SamplingParams::greedy(max_tokens)
        },
        priority: 0,
        constraint: j.constrained.then(|| m.constraint.clone()),
    }
}

/// Runs the jobs step by step; returns the tokens of each one that finished (None if aborted).
fn run(m: &Model, jobs: &[Job], config: EngineConfig, blocks: Option<usize>) -> Vec<Option<Vec<u32>>> {
    let backend = m.backend.lock().unwrap().take().unwrap();
    let mut engine = match blocks {
        Some(n) => EngineCore::with_pool(backend, m.tok.clone(), config, BlockPool::new(n)),
        None => EngineCore::new(backend, m.tok.clone(), config),
    };
    let mut all = Completions::default();
    let mut aborted = vec![false; jobs.len()];
    let last_event = jobs
        .iter()
        .map(|j| j.arrival + j.abort_after.unwrap_or(0))
        .max()
        .unwrap_or(0);
    let mut step = 0;
    while step <= last_event || engine.has_unfinished() {
        for (i, j) in jobs.iter().enumerate() {
            if j.arrival == step {
                engine
                    .add_request(EngineRequest {
                        id: i as u64,
                        ..request(m, j)
                    })
                    .unwrap();
            }
            if j.abort_after.map(|a| j.arrival + a) == Some(step) {
                if let Some(out) = engine.abort(i as u64) {
                    assert_eq!(out.finished, Some(FinishReason::Aborted));
                    aborted[i] = true;
                }
            }
        }
        for out in engine.step().unwrap() {
            all.push(&out);
        }
        step += 1;
        assert!(step < 5_000, "no progress");
    }
    let kv = engine.kv();
    assert_eq!(kv.num_free_blocks(), kv.pool().total(), "blocks leaked");
    *m.backend.lock().unwrap() = Some(engine.into_backend());
    let mut out: Vec<Option<Vec<u32>>> = vec![None; jobs.len()];
    for c in all.done {
        out[c.id as usize] = Some(c.tokens);
    }
    for (i, o) in out.iter_mut().enumerate() {
        if aborted[i] {
            *o = None;
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_arrivals_and_aborts_leak_nothing_and_change_no_one_else(
        jobs in prop::collection::vec(job(), 1..10),
        budget in prop::sample::select(vec![16usize, 64, 2048]),
        small_pool in any::<bool>(),
        speculate in any::<bool>(),
    ) {
        let Some(m) = model() else { return Ok(()) };
        let mut config = EngineConfig::default();
        config.scheduler.max_num_batched_tokens = budget;
        config.speculative = speculate.then(SpeculativeConfig::default);
        // A pool of 24 blocks (384 tokens) holds two or three of these requests at a time.
        let blocks = small_pool.then_some(24);
        let out = run(m, &jobs, config, blocks);
        for (i, j) in jobs.iter().enumerate() {
            let Some(tokens) = &out[i] else { continue };
            let alone = Job { arrival: 0, abort_after: None, ..j.clone() };
            let reference = run(m, std::slice::from_ref(&alone), EngineConfig::default(), None);
            prop_assert_eq!(Some(tokens), reference[0].as_ref(), "job {}", i);
        }
    }
}
