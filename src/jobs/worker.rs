//! Works through the store's queued items: claims as many as it has free slots, runs each
//! (the caller says how: the server through its extraction path), writes each result under
//! its lease, and renews its leases meanwhile. A store that cannot be reached is retried with
//! backoff; a result is never dropped while the store is away, only when the store says the
//! attempt is no longer ours (its lease ran out and someone else took the item).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// How long finished jobs and uploaded files are kept; `None`: until deleted.
    pub retention: Option<Duration>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            slots: 32,
            lease: Duration::from_secs(30),
            poll: Duration::from_millis(500),
            retention: None,
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
    /// The job was cancelled while this item was out with a worker that died: end it as
    /// cancelled, do not run it.
    pub cancelled: bool,
}

/// What a runner makes of an item: whether it succeeded, and the result to store.
pub type Done = (bool, Value);

/// The result stored for an item whose runner panicked, in the shape of its job's results
/// (an extraction record, a batch line's error): the caller's, since the shape is.
pub type Failed = fn(&JobSpec, &str) -> Value;

pub struct Worker {
    store: Arc<dyn JobStore>,
    /// Who holds this process's leases: unique per process.
    owner: String,
    config: WorkerConfig,
    /// Wakes an idle worker at once (a job was created here).
    wake: Notify,
    /// Job settings, fetched once per job (and forgotten wholesale past `MAX_SPECS`).
    specs: Mutex<HashMap<String, Arc<JobSpec>>>,
    /// The attempts this process is working on: the only leases its heartbeat renews.
    held: Mutex<HashSet<Attempt>>,
    stop: Notify,
    /// When `stop` was called: past a lease after it, a store that is still away is given up
    /// on (the items go back to the queue by their leases running out).
    stopped_at: Mutex<Option<Instant>>,
}

const MAX_SPECS: usize = 1024;

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
            held: Mutex::new(HashSet::new()),
            stop: Notify::new(),
            stopped_at: Mutex::new(None),
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

    /// Stops claiming; `run` returns once the items in flight have their results (or, where
    /// the store is away, once it has been away for a lease since).
    pub fn stop(&self) {
        lock(&self.stopped_at).get_or_insert_with(Instant::now);
        self.stop.notify_one();
    }

    /// Whether to stop retrying a store that is away: stopping, and for longer than a lease.
    fn giving_up(&self) -> bool {
        lock(&self.stopped_at).is_some_and(|t| t.elapsed() > self.config.lease)
    }

    /// Runs until `stop`: claims, runs each claimed item with `run_item`, completes it (with
    /// `failed`'s result where `run_item` panics).
    pub async fn run<F, Fut>(self: Arc<Self>, run_item: F, failed: Failed)
    where
        F: Fn(Work) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Done> + Send + 'static,
    {
        let janitor = tokio::spawn(self.clone().janitor());
        if self.config.slots == 0 {
            // Takes no items: other processes on the store run them.
            self.stop.notified().await;
            janitor.abort();
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
                    tracing::warn!("quarry: job store: {e}; trying again in {backoff:?}");
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
            lock(&self.held).extend(claims.iter().map(|c| c.attempt.clone()));
            for claim in claims {
                let Ok(permit) = slots.clone().try_acquire_owned() else {
                    unreachable!("claimed no more than the free slots")
                };
                let (me, run_item) = (self.clone(), run_item.clone());
                tokio::spawn(async move {
                    me.work(claim, run_item.as_ref(), failed).await;
                    drop(permit);
                });
            }
        }
        // Every slot back: the items in flight have their results.
        let _ = slots.acquire_many(self.config.slots as u32).await;
        heartbeat.abort();
        janitor.abort();
        let (me, store) = (self.clone(), self.store.clone());
        if let Err(e) = blocking(move || store.release(&me.owner)).await {
            tracing::warn!("quarry: job store: {e}; this process's items go back when their leases run out");
        }
    }

    async fn work<F, Fut>(&self, claim: Claim, run_item: &F, failed: Failed)
    where
        F: Fn(Work) -> Fut,
        Fut: Future<Output = Done>,
    {
        let attempt = claim.attempt.clone();
        let job = match self.spec(&attempt.job_id).await {
            Some(job) => job,
            // The job row went away under its item (or the store did, as we stop): nothing
            // to run it with. Its lease is no longer renewed and runs out.
            None => {
                lock(&self.held).remove(&attempt);
                return;
            }
        };
        let running = run_item(Work {
            job: job.clone(),
            item_id: claim.item_id,
            payload: claim.payload,
            max_tokens: claim.max_tokens,
            cancelled: claim.cancelled,
        });
        // A runner that panics fails its item alone: otherwise the heartbeat would keep the
        // item leased to this process, unfinished, for as long as it lives.
        let done = match std::panic::AssertUnwindSafe(running).catch_unwind().await {
            Ok(done) => done,
            Err(_) => (false, failed(&job, "the item's runner failed")),
        };
        self.complete(attempt.clone(), done).await;
        lock(&self.held).remove(&attempt);
    }

    /// Writes the result, retrying while the store is away; gives up only when the store
    /// says the attempt is no longer ours, or when stopping has waited a lease for it.
    async fn complete(&self, attempt: Attempt, (ok, result): Done) {
        let result = Arc::new(result);
        let attempt = Arc::new(attempt);
        let mut backoff = Duration::from_millis(100);
        loop {
            let (store, owner, a, r) = (self.store.clone(), self.owner.clone(), attempt.clone(), result.clone());
            match blocking(move || store.complete(&owner, &a, ok, &r)).await {
                Ok(_) => return,
                Err(e) if self.giving_up() => {
                    tracing::warn!(
                        "quarry: job store: {e}; stopping without {} item {}'s result: the item runs again elsewhere",
                        attempt.job_id,
                        attempt.index
                    );
                    return;
                }
                Err(e) => {
                    tracing::warn!(
                        "quarry: job store: {e}; writing {} item {} again in {backoff:?}",
                        attempt.job_id,
                        attempt.index
                    );
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    async fn spec(&self, job_id: &str) -> Option<Arc<JobSpec>> {
        if let Some(s) = lock(&self.specs).get(job_id) {
            return Some(s.clone());
        }
        let mut backoff = Duration::from_millis(100);
        loop {
            let (store, id) = (self.store.clone(), job_id.to_string());
            match blocking(move || store.spec(&id)).await {
                Ok(spec) => {
                    let spec = Arc::new(spec?);
                    let mut specs = lock(&self.specs);
                    if specs.len() >= MAX_SPECS {
                        specs.clear();
                    }
                    specs.insert(job_id.to_string(), spec.clone());
                    return Some(spec);
                }
                Err(_) if self.giving_up() => return None,
                Err(e) => {
                    tracing::warn!("quarry: job store: {e}; trying again in {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// Deletes what is past the retention, at start and then every tenth of it (at most hourly).
    /// Every process on a store does it; deleting twice deletes nothing more.
    async fn janitor(self: Arc<Self>) {
        let Some(retention) = self.config.retention else { return };
        let every = (retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(3600));
        loop {
            let before = super::now_ms() - retention.as_millis().min(i64::MAX as u128) as i64;
            let store = self.store.clone();
            match blocking(move || store.expire(before)).await {
                Ok((0, 0)) => {}
                Ok((jobs, files)) => {
                    tracing::info!(
                        "quarry: job store: deleted {jobs} finished job(s) and {files} file(s) past the retention"
                    );
                    if jobs == 100 {
                        continue; // more are due: the next pass at once
                    }
                }
                Err(e) => tracing::warn!("quarry: job store: {e}; expired jobs not deleted"),
            }
            tokio::time::sleep(every).await;
        }
    }

    /// Renews the leases of the items in flight every third of a lease.
    async fn heartbeat(self: Arc<Self>) {
        let every = self.config.lease / 3;
        loop {
            tokio::time::sleep(every).await;
            let attempts: Vec<Attempt> = lock(&self.held).iter().cloned().collect();
            if attempts.is_empty() {
                continue;
            }
            let (store, owner, lease) = (self.store.clone(), self.owner.clone(), self.config.lease);
            if let Err(e) = blocking(move || store.heartbeat(&owner, &attempts, lease)).await {
                tracing::warn!("quarry: job store: {e}; leases not renewed");
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A store call off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(StoreError::Backend(format!("store call failed: {e}"))))
}
