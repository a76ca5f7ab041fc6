//! Disaggregated prefill and decode on the CPU, two backends joined by a host link:
//! - KV blocks sent from one backend land in another's blocks of other ids bit for bit: the
//!   next token's logits from the received prompt equal the sender's own;
//! - requests served by a prefill engine and a decode engine give exactly the outputs one
//!   engine gives, the decode engine computing only the prompts' last partial blocks;
//! - a prompt the decode engine caches already is not sent again;
//! - a failed transfer, or a client gone mid-handoff, leaks no block on either side, and the
//!   request whose transfer failed still completes, computing its prompt itself;
//! - one prefill engine serving two decode engines, and two prefill engines serving one, each
//!   pair over a link of its own, give one engine's outputs, every engine taking part.
//!
//! tests/gpu_disaggregated.rs does the same between two GPUs over NCCL.

mod common;

use quarry::engine::{EngineClient, EngineConfig, EngineCore, FinishReason, KvLink};
use quarry::runtime::{Backend, DeviceChoice, HostLink};
use quarry::tokenizer::Tokenizer;
use std::sync::Arc;

const DOCUMENT: &str = "Invoice 4471 from Harbour Freight Ltd, 12 Quay Street, Bristol, to Northwind Traders, \
    dated 3 March 2024. Items: 40 pallets of ceramic tiles at 118.50 each, handling 220.00, insurance 95.00. \
    Payment due within 30 days to account GB29 NWBK 6016 1331 9268 19. Contact: Mira Patel, accounts.";

/// Prompts that share no block: each transfer then sends blocks of its own.
fn distinct_prompts(tok: &Tokenizer) -> Vec<Vec<u32>> {
    ["Harbour", "Northwind", "Quay"]
        .iter()
        .map(|w| {
            tok.encode(
                &format!("{w} case. {DOCUMENT}\n\nQuestion: what is due?\nAnswer:"),
                false,
            )
            .unwrap()
        })
        .collect()
}

fn prompts(tok: &Tokenizer) -> Vec<Vec<u32>> {
    [
        "Who sent the invoice?",
        "What is the total before insurance?",
        "When is payment due?",
        "Who is the contact?",
        "List the items.",
        "Where is the sender based?",
    ]
    .iter()
    .map(|q| {
        tok.encode(&format!("{DOCUMENT}\n\nQuestion: {q}\nAnswer:"), false)
            .unwrap()
    })
    .collect()
}

fn engine(backend: Box<dyn Backend>, tok: &Arc<Tokenizer>) -> EngineCore {
    let mut config = EngineConfig::default();
    // Small chunks: prompts go in several steps, as long documents do.
    config.scheduler.max_num_batched_tokens = 64;
    EngineCore::new(backend, tok.clone(), config)
}

/// A prefill and a decode engine over two CPU backends joined by a host link.
fn disaggregated(tokens: usize) -> Option<(EngineClient, HostLink, Arc<Tokenizer>)> {
    let (mut prefill, tok) = common::load(tokens)?;
    let (mut decode, _) = common::load(tokens)?;
    let (a, b, link) = HostLink::pair();
    prefill.attach_kv_link(a).unwrap();
    decode.attach_kv_link(b).unwrap();
    let tok = Arc::new(tok);
    let client =
        EngineClient::start_disaggregated(engine(Box::new(prefill), &tok), engine(Box::new(decode), &tok)).unwrap();
    Some((client, link, tok))
}

fn run_all(client: &EngineClient, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<(Vec<u32>, FinishReason)> {
    common::run_prompts(client, prompts, max_tokens, true)
}

#[test]
fn received_blocks_give_the_senders_next_logits() {
    let Some((mut a, tok)) = common::load(1024) else { return };
    let Some((mut b, _)) = common::load(1024) else { return };
    let Some((mut c, _)) = common::load(1024) else { return };
    // `a` holds two links, `c`'s second: numbered as attached, each its own queue.
    let ends = |a: &mut dyn Backend, b: &mut dyn Backend| {
        quarry::runtime::kv_link::join(a, DeviceChoice::Cpu, b, DeviceChoice::Cpu).unwrap()
    };
    assert_eq!(ends(&mut a, &mut b), (0, 0));
    assert_eq!(ends(&mut c, &mut b), (0, 1));
    assert_eq!(ends(&mut a, &mut c), (1, 1));
    // Other ids, out of order: the receiver's table is its own.
    common::check_transfer(&mut a, &mut b, (0, 0), &prompts(&tok)[0], |i| 40 - 3 * i);
    common::check_transfer(&mut a, &mut c, (1, 1), &prompts(&tok)[1], |i| 30 - 2 * i);

    // A block past the pool, or a link not attached, is refused before anything moves.
    assert!(a.send_kv_blocks(0, &[1 << 20]).is_err());
    assert!(a
        .send_kv_blocks(2, &[0])
        .unwrap_err()
        .to_string()
        .contains("no KV link 2"));
    assert_eq!(a.kv_transfers_done(0).unwrap(), 1);
}

#[test]
fn disaggregated_outputs_equal_one_engines() {
    let Some((backend, tok)) = common::load(4096) else {
        return;
    };
    let bs = backend.kv_layout().block_size;
    let tok_arc = Arc::new(tok);
    let all = prompts(&tok_arc);
    let reference = run_all(&EngineClient::start(engine(Box::new(backend), &tok_arc)), &all, 12);

    let Some((client, _, _)) = disaggregated(4096) else {
        return;
    };
    let got = run_all(&client, &all, 12);
    assert_eq!(got, reference);
    let (p, d) = common::settled(&client);
    common::assert_no_leak(&p, "prefill");
    common::assert_no_leak(&d, "decode");
    assert!(p.kv_blocks_sent > 0);
    assert_eq!(d.kv_blocks_received, p.kv_blocks_sent);
    // The decode engine took from its cache all but each prompt's last partial block.
    let prompt_tokens: usize = all.iter().map(Vec::len).sum();
    let cacheable: usize = all.iter().map(|p| (p.len() - 1) / bs * bs).sum();
    assert_eq!(d.prefix_cache.queried_tokens as usize, prompt_tokens);
    assert_eq!(d.prefix_cache.hit_tokens as usize, cacheable);

    // Again: the decode engine caches these prompts now, so nothing is sent.
    let again = run_all(&client, &all[..2], 12);
    assert_eq!(again, reference[..2]);
    let (p2, d2) = common::settled(&client);
    assert_eq!(
        (p2.kv_blocks_sent, d2.kv_blocks_received),
        (p.kv_blocks_sent, d.kv_blocks_received)
    );
}

#[test]
fn a_failed_transfer_leaks_nothing_and_the_request_computes_its_prompt() {
    let Some((backend, tok)) = common::load(4096) else {
        return;
    };
    let bs = backend.kv_layout().block_size;
    let tok_arc = Arc::new(tok);
    let all = distinct_prompts(&tok_arc);
    let reference = run_all(&EngineClient::start(engine(Box::new(backend), &tok_arc)), &all, 8);

    let Some((client, link, _)) = disaggregated(4096) else {
        return;
    };
    // One request at a time, the second one's send failing.
    let mut got = run_all(&client, &all[..1], 8);
    let sent_before = common::settled(&client).0.kv_blocks_sent;
    assert!(sent_before > 0);
    link.fail_send(1);
    got.extend(run_all(&client, &all[1..2], 8));
    let (p, _) = common::settled(&client);
    assert_eq!(
        (p.kv_transfer_failures, p.kv_blocks_sent),
        (1, sent_before),
        "the second send failed"
    );
    got.extend(run_all(&client, &all[2..3], 8));
    assert_eq!(got, reference);
    let (p, d) = common::settled(&client);
    assert_eq!(p.kv_transfer_failures, 1);
    assert!(p.kv_blocks_sent > sent_before, "the third send went");
    common::assert_no_leak(&p, "prefill");
    common::assert_no_leak(&d, "decode");
    // The failed request's prompt was computed by the decode engine: fewer tokens were cached.
    let cacheable: usize = all.iter().map(|p| (p.len() - 1) / bs * bs).sum();
    assert!((d.prefix_cache.hit_tokens as usize) < cacheable);
}

#[test]
fn a_client_gone_mid_handoff_leaks_nothing() {
    let Some((client, _, tok)) = disaggregated(4096) else {
        return;
    };
    let all = prompts(&tok);
    common::runtime().block_on(async {
        let mut kept = Vec::new();
        for (i, p) in all.iter().enumerate() {
            let stream = client.submit(common::greedy_request(p, 6)).await.unwrap();
            // Every other client goes away at once, its prompt still on the prefill engine.
            if i % 2 == 0 {
                drop(stream);
            } else {
                kept.push(stream);
            }
        }
        for s in kept {
            let c = s.collect().await.unwrap();
            assert_eq!((c.tokens.len(), c.finish), (6, FinishReason::Length));
        }
    });
    let (p, d) = common::settled(&client);
    common::assert_no_leak(&p, "prefill");
    common::assert_no_leak(&d, "decode");
}

/// `prefill` prefill engines and `decode` decode engines on CPU backends, every decode engine
/// joined to every prefill engine by a host link, as `quarry serve` joins them.
fn many(prefill: usize, decode: usize) -> Option<(EngineClient, Arc<Tokenizer>)> {
    let mut tok = None;
    let mut load = |n: usize| -> Option<Vec<Box<dyn Backend>>> {
        (0..n)
            .map(|_| {
                let (backend, t) = common::load(4096)?;
                tok.get_or_insert(t);
                Some(Box::new(backend) as Box<dyn Backend>)
            })
            .collect()
    };
    let (mut p, mut d) = (load(prefill)?, load(decode)?);
    let tok = Arc::new(tok?);
    let links = KvLink::join_all(
        &mut p,
        &vec![DeviceChoice::Cpu; prefill],
        &mut d,
        &vec![DeviceChoice::Cpu; decode],
    )
    .unwrap();
    let cores = |side: Vec<Box<dyn Backend>>| side.into_iter().map(|b| engine(b, &tok)).collect();
    let client = EngineClient::disaggregated(cores(p), cores(d), &links).unwrap();
    Some((client, tok))
}

/// Every prompt submitted at once, none waiting for another's admission; the outputs in order.
fn run_at_once(client: &EngineClient, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<(Vec<u32>, FinishReason)> {
    common::runtime().block_on(async {
        let each = prompts.iter().map(|p| async move {
            let stream = client.submit(common::greedy_request(p, max_tokens)).await.unwrap();
            let c = stream.collect().await.expect("the request finished");
            (c.tokens, c.finish)
        });
        futures_util::future::join_all(each).await
    })
}

/// One engine's outputs for `prompts` (with its own tokenizer's copy of the model).
fn alone(prompts: &[Vec<u32>], max_tokens: usize) -> Option<Vec<(Vec<u32>, FinishReason)>> {
    let (backend, tok) = common::load(4096)?;
    let one = EngineClient::start(engine(Box::new(backend), &Arc::new(tok)));
    Some(run_all(&one, prompts, max_tokens))
}

#[test]
fn one_prefill_engine_serves_two_decode_engines() {
    let Some((client, tok)) = many(1, 2) else { return };
    let all = distinct_prompts(&tok);
    let Some(reference) = alone(&all, 8) else { return };
    // Prompts that share no block spread over both decode engines.
    assert_eq!(run_at_once(&client, &all, 8), reference);
    let (p, _) = common::settled(&client);
    common::assert_no_leak(&p, "prefill");
    let decoders = client.shutdown_all();
    let prefill = client.prefill_stats().expect("a prefill engine");
    let received: Vec<u64> = decoders.iter().map(|c| c.stats().kv_blocks_received).collect();
    println!(
        "blocks sent {}, received by each decode engine {received:?}",
        prefill.kv_blocks_sent
    );
    assert!(
        received.iter().all(|&r| r > 0),
        "a decode engine received nothing: {received:?}"
    );
    assert_eq!(
        prefill.kv_blocks_sent,
        received.iter().sum::<u64>(),
        "every block sent was received"
    );
    for (i, core) in decoders.iter().enumerate() {
        common::assert_no_leak(&core.stats(), &format!("decode engine {i}"));
    }
}

#[test]
fn two_prefill_engines_serve_one_decode_engine() {
    let Some((client, tok)) = many(2, 1) else { return };
    let all = distinct_prompts(&tok);
    let Some(reference) = alone(&all, 8) else { return };
    // Submitted at once (none admitted before the others are placed), each prompt's handoff
    // goes to the prefill engine with fewer under way.
    assert_eq!(run_at_once(&client, &all, 8), reference);
    let (_, d) = common::settled(&client);
    common::assert_no_leak(&d, "decode");
    let each = client.prefill_stats_each();
    let sent: Vec<u64> = each.iter().map(|s| s.kv_blocks_sent).collect();
    println!(
        "blocks sent by each prefill engine {sent:?}, received {}",
        d.kv_blocks_received
    );
    assert_eq!(each.len(), 2);
    assert!(sent.iter().all(|&s| s > 0), "a prefill engine sent nothing: {sent:?}");
    assert_eq!(
        d.kv_blocks_received,
        sent.iter().sum::<u64>(),
        "every block sent was received"
    );
    for (i, s) in each.iter().enumerate() {
        common::assert_no_leak(s, &format!("prefill engine {i}"));
    }
}

#[test]
fn a_decode_engine_without_a_link_is_refused() {
    let Some((a, tok)) = common::load(1024) else { return };
    let Some((b, _)) = common::load(1024) else { return };
    let Some((c, _)) = common::load(1024) else { return };
    let tok = Arc::new(tok);
    let link = KvLink {
        prefill: 0,
        decode: 0,
        prefill_link: 0,
        decode_link: 0,
    };
    let cores = vec![engine(Box::new(b), &tok), engine(Box::new(c), &tok)];
    let err = EngineClient::disaggregated(vec![engine(Box::new(a), &tok)], cores, &[link]).err();
    assert_eq!(
        err.as_deref(),
        Some("decode engine 1 has no KV link to a prefill engine")
    );
}

#[test]
fn a_link_number_given_twice_is_refused() {
    let Some((a, tok)) = common::load(1024) else { return };
    let Some((b, _)) = common::load(1024) else { return };
    let Some((c, _)) = common::load(1024) else { return };
    let tok = Arc::new(tok);
    let link = |decode| KvLink {
        prefill: 0,
        decode,
        prefill_link: 0,
        decode_link: 0,
    };
    let cores = vec![engine(Box::new(b), &tok), engine(Box::new(c), &tok)];
    let err = EngineClient::disaggregated(vec![engine(Box::new(a), &tok)], cores, &[link(0), link(1)]).err();
    assert_eq!(
        err.as_deref(),
        Some("prefill engine 0's link 0 is given for decode engines 0 and 1")
    );
}

#[test]
fn a_link_that_failed_takes_no_more_handoffs() {
    let Some((tok_backend, tok)) = common::load(4096) else {
        return;
    };
    let tok = Arc::new(tok);
    let all = distinct_prompts(&tok);
    let reference = run_all(&EngineClient::start(engine(Box::new(tok_backend), &tok)), &all, 8);
    let (Some((mut p0, _)), Some((mut p1, _)), Some((mut d, _))) =
        (common::load(4096), common::load(4096), common::load(4096))
    else {
        return;
    };
    let mut links = Vec::new();
    let mut hosts = Vec::new();
    for (i, p) in [&mut p0, &mut p1].into_iter().enumerate() {
        let (a, b, host) = HostLink::pair();
        links.push(KvLink {
            prefill: i,
            decode: 0,
            prefill_link: p.attach_kv_link(a).unwrap(),
            decode_link: d.attach_kv_link(b).unwrap(),
        });
        hosts.push(host);
    }
    let prefill = vec![engine(Box::new(p0), &tok), engine(Box::new(p1), &tok)];
    let client = EngineClient::disaggregated(prefill, vec![engine(Box::new(d), &tok)], &links).unwrap();
    // The first request goes to prefill engine 0 (none busy), whose send fails; one at a time,
    // the others then go to engine 1, though engine 0 is as idle.
    hosts[0].fail_send(1);
    let got: Vec<_> = all
        .iter()
        .flat_map(|p| run_all(&client, std::slice::from_ref(p), 8))
        .collect();
    assert_eq!(got, reference);
    let (_, d) = common::settled(&client);
    let each = client.prefill_stats_each();
    let sent: Vec<u64> = each.iter().map(|s| s.kv_blocks_sent).collect();
    let failures: Vec<u64> = each.iter().map(|s| s.kv_transfer_failures).collect();
    assert_eq!((sent[0], failures), (0, vec![1, 0]), "blocks sent {sent:?}");
    assert!(sent[1] > 0);
    assert_eq!(d.kv_blocks_received, sent[1]);
    common::assert_no_leak(&d, "decode");
    each.iter().for_each(|s| common::assert_no_leak(s, "prefill"));
}
