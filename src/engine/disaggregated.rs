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
//!
//! Several prefill and decode engines (`--prefill-device cuda:0 --decode-device cuda:1,cuda:2`)
//! are joined by links (`KvLink`): each decode engine reaches one or more prefill engines, and
//! a request takes the route whose prefill engine has the fewest handoffs under way, among
//! those whose engine and link still work. Each link has its own stream on either end, so only
//! the handoffs over one link need an order (`Route::order`); links do not wait on each other.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{oneshot, Mutex};

use super::block_pool::BlockHash;
use super::client::{DecodeSide, Engine, Handoff};
use super::core::{EngineRequest, FinishReason};
use super::kv_cache_manager::{BlockHasher, RequestId};
use crate::runtime::{kv_link, Backend, DeviceChoice, RuntimeError};
use crate::sampling::SamplingParams;

/// A KV link between prefill engine `prefill` and decode engine `decode` (their places in the
/// lists given to `EngineClient::disaggregated`), by its number on each one's backend (what
/// `runtime::kv_link::join` returned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLink {
    pub prefill: usize,
    pub decode: usize,
    pub prefill_link: usize,
    pub decode_link: usize,
}

impl KvLink {
    /// Joins every decode backend to every prefill backend (`prefill[i]` on `prefill_on[i]`,
    /// likewise for decode), as `EngineClient::disaggregated` wants them: a decode engine
    /// takes a hand-off from any prefill engine.
    pub fn join_all(
        prefill: &mut [Box<dyn Backend>],
        prefill_on: &[DeviceChoice],
        decode: &mut [Box<dyn Backend>],
        decode_on: &[DeviceChoice],
    ) -> crate::runtime::Result<Vec<KvLink>> {
        assert_eq!(prefill.len(), prefill_on.len(), "a device for each prefill backend");
        assert_eq!(decode.len(), decode_on.len(), "a device for each decode backend");
        let mut links = Vec::with_capacity(prefill.len() * decode.len());
        for (p, (a, &from)) in prefill.iter_mut().zip(prefill_on).enumerate() {
            for (d, (b, &to)) in decode.iter_mut().zip(decode_on).enumerate() {
                let (prefill_link, decode_link) = kv_link::join(a.as_mut(), from, b.as_mut(), to)?;
                links.push(KvLink {
                    prefill: p,
                    decode: d,
                    prefill_link,
                    decode_link,
                });
            }
        }
        Ok(links)
    }
}

/// A prefill engine, shared by the routes of the decode engines it serves.
pub struct Router {
    pub(super) prefill: Engine,
    hasher: BlockHasher,
    /// Handoffs under way through this engine.
    busy: AtomicUsize,
}

impl Router {
    pub(super) fn new(prefill: Engine, hasher: BlockHasher) -> Self {
        Router {
            prefill,
            hasher,
            busy: AtomicUsize::new(0),
        }
    }

    /// Handoffs under way through this engine.
    pub(super) fn busy(&self) -> usize {
        self.busy.load(Ordering::Relaxed)
    }
}

/// Counts a handoff under way through a prefill engine from the moment its route is chosen
/// (so that requests submitted together spread) until dropped.
pub(super) struct Busy(Arc<Router>);

impl Busy {
    pub(super) fn new(router: &Arc<Router>) -> Self {
        router.busy.fetch_add(1, Ordering::Relaxed);
        Busy(router.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A decode engine's way to one prefill engine: the engine, and the link between them by its
/// number on each end.
#[derive(Clone)]
pub(super) struct Route {
    pub router: Arc<Router>,
    prefill_link: usize,
    decode_link: usize,
    /// The link's handoffs, one at a time from reserving to queueing the receive: sends and
    /// receives are matched in the order queued on each end.
    order: Arc<Mutex<()>>,
    /// Set once a transfer over the link failed (a failed link refuses every later one).
    failed: Arc<AtomicBool>,
}

impl Route {
    pub(super) fn new(router: Arc<Router>, prefill_link: usize, decode_link: usize) -> Self {
        Route {
            router,
            prefill_link,
            decode_link,
            order: Arc::new(Mutex::new(())),
            failed: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Whether the route's prefill engine can run and its link has not failed.
    pub(super) fn usable(&self) -> bool {
        !self.failed.load(Ordering::Relaxed) && self.router.prefill.stats().broken.is_none()
    }

    /// Hands request `id`'s prompt from the prefill engine to the decode engine (the module's
    /// steps), then lets the decode engine schedule it; `busy` counts it until then.
    pub(super) async fn hand_off(
        &self,
        decode: &DecodeSide,
        id: RequestId,
        prompt: Vec<u32>,
        priority: i32,
        busy: Busy,
    ) {
        let router = &*self.router;
        let _busy = busy;
        // Whatever happens to this task, the decode engine gets its receive (`Pending`).
        let mut pending = Pending {
            decode: decode.clone(),
            link: self.decode_link,
            id,
            claim: None,
        };
        // The decode engine computes at least the last token itself (its logits are needed):
        // the blocks before it are what a cache can give.
        let usable = (prompt.len().saturating_sub(1) / router.hasher.block_size) * router.hasher.block_size;
        let hashes = router.hasher.chain(None, &prompt[..usable]);
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
        if cached == hashes.len() || !router.prefill_prompt(&prompt[..usable], priority).await {
            return;
        }
        let _order = self.order.lock().await;
        let wanted = ask(decode, |wanted| Handoff::Reserve { id, hashes, wanted })
            .await
            .unwrap_or_default();
        if wanted.is_empty() {
            return;
        }
        let claim = Arc::new(SendClaim::default());
        pending.claim = Some(claim.clone());
        if router.send(self.prefill_link, &wanted, claim.clone()).await.is_err() {
            self.failed.store(true, Ordering::Relaxed);
        }
        let count = claim.settle();
        pending.disarm();
        let link = self.decode_link;
        let received = ask(decode, |queued| Handoff::Receive {
            link,
            id,
            count,
            queued,
        })
        .await;
        if let Some(Err(e)) = received {
            self.failed.store(true, Ordering::Relaxed);
            tracing::warn!(
                "quarry: request {id}: receiving its prompt's KV blocks failed ({e}); it computes them itself"
            );
        }
    }
}

impl Router {
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

    /// Has the prefill engine send over its link `link` the blocks of `hashes` it still
    /// caches (how many went is `claim`'s); `Err` where the link failed.
    async fn send(&self, link: usize, hashes: &[BlockHash], claim: Arc<SendClaim>) -> Result<(), ()> {
        let hashes = hashes.to_vec();
        let sent = ask(&PrefillSide(&self.prefill), |sent| Handoff::Send {
            link,
            hashes,
            claim,
            sent,
        })
        .await;
        match sent {
            Some(Err(e)) => {
                tracing::warn!("quarry: sending KV blocks failed: {e}");
                Err(())
            }
            _ => Ok(()),
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

/// What became of a handoff's send, shared by its task and the prefill engine, so that the
/// receive the task owes the decode engine counts exactly the blocks that went, even where the
/// task is dropped while it waits for the send (at shutdown): dropped before the prefill
/// engine takes the send, the task abandons it and the engine sends nothing; dropped after, it
/// reads how many went.
#[derive(Default)]
pub(super) struct SendClaim(std::sync::Mutex<Claim>);

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Claim {
    #[default]
    Asked,
    Sent(usize),
    Abandoned,
}

impl SendClaim {
    /// The prefill engine's side: `send` runs unless the task has gone; how many went.
    pub(super) fn send(&self, send: impl FnOnce() -> Result<usize, RuntimeError>) -> Result<usize, RuntimeError> {
        let mut claim = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if *claim == Claim::Abandoned {
            return Ok(0);
        }
        let sent = send();
        *claim = Claim::Sent(*sent.as_ref().unwrap_or(&0));
        sent
    }

    /// The task's side, once it waits no more: how many blocks went; none will after this.
    fn settle(&self) -> usize {
        let mut claim = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match *claim {
            Claim::Sent(n) => n,
            _ => {
                *claim = Claim::Abandoned;
                0
            }
        }
    }
}

/// A handoff's last step, taken when the task ends without it (the prompt failed on the
/// prefill engine, nothing was wanted, or the task was dropped): the decode engine receives
/// what was sent (a queued send must meet its receive), lets go of what it held and lets the
/// request be scheduled.
struct Pending {
    decode: DecodeSide,
    /// The link on the decode engine's end.
    link: usize,
    id: RequestId,
    /// The send, once asked for.
    claim: Option<Arc<SendClaim>>,
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
                link: self.link,
                id: self.id,
                count: self.claim.as_ref().map_or(0, |c| c.settle()),
                queued,
            };
            let _ = self.decode.handoff(step);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_send_and_the_receive_owed_for_it_count_the_same_blocks_whoever_comes_first() {
        // The prefill engine sends first: the task's end receives what went.
        let claim = SendClaim::default();
        assert_eq!(claim.send(|| Ok(5)).unwrap(), 5);
        assert_eq!(claim.settle(), 5);
        assert_eq!(claim.settle(), 5, "settling again reads the same count");
        // The task ends first (dropped at shutdown): the engine then sends nothing.
        let claim = SendClaim::default();
        assert_eq!(claim.settle(), 0);
        let mut ran = false;
        let sent = claim.send(|| {
            ran = true;
            Ok(5)
        });
        assert_eq!((sent.unwrap(), ran), (0, false));
        assert_eq!(claim.settle(), 0);
        // A send that failed moved nothing.
        let claim = SendClaim::default();
        assert!(claim.send(|| Err(RuntimeError::Backend("link down".into()))).is_err());
        assert_eq!(claim.settle(), 0);
    }
}
