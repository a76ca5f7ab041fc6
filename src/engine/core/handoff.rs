//! Disaggregated serving (`engine::disaggregated`), the engine's part: a prefill engine sends
//! the blocks of a prompt it computed; a decode engine holds blocks for them, receives them,
//! enters them in its prefix cache and only then lets the request they belong to be scheduled,
//! which finds its prompt cached and computes the rest. Neither engine's steps wait for a
//! transfer: both hold a transfer's blocks until the backend says it is done
//! (`poll_transfers`, every turn of the engine's loop).
//!
//! Every reservation ends in `receive_blocks` (the router's duty, even for a request aborted
//! meanwhile, since a send already queued must meet its receive), and every path out of it
//! lets go of the blocks: a failed transfer leaves them uncached and the request computes its
//! prompt itself.

use std::collections::{HashMap, VecDeque};

use super::EngineCore;
use crate::engine::block_pool::{BlockHash, BlockId};
use crate::engine::kv_cache_manager::RequestId;
use crate::runtime::RuntimeError;

/// Transfers in flight and blocks held for them.
#[derive(Default)]
pub(super) struct Handoffs {
    /// Blocks held for a request until its transfer is queued, with their chain and how many
    /// were cached already.
    reserved: HashMap<RequestId, Reserved>,
    /// Queued transfers on each link (by the link's number), in ticket order (sends and
    /// receives on one link share its count).
    queued: Vec<VecDeque<Queued>>,
    /// Blocks whose transfer is done.
    pub blocks_sent: u64,
    pub blocks_received: u64,
    pub failures: u64,
}

struct Reserved {
    blocks: Vec<BlockId>,
    hashes: Vec<BlockHash>,
    cached: usize,
}

struct Queued {
    ticket: u64,
    blocks: Vec<BlockId>,
    /// Blocks the transfer moves (counted in the stats once it is done).
    moved: usize,
    /// A receive: the request to let go, the chain and how many blocks it fills.
    receive: Option<(RequestId, Vec<BlockHash>, usize)>,
}

impl EngineCore {
    /// Sending side: queues the sending over link `link` of the leading blocks of the chain
    /// `hashes` that are still cached here; returns how many go (the receiver must receive as
    /// many).
    pub fn send_blocks(&mut self, link: usize, hashes: &[BlockHash]) -> Result<usize, RuntimeError> {
        let blocks = self.scheduler.kv_mut().hold_cached(hashes);
        if blocks.is_empty() {
            return Ok(0);
        }
        match self.backend.send_kv_blocks(link, &blocks) {
            Ok(ticket) => {
                let n = blocks.len();
                self.handoffs.on(link).push_back(Queued {
                    ticket,
                    blocks,
                    moved: n,
                    receive: None,
                });
                Ok(n)
            }
            Err(e) => {
                self.handoffs.failures += 1;
                self.scheduler.kv_mut().let_go(&blocks);
                Err(e)
            }
        }
    }

    /// Receiving side: how many leading blocks of the chain `hashes` this cache has (nothing
    /// is held: a request whose whole chain is here needs no prefill elsewhere).
    pub fn cached_blocks(&self, hashes: &[BlockHash]) -> usize {
        self.scheduler.kv().cached_run(hashes)
    }

    /// Receiving side: holds blocks for request `id`'s chain `hashes` (its prompt's full
    /// blocks) and returns the hashes whose blocks must be sent: those after the ones cached
    /// here, as far as the free blocks allow while the requests running here keep room to
    /// grow. `receive_blocks` must follow.
    pub fn reserve_blocks(&mut self, id: RequestId, hashes: Vec<BlockHash>) -> Vec<BlockHash> {
        // A block per running request spares them a preemption on the next steps.
        let keep_free = self.scheduler.num_running();
        let (blocks, cached) = self.scheduler.kv_mut().hold_chain(&hashes, keep_free);
        let wanted = hashes[cached..blocks.len()].to_vec();
        self.handoffs.reserved.insert(id, Reserved { blocks, hashes, cached });
        wanted
    }

    /// Receiving side: queues the receiving over link `link` of `count` blocks (what the
    /// sender sent of those `reserve_blocks` asked for) into request `id`'s reservation. The
    /// request is let go once they land; at once where none come.
    pub fn receive_blocks(&mut self, link: usize, id: RequestId, count: usize) -> Result<(), RuntimeError> {
        let Some(r) = self.handoffs.reserved.remove(&id) else {
            self.scheduler.release(id);
            return Ok(());
        };
        let count = count.min(r.blocks.len() - r.cached);
        let filled = r.cached + count;
        let mut result = Ok(());
        if count > 0 {
            match self.backend.recv_kv_blocks(link, &r.blocks[r.cached..filled]) {
                Ok(ticket) => {
                    self.handoffs.on(link).push_back(Queued {
                        ticket,
                        blocks: r.blocks,
                        moved: count,
                        receive: Some((id, r.hashes, filled)),
                    });
                    self.poll_link(link);
                    return Ok(());
                }
                Err(e) => {
                    self.handoffs.failures += 1;
                    result = Err(e);
                }
            }
        }
        // Nothing comes (or nothing can): what was cached here is still good.
        self.scheduler.kv_mut().enter_chain(&r.blocks, &r.hashes, r.cached);
        self.scheduler.release(id);
        result
    }

    /// Lets go of the blocks of every transfer the backend has finished; where a link failed,
    /// of every transfer on it, their requests computing their prompts themselves.
    pub fn poll_transfers(&mut self) {
        for link in 0..self.handoffs.queued.len() {
            if !self.handoffs.queued[link].is_empty() {
                self.poll_link(link);
            }
        }
    }

    fn poll_link(&mut self, link: usize) {
        let done = match self.backend.kv_transfers_done(link) {
            Ok(done) => done,
            Err(e) => {
                tracing::error!(
                    "quarry: KV transfer on link {link} failed: {e}; the requests waiting for it compute their prompts here"
                );
                self.handoffs.failures += 1;
                u64::MAX
            }
        };
        let failed = done == u64::MAX;
        while self.handoffs.queued[link].front().is_some_and(|q| q.ticket < done) {
            let q = self.handoffs.queued[link].pop_front().expect("checked");
            if !failed {
                let moved = q.moved as u64;
                match q.receive {
                    Some(_) => self.handoffs.blocks_received += moved,
                    None => self.handoffs.blocks_sent += moved,
                }
            }
            match q.receive {
                Some((id, hashes, filled)) => {
                    let filled = if failed { 0 } else { filled };
                    self.scheduler.kv_mut().enter_chain(&q.blocks, &hashes, filled);
                    self.scheduler.release(id);
                }
                None => self.scheduler.kv_mut().let_go(&q.blocks),
            }
        }
    }

    /// Whether transfers are in flight (the engine's loop must come back to poll them).
    pub fn has_transfers(&self) -> bool {
        self.handoffs.queued.iter().any(|q| !q.is_empty())
    }
}

impl Handoffs {
    /// The queue of link `link`'s transfers.
    fn on(&mut self, link: usize) -> &mut VecDeque<Queued> {
        if self.queued.len() <= link {
            self.queued.resize_with(link + 1, VecDeque::new);
        }
        &mut self.queued[link]
    }
}
