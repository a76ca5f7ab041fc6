//! The engine behind its async client, with the real model: 32 concurrent mixed requests
//! (a long shared prefix, JSON Schema constraints, different lengths) give each request the
//! greedy output it gets alone, also when the pool is small enough to preempt and when every
//! prompt is split into chunks; a client that drops its stream frees the request's blocks and
//! leaves the others' outputs alone.
//!
//! With `QUARRY_TEST_DEVICE=cuda` (scripts/gpu-check) the same runs go to the GPU, where a
//! batch's shape may change a GEMM's summation order: there outputs must agree up to the first
//! near-tie, which the requests' top log-probabilities show; with `QUARRY_TEST_BATCH_INVARIANT=1`
//! as well (the backend loaded batch-invariant), exactly.

mod common;

use std::sync::Arc;

use quarry::engine::{
    AsyncScheduling, BlockPool, Constraint, EngineClient, EngineConfig, EngineCore, EngineRequest, FinishReason,
    SpeculativeConfig, StructuredOutputs,
};
use quarry::sampling::{ContrastParams, SamplingParams};
use quarry::tokenizer::Tokenizer;
use quarry_grammar::json::Whitespace;
use serde_json::Value;

/// About 200 tokens that half the requests start with.
const PREFIX: &str = "You are a meticulous analyst working for a logistics company. Every morning you receive \
    a stack of shipping manifests, customs declarations, supplier invoices and customer emails. Your task is \
    to read each one, decide what kind of document it is, pull out the parties, dates, amounts and reference \
    numbers, and flag anything unusual: totals that do not add up, dates in the future, duplicate invoice \
    numbers, or addresses that do not match the customer record. Be brief. Use plain words. When something is \
    missing, say so rather than guessing. Answer the question that follows about today's first document.\n\n";

const QUESTIONS: [&str; 8] = [
    "Question: what is a bill of lading?",
    "Question: name three reasons a customs declaration is held.",
    "Question: how do you spot a duplicate invoice?",
    "Question: what does FOB mean?",
    "Question: why check the consignee address?",
    "Question: what is a pro forma invoice?",
    "Question: who pays import duty under DDP terms?",
    "Question: what is demurrage?",
];

const PLAIN: [&str; 6] = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a village by the sea, there lived",
    "1, 2, 3, 5, 8, 13,",
    "The three primary colors are",
    "Translate to French: good morning, my friend.",
];

#[derive(Clone)]
struct Job {
    prompt: Vec<u32>,
    max_tokens: usize,
    schema: Option<Value>,
}

fn jobs(tok: &Tokenizer) -> Vec<Job> {
    let cases: Vec<Value> = serde_json::from_str(include_str!("data/structured_cases.json")).expect("cases are JSON");
    let mut jobs = Vec::new();
    for i in 0..32 {
        let job = match i % 4 {
            0 | 2 => Job {
                prompt: tok
                    .encode(&format!("{PREFIX}{}", QUESTIONS[(i / 2) % QUESTIONS.len()]), false)
                    .unwrap(),
                max_tokens: 6 + (i * 5) % 23,
                schema: None,
            },
            1 => Job {
                prompt: tok.encode(PLAIN[(i / 4) % PLAIN.len()], false).unwrap(),
                max_tokens: 4 + (i * 7) % 29,
                schema: None,
            },
            _ => {
                let case = &cases[(i / 4) % cases.len()];
                let text = format!(
                    "Schema: {}\nDocument: {}\nJSON:",
                    case["schema"],
                    case["document"].as_str().unwrap()
                );
                Job {
                    prompt: tok.encode(&text, false).unwrap(),
                    max_tokens: 48,
                    schema: Some(case["schema"].clone()),
                }
            }
        };
        jobs.push(job);
    }
    jobs
}

/// Exact comparisons on the CPU and on a batch-invariant GPU; on the GPU otherwise, top
/// log-probabilities to judge near-ties by.
fn exact() -> bool {
    common::test_device() == quarry::runtime::DeviceChoice::Cpu || common::batch_invariant_asked()
}

/// Two greedy runs of one request part only where the first run's choice and the second's were
/// within this many nats of each other (the CUDA backend's spread against llama.cpp, see
/// tests/gpu_backend.rs).
const NEAR_TIE: f32 = 0.5;

/// How the jobs' tokens are chosen.
#[derive(Clone, Copy, PartialEq)]
enum Draw {
    Greedy,
    /// Temperature 0.8, top-p 0.95, a seed per job.
    Seeded,
    /// Greedy, each job contrasted (context-aware decoding) with its own prompt at weight 1:
    /// `2 * logits - logits`, the same logits where the twin's rows line up with the request's.
    SelfContrast,
    /// Greedy, each job contrasted at weight 0.5 with the first half of its prompt, as a
    /// request with its document left out would be.
    Contrast,
}

/// `logprobs`: the reference runs on the GPU ask for the top alternatives, to judge near-ties
/// by; the runs compared with them do not.
fn request(job: &Job, structured: &StructuredOutputs, logprobs: bool, draw: Draw) -> EngineRequest {
    let constraint = job.schema.as_ref().map(|schema| {
        structured
            .compile(&Constraint::Json {
                schema: schema.clone(),
                whitespace: Whitespace::Compact,
                strict: false,
                close_objects: false,
                ordered_properties: false,
            })
            .unwrap()
    });
    // A constrained job gets its budget on top of its schema's shortest record: fewer tokens
    // than that are refused at admission.
    let minimum = constraint
        .as_ref()
        .map_or(0, |c| c.matcher().completion_cost().unwrap_or(0));
    EngineRequest {
        id: 0,
        prompt: job.prompt.clone(),
        params: SamplingParams {
            ignore_eos: job.schema.is_none(),
            logprobs: logprobs.then_some(quarry::sampling::MAX_LOGPROBS),
            temperature: if draw == Draw::Seeded { 0.8 } else { 0.0 },
            top_p: if draw == Draw::Seeded { 0.95 } else { 1.0 },
            seed: Some(job.prompt.len() as u64 * 7 + job.max_tokens as u64),
            contrast: match draw {
                Draw::SelfContrast => Some(ContrastParams {
                    prompt: job.prompt.clone(),
                    weight: 1.0,
                }),
                Draw::Contrast => Some(ContrastParams {
                    prompt: job.prompt[..job.prompt.len() / 2 + 1].to_vec(),
                    weight: 0.5,
                }),
                _ => None,
            },
            ..SamplingParams::greedy(job.max_tokens + minimum)
        },
        priority: 0,
        constraint,
    }
}

/// What a request produced, as the client saw it.
#[derive(Debug)]
struct Seen {
    tokens: Vec<u32>,
    text: String,
    finish: FinishReason,
    /// Per token, the most likely alternatives (GPU runs only).
    top: Vec<Vec<(u32, f32)>>,
}

impl PartialEq for Seen {
    fn eq(&self, other: &Self) -> bool {
        (&self.tokens, &self.text, self.finish) == (&other.tokens, &other.text, other.finish)
    }
}

/// Every output equal to its reference; on the GPU, equal up to a near-tie of the reference
/// run, where the two parted. Returns how many parted.
fn same_up_to_near_ties(got: &[Seen], reference: &[Seen], what: &str) -> usize {
    if exact() {
        assert_eq!(got, reference, "{what}");
        return 0;
    }
    let mut parted = 0;
    for (i, (g, r)) in got.iter().zip(reference).enumerate() {
        if g == r {
            continue;
        }
        let at = g.tokens.iter().zip(&r.tokens).position(|(a, b)| a != b);
        let Some(at) = at else {
            panic!("{what}: request {i} differs without a differing token: {g:?} vs {r:?}");
        };
        let logprob = |t: u32| r.top[at].iter().find(|(tok, _)| *tok == t).map(|&(_, lp)| lp);
        let (chosen, other) = (logprob(r.tokens[at]), logprob(g.tokens[at]));
        match (chosen, other) {
            (Some(a), Some(b)) if a - b <= NEAR_TIE => parted += 1,
            _ => panic!(
                "{what}: request {i} parts at token {at} ({} vs {}) with log-probabilities {chosen:?} vs {other:?}",
                r.tokens[at], g.tokens[at]
            ),
        }
    }
    eprintln!("{what}: {parted} of {} outputs parted at a near-tie", got.len());
    parted
}

async fn collect(stream: quarry::engine::RequestStream) -> (Seen, usize) {
    let c = stream.collect().await.expect("the engine finished the request");
    let top = c
        .sampled
        .iter()
        .map(|s| s.top.iter().map(|t| (t.token, t.logprob)).collect())
        .collect();
    let seen = Seen {
        tokens: c.tokens,
        text: c.text,
        finish: c.finish,
        top,
    };
    (seen, c.metrics.preemptions)
}

/// Runs every job through a client, all at once (`together`) or one after another; returns
/// the outputs, the total preemptions and the engine back. Every block must be free at the end.
fn run(
    core: EngineCore,
    jobs: &[Job],
    structured: &StructuredOutputs,
    together: bool,
) -> (Vec<Seen>, usize, EngineCore) {
    run_drawn(core, jobs, structured, together, Draw::Greedy)
}

fn run_drawn(
    core: EngineCore,
    jobs: &[Job],
    structured: &StructuredOutputs,
    together: bool,
    draw: Draw,
) -> (Vec<Seen>, usize, EngineCore) {
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let client = EngineClient::start(core);
    let results = runtime.block_on(async {
        if together {
            let mut streams = Vec::new();
            for j in jobs {
                streams.push(client.submit(request(j, structured, false, draw)).await.unwrap());
            }
            let mut tasks = tokio::task::JoinSet::new();
            for (i, s) in streams.into_iter().enumerate() {
                tasks.spawn(async move { (i, collect(s).await) });
            }
            let mut out: Vec<_> = Vec::new();
            while let Some(r) = tasks.join_next().await {
                out.push(r.unwrap());
            }
            out.sort_by_key(|(i, _)| *i);
            out.into_iter().map(|(_, r)| r).collect::<Vec<_>>()
        } else {
            let mut out = Vec::new();
            for j in jobs {
                out.push(collect(client.submit(request(j, structured, !exact(), draw)).await.unwrap()).await);
            }
            out
        }
    });
    let core = client.shutdown().expect("the engine thread returns the engine");
    let kv = core.kv();
    assert_eq!(kv.num_free_blocks(), kv.pool().total(), "blocks leaked");
    let preemptions = results.iter().map(|(_, p)| p).sum();
    (results.into_iter().map(|(s, _)| s).collect(), preemptions, core)
}

#[test]
fn thirty_two_concurrent_requests_match_each_alone() {
    let Some((backend, tok)) = common::load_backend(8192) else {
        return;
    };
    let tok = Arc::new(tok);
    let structured = StructuredOutputs::new(&tok);
    let jobs = jobs(&tok);
    let config = EngineConfig::default();
    let block_size = backend.kv_layout().block_size;
    eprintln!("device: {}", backend.device_name());

    let (alone, _, core) = run(common::engine(backend, &tok, config, None), &jobs, &structured, false);
    for (j, a) in jobs.iter().zip(&alone) {
        match &j.schema {
            None => assert_eq!(a.tokens.len(), j.max_tokens),
            Some(schema) if a.finish == FinishReason::Stop => {
                let value: Value = serde_json::from_str(&a.text).unwrap_or_else(|e| panic!("{e}: {}", a.text));
                assert!(jsonschema::validator_for(schema).unwrap().is_valid(&value), "{value}");
            }
            Some(_) => {}
        }
    }

    let (together, _, core) = run(core, &jobs, &structured, true);
    same_up_to_near_ties(&together, &alone, "32 at once");

    // Every prompt is longer than 4 tokens, so every one is split.
    assert!(jobs.iter().all(|j| j.prompt.len() > 4));
    let mut chunked = config;
    chunked.scheduler.max_num_batched_tokens = 4;
    let (out, _, core) = run(
        common::engine(core.into_backend(), &tok, chunked, None),
        &jobs,
        &structured,
        true,
    );
    same_up_to_near_ties(&out, &alone, "every prompt in chunks of at most 4 tokens");

    // Room for about four of the 32 at a time.
    let longest = jobs.iter().map(|j| j.prompt.len() + j.max_tokens).max().unwrap();
    let pool = BlockPool::new(4 * longest.div_ceil(block_size));
    let (out, preemptions, _) = run(
        common::engine(core.into_backend(), &tok, config, Some(pool)),
        &jobs,
        &structured,
        true,
    );
    eprintln!("small pool: {preemptions} preemptions");
    same_up_to_near_ties(&out, &alone, "a pool too small for everyone");
    assert!(preemptions > 0, "the small pool never preempted");
}

/// Speculative decoding changes no output: the 32 jobs at once with prompt lookup alone, the
/// grammar's forced tokens alone (with jump-forward off, where they are guesses to check) and
/// both, with every prompt chunked and with a pool small enough to preempt; a draft model;
/// seeded sampling too. Drafts are checked and many kept, and every block comes back (`run` checks).
#[test]
fn speculation_changes_no_output() {
    let Some((backend, tok)) = common::load_backend(8192) else {
        return;
    };
    let tok = Arc::new(tok);
    let structured = StructuredOutputs::new(&tok);
    let jobs = jobs(&tok);
    let config = EngineConfig::default();
    let block_size = backend.kv_layout().block_size;
    let speculating = |ngram: bool, grammar: bool, base: EngineConfig| EngineConfig {
        speculative: Some(SpeculativeConfig {
            tokens: 6,
            ngram,
            grammar,
            // Every draft checked: this is about outputs, not whether drafts pay.
            adaptive: false,
        }),
        ..base
    };

    let (alone, _, mut core) = run(common::engine(backend, &tok, config, None), &jobs, &structured, false);
    for (what, ngram, grammar) in [
        ("prompt lookup", true, false),
        ("prompt lookup and grammar", true, true),
    ] {
        let c = speculating(ngram, grammar, config);
        let (out, _, done) = run(
            common::engine(core.into_backend(), &tok, c, None),
            &jobs,
            &structured,
            true,
        );
        same_up_to_near_ties(&out, &alone, what);
        let d = done.stats().drafts;
        eprintln!("{what}: {} of {} drafts kept ({d:?})", d.accepted(), d.proposed());
        assert!(d.ngram_accepted > 100, "{what}: prompt lookup kept {d:?}");
        assert!(d.accepted() < d.proposed(), "{what}: some drafts are rejected");
        core = done;
    }

    let mut chunked = speculating(true, true, config);
    chunked.scheduler.max_num_batched_tokens = 4;
    let (out, _, done) = run(
        common::engine(core.into_backend(), &tok, chunked, None),
        &jobs,
        &structured,
        true,
    );
    same_up_to_near_ties(&out, &alone, "speculating, every prompt in chunks of at most 4 tokens");
    assert!(done.stats().drafts.accepted() > 0);

    let longest = jobs.iter().map(|j| j.prompt.len() + j.max_tokens).max().unwrap();
    let pool = BlockPool::new(4 * longest.div_ceil(block_size));
    let c = speculating(true, true, config);
    let (out, preemptions, done) = run(
        common::engine(done.into_backend(), &tok, c, Some(pool)),
        &jobs,
        &structured,
        true,
    );
    same_up_to_near_ties(&out, &alone, "speculating, a pool too small for everyone");
    assert!(preemptions > 0, "the small pool never preempted");

    // Without jump-forward the grammar's forced tokens are drafts like any other.
    let plain = EngineConfig {
        jump_forward: false,
        ..config
    };
    // Alone: on the GPU the reference needs its log-probabilities to judge near-ties by.
    let (reference, _, core) = run(
        common::engine(done.into_backend(), &tok, plain, None),
        &jobs,
        &structured,
        false,
    );
    let c = speculating(false, true, plain);
    let (out, _, done) = run(
        common::engine(core.into_backend(), &tok, c, None),
        &jobs,
        &structured,
        true,
    );
    same_up_to_near_ties(&out, &reference, "forced tokens as drafts, jump-forward off");
    let d = done.stats().drafts;
    assert!(d.grammar_accepted > 20 && d.ngram_proposed == 0, "{d:?}");

    // A draft model: the same model again, as a second backend. Its guess under the request's
    // mask is the model's own choice (these requests have no penalties), so nearly every
    // guess is kept; the outputs are those without it.
    let (draft, _) = common::load_backend(8192).expect("loaded once already");
    let mut with_model = common::engine(done.into_backend(), &tok, speculating(false, true, config), None);
    with_model.set_draft_model(draft);
    let (out, _, done) = run(with_model, &jobs, &structured, true);
    same_up_to_near_ties(&out, &alone, "a draft model");
    let d = done.stats().drafts;
    eprintln!("a draft model: {d:?}");
    assert!(d.model_accepted * 10 > d.model_proposed * 8, "{d:?}");

    // A seeded draw depends on the request's seed and output position alone, so checking a
    // draft is drawing that position: the same tokens, where the batch cannot move a draw.
    if exact() {
        let c = speculating(true, true, config);
        let (reference, _, core) = run_drawn(
            common::engine(done.into_backend(), &tok, config, None),
            &jobs,
            &structured,
            true,
            Draw::Seeded,
        );
        let (out, _, done) = run_drawn(
            common::engine(core.into_backend(), &tok, c, None),
            &jobs,
            &structured,
            true,
            Draw::Seeded,
        );
        assert_eq!(out, reference, "seeded sampling with and without speculation");
        assert!(done.stats().drafts.accepted() > 0);
    }
}

/// Where steps may be pipelined, a speculating engine pipelines the steps in which drafting
/// would gain less (at 32 requests, where most requests find no drafts in a step) and drafts in
/// the others (its first step, before any is measured; the last few requests): both kinds of
/// step run, and the records are those of each request alone. Alone, requests copying from
/// their documents draft in most steps.
#[test]
fn speculation_pipelines_the_steps_its_drafts_would_not_pay_for() {
    let Some((backend, tok)) = common::load_backend(8192) else {
        return;
    };
    let tok = Arc::new(tok);
    let structured = StructuredOutputs::new(&tok);
    let jobs = jobs(&tok);
    let plain = EngineConfig {
        async_scheduling: AsyncScheduling::Off,
        ..EngineConfig::default()
    };
    let (alone, _, core) = run(common::engine(backend, &tok, plain, None), &jobs, &structured, false);
    let both = EngineConfig {
        async_scheduling: AsyncScheduling::On,
        speculative: Some(SpeculativeConfig::default()),
        ..plain
    };
    let (out, _, done) = run(
        common::engine(core.into_backend(), &tok, both, None),
        &jobs,
        &structured,
        true,
    );
    same_up_to_near_ties(&out, &alone, "speculating where it pays, pipelined elsewhere");
    let stats = done.stats();
    let d = stats.drafts;
    eprintln!(
        "{} of {} steps pipelined; {} of {} drafts kept in {} checks",
        stats.pipelined_steps,
        stats.steps,
        d.accepted(),
        d.proposed(),
        d.checks
    );
    assert!(stats.pipelined_steps > 0, "no step was pipelined: {stats:?}");
    // On the CPU a check's rows cost what plain rows do, so whether any step of the batch
    // drafts turns on the measured timings (on CI's two shared cores one run pipelined 126 of
    // 131 steps and checked no draft): there only the outputs and the pipelining are asserted.
    let on_gpu = common::test_device() != quarry::runtime::DeviceChoice::Cpu;
    if on_gpu {
        assert!(d.checks > 0, "no step drafted: {stats:?}");
    }

    // Alone, extractions copying from their documents draft on the GPU, whose step costs next
    // to the same for 3 rows or 27, in a larger share of their steps than the batch of 32 did,
    // and keep drafts: the choice that pipelines a full batch's steps must not take over where
    // drafting gains most. (The shares move with the measured timings: on an H200, 0.20-0.54
    // of the steps alone against 0.11-0.13 in the batch, over ten runs.) On the CPU a check of 27 rows costs several plain steps, and whether
    // drafting pays turns on the machine's measured timings (CI's two shared cores once chose
    // to pipeline all 245), so there the counts are only printed. So too on a batch-invariant
    // GPU, whose products sum every row in one order at a cost per row of their own, which the
    // policy measures like any other (an H100 pipelined 226 of 247 steps of the three alone,
    // with one check, where the plain backend in the same run checked in 27 of 125).
    let copying: Vec<Job> = jobs.iter().filter(|j| j.schema.is_some()).take(3).cloned().collect();
    let (out, _, done) = run(done, &copying, &structured, false);
    let after = done.stats();
    let (steps, pipelined) = (after.steps - stats.steps, after.pipelined_steps - stats.pipelined_steps);
    let checks = (after.drafts.checks - d.checks) as u64;
    let kept = after.drafts.accepted() - d.accepted();
    eprintln!("alone: {pipelined} of {steps} steps pipelined, {checks} checks, {kept} drafts kept");
    assert_eq!(out.len(), copying.len());
    let unpipelined = |steps: u64, pipelined: u64| (steps - pipelined) as f64 / steps.max(1) as f64;
    let (alone, batch) = (
        unpipelined(steps, pipelined),
        unpipelined(stats.steps, stats.pipelined_steps),
    );
    if on_gpu && !common::batch_invariant_asked() {
        assert!(
            alone > batch && kept > 0,
            "alone {alone:.2} against {batch:.2}: {after:?}"
        );
    }
}

/// Runs the jobs drawn by `draw` all at once three ways: in the default engine; with every
/// prompt in chunks of 4 and 6 drafts checked a step; and in a pool small enough to preempt
/// (twins take their blocks from it too). Each way must give `alone`'s records; every block,
/// twins' included, comes back (`run` checks). Returns the engine and the small pool's
/// preemptions.
#[allow(clippy::too_many_arguments)]
fn the_same_under_load(
    core: EngineCore,
    tok: &Arc<Tokenizer>,
    jobs: &[Job],
    structured: &StructuredOutputs,
    alone: &[Seen],
    draw: Draw,
    what: &str,
) -> (EngineCore, usize) {
    let config = EngineConfig::default();
    let block_size = core.backend().kv_layout().block_size;
    let (out, _, core) = run_drawn(
        common::engine(core.into_backend(), tok, config, None),
        jobs,
        structured,
        true,
        draw,
    );
    same_up_to_near_ties(&out, alone, &format!("{what}, 32 at once"));

    let mut chunked = EngineConfig {
        speculative: Some(SpeculativeConfig {
            tokens: 6,
            ngram: true,
            grammar: true,
            adaptive: false,
        }),
        ..config
    };
    chunked.scheduler.max_num_batched_tokens = 4;
    let (out, _, core) = run_drawn(
        common::engine(core.into_backend(), tok, chunked, None),
        jobs,
        structured,
        true,
        draw,
    );
    same_up_to_near_ties(&out, alone, &format!("{what}, speculating, prompts in chunks of 4"));
    assert!(core.stats().drafts.accepted() > 0);

    let longest = jobs.iter().map(|j| j.prompt.len() + j.max_tokens).max().unwrap();
    let pool = BlockPool::new(4 * longest.div_ceil(block_size));
    let (out, preemptions, core) = run_drawn(
        common::engine(core.into_backend(), tok, config, Some(pool)),
        jobs,
        structured,
        true,
        draw,
    );
    same_up_to_near_ties(&out, alone, &format!("{what}, a pool too small for everyone"));
    assert!(preemptions > 0, "the small pool never preempted");
    (core, preemptions)
}

/// Context-aware decoding's twin follows its request row for row: contrasted with its own
/// prompt at weight 1, every job gives its output without contrast, under every load of
/// `the_same_under_load`.
#[test]
fn a_twin_with_the_requests_own_prompt_changes_no_output() {
    let Some((backend, tok)) = common::load_backend(8192) else {
        return;
    };
    let tok = Arc::new(tok);
    let structured = StructuredOutputs::new(&tok);
    let jobs = jobs(&tok);
    let (alone, _, core) = run(
        common::engine(backend, &tok, EngineConfig::default(), None),
        &jobs,
        &structured,
        false,
    );
    the_same_under_load(
        core,
        &tok,
        &jobs,
        &structured,
        &alone,
        Draw::SelfContrast,
        "self-contrasted",
    );
}

/// A contrasted request's record does not depend on what else runs: each job contrasted with
/// half its prompt gives, under every load of `the_same_under_load` (a pool that preempts
/// included: the scheduler plans twins' blocks with their requests'), what it gives alone; and
/// the contrast does change records.
#[test]
fn a_contrasted_record_is_the_same_under_kv_pressure() {
    let Some((backend, tok)) = common::load_backend(8192) else {
        return;
    };
    let tok = Arc::new(tok);
    let structured = StructuredOutputs::new(&tok);
    let jobs = jobs(&tok);
    let config = EngineConfig::default();
    let (plain, _, core) = run(common::engine(backend, &tok, config, None), &jobs, &structured, false);
    let (alone, _, core) = run_drawn(
        common::engine(core.into_backend(), &tok, config, None),
        &jobs,
        &structured,
        false,
        Draw::Contrast,
    );
    let changed = alone.iter().zip(&plain).filter(|(a, p)| a.tokens != p.tokens).count();
    assert!(changed > 0, "the contrast changed no record");
    let (_, preemptions) = the_same_under_load(core, &tok, &jobs, &structured, &alone, Draw::Contrast, "contrasted");
    eprintln!("contrasted, small pool: {preemptions} preemptions; {changed} records changed by the contrast");
}

/// Pipelined steps (`async_scheduling`: each step planned and queued before the one before it
/// is read) change no output: greedy, seeded and contrasted jobs all at once, with every prompt
/// in chunks of 4 and in a pool small enough to preempt, give what each gives alone in
/// unpipelined steps, with jump-forward's tokens and stops found a step late. Every block comes
/// back (`run` checks). On the GPU the next pass takes its tokens from the device's draws.
#[test]
fn pipelined_steps_change_no_output() {
    let Some((backend, tok)) = common::load_backend(8192) else {
        return;
    };
    let tok = Arc::new(tok);
    let structured = StructuredOutputs::new(&tok);
    let jobs = jobs(&tok);
    let plain = EngineConfig {
        async_scheduling: AsyncScheduling::Off,
        ..EngineConfig::default()
    };
    let pipelined = EngineConfig {
        async_scheduling: AsyncScheduling::On,
        ..plain
    };
    let block_size = backend.kv_layout().block_size;
    let longest = jobs.iter().map(|j| j.prompt.len() + j.max_tokens).max().unwrap();
    let mut core = common::engine(backend, &tok, plain, None);
    // A seeded draw parts wherever the batch moves a logit, not only at near-ties: compared
    // where rows do not depend on the batch (the CPU).
    let draws = match exact() {
        true => vec![Draw::Greedy, Draw::Seeded, Draw::Contrast],
        false => vec![Draw::Greedy, Draw::Contrast],
    };
    for draw in draws {
        let (alone, _, done) = run_drawn(core, &jobs, &structured, false, draw);
        let (out, _, done) = run_drawn(
            common::engine(done.into_backend(), &tok, pipelined, None),
            &jobs,
            &structured,
            true,
            draw,
        );
        let what = match draw {
            Draw::Greedy => "greedy, pipelined",
            Draw::Seeded => "seeded, pipelined",
            _ => "contrasted, pipelined",
        };
        same_up_to_near_ties(&out, &alone, &format!("{what}, 32 at once"));
        let mut chunked = pipelined;
        chunked.scheduler.max_num_batched_tokens = 4;
        let (out, _, done) = run_drawn(
            common::engine(done.into_backend(), &tok, chunked, None),
            &jobs,
            &structured,
            true,
            draw,
        );
        same_up_to_near_ties(&out, &alone, &format!("{what}, prompts in chunks of 4"));
        let pool = BlockPool::new(4 * longest.div_ceil(block_size));
        let (out, preemptions, done) = run_drawn(
            common::engine(done.into_backend(), &tok, pipelined, Some(pool)),
            &jobs,
            &structured,
            true,
            draw,
        );
        same_up_to_near_ties(&out, &alone, &format!("{what}, a pool too small for everyone"));
        assert!(preemptions > 0, "{what}: the small pool never preempted");
        let stats = done.stats();
        eprintln!(
            "{what}: {} of {} steps pipelined, {} rows dropped",
            stats.pipelined_steps, stats.steps, stats.pipelined_rows_dropped
        );
        assert!(stats.pipelined_steps * 2 > stats.steps, "{what}: {stats:?}");
        // Requests that finished, and jump-forward's tokens after a sampled one.
        assert!(stats.pipelined_rows_dropped > 0, "{what}: {stats:?}");
        core = common::engine(done.into_backend(), &tok, plain, None);
    }
}

#[test]
fn a_dropped_stream_aborts_its_request_at_once() {
    let Some((backend, tok)) = common::load(4096) else {
        return;
    };
    let tok = Arc::new(tok);
    let client = EngineClient::start(EngineCore::new(Box::new(backend), tok.clone(), EngineConfig::default()));
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let kept = runtime.block_on(async {
        let mut kept = Vec::new();
        for (i, text) in PLAIN.iter().enumerate() {
            // The ones to be dropped would run for 2,000 tokens if nobody stopped them.
            let max_tokens = if i % 2 == 0 { 2000 } else { 12 };
            let request = EngineRequest {
                id: 0,
                prompt: tok.encode(text, false).unwrap(),
                params: SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(max_tokens)
                },
                priority: 0,
                constraint: None,
            };
            let mut stream = client.submit(request).await.unwrap();
            if i % 2 == 0 {
                let first = stream.next().await.unwrap();
                assert!(first.finished.is_none());
                drop(stream);
            } else {
                kept.push(stream);
            }
        }
        let mut done = Vec::new();
        for s in kept {
            done.push(collect(s).await.0);
        }
        done
    });
    for seen in &kept {
        assert_eq!((seen.finish, seen.tokens.len()), (FinishReason::Length, 12));
    }
    let core = client.shutdown().unwrap();
    let stats = core.stats();
    assert!(
        stats.steps < 100,
        "the dropped requests kept running: {} steps",
        stats.steps
    );
    assert_eq!(stats.kv_blocks_free, stats.kv_blocks_total, "blocks leaked");
}
