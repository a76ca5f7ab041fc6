//! Data parallelism on the CPU: two engines, each with its own backend and KV cache, behind one
//! client (`EngineClient::start_replicas`, `--data-parallel-size`):
//! - every request gets the output one engine alone gives it (the CPU is batch-invariant),
//!   the requests spread over both engines, and neither leaks a block;
//! - questions about one document meet the engine that computed it: the two caches hit as
//!   often as one engine's cache does for the same requests;
//! - a stream dropped mid-request frees its engine's blocks and its share of the load;
//! - a copy whose backend is broken takes no request while another can, and the service is
//!   broken only when every copy is;
//! - copies that are each a prefill and a decode engine (disaggregated pairs, over host links)
//!   give one engine's outputs too, each pair's decode engine receiving its prompts' blocks.

mod common;

use std::sync::Arc;
use std::time::Duration;

use quarry::engine::{EngineClient, EngineConfig, EngineCore};
use quarry::runtime::{Backend, ForwardBatch, HostLink, KvLayout, ModelConfig, Result, RowDraw, RowRequest, Sampled};
use quarry::tokenizer::Tokenizer;

const TOKENS: usize = 4096;

/// `count` engines, each over a backend of its own.
fn engines(count: usize) -> Option<(Vec<EngineCore>, Arc<Tokenizer>)> {
    let (backend, tok) = common::load(TOKENS)?;
    let tok = Arc::new(tok);
    let mut cores = vec![common::engine(Box::new(backend), &tok, EngineConfig::default(), None)];
    for _ in 1..count {
        let (backend, _) = common::load(TOKENS)?;
        cores.push(common::engine(Box::new(backend), &tok, EngineConfig::default(), None));
    }
    Some((cores, tok))
}

/// One engine, and two behind one client.
fn clients() -> Option<(EngineClient, EngineClient, Arc<Tokenizer>)> {
    let (mut cores, tok) = engines(3)?;
    let one = EngineClient::start(cores.pop().unwrap());
    let many = EngineClient::start_replicas(cores).expect("engines of one model");
    Some((one, many, tok))
}

/// Questions about several documents, each long enough to be most of its prompt.
fn questions(tok: &Tokenizer) -> Vec<Vec<u32>> {
    let documents = [
        "Invoice 4471 from Harbour Freight Ltd, 12 Quay Street, Bristol, to Northwind Traders, dated 3 March 2024. Items: 40 pallets of ceramic tiles at 118.50 each, handling 220.00, insurance 95.00. Payment due within 30 days.",
        "Purchase order 9921 from Alder & Finch, 8 Mill Lane, Leeds, to Cobalt Supplies, dated 17 June 2024. Items: 12 oak desks at 340.00 each, 24 chairs at 89.00 each, delivery 150.00. Terms: net 45.",
        "Receipt 5530 from the Blue Door Cafe, 3 Market Square, York, dated 2 February 2024. Items: two flat whites at 3.20 each, one almond croissant at 2.80, one bottle of water at 1.50. Paid by card.",
        "Statement 207 from Meridian Energy to Flat 4, 19 Elm Road, Cardiff, for the period 1 April to 30 June 2024. Electricity 412 kWh at 0.27, standing charge 0.53 a day for 91 days. Balance due 159.46.",
    ];
    let asked = ["Who sent it?", "What is the total?", "When is it dated?"];
    // A document's questions one after another, 3 of them: placed by turns, each document's
    // would land on both engines.
    documents
        .iter()
        .flat_map(|d| {
            asked
                .iter()
                .map(move |q| tok.encode(&format!("{d}\n\nQuestion: {q}\nAnswer:"), false).unwrap())
        })
        .collect()
}

/// Every engine of `client`, stopped, each checked for leaked blocks.
fn stopped(client: EngineClient, side: &str) -> Vec<EngineCore> {
    let cores = client.shutdown_all();
    for (i, core) in cores.iter().enumerate() {
        common::assert_no_leak(&core.stats(), &format!("{side}, engine {i}"));
    }
    cores
}

#[test]
fn copies_give_each_request_what_one_engine_gives() {
    let Some((one, many, _)) = clients() else { return };
    let golden = common::golden();
    let prompts: Vec<Vec<u32>> = golden.prompts.iter().take(8).map(|p| p.prompt_tokens.clone()).collect();
    let alone = common::run_prompts(&one, &prompts, 12, true);
    let spread = common::run_prompts(&many, &prompts, 12, true);
    assert_eq!(spread, alone, "outputs through two engines differ from one engine's");
    assert_eq!(many.loads(), vec![0, 0], "every request ended");
    stopped(one, "one engine");
    let cores = stopped(many, "two engines");
    for (i, core) in cores.iter().enumerate() {
        assert!(
            core.stats().steps > 0,
            "engine {i} ran nothing: the requests did not spread"
        );
    }
}

#[test]
fn questions_about_a_document_meet_the_engine_that_computed_it() {
    let Some((one, many, tok)) = clients() else { return };
    let prompts = questions(&tok);
    // One after another: each finds what the ones before left in a cache.
    let alone = common::run_prompts(&one, &prompts, 4, false);
    let spread = common::run_prompts(&many, &prompts, 4, false);
    assert_eq!(spread, alone);
    let one_hits = stopped(one, "one engine")[0].stats().prefix_cache.hit_tokens;
    let cores = stopped(many, "two engines");
    let hits: Vec<u64> = cores.iter().map(|c| c.stats().prefix_cache.hit_tokens).collect();
    eprintln!("prefix cache hits: one engine {one_hits} tokens; two engines {hits:?}");
    assert!(one_hits > 0, "the questions share their documents' blocks");
    assert_eq!(
        hits.iter().sum::<u64>(),
        one_hits,
        "each document computed once, on one engine, as on one engine alone"
    );
    assert!(
        hits.iter().all(|&h| h > 0),
        "the documents spread over both engines: {hits:?}"
    );
}

#[test]
fn a_dropped_stream_frees_its_engine_and_its_load() {
    let Some((cores, tok)) = engines(2) else { return };
    let many = EngineClient::start_replicas(cores).expect("engines of one model");
    let prompt = questions(&tok).remove(0);
    common::runtime().block_on(async {
        let mut stream = many.submit(common::greedy_request(&prompt, 200)).await.unwrap();
        assert_eq!(many.loads().iter().sum::<usize>(), 1);
        let first = stream.next().await.expect("a first output");
        assert!(first.finished.is_none());
        drop(stream);
    });
    assert_eq!(many.loads(), vec![0, 0], "the dropped request still counts in a load");
    // The abort lands at the engine's next step boundary: the request does not run out its
    // 200 tokens.
    let idle = (0..1000).any(|_| {
        let s = many.stats();
        let idle = s.running + s.waiting == 0 && s.kv_blocks_free == s.kv_blocks_total;
        if !idle {
            std::thread::sleep(Duration::from_millis(10));
        }
        idle
    });
    assert!(idle, "the engines still hold the dropped request after 10 s");
    let cores = stopped(many, "two engines");
    let steps: u64 = cores.iter().map(|c| c.stats().steps).sum();
    assert!(steps < 100, "{steps} steps: the dropped request ran on");
}

#[test]
fn prefill_and_decode_pairs_serve_as_copies() {
    let Some((mut cores, tok)) = engines(1) else { return };
    let one = EngineClient::start(cores.pop().unwrap());
    let mut pairs = Vec::new();
    for _ in 0..2 {
        let (Some((mut prefill, _)), Some((mut decode, _))) = (common::load(TOKENS), common::load(TOKENS)) else {
            return;
        };
        let (a, b, _) = HostLink::pair();
        prefill.attach_kv_link(a).unwrap();
        decode.attach_kv_link(b).unwrap();
        let engine = |backend| common::engine(Box::new(backend), &tok, EngineConfig::default(), None);
        pairs.push(EngineClient::start_disaggregated(engine(prefill), engine(decode)).unwrap());
    }
    let many = EngineClient::replicas(pairs).expect("pairs of one model");
    let prompts = questions(&tok);
    let alone = common::run_prompts(&one, &prompts, 4, false);
    let spread = common::run_prompts(&many, &prompts, 4, false);
    assert_eq!(spread, alone, "outputs through two pairs differ from one engine's");
    stopped(one, "one engine");
    // Stopped first, so that the prefill engines' stats are their last.
    let decoders = many.shutdown_all();
    let prefill = many.prefill_stats().expect("prefill engines");
    common::assert_no_leak(&prefill, "the prefill engines");
    for (i, core) in decoders.iter().enumerate() {
        common::assert_no_leak(&core.stats(), &format!("pair {i}'s decode engine"));
        assert!(
            core.stats().kv_blocks_received > 0,
            "pair {i}'s decode engine received no block: the requests did not spread"
        );
    }
    let received: u64 = decoders.iter().map(|c| c.stats().kv_blocks_received).sum();
    assert_eq!(prefill.kv_blocks_sent, received, "every block sent was received");
}

/// A backend that says it is broken (`Backend::broken`, as a tensor-parallel group whose rank
/// failed does) and otherwise computes as the one it wraps.
struct Broken(Box<dyn Backend>);

impl Backend for Broken {
    fn config(&self) -> &ModelConfig {
        self.0.config()
    }

    fn kv_layout(&self) -> KvLayout {
        self.0.kv_layout()
    }

    fn run(&mut self, batch: &ForwardBatch) -> Result<()> {
        self.0.run(batch)
    }

    fn sample(&mut self, rows: &[RowRequest<'_>]) -> Result<Sampled> {
        self.0.sample(rows)
    }

    fn redraw_within(&mut self, row: usize, mask: &[u32]) -> Result<RowDraw> {
        self.0.redraw_within(row, mask)
    }

    fn device_name(&self) -> String {
        self.0.device_name()
    }

    fn broken(&self) -> Option<String> {
        Some("a rank stopped answering (injected)".into())
    }
}

fn broken_engine(tok: &Arc<Tokenizer>) -> Option<EngineCore> {
    let (backend, _) = common::load(TOKENS)?;
    let backend = Box::new(Broken(Box::new(backend)));
    Some(common::engine(backend, tok, EngineConfig::default(), None))
}

#[test]
fn a_broken_copy_takes_no_requests_while_another_serves() {
    let Some((mut cores, tok)) = engines(1) else { return };
    let Some(broken) = broken_engine(&tok) else { return };
    cores.insert(0, broken);
    let many = EngineClient::start_replicas(cores).expect("engines of one model");
    assert_eq!(many.stats().broken, None, "one copy serves: the service is not broken");
    let prompts = questions(&tok);
    let done = common::run_prompts(&many, &prompts[..4], 4, true);
    assert_eq!(done.len(), 4);
    let cores = stopped(many, "two engines");
    assert_eq!(cores[0].stats().steps, 0, "the broken copy ran a request");
    assert!(cores[1].stats().steps > 0);

    let (Some(a), Some(b)) = (broken_engine(&tok), broken_engine(&tok)) else {
        return;
    };
    let none = EngineClient::start_replicas(vec![a, b]).expect("engines of one model");
    let why = none.stats().broken.expect("every copy is broken: so is the service");
    assert!(why.contains("injected"), "{why}");
}
