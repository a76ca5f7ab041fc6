//! Disaggregated prefill and decode (`quarry serve --prefill-device ... --decode-device ...`):
//! one engine computes prompts, another decodes, each on its own GPU, so a long prompt
//! arriving never stretches the decode engine's steps.
//!
//! A request is admitted by the decode engine as usual (its checks, its grammar, its stream),
//! but held there. The router then, for the prompt's full blocks:
//! 1. asks the decode engine which of them it lacks, and it holds blocks for them (its prefix
//!    cache may have some already: those are never sent);
//! 2. has the prefill engine compute the prompt (a request of those tokens and one greedy
//!    token, whose blocks its prefix cache keeps, and whose own cache may hold part already);
//! 3. has the prefill engine send the blocks and the decode engine receive them, over the
//!    link between their backends (`runtime::kv_link`);
//! 4. the decode engine enters them in its prefix cache once they land and lets the request
//!    go: it finds its prompt cached and computes only the last partial block, then decodes
//!    with its grammar and its own shadow prompt as on one engine.
//!
//! Whatever fails on the way (the prefill request, the send, the receive), step 3 still ends
//! in a receive of what was sent, and the request computes the rest itself: slower, the same
//! record. Sends and receives are matched in order over the link, so one handoff at a time
//! moves blocks.

use tokio::sync::{oneshot, Mutex};

use super::block_pool::BlockHash;
use super::client::{DecodeSide, EngineClient, Handoff};
use super::core::{EngineRequest, FinishReason};
use super::kv_cache_manager::{BlockHasher, RequestId};
use crate::sampling::SamplingParams;

/// The prefill side of disaggregated serving, and the order of transfers.
pub struct Router {
    pub(super) prefill: EngineClient,
    hasher: BlockHasher,
    transfers: Mutex<()>,
}

impl Router {
    pub(super) fn new(prefill: EngineClient, hasher: BlockHasher) -> Self {
        Router {
            prefill,
            hasher,
            transfers: Mutex::new(()),
        }
    }

    /// Hands request `id`'s prompt from the prefill engine to the decode engine (the module's
    /// steps), then lets the decode engine schedule it.
    pub(super) async fn hand_off(&self, decode: &DecodeSide, id: RequestId, prompt: Vec<u32>, priority: i32) {
        // The decode engine computes at least the last token itself (its logits are needed):
        // the blocks before it are what a cache can give.
        let usable = (prompt.len().saturating_sub(1) / self.hasher.block_size) * self.hasher.block_size;
        let hashes = self.hasher.chain(None, &prompt[..usable]);
        let wanted = match hashes.is_empty() {
            true => Vec::new(),
            false => ask(decode, |wanted| Handoff::Reserve { id, hashes, wanted })
                .await
                .unwrap_or_default(),
        };
        let computed = !wanted.is_empty() && self.prefill_prompt(&prompt[..usable], priority).await;
        let _order = self.transfers.lock().await;
        let sent = match computed {
            true => self.send(&wanted).await,
            false => 0,
        };
        let received = ask(decode, |queued| Handoff::Receive {
            id,
            count: sent,
            queued,
        })
        .await;
        if let Some(Err(e)) = received {
            tracing::warn!(
                "quarry: request {id}: receiving its prompt's KV blocks failed ({e}); it computes them itself"
            );
        }
    }

    /// Whether the prefill engine computed `tokens` (its cache then holds their blocks).
    async fn prefill_prompt(&self, tokens: &[u32], priority: i32) -> bool {
        let request = EngineRequest {
            id: 0,
            prompt: tokens.to_vec(),
            params: SamplingParams {
                max_tokens: 1,
                temperature: 0.0,
                ..Default::default()
            },
            priority,
            constraint: None,
        };
        let Ok(stream) = self.prefill.enqueue(request, false).await else {
            return false;
        };
        match stream.collect().await {
            Some(done) => matches!(done.finish, FinishReason::Length | FinishReason::Stop),
            None => false,
        }
    }

    /// Has the prefill engine send the blocks of `hashes` it still caches; how many went.
    async fn send(&self, hashes: &[BlockHash]) -> usize {
        let hashes = hashes.to_vec();
        let sent = ask(&PrefillSide(&self.prefill), |sent| Handoff::Send { hashes, sent }).await;
        match sent {
            Some(Ok(n)) => n,
            Some(Err(e)) => {
                tracing::warn!("quarry: sending KV blocks failed: {e}");
                0
            }
            None => 0,
        }
    }
}

/// Either engine, as a handoff step's recipient.
trait Side {
    fn send_step(&self, step: Handoff) -> bool;
}

impl Side for DecodeSide {
    fn send_step(&self, step: Handoff) -> bool {
        self.handoff(step).is_ok()
    }
}

struct PrefillSide<'a>(&'a EngineClient);

impl Side for PrefillSide<'_> {
    fn send_step(&self, step: Handoff) -> bool {
        self.0.handoff(step).is_ok()
    }
}

/// Sends the step `make` builds around its answer channel and waits for the answer; `None`
/// where the engine has stopped.
async fn ask<T>(side: &impl Side, make: impl FnOnce(oneshot::Sender<T>) -> Handoff) -> Option<T> {
    let (tx, rx) = oneshot::channel();
    if !side.send_step(make(tx)) {
        return None;
    }
    rx.await.ok()
}
