//! Disaggregated prefill and decode on the CPU, two backends joined by a host link:
//! - KV blocks sent from one backend land in another's blocks of other ids bit for bit: the
//!   next token's logits from the received prompt equal the sender's own;
//! - requests served by a prefill engine and a decode engine give exactly the outputs one
//!   engine gives, the decode engine computing only the prompts' last partial blocks;
//! - a prompt the decode engine caches already is not sent again;
//! - a failed transfer, or a client gone mid-handoff, leaks no block on either side, and the
//!   request whose transfer failed still completes, computing its prompt itself.
//!
//! tests/gpu_disaggregated.rs does the same between two GPUs over NCCL.

mod common;

use quarry::engine::{EngineClient, EngineConfig, EngineCore, FinishReason};
use quarry::runtime::{Backend, HostLink};
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
    let (ea, eb, _) = HostLink::pair();
    a.attach_kv_link(ea).unwrap();
    b.attach_kv_link(eb).unwrap();
    // Other ids, out of order: the receiver's table is its own.
    common::check_transfer(&mut a, &mut b, &prompts(&tok)[0], |i| 40 - 3 * i);

    // A block past the pool is refused before anything moves.
    assert!(a.send_kv_blocks(&[1 << 20]).is_err());
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
