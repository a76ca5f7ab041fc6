//! The default job store: one SQLite file (WAL, `synchronous=FULL`: a result the store has
//! acknowledged survives a power cut). Several processes on one machine may share the file;
//! SQLite serialises their writes.

use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use serde_json::Value;

use super::{
    now_ms, Attempt, Claim, Counts, Deleted, ItemResult, JobSpec, JobStore, NewJob, Result, StoreError, StoredFile,
};

/// Item states, as stored.
const QUEUED: i64 = 0;
const RUNNING: i64 = 1;
const DONE: i64 = 2;

/// Each entry moves the file's schema one version up (`PRAGMA user_version` is the version).
const MIGRATIONS: &[&str] = &[r#"
CREATE TABLE jobs (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    settings TEXT NOT NULL,
    created_ms INTEGER NOT NULL,
    cancelled_ms INTEGER
);
CREATE INDEX jobs_by_kind ON jobs (kind, created_ms);
-- rowid is the queue order: jobs in the order they came, items in input order.
CREATE TABLE items (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    idx INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    payload TEXT NOT NULL,
    state INTEGER NOT NULL,
    ok INTEGER,
    lease_owner TEXT,
    lease_expiry INTEGER,
    attempt INTEGER NOT NULL DEFAULT 0,
    max_tokens INTEGER,
    UNIQUE (job_id, idx)
);
CREATE INDEX items_by_state ON items (state, lease_expiry);
CREATE INDEX items_by_owner ON items (lease_owner) WHERE lease_owner IS NOT NULL;
CREATE TABLE results (
    job_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    result TEXT NOT NULL,
    done_ms INTEGER NOT NULL,
    PRIMARY KEY (job_id, idx)
);
CREATE TABLE files (
    id TEXT PRIMARY KEY,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes BLOB NOT NULL,
    created_ms INTEGER NOT NULL
);
"#];

pub struct SqliteStore {
    conn: Mutex<Connection>,
}

/// How long a connection waits for another's lock.
const BUSY_WAIT: Duration = Duration::from_secs(30);

fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    )
}

fn backend(e: rusqlite::Error) -> StoreError {
    StoreError::Backend(e.to_string())
}

impl SqliteStore {
    pub fn open(path: &Path) -> Result<Self> {
        let open_error = |message: String| StoreError::Open {
            location: path.display().to_string(),
            message,
        };
        let conn = Connection::open(path).map_err(|e| open_error(e.to_string()))?;
        // Another process may hold the write lock for a moment.
        conn.busy_timeout(BUSY_WAIT).map_err(|e| open_error(e.to_string()))?;
        // Some waits SQLite answers with "busy" at once, without its busy handler: switching a
        // new file to WAL while another connection does the same, or a lock upgrade it judges
        // a deadlock. Those are tried again, within the same wait.
        let deadline = Instant::now() + BUSY_WAIT;
        loop {
            let set_up = conn
                .execute_batch("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;")
                .and_then(|()| migrate(&conn));
            match set_up {
                Ok(()) => break,
                Err(e) if is_busy(&e) && Instant::now() < deadline => {
                    if !conn.is_autocommit() {
                        let _ = conn.execute_batch("ROLLBACK");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(open_error(e.to_string())),
            }
        }
        Ok(SqliteStore { conn: Mutex::new(conn) })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Brings the file's schema up to date, each step in its own transaction. The version is read
/// inside the write transaction, so two processes opening a new file at once cannot both run
/// the same step.
fn migrate(conn: &Connection) -> rusqlite::Result<()> {
    loop {
        conn.execute_batch("BEGIN IMMEDIATE")?;
        let version = conn.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0))? as usize;
        let Some(sql) = MIGRATIONS.get(version) else {
            return conn.execute_batch("COMMIT");
        };
        let step = conn.execute_batch(&format!("{sql}; PRAGMA user_version = {};", version + 1));
        match step {
            Ok(()) => conn.execute_batch("COMMIT")?,
            Err(e) => {
                let _ = conn.execute_batch("ROLLBACK");
                return Err(e);
            }
        }
    }
}

fn to_i64(n: Option<usize>) -> Option<i64> {
    n.map(|n| n as i64)
}

impl JobStore for SqliteStore {
    fn create(&self, job: &NewJob) -> Result<()> {
        job.check()?;
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(backend)?;
        let inserted = tx
            .execute(
                "INSERT INTO jobs (id, kind, settings, created_ms) VALUES (?1, ?2, ?3, ?4) ON CONFLICT (id) DO NOTHING",
                params![job.id, job.kind, job.settings.to_string(), now_ms()],
            )
            .map_err(backend)?;
        if inserted == 0 {
            return Err(StoreError::Duplicate(job.id.clone()));
        }
        {
            let mut insert = tx
                .prepare("INSERT INTO items (job_id, idx, item_id, payload, state) VALUES (?1, ?2, ?3, ?4, ?5)")
                .map_err(backend)?;
            for (i, item) in job.items.iter().enumerate() {
                insert
                    .execute(params![job.id, i as i64, item.item_id, item.payload, QUEUED])
                    .map_err(backend)?;
            }
        }
        tx.commit().map_err(backend)
    }

    fn spec(&self, job_id: &str) -> Result<Option<JobSpec>> {
        let conn = self.conn();
        conn.query_row(
            "SELECT id, kind, settings, created_ms, cancelled_ms FROM jobs WHERE id = ?1",
            params![job_id],
            spec_row,
        )
        .optional()
        .map_err(backend)?
        .transpose()
    }

    fn list(&self, kind: &str, limit: usize, after: Option<&str>) -> Result<Vec<JobSpec>> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT id, kind, settings, created_ms, cancelled_ms FROM jobs
                 WHERE kind = ?1 AND (?2 IS NULL OR (created_ms, id) < (SELECT created_ms, id FROM jobs WHERE id = ?2))
                 ORDER BY created_ms DESC, id DESC LIMIT ?3",
            )
            .map_err(backend)?;
        let rows = stmt
            .query_map(params![kind, after, limit as i64], spec_row)
            .map_err(backend)?;
        rows.map(|r| r.map_err(backend).and_then(|spec| spec)).collect()
    }

    fn last_result_ms(&self, job_id: &str) -> Result<Option<i64>> {
        self.conn()
            .query_row(
                "SELECT MAX(done_ms) FROM results WHERE job_id = ?1",
                params![job_id],
                |r| r.get(0),
            )
            .map_err(backend)
    }

    fn counts(&self, job_id: &str) -> Result<Option<Counts>> {
        let conn = self.conn();
        let exists = conn
            .query_row("SELECT 1 FROM jobs WHERE id = ?1", params![job_id], |_| Ok(()))
            .optional()
            .map_err(backend)?;
        if exists.is_none() {
            return Ok(None);
        }
        let mut stmt = conn
            .prepare("SELECT state, ok, COUNT(*) FROM items WHERE job_id = ?1 GROUP BY state, ok")
            .map_err(backend)?;
        let rows = stmt
            .query_map(params![job_id], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Option<bool>>(1)?,
                    r.get::<_, i64>(2)? as usize,
                ))
            })
            .map_err(backend)?;
        let mut c = Counts::default();
        for row in rows {
            match row.map_err(backend)? {
                (QUEUED, _, n) => c.queued += n,
                (RUNNING, _, n) => c.running += n,
                (_, Some(true), n) => c.ok += n,
                (_, _, n) => c.failed += n,
            }
        }
        Ok(Some(c))
    }

    fn claim(&self, owner: &str, n: usize, lease: Duration) -> Result<Vec<Claim>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let now = now_ms();
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(backend)?;
        let claims = {
            let mut stmt = tx
                .prepare(
                    "UPDATE items SET state = ?1, lease_owner = ?2, lease_expiry = ?3, attempt = attempt + 1
                     WHERE rowid IN (
                         SELECT r FROM (
                             SELECT r, k FROM (
                                 SELECT rowid AS r, 0 AS k FROM items WHERE state = ?4 ORDER BY rowid LIMIT ?6)
                             UNION ALL
                             SELECT r, k FROM (
                                 SELECT rowid AS r, 1 AS k FROM items WHERE state = ?1 AND lease_expiry < ?5
                                 ORDER BY rowid LIMIT ?6)
                         ) ORDER BY k, r LIMIT ?6
                     )
                     RETURNING rowid, job_id, idx, attempt, item_id, payload, max_tokens,
                         (SELECT cancelled_ms IS NOT NULL FROM jobs WHERE jobs.id = items.job_id)",
                )
                .map_err(backend)?;
            let rows = stmt
                .query_map(
                    params![RUNNING, owner, now + lease.as_millis() as i64, QUEUED, now, n as i64],
                    |r| {
                        Ok((
                            r.get::<_, i64>(0)?,
                            Claim {
                                attempt: Attempt {
                                    job_id: r.get(1)?,
                                    index: r.get::<_, i64>(2)? as usize,
                                    attempt: r.get::<_, i64>(3)? as u32,
                                },
                                item_id: r.get(4)?,
                                payload: r.get(5)?,
                                max_tokens: r.get::<_, Option<i64>>(6)?.map(|n| n as usize),
                                cancelled: r.get::<_, Option<bool>>(7)?.unwrap_or(false),
                            },
                        ))
                    },
                )
                .map_err(backend)?;
            rows.collect::<rusqlite::Result<Vec<(i64, Claim)>>>().map_err(backend)?
        };
        tx.commit().map_err(backend)?;
        // RETURNING's order is not guaranteed: hand them out in queue order.
        let mut claims = claims;
        claims.sort_by_key(|c| c.0);
        Ok(claims.into_iter().map(|c| c.1).collect())
    }

    fn heartbeat(&self, owner: &str, attempts: &[Attempt], lease: Duration) -> Result<usize> {
        let expiry = now_ms() + lease.as_millis() as i64;
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(backend)?;
        let mut held = 0;
        {
            let mut renew = tx
                .prepare(
                    "UPDATE items SET lease_expiry = ?1
                     WHERE job_id = ?2 AND idx = ?3 AND attempt = ?4 AND lease_owner = ?5 AND state = ?6",
                )
                .map_err(backend)?;
            for a in attempts {
                held += renew
                    .execute(params![
                        expiry,
                        a.job_id,
                        a.index as i64,
                        a.attempt as i64,
                        owner,
                        RUNNING
                    ])
                    .map_err(backend)?;
            }
        }
        tx.commit().map_err(backend)?;
        Ok(held)
    }

    fn complete(&self, owner: &str, a: &Attempt, ok: bool, result: &Value) -> Result<bool> {
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(backend)?;
        let marked = tx
            .execute(
                "UPDATE items SET state = ?1, ok = ?2, lease_owner = NULL, lease_expiry = NULL
                 WHERE job_id = ?3 AND idx = ?4 AND attempt = ?5 AND lease_owner = ?6 AND state = ?7",
                params![DONE, ok, a.job_id, a.index as i64, a.attempt as i64, owner, RUNNING],
            )
            .map_err(backend)?;
        if marked == 0 {
            return Ok(false);
        }
        write_result(&tx, &a.job_id, a.index, a.attempt, result)?;
        tx.commit().map_err(backend)?;
        Ok(true)
    }

    fn results(&self, job_id: &str, from: usize, limit: usize) -> Result<Vec<(usize, ItemResult)>> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT i.idx, i.item_id, i.ok, r.result FROM items i JOIN results r ON r.job_id = i.job_id AND r.idx = i.idx
                 WHERE i.job_id = ?1 AND i.state = ?2 AND i.idx >= ?3 ORDER BY i.idx LIMIT ?4",
            )
            .map_err(backend)?;
        let rows = stmt
            .query_map(
                params![job_id, DONE, from as i64, limit.min(i64::MAX as usize) as i64],
                |r| {
                    Ok((
                        r.get::<_, i64>(0)? as usize,
                        r.get::<_, String>(1)?,
                        r.get::<_, bool>(2)?,
                        r.get::<_, String>(3)?,
                    ))
                },
            )
            .map_err(backend)?;
        let mut out = Vec::new();
        for row in rows {
            let (idx, item_id, ok, json) = row.map_err(backend)?;
            let result = serde_json::from_str(&json)
                .map_err(|e| StoreError::Backend(format!("job {job_id} item {idx}: {e}")))?;
            out.push((idx, ItemResult { item_id, ok, result }));
        }
        Ok(out)
    }

    fn payloads(&self, job_id: &str, from: usize, to: usize) -> Result<Vec<(usize, String)>> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare("SELECT idx, payload FROM items WHERE job_id = ?1 AND idx >= ?2 AND idx < ?3 ORDER BY idx")
            .map_err(backend)?;
        let rows = stmt
            .query_map(params![job_id, from as i64, to.min(i64::MAX as usize) as i64], |r| {
                Ok((r.get::<_, i64>(0)? as usize, r.get::<_, String>(1)?))
            })
            .map_err(backend)?;
        rows.map(|r| r.map_err(backend)).collect()
    }

    fn retry_failed(&self, job_id: &str, max_tokens: Option<usize>) -> Result<usize> {
        self.conn()
            .execute(
                "UPDATE items SET state = ?1, ok = NULL, max_tokens = COALESCE(?2, max_tokens)
                 WHERE job_id = ?3 AND state = ?4 AND ok = 0",
                params![QUEUED, to_i64(max_tokens), job_id, DONE],
            )
            .map_err(backend)
    }

    fn release(&self, owner: &str) -> Result<usize> {
        self.conn()
            .execute(
                "UPDATE items SET state = ?1, lease_owner = NULL, lease_expiry = NULL
                 WHERE lease_owner = ?2 AND state = ?3",
                params![QUEUED, owner, RUNNING],
            )
            .map_err(backend)
    }

    fn cancel(&self, job_id: &str, result: &Value) -> Result<Option<usize>> {
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(backend)?;
        let marked = tx
            .execute(
                "UPDATE jobs SET cancelled_ms = COALESCE(cancelled_ms, ?1)
                 WHERE id = ?2 AND EXISTS (SELECT 1 FROM items WHERE job_id = ?2 AND state IN (?3, ?4))",
                params![now_ms(), job_id, QUEUED, RUNNING],
            )
            .map_err(backend)?;
        if marked == 0 {
            return Ok(None);
        }
        let queued: Vec<(i64, i64)> = {
            let mut stmt = tx
                .prepare("SELECT idx, attempt FROM items WHERE job_id = ?1 AND state = ?2")
                .map_err(backend)?;
            let rows = stmt
                .query_map(params![job_id, QUEUED], |r| Ok((r.get(0)?, r.get(1)?)))
                .map_err(backend)?;
            rows.collect::<rusqlite::Result<_>>().map_err(backend)?
        };
        tx.execute(
            "UPDATE items SET state = ?1, ok = 0 WHERE job_id = ?2 AND state = ?3",
            params![DONE, job_id, QUEUED],
        )
        .map_err(backend)?;
        for &(idx, attempt) in &queued {
            write_result(&tx, job_id, idx as usize, attempt as u32, result)?;
        }
        tx.commit().map_err(backend)?;
        Ok(Some(queued.len()))
    }

    fn delete(&self, job_id: &str) -> Result<Deleted> {
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(backend)?;
        let exists = tx
            .query_row("SELECT 1 FROM jobs WHERE id = ?1", params![job_id], |_| Ok(()))
            .optional()
            .map_err(backend)?
            .is_some();
        if !exists {
            return Ok(Deleted::Missing);
        }
        let open: i64 = tx
            .query_row(
                "SELECT COUNT(*) FROM items WHERE job_id = ?1 AND state IN (?2, ?3)",
                params![job_id, QUEUED, RUNNING],
                |r| r.get(0),
            )
            .map_err(backend)?;
        if open > 0 {
            return Ok(Deleted::Busy);
        }
        delete_job(&tx, job_id)?;
        tx.commit().map_err(backend)?;
        Ok(Deleted::Deleted)
    }

    fn expire(&self, before_ms: i64) -> Result<(usize, usize)> {
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(backend)?;
        let ids: Vec<String> = {
            let mut stmt = tx
                .prepare(
                    "SELECT j.id FROM jobs j
                     WHERE NOT EXISTS (SELECT 1 FROM items i WHERE i.job_id = j.id AND i.state IN (?1, ?2))
                       AND COALESCE((SELECT MAX(r.done_ms) FROM results r WHERE r.job_id = j.id), j.created_ms) < ?3
                     LIMIT 100",
                )
                .map_err(backend)?;
            let rows = stmt
                .query_map(params![QUEUED, RUNNING, before_ms], |r| r.get(0))
                .map_err(backend)?;
            rows.collect::<rusqlite::Result<_>>().map_err(backend)?
        };
        for id in &ids {
            delete_job(&tx, id)?;
        }
        let files = tx
            .execute("DELETE FROM files WHERE created_ms < ?1", params![before_ms])
            .map_err(backend)?;
        tx.commit().map_err(backend)?;
        Ok((ids.len(), files))
    }

    fn delete_file(&self, id: &str) -> Result<bool> {
        let n = self
            .conn()
            .execute("DELETE FROM files WHERE id = ?1", params![id])
            .map_err(backend)?;
        Ok(n > 0)
    }

    fn put_file(&self, f: &StoredFile) -> Result<()> {
        let n = self
            .conn()
            .execute(
                "INSERT INTO files (id, purpose, filename, bytes, created_ms) VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT (id) DO NOTHING",
                params![f.id, f.purpose, f.filename, f.bytes, f.created_ms],
            )
            .map_err(backend)?;
        match n {
            0 => Err(StoreError::Duplicate(f.id.clone())),
            _ => Ok(()),
        }
    }

    fn file(&self, id: &str) -> Result<Option<StoredFile>> {
        self.conn()
            .query_row(
                "SELECT id, purpose, filename, bytes, created_ms FROM files WHERE id = ?1",
                params![id],
                |r| {
                    Ok(StoredFile {
                        id: r.get(0)?,
                        purpose: r.get(1)?,
                        filename: r.get(2)?,
                        bytes: r.get(3)?,
                        created_ms: r.get(4)?,
                    })
                },
            )
            .optional()
            .map_err(backend)
    }
}

fn delete_job(tx: &rusqlite::Transaction<'_>, job_id: &str) -> Result<()> {
    for sql in [
        "DELETE FROM results WHERE job_id = ?1",
        "DELETE FROM items WHERE job_id = ?1",
        "DELETE FROM jobs WHERE id = ?1",
    ] {
        tx.execute(sql, params![job_id]).map_err(backend)?;
    }
    Ok(())
}

fn write_result(tx: &rusqlite::Transaction<'_>, job_id: &str, idx: usize, attempt: u32, result: &Value) -> Result<()> {
    tx.execute(
        "INSERT INTO results (job_id, idx, attempt, result, done_ms) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT (job_id, idx) DO UPDATE SET attempt = excluded.attempt, result = excluded.result,
             done_ms = excluded.done_ms",
        params![job_id, idx as i64, attempt as i64, result.to_string(), now_ms()],
    )
    .map_err(backend)?;
    Ok(())
}

fn spec_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Result<JobSpec>> {
    let id: String = r.get(0)?;
    let settings: String = r.get(2)?;
    let settings = match serde_json::from_str(&settings) {
        Ok(v) => v,
        Err(e) => return Ok(Err(StoreError::Backend(format!("job {id}: {e}")))),
    };
    Ok(Ok(JobSpec {
        id,
        kind: r.get(1)?,
        settings,
        created_ms: r.get(3)?,
        cancelled_ms: r.get(4)?,
    }))
}
