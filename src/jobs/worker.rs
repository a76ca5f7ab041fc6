//! Works through the store's queued items: claims as many as it has free slots, runs each
//! (the caller says how: the server through its extraction path), writes each result under
//! its lease, and renews its leases meanwhile. A store that cannot be reached is retried with
//! backoff; a result is never dropped while the store is away, only when the store says the
//! attempt is no longer ours (its lease ran out and someone else took the item).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::{Notify, Semaphore};

use serde_json::Value;

use super::{Attempt, Claim, JobSpec, JobStore, StoreError};

#[derive(Debug, Clone, Copy)]
pub struct WorkerConfig {
    /// Items in flight at once (0: none; the process only accepts and serves jobs).
    pub slots: usize,
    /// How long a claim holds without a heartbeat; heartbeats come at a third of it.
    pub lease: Duration,
    /// How often an idle worker looks for new items (others' processes may add them).
    pub poll: Duration,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            slots: 32,
            lease: Duration::from_secs(30),
            poll: Duration::from_millis(500),
        }
    }
}

/// What a worker hands its runner: one item, with its job's settings.
#[derive(Debug, Clone)]
pub struct Work {
    pub job: Arc<JobSpec>,
    pub item_id: String,
    pub payload: String,
    pub max_tokens: Option<usize>,
}

/// What a runner makes of an item: whether it succeeded, and the result to store.
pub type Done = (bool, Value);

pub struct Worker {
    store: Arc<dyn JobStore>,
    /// Who holds this process's leases: unique per process.
    owner: String,
    config: WorkerConfig,
    /// Wakes an idle worker at once (a job was created here).
    wake: Notify,
    /// Job settings, fetched once per job.
    specs: Mutex<HashMap<String, Arc<JobSpec>>>,
    stop: Notify,
}

/// Longest wait between two tries at an unreachable store.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

impl Worker {
    pub fn new(store: Arc<dyn JobStore>, config: WorkerConfig) -> Arc<Self> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "host".into());
        let owner = format!("{host}/{}/{:08x}", std::process::id(), rand::random::<u32>());
        Arc::new(Worker {
            store,
            owner,
            config,
            wake: Notify::new(),
            specs: Mutex::new(HashMap::new()),
            stop: Notify::new(),
        })
    }

    pub fn store(&self) -> &Arc<dyn JobStore> {
        &self.store
    }

    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// New items are queued: an idle worker looks now instead of at its next poll.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Stops claiming; `run` returns once the items in flight have their results.
    pub fn stop(&self) {
        self.stop.notify_one();
    }

    /// Runs until `stop`: claims, runs each claimed item with `run_item`, completes it.
    pub async fn run<F, Fut>(self: Arc<Self>, run_item: F)
    where
        F: Fn(Work) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Done> + Send + 'static,
    {
        if self.config.slots == 0 {
            // Takes no items: other processes on the store run them.
            self.stop.notified().await;
            return;
        }
        let run_item = Arc::new(run_item);
        let slots = Arc::new(Semaphore::new(self.config.slots));
        let heartbeat = tokio::spawn(self.clone().heartbeat());
        let mut backoff = Duration::from_millis(100);
        let stopped = self.stop.notified();
        tokio::pin!(stopped);
        loop {
            // Wait for a free slot, then take as many items as there are slots free.
            tokio::select! {
                _ = &mut stopped => break,
                permit = slots.clone().acquire_owned() => drop(permit),
            }
            let free = slots.available_permits();
            let claimed = {
                let (me, store) = (self.clone(), self.store.clone());
                let lease = self.config.lease;
                blocking(move || store.claim(&me.owner, free, lease)).await
            };
            let claims = match claimed {
                Ok(c) => {
                    backoff = Duration::from_millis(100);
                    c
                }
                Err(e) => {
                    eprintln!("quarry: job store: {e}; trying again in {backoff:?}");
                    tokio::select! {
                        _ = &mut stopped => break,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
            };
            if claims.is_empty() {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(self.config.poll) => {}
                }
                continue;
            }
            for claim in claims {
                let Ok(permit) = slots.clone().try_acquire_owned() else {
                    unreachable!("claimed no more than the free slots")
                };
                let (me, run_item) = (self.clone(), run_item.clone());
                tokio::spawn(async move {
                    me.work(claim, run_item.as_ref()).await;
                    drop(permit);
                });
            }
        }
        // Every slot back: the items in flight have their results.
        let _ = slots.acquire_many(self.config.slots as u32).await;
        heartbeat.abort();
        let (me, store) = (self.clone(), self.store.clone());
        if let Err(e) = blocking(move || store.release(&me.owner)).await {
            eprintln!("quarry: job store: {e}; this process's items go back when their leases run out");
        }
    }

    async fn work<F, Fut>(&self, claim: Claim, run_item: &F)
    where
        F: Fn(Work) -> Fut,
        Fut: Future<Output = Done>,
    {
        let job = match self.spec(&claim.attempt.job_id).await {
            Some(job) => job,
            // The job row went away under its item: nothing to run it with.
            None => return,
        };
        let running = run_item(Work {
            job,
            item_id: claim.item_id,
            payload: claim.payload,
            max_tokens: claim.max_tokens,
        });
        // A runner that panics fails its item alone: otherwise the heartbeat would keep the
        // item leased to this process, unfinished, for as long as it lives.
        let done = match std::panic::AssertUnwindSafe(running).catch_unwind().await {
            Ok(done) => done,
            Err(_) => (
                false,
                serde_json::json!({"outcome": "internal", "error": "the item's runner failed"}),
            ),
        };
        self.complete(claim.attempt, done).await;
    }

    /// Writes the result, retrying while the store is away; gives up only when the store
    /// says the attempt is no longer ours.
    async fn complete(&self, attempt: Attempt, (ok, result): Done) {
        let result = Arc::new(result);
        let attempt = Arc::new(attempt);
        let mut backoff = Duration::from_millis(100);
        loop {
            let (store, owner, a, r) = (self.store.clone(), self.owner.clone(), attempt.clone(), result.clone());
            match blocking(move || store.complete(&owner, &a, ok, &r)).await {
                Ok(_) => return,
                Err(e) => {
                    eprintln!(
                        "quarry: job store: {e}; writing {} item {} again in {backoff:?}",
                        attempt.job_id, attempt.index
                    );
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    async fn spec(&self, job_id: &str) -> Option<Arc<JobSpec>> {
        if let Some(s) = self.specs.lock().unwrap_or_else(|e| e.into_inner()).get(job_id) {
            return Some(s.clone());
        }
        let mut backoff = Duration::from_millis(100);
        loop {
            let (store, id) = (self.store.clone(), job_id.to_string());
            match blocking(move || store.spec(&id)).await {
                Ok(spec) => {
                    let spec = Arc::new(spec?);
                    self.specs
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(job_id.to_string(), spec.clone());
                    return Some(spec);
                }
                Err(e) => {
                    eprintln!("quarry: job store: {e}; trying again in {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// Renews this process's leases every third of a lease.
    async fn heartbeat(self: Arc<Self>) {
        let every = self.config.lease / 3;
        loop {
            tokio::time::sleep(every).await;
            let (store, owner, lease) = (self.store.clone(), self.owner.clone(), self.config.lease);
            if let Err(e) = blocking(move || store.heartbeat(&owner, lease)).await {
                eprintln!("quarry: job store: {e}; leases not renewed");
            }
        }
    }
}

/// A store call off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(StoreError::Backend(format!("store call failed: {e}"))))
}
