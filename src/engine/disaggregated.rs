//! Disaggregated prefill and decode (`quarry serve --prefill-device ... --decode-device ...`):
//! one engine computes prompts, another decodes, each on its own GPU, so a long prompt
//! arriving never stretches the decode engine's steps.
//!
//! A request is admitted by the decode engine as usual (its checks, its grammar, its stream),
//! but held there. The router then, for the prompt's full blocks:
//! 1. asks the decode engine how many it caches already (all of them: nothing more to do);
//! 2. has the prefill engine compute the prompt (a request of those tokens and one greedy
//!    token, whose blocks its prefix cache keeps, and whose own cache may hold part already);
//! 3. has the decode engine hold blocks for those it lacks (as far as its free blocks allow),
//!    the prefill engine send them and the decode engine receive them, over the link between
//!    their backends (`runtime::kv_link`);
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
use super::client::{DecodeSide, Engine, Handoff};
use super::core::{EngineRequest, FinishReason};
use super::kv_cache_manager::{BlockHasher, RequestId};
use crate::sampling::SamplingParams;

/// The prefill side of disaggregated serving, and the order of transfers.
pub struct Router {
    pub(super) prefill: Engine,
    hasher: BlockHasher,
    transfers: Mutex<()>,
}

impl Router {
    pub(super) fn new(prefill: Engine, hasher: BlockHasher) -> Self {
        Router {
            prefill,
            hasher,
            transfers: Mutex::new(()),
        }
    }

    /// Hands request `id`'s prompt from the prefill engine to the decode engine (the module's
    /// steps), then lets the decode engine schedule it.
    pub(super) async fn hand_off(&self, decode: &DecodeSide, id: RequestId, prompt: Vec<u32>, priority: i32) {
        // Whatever happens to this task, the decode engine gets its receive (`Pending`).
        let mut pending = Pending {
            decode: decode.clone(),
            id,
            sent: 0,
        };
        // The decode engine computes at least the last token itself (its logits are needed):
        // the blocks before it are what a cache can give.
        let usable = (prompt.len().saturating_sub(1) / self.hasher.block_size) * self.hasher.block_size;
        let hashes = self.hasher.chain(None, &prompt[..usable]);
        let cached = match hashes.is_empty() {
            true => 0,
            false => {
                let hashes = hashes.clone();
                ask(decode, |count| Handoff::Cached { hashes, count })
                    .await
                    .unwrap_or(0)
            }
        };
        // Blocks are held on the decode engine only once the prompt is computed: a prompt
        // queued for prefill holds none of the decoders' room.
        if cached == hashes.len() || !self.prefill_prompt(&prompt[..usable], priority).await {
            return;
        }
        let _order = self.transfers.lock().await;
        let wanted = ask(decode, |wanted| Handoff::Reserve { id, hashes, wanted })
            .await
            .unwrap_or_default();
        if wanted.is_empty() {
            return;
        }
        pending.sent = self.send(&wanted).await;
        let count = pending.sent;
        pending.disarm();
        let received = ask(decode, |queued| Handoff::Receive { id, count, queued }).await;
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

struct PrefillSide<'a>(&'a Engine);

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

/// A handoff's last step, taken when the task ends without it (the prompt failed on the
/// prefill engine, nothing was wanted, or the task was dropped): the decode engine receives
/// what was sent (a queued send must meet its receive), lets go of what it held and lets the
/// request be scheduled.
struct Pending {
    decode: DecodeSide,
    id: RequestId,
    sent: usize,
}

impl Pending {
    /// The handoff takes its last step itself.
    fn disarm(&mut self) {
        self.id = RequestId::MAX;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.id != RequestId::MAX {
            // Nobody waits for the answer.
            let (queued, _) = oneshot::channel();
            let step = Handoff::Receive {
                id: self.id,
                count: self.sent,
                queued,
            };
            let _ = self.decode.handoff(step);
        }
    }
}
