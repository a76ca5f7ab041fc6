//! A backend that fails in the middle of a step: the requests of that step end as `internal`,
//! their KV blocks come back, and the engine goes on: the next request gives what it gives
//! alone. The failure comes between `run` (the pass is queued) and `sample`, so a GPU backend
//! must finish the abandoned pass before the next one. On the CPU, and on the GPU where
//! `QUARRY_TEST_DEVICE=cuda` (scripts/gpu-check).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use quarry::engine::{AsyncScheduling, EngineConfig, EngineCore, EngineRequest, FinishReason, SpeculativeConfig};
use quarry::runtime::{
    Backend, ForwardBatch, KvLayout, ModelConfig, Result, RowDraw, RowRequest, RuntimeError, Sampled,
};
use quarry::sampling::SamplingParams;

/// Delegates to `inner`, except that the `fail_at`-th call of `sample` (or `launch_sample`)
/// fails.
struct FailingSample {
    inner: Box<dyn Backend>,
    samples: usize,
    fail_at: Arc<AtomicUsize>,
}

impl Backend for FailingSample {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }

    fn kv_layout(&self) -> KvLayout {
        self.inner.kv_layout()
    }

    fn run(&mut self, batch: &ForwardBatch) -> Result<()> {
        self.inner.run(batch)
    }

    fn sample(&mut self, rows: &[RowRequest<'_>]) -> Result<Sampled> {
        self.samples += 1;
        if self.samples == self.fail_at.load(Ordering::SeqCst) {
            return Err(RuntimeError::Backend("injected failure".into()));
        }
        self.inner.sample(rows)
    }

    fn redraw_within(&mut self, row: usize, mask: &[u32]) -> Result<RowDraw> {
        self.inner.redraw_within(row, mask)
    }

    fn pipelines(&self) -> bool {
        self.inner.pipelines()
    }

    fn launch_sample(&mut self, rows: &[RowRequest<'_>]) -> Result<()> {
        self.samples += 1;
        if self.samples == self.fail_at.load(Ordering::SeqCst) {
            return Err(RuntimeError::Backend("injected failure".into()));
        }
        self.inner.launch_sample(rows)
    }

    fn collect(&mut self) -> Result<Sampled> {
        self.inner.collect()
    }

    fn draws_on_device(&self) -> bool {
        self.inner.draws_on_device()
    }

    fn device_name(&self) -> String {
        self.inner.device_name()
    }
}

#[test]
fn a_failed_step_ends_its_requests_as_internal_and_the_engine_goes_on() {
    a_failed_step_in(false);
}

/// The same with pipelined steps (`async_scheduling`): the failure comes while the next step
/// is already planned.
#[test]
fn a_failed_pipelined_step_ends_its_requests_as_internal_and_the_engine_goes_on() {
    a_failed_step_in(true);
}

fn a_failed_step_in(pipelined: bool) {
    let Some((backend, tok)) = common::load_backend(4096) else {
        return;
    };
    let fail_at = Arc::new(AtomicUsize::new(usize::MAX));
    let failing = FailingSample {
        inner: backend,
        samples: 0,
        fail_at: fail_at.clone(),
    };
    // No prefix cache: the second run of a prompt computes it as the first did.
    let config = EngineConfig {
        prefix_caching: false,
        async_scheduling: match pipelined {
            true => AsyncScheduling::On,
            false => AsyncScheduling::Off,
        },
        ..EngineConfig::default()
    };
    let tok = Arc::new(tok);
    let mut engine = EngineCore::new(Box::new(failing), tok.clone(), config);
    let request = |id, text: &str| EngineRequest {
        id,
        prompt: tok.encode(text, false).unwrap(),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(12)
        },
        priority: 0,
        constraint: None,
    };
    let alone = |engine: &mut EngineCore, id| {
        engine.add_request(request(id, "The three primary colors are")).unwrap();
        engine.run_until_idle(|_| {}).unwrap().remove(0).tokens
    };
    let before = alone(&mut engine, 1);
    assert_eq!(before.len(), 12);

    // Two requests; the fourth sample of their run fails (the first run sampled 12 times).
    fail_at.store(12 + 4, Ordering::SeqCst);
    engine.add_request(request(2, "Count from one to ten:")).unwrap();
    engine.add_request(request(3, "Name a large animal:")).unwrap();
    let mut produced = 0;
    let err = loop {
        match engine.step() {
            Ok(outputs) => produced += outputs.len(),
            Err(e) => break e,
        }
    };
    assert!(err.to_string().contains("injected failure"), "{err}");
    assert!(produced > 0, "the steps before the failure produced tokens");
    let failed = engine.fail_all();
    let mut ids: Vec<_> = failed.iter().map(|o| (o.id, o.finished)).collect();
    ids.sort_by_key(|x| x.0);
    assert_eq!(
        ids,
        vec![(2, Some(FinishReason::Internal)), (3, Some(FinishReason::Internal))]
    );
    assert!(!engine.has_unfinished());
    let kv = engine.kv();
    assert_eq!(kv.num_free_blocks(), kv.pool().total(), "every block came back");

    // The engine goes on, and gives what it gave before the failure.
    assert_eq!(alone(&mut engine, 4), before);
}

/// Where two greedy GPU runs may part: their choices within this many nats (tests/engine_client.rs).
const NEAR_TIE: f32 = 0.5;

/// A draft model that fails mid-run costs the speed-up, never a request: the engine drops it
/// and decodes on, and every request ends as it would have without speculation (on the GPU, up
/// to a near-tie: checks of several rows take other matrix kernels than single decode steps).
#[test]
fn a_failed_draft_model_ends_no_request() {
    let Some((backend, tok)) = common::load_backend(4096) else {
        return;
    };
    let (draft, _) = common::load_backend(4096).expect("loaded once already");
    let fail_at = Arc::new(AtomicUsize::new(3));
    let failing = FailingSample {
        inner: draft,
        samples: 0,
        fail_at: fail_at.clone(),
    };
    let tok = Arc::new(tok);
    let on_gpu = common::test_device() != quarry::runtime::DeviceChoice::Cpu;
    let request = |id, text: &str| EngineRequest {
        id,
        prompt: tok.encode(text, false).unwrap(),
        params: SamplingParams {
            ignore_eos: true,
            logprobs: on_gpu.then_some(quarry::sampling::MAX_LOGPROBS),
            ..SamplingParams::greedy(24)
        },
        priority: 0,
        constraint: None,
    };
    let prompts = ["The three primary colors are", "Count from one to ten:"];
    let mut plain = EngineCore::new(backend, tok.clone(), EngineConfig::default());
    for (i, p) in prompts.iter().enumerate() {
        plain.add_request(request(i as u64, p)).unwrap();
    }
    let mut expected = plain.run_until_idle(|_| {}).unwrap();
    expected.sort_by_key(|c| c.id);

    let config = EngineConfig {
        speculative: Some(SpeculativeConfig {
            tokens: 4,
            adaptive: false,
            ..SpeculativeConfig::default()
        }),
        ..EngineConfig::default()
    };
    let mut engine = EngineCore::new(plain.into_backend(), tok.clone(), config);
    engine.set_draft_model(Box::new(failing));
    for (i, p) in prompts.iter().enumerate() {
        engine.add_request(request(i as u64, p)).unwrap();
    }
    let mut done = engine
        .run_until_idle(|_| {})
        .expect("the step goes on without the draft model");
    done.sort_by_key(|c| c.id);
    let stats = engine.stats();
    assert_eq!(stats.draft_model_failures, 1);
    assert!(
        stats.drafts.model_proposed > 0,
        "the draft model guessed before it failed: {stats:?}"
    );
    for (got, want) in done.iter().zip(&expected) {
        assert_eq!(got.finish, FinishReason::Length);
        match got.tokens.iter().zip(&want.tokens).position(|(a, b)| a != b) {
            None => assert_eq!(got.tokens, want.tokens, "request {}", got.id),
            Some(at) if on_gpu => {
                let logprob = |t: u32| want.sampled[at].top.iter().find(|c| c.token == t).map(|c| c.logprob);
                let (chosen, other) = (logprob(want.tokens[at]), logprob(got.tokens[at]));
                assert!(
                    matches!((chosen, other), (Some(a), Some(b)) if a - b <= NEAR_TIE),
                    "request {} parts at token {at} with log-probabilities {chosen:?} vs {other:?}",
                    got.id
                );
            }
            Some(at) => panic!(
                "request {} parts at token {at}: {:?} vs {:?}",
                got.id, got.tokens, want.tokens
            ),
        }
    }
    let kv = engine.kv();
    assert_eq!(kv.num_free_blocks(), kv.pool().total(), "every block came back");
}
