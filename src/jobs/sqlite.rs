//! The default job store: one SQLite file (WAL, `synchronous=FULL`: a result the store has
//! acknowledged survives a power cut). Several processes on one machine may share the file;
//! SQLite serialises their writes.

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use super::{now_ms, Attempt, Claim, Counts, JobSpec, JobStore, NewJob, Result, StoreError};
use crate::extract::records::RecordResult;

/// Item states, as stored.
const QUEUED: i64 = 0;
const RUNNING: i64 = 1;
const DONE: i64 = 2;

/// Each entry moves the file's schema one version up (`PRAGMA user_version` is the version).
const MIGRATIONS: &[&str] = &[r#"
CREATE TABLE jobs (
    id TEXT PRIMARY KEY,
    schema_id TEXT NOT NULL,
    schema TEXT NOT NULL,
    max_tokens INTEGER,
    created_ms INTEGER NOT NULL
);
-- rowid is the queue order: jobs in the order they came, items in input order.
CREATE TABLE items (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    idx INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    document TEXT NOT NULL,
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
    PRIMARY KEY (job_id, idx)
);
"#];

pub struct SqliteStore {
    conn: Mutex<Connection>,
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
        conn.busy_timeout(Duration::from_secs(30))
            .map_err(|e| open_error(e.to_string()))?;
        conn.execute_batch("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;")
            .map_err(|e| open_error(e.to_string()))?;
        migrate(&conn).map_err(|e| open_error(e.to_string()))?;
        Ok(SqliteStore { conn: Mutex::new(conn) })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Brings the file's schema up to date, each step in its own transaction.
fn migrate(conn: &Connection) -> rusqlite::Result<()> {
    let version: usize = conn.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0))? as usize;
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(version) {
        conn.execute_batch(&format!(
            "BEGIN IMMEDIATE; {sql}; PRAGMA user_version = {}; COMMIT;",
            i + 1
        ))?;
    }
    Ok(())
}

fn to_i64(n: Option<usize>) -> Option<i64> {
    n.map(|n| n as i64)
}

impl JobStore for SqliteStore {
    fn create(&self, job: &NewJob) -> Result<()> {
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(backend)?;
        let inserted = tx
            .execute(
                "INSERT INTO jobs (id, schema_id, schema, max_tokens, created_ms) VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT (id) DO NOTHING",
                params![
                    job.id,
                    job.schema_id,
                    job.schema.to_string(),
                    to_i64(job.max_tokens),
                    now_ms()
                ],
            )
            .map_err(backend)?;
        if inserted == 0 {
            return Err(StoreError::DuplicateJob(job.id.clone()));
        }
        {
            let mut insert = tx
                .prepare("INSERT INTO items (job_id, idx, item_id, document, state) VALUES (?1, ?2, ?3, ?4, ?5)")
                .map_err(backend)?;
            for (i, item) in job.items.iter().enumerate() {
                insert
                    .execute(params![job.id, i as i64, item.id, item.document, QUEUED])
                    .map_err(backend)?;
            }
        }
        tx.commit().map_err(backend)
    }

    fn spec(&self, job_id: &str) -> Result<Option<JobSpec>> {
        let conn = self.conn();
        let row = conn
            .query_row(
                "SELECT schema_id, schema, max_tokens FROM jobs WHERE id = ?1",
                params![job_id],
                |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, Option<i64>>(2)?,
                    ))
                },
            )
            .optional()
            .map_err(backend)?;
        let Some((schema_id, schema, max_tokens)) = row else {
            return Ok(None);
        };
        let schema = serde_json::from_str(&schema).map_err(|e| StoreError::Backend(format!("job {job_id}: {e}")))?;
        Ok(Some(JobSpec {
            id: job_id.into(),
            schema_id,
            schema,
            max_tokens: max_tokens.map(|n| n as usize),
        }))
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
                     RETURNING job_id, idx, attempt, item_id, document, max_tokens",
                )
                .map_err(backend)?;
            let rows = stmt
                .query_map(
                    params![RUNNING, owner, now + lease.as_millis() as i64, QUEUED, now, n as i64],
                    |r| {
                        Ok(Claim {
                            attempt: Attempt {
                                job_id: r.get(0)?,
                                index: r.get::<_, i64>(1)? as usize,
                                attempt: r.get::<_, i64>(2)? as u32,
                            },
                            item_id: r.get(3)?,
                            document: r.get(4)?,
                            max_tokens: r.get::<_, Option<i64>>(5)?.map(|n| n as usize),
                        })
                    },
                )
                .map_err(backend)?;
            rows.collect::<rusqlite::Result<Vec<Claim>>>().map_err(backend)?
        };
        tx.commit().map_err(backend)?;
        Ok(claims)
    }

    fn heartbeat(&self, owner: &str, lease: Duration) -> Result<usize> {
        let expiry = now_ms() + lease.as_millis() as i64;
        self.conn()
            .execute(
                "UPDATE items SET lease_expiry = ?1 WHERE lease_owner = ?2 AND state = ?3",
                params![expiry, owner, RUNNING],
            )
            .map_err(backend)
    }

    fn complete(&self, owner: &str, a: &Attempt, result: &RecordResult) -> Result<bool> {
        let json = serde_json::to_string(result).map_err(|e| StoreError::Backend(e.to_string()))?;
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(backend)?;
        let marked = tx
            .execute(
                "UPDATE items SET state = ?1, ok = ?2, lease_owner = NULL, lease_expiry = NULL
                 WHERE job_id = ?3 AND idx = ?4 AND attempt = ?5 AND lease_owner = ?6 AND state = ?7",
                params![
                    DONE,
                    result.ok(),
                    a.job_id,
                    a.index as i64,
                    a.attempt as i64,
                    owner,
                    RUNNING
                ],
            )
            .map_err(backend)?;
        if marked == 0 {
            return Ok(false);
        }
        tx.execute(
            "INSERT INTO results (job_id, idx, attempt, result) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (job_id, idx) DO UPDATE SET attempt = excluded.attempt, result = excluded.result",
            params![a.job_id, a.index as i64, a.attempt as i64, json],
        )
        .map_err(backend)?;
        tx.commit().map_err(backend)?;
        Ok(true)
    }

    fn results(&self, job_id: &str, from: usize, limit: usize) -> Result<Vec<(usize, String, RecordResult)>> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT i.idx, i.item_id, r.result FROM items i JOIN results r ON r.job_id = i.job_id AND r.idx = i.idx
                 WHERE i.job_id = ?1 AND i.state = ?2 AND i.idx >= ?3 ORDER BY i.idx LIMIT ?4",
            )
            .map_err(backend)?;
        let rows = stmt
            .query_map(params![job_id, DONE, from as i64, limit as i64], |r| {
                Ok((
                    r.get::<_, i64>(0)? as usize,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                ))
            })
            .map_err(backend)?;
        let mut out = Vec::new();
        for row in rows {
            let (idx, id, json) = row.map_err(backend)?;
            let result = serde_json::from_str(&json)
                .map_err(|e| StoreError::Backend(format!("job {job_id} item {idx}: {e}")))?;
            out.push((idx, id, result));
        }
        Ok(out)
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
}
