//! The engine on its own thread, driven from async code. Requests go in over one channel;
//! each request's outputs come back over its own. Dropping a request's stream aborts the
//! request, so a client that goes away frees its KV blocks at the next step boundary, and
//! the others in the batch carry on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::{mpsc as async_mpsc, oneshot};

use super::core::{AddError, Completion, Completions, EngineCore, EngineRequest, RequestOutput};
use super::kv_cache_manager::{PrefixCacheStats, RequestId};

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
    },
    Abort(RequestId),
}

/// A handle to the engine thread; cheap to share behind an `Arc`.
pub struct EngineClient {
    commands: Mutex<Option<mpsc::Sender<Command>>>,
    next_id: AtomicU64,
    stats: Arc<Mutex<EngineStats>>,
    thread: Mutex<Option<JoinHandle<EngineCore>>>,
}

/// The outputs of one request, in order; the last one has `finished` set.
pub struct RequestStream {
    id: RequestId,
    outputs: async_mpsc::UnboundedReceiver<RequestOutput>,
    commands: mpsc::Sender<Command>,
    done: bool,
    /// What the submitter keeps for as long as the request has its stream (the server's
    /// admission permit): dropped with it.
    held: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl RequestStream {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Keeps `value` until the request ends (its last output is read) or its stream is
    /// dropped (which aborts it).
    pub fn hold(mut self, value: impl std::any::Any + Send + Sync) -> Self {
        self.held = Some(Box::new(value));
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
                self.held = None;
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
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(Mutex::new(core.stats()));
        let shared = stats.clone();
        let thread = std::thread::Builder::new()
            .name("quarry-engine".into())
            .spawn(move || run(core, rx, shared))
            .expect("spawn the engine thread");
        EngineClient {
            commands: Mutex::new(Some(tx)),
            next_id: AtomicU64::new(0),
            stats,
            thread: Mutex::new(Some(thread)),
        }
    }

    /// Queues a request (its `id` is assigned here) and returns its output stream, or the
    /// reason it was refused up front.
    pub async fn submit(&self, mut request: EngineRequest) -> Result<RequestStream, SubmitError> {
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
            })
            .map_err(|_| SubmitError::Stopped)?;
        ok_rx.await.map_err(|_| SubmitError::Stopped)??;
        Ok(RequestStream {
            id,
            outputs: out_rx,
            commands,
            done: false,
            held: None,
        })
    }

    pub fn stats(&self) -> EngineStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Stops taking requests, lets the running ones finish, and returns the engine.
    pub fn shutdown(&self) -> Option<EngineCore> {
        self.commands.lock().unwrap_or_else(|e| e.into_inner()).take();
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take()?;
        thread.join().ok()
    }

    fn sender(&self) -> Option<mpsc::Sender<Command>> {
        self.commands.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Drop for EngineClient {
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
            if !core.has_unfinished() {
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
                    } => {
                        let id = request.id;
                        let result = core.add_request(*request);
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
                }
            }
        }
        if !core.has_unfinished() {
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
