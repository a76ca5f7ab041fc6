//! Durable batch jobs. A job is a schema and a list of items (documents); its items live in a
//! store that outlives the process, so a restart, a crash or a deploy loses nothing, and any
//! number of processes sharing the store work through the same jobs.
//!
//! Every item is claimed under a lease: its owner renews the lease while it works
//! (`Worker`'s heartbeat), and an item whose lease ran out (its owner died) is claimed again
//! by anyone. Each claim bumps the item's attempt number, and a result is written only by the
//! owner of the current attempt, in the transaction that marks the item done: a late writer
//! (a worker that stalled past its lease) is fenced out, so every item ends with exactly one
//! result.

pub mod postgres;
pub mod runners;
pub mod sqlite;
pub mod worker;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;
pub use worker::{Worker, WorkerConfig};

/// A job as it is submitted. The store keeps `kind`, `settings` and each item's payload as
/// given: what they mean is the runner's business (an extraction job's settings hold its
/// schema and its items' payloads are documents; a batch's items are request bodies).
#[derive(Debug, Clone)]
pub struct NewJob {
    pub id: String,
    pub kind: String,
    pub settings: Value,
    pub items: Vec<NewItem>,
}

impl NewJob {
    /// What no store may be handed: text with a NUL character (Postgres cannot keep one in
    /// `TEXT`; SQLite refuses it too, so a job means the same on either).
    pub fn check(&self) -> Result<()> {
        let nul = |what: &str, text: &str| match text.find('\0') {
            Some(at) => Err(StoreError::Invalid(format!(
                "{what} has a NUL character at byte {at}: remove it or escape it"
            ))),
            None => Ok(()),
        };
        nul("the job id", &self.id)?;
        nul("the job kind", &self.kind)?;
        for (i, item) in self.items.iter().enumerate() {
            nul(&format!("item {i}'s id"), &item.item_id)?;
            nul(&format!("item {i} ({:?})", item.item_id), &item.payload)?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
pub struct NewItem {
    /// The caller's name for the item (a record id, a batch line's `custom_id`).
    pub item_id: String,
    pub payload: String,
}

/// A job as stored.
#[derive(Debug, Clone)]
pub struct JobSpec {
    pub id: String,
    pub kind: String,
    pub settings: Value,
    pub created_ms: i64,
    /// When it was cancelled, if it was.
    pub cancelled_ms: Option<i64>,
}

/// A stored file (the OpenAI Files API: a batch's input).
#[derive(Debug, Clone)]
pub struct StoredFile {
    pub id: String,
    pub purpose: String,
    pub filename: String,
    pub bytes: Vec<u8>,
    pub created_ms: i64,
}

/// How a job's items stand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub queued: usize,
    pub running: usize,
    pub ok: usize,
    pub failed: usize,
}

impl Counts {
    pub fn total(&self) -> usize {
        self.queued + self.running + self.ok + self.failed
    }
}

/// One attempt at one item: what fences its result.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Attempt {
    pub job_id: String,
    pub index: usize,
    pub attempt: u32,
}

/// An item claimed for work.
#[derive(Debug, Clone)]
pub struct Claim {
    pub attempt: Attempt,
    pub item_id: String,
    pub payload: String,
    /// A retry's budget, over the job's.
    pub max_tokens: Option<usize>,
    /// The job was cancelled after this item was first claimed (its first worker died): the
    /// runner ends it as cancelled instead of running it.
    pub cancelled: bool,
}

/// What `delete` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// The job, its items and their results are gone.
    Deleted,
    /// Items are still queued or running: nothing was deleted.
    Busy,
    /// No such job.
    Missing,
}

/// An item's result as stored: whether it succeeded (for counts and retries), and what the
/// runner made of it.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemResult {
    pub item_id: String,
    pub ok: bool,
    pub result: Value,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("job store: {0}")]
    Backend(String),
    #[error("job store {location}: {message}")]
    Open { location: String, message: String },
    #[error("`{0}` exists already")]
    Duplicate(String),
    /// The caller's data cannot be stored as given (not the store's fault: a 400, not a 503).
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// Where jobs are kept. Every call is one short transaction; none is held open while an item
/// runs. The calls block: async callers go through `tokio::task::spawn_blocking`.
pub trait JobStore: Send + Sync {
    /// The job and all its items, queued, in one transaction.
    fn create(&self, job: &NewJob) -> Result<()>;
    fn spec(&self, job_id: &str) -> Result<Option<JobSpec>>;
    fn counts(&self, job_id: &str) -> Result<Option<Counts>>;
    /// Jobs of `kind`, newest first, at most `limit`, those created before `after` where given.
    fn list(&self, kind: &str, limit: usize, after: Option<&str>) -> Result<Vec<JobSpec>>;
    /// When the job's last result was written (milliseconds since the epoch), if any was.
    fn last_result_ms(&self, job_id: &str) -> Result<Option<i64>>;
    /// Up to `n` items for `owner`, leased until `lease` from now: queued ones first, in the
    /// order they were queued, then ones whose lease ran out.
    fn claim(&self, owner: &str, n: usize, lease: Duration) -> Result<Vec<Claim>>;
    /// Extends the leases of `attempts`, where `owner` still holds them, to `lease` from now;
    /// how many it still holds. Only the attempts named: an item claimed by a call whose
    /// answer was lost is not renewed, so it goes back to the queue when its lease runs out.
    fn heartbeat(&self, owner: &str, attempts: &[Attempt], lease: Duration) -> Result<usize>;
    /// The attempt's result, with the item marked done, if `owner` still holds that attempt;
    /// false (nothing written) where it does not.
    fn complete(&self, owner: &str, attempt: &Attempt, ok: bool, result: &Value) -> Result<bool>;
    /// The results of the items that have one, in input order, from item `from` on, at most
    /// `limit`, each with its item index.
    fn results(&self, job_id: &str, from: usize, limit: usize) -> Result<Vec<(usize, ItemResult)>>;
    /// The payloads of the job's items from index `from` up to (not including) `to`, whatever
    /// their state, by index.
    fn payloads(&self, job_id: &str, from: usize, to: usize) -> Result<Vec<(usize, String)>>;
    /// Queues the job's failed items again (with a new budget where given); how many.
    fn retry_failed(&self, job_id: &str, max_tokens: Option<usize>) -> Result<usize>;
    /// Marks the job cancelled and ends its queued items with `result` (not ok); items
    /// running finish as they would. How many were ended; `None` where the job had nothing
    /// left to run (it is finished, and stays as it was) or does not exist.
    fn cancel(&self, job_id: &str, result: &Value) -> Result<Option<usize>>;
    /// Queues again every item `owner` holds (it is shutting down).
    fn release(&self, owner: &str) -> Result<usize>;
    /// Deletes a finished job (none of its items queued or running) with its results.
    fn delete(&self, job_id: &str) -> Result<Deleted>;
    /// Deletes up to 100 of the finished jobs whose last result (or, with none, whose
    /// creation) came before `before_ms`, and the files created before it; how many jobs and
    /// files. Bounded, so no pass holds the store for long: call again while it deletes 100.
    fn expire(&self, before_ms: i64) -> Result<(usize, usize)>;
    fn put_file(&self, file: &StoredFile) -> Result<()>;
    fn file(&self, id: &str) -> Result<Option<StoredFile>>;
    /// Whether there was such a file.
    fn delete_file(&self, id: &str) -> Result<bool>;
}

/// Opens the store `location` names: a `postgres://` URL, `sqlite:PATH`, or nothing for
/// SQLite at `state_dir/jobs.sqlite3`.
pub fn open(location: Option<&str>, state_dir: &Path) -> Result<Arc<dyn JobStore>> {
    match location {
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            Ok(Arc::new(PostgresStore::open(url)?))
        }
        Some(path) => Ok(Arc::new(SqliteStore::open(Path::new(
            path.strip_prefix("sqlite:").unwrap_or(path),
        ))?)),
        None => {
            std::fs::create_dir_all(state_dir).map_err(|e| StoreError::Open {
                location: state_dir.display().to_string(),
                message: e.to_string(),
            })?;
            Ok(Arc::new(SqliteStore::open(&state_dir.join("jobs.sqlite3"))?))
        }
    }
}

/// `$XDG_DATA_HOME/quarry`, else `~/.local/share/quarry`, else `./quarry-state`.
pub fn default_state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("quarry");
    }
    match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        Some(home) => PathBuf::from(home).join(".local/share/quarry"),
        None => PathBuf::from("quarry-state"),
    }
}

/// An id no other process will pick: `prefix`, the clock and a random number.
pub fn new_id(prefix: &str) -> String {
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("{prefix}{millis:x}{:08x}", rand::random::<u32>())
}

/// Milliseconds since the epoch: lease expiries are compared across processes (and machines,
/// whose clocks are assumed to agree to well within a lease).
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
