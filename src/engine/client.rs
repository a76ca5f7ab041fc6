//! The engine on its own thread, driven from async code. Requests go in over one channel;
//! each request's outputs come back over its own. Dropping a request's stream aborts the
//! request, so a client that goes away frees its KV blocks at the next step boundary, and
//! the others in the batch carry on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::{mpsc as async_mpsc, oneshot};

use super::block_pool::BlockHash;
use super::core::{AddError, Completion, Completions, EngineCore, EngineRequest, RequestOutput};
use super::disaggregated::{Busy, KvLink, Route, Router, SendClaim};
use super::kv_cache_manager::{BlockHasher, PrefixCacheStats, RequestId};
use super::placement::Placement;
use crate::runtime::RuntimeError;

/// A snapshot of the engine, refreshed after every step (for metrics and admission control).
#[derive(Debug, Clone, Default)]
pub struct EngineStats {
    pub waiting: usize,
    pub running: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_free: usize,
    pub prefix_cache: PrefixCacheStats,
    pub preemptions: usize,
    pub steps: u64,
    /// Speculative decoding's drafts, checked and kept, over every request so far.
    pub drafts: super::speculation::DraftCounts,
    /// Draft-model passes that failed (the engine then drops the draft model and decodes on).
    pub draft_model_failures: u64,
    /// Full logits rows the backend copied to the host (`Backend::logits_rows_copied`).
    pub logits_rows_copied: u64,
    /// Steps the backend replayed from CUDA graphs (`Backend::graph_steps`).
    pub graph_steps: u64,
    /// Steps planned before the step before them was read (`EngineConfig::async_scheduling`;
    /// on a GPU their pass is queued before that read too).
    pub pipelined_steps: u64,
    /// Sampled rows of pipelined steps dropped because the step before ended their request,
    /// forced tokens after it, or took back the token they were computed from.
    pub pipelined_rows_dropped: u64,
    /// Disaggregated serving's KV blocks moved from or to this engine, and failed transfers.
    pub kv_blocks_sent: u64,
    pub kv_blocks_received: u64,
    pub kv_transfer_failures: u64,
    /// Why the backend can run nothing more (`Backend::broken`).
    pub broken: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error(transparent)]
    Refused(#[from] AddError),
    #[error("the engine has stopped")]
    Stopped,
}

enum Command {
    Add {
        /// Boxed: a request (its sampling parameters, its constraint) is far larger than an
        /// abort, and commands sit in the channel by value.
        request: Box<EngineRequest>,
        outputs: async_mpsc::UnboundedSender<RequestOutput>,
        admitted: oneshot::Sender<Result<(), AddError>>,
        /// Not scheduled until its prompt's blocks are handed over (`Handoff::Receive`).
        held: bool,
    },
    Abort(RequestId),
    /// Disaggregated serving (`disaggregated`): the engine side of a handoff.
    Handoff(Handoff),
}

/// A step of a prompt's handoff between engines (`EngineCore`'s `send_blocks`,
/// `reserve_blocks`, `receive_blocks`), answered on its own channel.
pub(super) enum Handoff {
    Send {
        link: usize,
        hashes: Vec<BlockHash>,
        claim: Arc<SendClaim>,
        sent: oneshot::Sender<Result<usize, RuntimeError>>,
    },
    Cached {
        hashes: Vec<BlockHash>,
        count: oneshot::Sender<usize>,
    },
    Reserve {
        id: RequestId,
        hashes: Vec<BlockHash>,
        wanted: oneshot::Sender<Vec<BlockHash>>,
    },
    Receive {
        link: usize,
        id: RequestId,
        count: usize,
        queued: oneshot::Sender<Result<(), RuntimeError>>,
    },
}

/// A handle to the engine (or engines) behind the service; cheap to share behind an `Arc`.
pub struct EngineClient {
    /// One, or several serving the same model (data parallelism), each request placed on one
    /// by `placement`.
    engines: Vec<Engine>,
    placement: Option<Arc<Mutex<Placement>>>,
    /// `EngineCore::pipelining` of the engines (of every one).
    pipelining: bool,
    /// `Backend::batch_invariant` of the engines' backends (of every one, and of both sides
    /// where prompts are computed by another engine).
    batch_invariant: bool,
}

/// One engine's thread, and what it is told and tells.
pub(super) struct Engine {
    commands: Mutex<Option<mpsc::Sender<Command>>>,
    /// Shared by every engine behind one client: request ids are the client's.
    next_id: Arc<AtomicU64>,
    stats: Arc<Mutex<EngineStats>>,
    thread: Mutex<Option<JoinHandle<EngineCore>>>,
    /// Where prompts are computed by another engine first (disaggregated serving): the
    /// prefill engines it reaches.
    routes: Vec<Route>,
    /// How its cache names blocks, how many its pool holds, and whether it caches prefixes.
    hasher: BlockHasher,
    blocks: usize,
    caching: bool,
    /// What it computes on (`device_kind`).
    device_kind: String,
}

/// What computes on a device, from `Backend::device_name`: `cpu` or the GPU's model, without its
/// ordinal or thread count.
fn device_kind(name: &str) -> &str {
    match name.split_once(' ') {
        Some((head, rest)) if head.starts_with("cuda") => rest,
        Some((head, _)) => head,
        None => name,
    }
}

/// The outputs of one request, in order; the last one has `finished` set.
pub struct RequestStream {
    id: RequestId,
    outputs: async_mpsc::UnboundedReceiver<RequestOutput>,
    commands: mpsc::Sender<Command>,
    done: bool,
    /// What the submitter keeps for as long as the request has its stream (the server's
    /// admission permit): dropped with it.
    held: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

impl RequestStream {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Keeps `value` until the request ends (its last output is read) or its stream is
    /// dropped (which aborts it).
    pub fn hold(mut self, value: impl std::any::Any + Send + Sync) -> Self {
        self.held.push(Box::new(value));
        self
    }

    /// The next output, or `None` after the last one (or when the engine stopped).
    pub async fn next(&mut self) -> Option<RequestOutput> {
        if self.done {
            return None;
        }
        let out = self.outputs.recv().await;
        match &out {
            Some(o) if o.finished.is_none() => {}
            // What was held for the request goes back as it ends, not when its reader is done.
            _ => {
                self.done = true;
                self.held.clear();
            }
        }
        out
    }
}

impl RequestStream {
    /// Every output to the last, gathered; `None` when the engine stopped first.
    pub async fn collect(mut self) -> Option<Completion> {
        let mut all = Completions::default();
        while let Some(out) = self.next().await {
            all.push(&out);
        }
        all.done.pop()
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            // The engine may already be gone; nothing is left to free then.
            let _ = self.commands.send(Command::Abort(self.id));
        }
    }
}

impl EngineClient {
    /// Moves `core` onto a thread of its own.
    pub fn start(core: EngineCore) -> Self {
        let pipelining = core.pipelining();
        let batch_invariant = core.backend().batch_invariant();
        EngineClient {
            engines: vec![Engine::start(core)],
            placement: None,
            pipelining,
            batch_invariant,
        }
    }

    /// Disaggregated serving: `decode` serves the requests, each prompt computed by `prefill`
    /// first and its blocks handed over (their backends joined by a KV link,
    /// `Backend::attach_kv_link`, the first of each). Both caches must name blocks alike (the
    /// same model).
    pub fn start_disaggregated(prefill: EngineCore, decode: EngineCore) -> Result<Self, String> {
        let link = KvLink {
            prefill: 0,
            decode: 0,
            prefill_link: 0,
            decode_link: 0,
        };
        Self::disaggregated(vec![prefill], vec![decode], &[link])
    }

    /// Disaggregated serving over several engines: the `decode` engines serve the requests
    /// (each placed on one as `replicas` places them), each prompt computed first by one of
    /// the `prefill` engines its `links` reach (the one with the fewest handoffs under way).
    /// Every decode and every prefill engine must have a link; all must name blocks alike.
    pub fn disaggregated(prefill: Vec<EngineCore>, decode: Vec<EngineCore>, links: &[KvLink]) -> Result<Self, String> {
        let Some(hasher) = decode.first().map(|d| d.kv().hasher()) else {
            return Err("disaggregated serving needs a decode engine".into());
        };
        let cores = || prefill.iter().chain(&decode);
        if let Some(other) = cores().find(|c| c.kv().hasher() != hasher) {
            return Err(format!(
                "the prefill and decode engines name KV blocks differently (block sizes {} and {}, or another model)",
                other.kv().block_size(),
                hasher.block_size
            ));
        }
        if let Some(l) = links
            .iter()
            .find(|l| l.prefill >= prefill.len() || l.decode >= decode.len())
        {
            return Err(format!(
                "a KV link joins prefill engine {} and decode engine {}, of {} and {}",
                l.prefill,
                l.decode,
                prefill.len(),
                decode.len()
            ));
        }
        if let Some(p) = (0..prefill.len()).find(|&p| !links.iter().any(|l| l.prefill == p)) {
            return Err(format!("prefill engine {p} has no KV link to a decode engine"));
        }
        if let Some(d) = (0..decode.len()).find(|&d| !links.iter().any(|l| l.decode == d)) {
            return Err(format!("decode engine {d} has no KV link to a prefill engine"));
        }
        // A link number given twice on one engine would cross two links' transfers.
        for (i, l) in links.iter().enumerate() {
            if let Some(m) = links[..i]
                .iter()
                .find(|m| m.prefill == l.prefill && m.prefill_link == l.prefill_link)
            {
                return Err(format!(
                    "prefill engine {}'s link {} is given for decode engines {} and {}",
                    l.prefill, l.prefill_link, m.decode, l.decode
                ));
            }
            if let Some(m) = links[..i]
                .iter()
                .find(|m| m.decode == l.decode && m.decode_link == l.decode_link)
            {
                return Err(format!(
                    "decode engine {}'s link {} is given for prefill engines {} and {}",
                    l.decode, l.decode_link, m.prefill, l.prefill
                ));
            }
        }
        // A prompt's blocks come from any of these engines (computed by a prefill engine, or by
        // the decode engine where it has them cached or the handoff fails): the same bits only
        // where all compute alike, on devices of one kind.
        let kind = device_kind(&decode[0].backend().device_name()).to_string();
        let invariant =
            cores().all(|c| c.backend().batch_invariant() && device_kind(&c.backend().device_name()) == kind);
        let routers: Vec<Arc<Router>> = prefill
            .into_iter()
            .map(|core| Arc::new(Router::new(Engine::start(core), hasher)))
            .collect();
        let mut clients: Vec<EngineClient> = decode.into_iter().map(EngineClient::start).collect();
        for l in links {
            let route = Route::new(routers[l.prefill].clone(), l.prefill_link, l.decode_link);
            clients[l.decode].engines[0].routes.push(route);
        }
        let mut client = match clients.len() {
            1 => clients.pop().expect("one"),
            _ => Self::replicas(clients)?,
        };
        client.batch_invariant &= invariant;
        Ok(client)
    }

    /// Data parallelism: `cores`, each a whole model on devices of its own, behind one client
    /// (`replicas`).
    pub fn start_replicas(cores: Vec<EngineCore>) -> Result<Self, String> {
        Self::replicas(cores.into_iter().map(EngineClient::start).collect())
    }

    /// Data parallelism: the engines of `clients` (each one engine, or a prefill and a decode
    /// engine), behind one client that places each request on one of them (`placement`: where
    /// its prompt's start is cached, or the least busy). They must name KV blocks alike (the
    /// same model).
    pub fn replicas(clients: Vec<EngineClient>) -> Result<Self, String> {
        // A request's output may come from any engine, and a preempted one resumes where it
        // ran: the same bits only where every engine computes alike, on devices of one kind.
        let batch_invariant = clients.iter().all(|c| c.batch_invariant);
        let pipelining = clients.iter().all(|c| c.pipelining);
        let mut engines: Vec<Engine> = Vec::new();
        for mut client in clients {
            engines.append(&mut client.engines);
        }
        let Some(first) = engines.first() else {
            return Err("data parallelism needs at least one engine".into());
        };
        if let Some(other) = engines.iter().find(|e| e.hasher != first.hasher) {
            return Err(format!(
                "the engines name KV blocks differently (block sizes {} and {}, or another model)",
                first.hasher.block_size, other.hasher.block_size
            ));
        }
        let alike = engines.iter().all(|e| e.device_kind == first.device_kind);
        let caching = engines.iter().all(|e| e.caching);
        let hasher = first.hasher;
        let capacities: Vec<usize> = engines.iter().map(|e| e.blocks).collect();
        let next_id = Arc::new(AtomicU64::new(0));
        for engine in &mut engines {
            engine.next_id = next_id.clone();
        }
        Ok(EngineClient {
            engines,
            placement: Some(Arc::new(Mutex::new(Placement::new(hasher, &capacities, caching)))),
            pipelining,
            batch_invariant: batch_invariant && alike,
        })
    }

    /// The prefill engines' stats (summed), where prompts are computed by other engines.
    pub fn prefill_stats(&self) -> Option<EngineStats> {
        let mut sides = self.prefill_stats_each().into_iter();
        let mut sum = sides.next()?;
        sides.for_each(|s| sum.add(&s));
        Some(sum)
    }

    /// Each prefill engine's stats, in the order of the routes that reach them.
    pub fn prefill_stats_each(&self) -> Vec<EngineStats> {
        // A prefill engine may serve several decode engines: each counted once.
        let mut routers: Vec<&Arc<Router>> = Vec::new();
        for route in self.engines.iter().flat_map(|e| &e.routes) {
            if !routers.iter().any(|r| Arc::ptr_eq(r, &route.router)) {
                routers.push(&route.router);
            }
        }
        routers.iter().map(|r| r.prefill.stats()).collect()
    }

    /// Queues a request (its `id` is assigned here) and returns its output stream, or the
    /// reason it was refused up front.
    pub async fn submit(&self, request: EngineRequest) -> Result<RequestStream, SubmitError> {
        let Some(placement) = &self.placement else {
            return self.engines[0].submit(request).await;
        };
        // An engine that can run nothing more takes no more requests while another can.
        let usable: Vec<bool> = self.engines.iter().map(|e| e.stats().broken.is_none()).collect();
        let placed = lock(placement).place(&request.prompt, |i| usable[i]);
        let Some(engine) = placed else {
            return self.engines[0].submit(request).await;
        };
        let ended = Ended {
            placement: placement.clone(),
            engine,
        };
        let stream = self.engines[engine].submit(request).await?;
        Ok(stream.hold(ended))
    }

    /// Whether the (decode) engines pipeline their steps (`EngineCore::pipelining`).
    pub fn pipelining(&self) -> bool {
        self.pipelining
    }

    /// Whether a request's output is the same whatever else runs beside it
    /// (`Backend::batch_invariant`).
    pub fn batch_invariant(&self) -> bool {
        self.batch_invariant
    }

    /// The engines' stats, summed. Broken only where every engine is: the others serve on.
    pub fn stats(&self) -> EngineStats {
        let each: Vec<EngineStats> = self.engines.iter().map(Engine::stats).collect();
        let broken = each.iter().all(|s| s.broken.is_some());
        let mut sum = EngineStats::default();
        each.iter().for_each(|s| sum.add(s));
        if !broken {
            sum.broken = None;
        }
        sum
    }

    /// How many engines serve (data parallelism), and the requests placed on each that have
    /// not ended.
    pub fn loads(&self) -> Vec<usize> {
        match &self.placement {
            Some(p) => lock(p).loads(),
            None => {
                let s = self.engines[0].stats();
                vec![s.waiting + s.running]
            }
        }
    }

    /// How many requests each engine has been given so far, where several serve (`None`
    /// for one engine: there is nothing to place).
    pub fn placed(&self) -> Option<Vec<u64>> {
        self.placement.as_ref().map(|p| lock(p).placed())
    }

    /// Stops taking requests, lets the running ones finish, and returns the engine (the
    /// decode engine, where prompts were computed by another; the first, where several serve).
    pub fn shutdown(&self) -> Option<EngineCore> {
        self.shutdown_all().into_iter().next()
    }

    /// `shutdown`, returning every engine, in order.
    pub fn shutdown_all(&self) -> Vec<EngineCore> {
        // Every engine stops taking requests before any is waited for.
        self.engines.iter().for_each(Engine::close);
        self.engines.iter().filter_map(Engine::join).collect()
    }
}

impl Drop for EngineClient {
    fn drop(&mut self) {
        self.shutdown_all();
    }
}

/// Held by a placed request's stream: its engine's load drops when it ends.
struct Ended {
    placement: Arc<Mutex<Placement>>,
    engine: usize,
}

impl Drop for Ended {
    fn drop(&mut self) {
        lock(&self.placement).ended(self.engine);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl EngineStats {
    /// Adds `other`'s counts into these (several engines as one).
    fn add(&mut self, other: &EngineStats) {
        self.waiting += other.waiting;
        self.running += other.running;
        self.kv_blocks_total += other.kv_blocks_total;
        self.kv_blocks_free += other.kv_blocks_free;
        self.prefix_cache.queried_tokens += other.prefix_cache.queried_tokens;
        self.prefix_cache.hit_tokens += other.prefix_cache.hit_tokens;
        self.preemptions += other.preemptions;
        self.steps += other.steps;
        self.drafts.add(&other.drafts);
        self.draft_model_failures += other.draft_model_failures;
        self.logits_rows_copied += other.logits_rows_copied;
        self.graph_steps += other.graph_steps;
        self.pipelined_steps += other.pipelined_steps;
        self.pipelined_rows_dropped += other.pipelined_rows_dropped;
        self.kv_blocks_sent += other.kv_blocks_sent;
        self.kv_blocks_received += other.kv_blocks_received;
        self.kv_transfer_failures += other.kv_transfer_failures;
        if self.broken.is_none() {
            self.broken = other.broken.clone();
        }
    }
}

impl Engine {
    /// Moves `core` onto a thread of its own.
    fn start(core: EngineCore) -> Self {
        let (hasher, blocks, caching) = (core.kv().hasher(), core.kv().pool().total(), core.kv().caching());
        let device_kind = device_kind(&core.backend().device_name()).to_string();
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(Mutex::new(core.stats()));
        let shared = stats.clone();
        let thread = std::thread::Builder::new()
            .name("quarry-engine".into())
            .spawn(move || run(core, rx, shared))
            .expect("spawn the engine thread");
        Engine {
            commands: Mutex::new(Some(tx)),
            next_id: Arc::new(AtomicU64::new(0)),
            stats,
            thread: Mutex::new(Some(thread)),
            routes: Vec::new(),
            hasher,
            blocks,
            caching,
            device_kind,
        }
    }

    /// Asks the engine to take part in a handoff (`disaggregated`).
    pub(super) fn handoff(&self, step: Handoff) -> Result<(), SubmitError> {
        let commands = self.sender().ok_or(SubmitError::Stopped)?;
        commands.send(Command::Handoff(step)).map_err(|_| SubmitError::Stopped)
    }

    /// `EngineClient::submit` on this engine (and a prefill engine, where it has them).
    async fn submit(&self, request: EngineRequest) -> Result<RequestStream, SubmitError> {
        // The least busy prefill engine whose engine and link still work, counted busy from
        // now (admission waits for the decode engine's loop, and requests arriving meanwhile
        // must see this one).
        let route = self
            .routes
            .iter()
            .filter(|r| r.usable())
            .min_by_key(|r| r.router.busy());
        let Some(route) = route.or(self.routes.first()) else {
            return self.enqueue(request, false).await;
        };
        let busy = Busy::new(&route.router);
        // Kept for the prefill engine: the prompt and where its request goes in the queue.
        let (prompt, priority) = (request.prompt.clone(), request.priority);
        let stream = self.enqueue(request, true).await?;
        let decode = DecodeSide {
            commands: stream.commands.clone(),
        };
        let (route, id) = (route.clone(), stream.id);
        tokio::spawn(async move { route.hand_off(&decode, id, prompt, priority, busy).await });
        Ok(stream)
    }

    /// `submit` to this engine alone; a `held` request waits for its prompt's blocks.
    pub(super) async fn enqueue(&self, mut request: EngineRequest, held: bool) -> Result<RequestStream, SubmitError> {
        request.id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let id = request.id;
        let commands = self.sender().ok_or(SubmitError::Stopped)?;
        let (out_tx, out_rx) = async_mpsc::unbounded_channel();
        let (ok_tx, ok_rx) = oneshot::channel();
        commands
            .send(Command::Add {
                request: Box::new(request),
                outputs: out_tx,
                admitted: ok_tx,
                held,
            })
            .map_err(|_| SubmitError::Stopped)?;
        ok_rx.await.map_err(|_| SubmitError::Stopped)??;
        Ok(RequestStream {
            id,
            outputs: out_rx,
            commands,
            done: false,
            held: Vec::new(),
        })
    }

    pub(super) fn stats(&self) -> EngineStats {
        let mut stats = lock(&self.stats).clone();
        // Prefill engines that can run nothing more break the service as much, once none of
        // this engine's can.
        if stats.broken.is_none() {
            let mut prefill = self.routes.iter().map(|r| r.router.prefill.stats().broken);
            if let Some(first) = prefill.next().flatten() {
                if prefill.all(|b| b.is_some()) {
                    stats.broken = Some(first);
                }
            }
        }
        stats
    }

    /// Stops taking requests (its prefill engines' too); the running ones finish.
    fn close(&self) {
        for route in &self.routes {
            route.router.prefill.close();
        }
        lock(&self.commands).take();
    }

    /// Waits for the engine's thread (closed first) and returns the engine; its prefill
    /// engines' threads are waited for too.
    fn join(&self) -> Option<EngineCore> {
        for route in &self.routes {
            route.router.prefill.join();
        }
        lock(&self.thread).take()?.join().ok()
    }

    fn shutdown(&self) -> Option<EngineCore> {
        self.close();
        self.join()
    }

    fn sender(&self) -> Option<mpsc::Sender<Command>> {
        lock(&self.commands).clone()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The engine loop: take commands (waiting for one when idle), step, route outputs. Runs
/// until every sender is gone and the last request has finished.
fn run(mut core: EngineCore, commands: mpsc::Receiver<Command>, stats: Arc<Mutex<EngineStats>>) -> EngineCore {
    let mut streams: std::collections::HashMap<RequestId, async_mpsc::UnboundedSender<RequestOutput>> =
        Default::default();
    let mut open = true;
    loop {
        if open {
            let mut first = None;
            if !core.has_unfinished() && !core.has_transfers() {
                match commands.recv() {
                    Ok(c) => first = Some(c),
                    Err(_) => open = false,
                }
            }
            for c in first.into_iter().chain(std::iter::from_fn(|| commands.try_recv().ok())) {
                match c {
                    Command::Add {
                        request,
                        outputs,
                        admitted,
                        held,
                    } => {
                        let id = request.id;
                        let result = match held {
                            true => core.add_held_request(*request),
                            false => core.add_request(*request),
                        };
                        if result.is_ok() {
                            streams.insert(id, outputs);
                        }
                        if admitted.send(result).is_err() {
                            // The caller gave up while waiting for the answer.
                            core.abort(id);
                            streams.remove(&id);
                        }
                    }
                    Command::Abort(id) => {
                        core.abort(id);
                        streams.remove(&id);
                    }
                    Command::Handoff(step) => hand_off(&mut core, step),
                }
            }
        }
        core.poll_transfers();
        if !core.has_unfinished() {
            if core.has_transfers() {
                // Nothing to step, but a transfer's blocks to let go of when it lands.
                std::thread::sleep(std::time::Duration::from_micros(200));
                continue;
            }
            *stats.lock().unwrap_or_else(|e| e.into_inner()) = core.stats();
            if open {
                continue;
            }
            return core;
        }
        let outputs = match core.step() {
            Ok(outputs) => outputs,
            // The backend failed: every request ends as `internal`, and the engine goes on.
            Err(e) => {
                tracing::error!("quarry: engine step failed: {e}");
                core.fail_all()
            }
        };
        for out in outputs {
            let finished = out.finished.is_some();
            let id = out.id;
            let gone = streams.get(&id).is_none_or(|s| s.send(out).is_err());
            if finished {
                streams.remove(&id);
            } else if gone {
                core.abort(id);
                streams.remove(&id);
            }
        }
        *stats.lock().unwrap_or_else(|e| e.into_inner()) = core.stats();
    }
}

/// One handoff step on the engine's thread; its answer goes back on the step's channel (a
/// router that gave up no longer listens, which changes nothing here).
fn hand_off(core: &mut EngineCore, step: Handoff) {
    match step {
        Handoff::Send {
            link,
            hashes,
            claim,
            sent,
        } => {
            let _ = sent.send(claim.send(|| core.send_blocks(link, &hashes)));
        }
        Handoff::Cached { hashes, count } => {
            let _ = count.send(core.cached_blocks(&hashes));
        }
        Handoff::Reserve { id, hashes, wanted } => {
            let _ = wanted.send(core.reserve_blocks(id, hashes));
        }
        Handoff::Receive {
            link,
            id,
            count,
            queued,
        } => {
            let _ = queued.send(core.receive_blocks(link, id, count));
        }
    }
}

/// The decode engine's channel, as a handoff task drives it.
#[derive(Clone)]
pub(super) struct DecodeSide {
    commands: mpsc::Sender<Command>,
}

impl DecodeSide {
    pub(super) fn handoff(&self, step: Handoff) -> Result<(), SubmitError> {
        self.commands
            .send(Command::Handoff(step))
            .map_err(|_| SubmitError::Stopped)
    }
}

#[cfg(test)]
mod tests {
    use super::device_kind;

    #[test]
    fn device_kinds_leave_out_ordinals_and_thread_counts() {
        assert_eq!(device_kind("cuda:0 (NVIDIA H200)"), device_kind("cuda:1 (NVIDIA H200)"));
        assert_eq!(device_kind("cpu (16 threads)"), device_kind("cpu (2 threads)"));
        assert_ne!(device_kind("cpu (16 threads)"), device_kind("cuda:0 (NVIDIA H200)"));
        assert_ne!(
            device_kind("cuda:0 (NVIDIA H100 80GB HBM3)"),
            device_kind("cuda:1 (NVIDIA H200)")
        );
    }
}
