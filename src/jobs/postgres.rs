//! The distributed job store: one Postgres database shared by every Quarry process that works
//! on the same jobs, on any number of machines. Items are claimed with `FOR UPDATE SKIP
//! LOCKED` in a short transaction (never held open while an item runs), so processes claiming
//! at once take different items without waiting on each other. A dropped connection is opened
//! again on the next call; the caller retries with backoff meanwhile.

use std::sync::Mutex;
use std::time::Duration;

use postgres::{Client, NoTls};

use postgres::{GenericClient, Row};
use serde_json::Value;

use super::{
    now_ms, Attempt, Claim, Counts, Deleted, ItemResult, JobSpec, JobStore, NewJob, Result, StoreError, StoredFile,
};

const QUEUED: i16 = 0;
const RUNNING: i16 = 1;
const DONE: i16 = 2;

/// Each entry moves the database one version up; `quarry_migrations` lists those applied.
const MIGRATIONS: &[&str] = &[r#"
CREATE TABLE quarry_jobs (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    settings TEXT NOT NULL,
    created_ms BIGINT NOT NULL,
    cancelled_ms BIGINT
);
CREATE INDEX quarry_jobs_by_kind ON quarry_jobs (kind, created_ms);
-- seq is the queue order: jobs in the order they came, items in input order.
CREATE TABLE quarry_items (
    seq BIGSERIAL PRIMARY KEY,
    job_id TEXT NOT NULL REFERENCES quarry_jobs (id),
    idx INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    payload TEXT NOT NULL,
    state SMALLINT NOT NULL,
    ok BOOLEAN,
    lease_owner TEXT,
    lease_expiry BIGINT,
    attempt INTEGER NOT NULL DEFAULT 0,
    max_tokens INTEGER,
    UNIQUE (job_id, idx)
);
CREATE INDEX quarry_items_by_state ON quarry_items (state, seq);
CREATE INDEX quarry_items_by_owner ON quarry_items (lease_owner) WHERE lease_owner IS NOT NULL;
CREATE TABLE quarry_results (
    job_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    result TEXT NOT NULL,
    done_ms BIGINT NOT NULL,
    PRIMARY KEY (job_id, idx)
);
CREATE TABLE quarry_files (
    id TEXT PRIMARY KEY,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes BYTEA NOT NULL,
    created_ms BIGINT NOT NULL
);
"#];

/// Any number to name the advisory lock that serialises migrations between processes.
const MIGRATION_LOCK: i64 = 0x5155_4152_5259;

pub struct PostgresStore {
    url: String,
    client: Mutex<Option<Client>>,
}

fn backend(e: postgres::Error) -> StoreError {
    StoreError::Backend(e.to_string())
}

impl PostgresStore {
    /// Connects and brings the database's tables up to date: an unreachable database is an
    /// error here, at start.
    pub fn open(url: &str) -> Result<Self> {
        let open_error = |e: postgres::Error| StoreError::Open {
            location: redact(url),
            message: e.to_string(),
        };
        let mut client = connect(url).map_err(open_error)?;
        migrate(&mut client).map_err(open_error)?;
        Ok(PostgresStore {
            url: url.to_string(),
            client: Mutex::new(Some(client)),
        })
    }

    /// Runs `f` on the connection, opening it again where it was lost.
    fn with<T>(&self, f: impl FnOnce(&mut Client) -> std::result::Result<T, postgres::Error>) -> Result<T> {
        let mut slot = self.client.lock().unwrap_or_else(|e| e.into_inner());
        if slot.as_ref().is_none_or(Client::is_closed) {
            *slot = Some(connect(&self.url).map_err(backend)?);
        }
        let client = slot.as_mut().expect("connected above");
        let result = f(client);
        if result.is_err() && client.is_closed() {
            *slot = None;
        }
        result.map_err(backend)
    }
}

fn connect(url: &str) -> std::result::Result<Client, postgres::Error> {
    let mut config: postgres::Config = url.parse()?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(10));
    }
    config.connect(NoTls)
}

/// The URL without its password, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

fn migrate(client: &mut Client) -> std::result::Result<(), postgres::Error> {
    let mut tx = client.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS quarry_migrations (version INTEGER PRIMARY KEY)")?;
    let applied: i32 = tx
        .query_one("SELECT COALESCE(MAX(version), 0) FROM quarry_migrations", &[])?
        .get(0);
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(applied as usize) {
        tx.batch_execute(sql)?;
        tx.execute(
            "INSERT INTO quarry_migrations (version) VALUES ($1)",
            &[&(i as i32 + 1)],
        )?;
    }
    tx.commit()
}

fn int(n: Option<usize>) -> Option<i32> {
    n.map(|n| n.min(i32::MAX as usize) as i32)
}

impl JobStore for PostgresStore {
    fn create(&self, job: &NewJob) -> Result<()> {
        job.check()?;
        let inserted = self.with(|c| {
            let mut tx = c.transaction()?;
            let n = tx.execute(
                "INSERT INTO quarry_jobs (id, kind, settings, created_ms) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (id) DO NOTHING",
                &[&job.id, &job.kind, &job.settings.to_string(), &now_ms()],
            )?;
            if n == 0 {
                return Ok(false);
            }
            let insert = tx.prepare(
                "INSERT INTO quarry_items (job_id, idx, item_id, payload, state) VALUES ($1, $2, $3, $4, $5)",
            )?;
            for (i, item) in job.items.iter().enumerate() {
                tx.execute(&insert, &[&job.id, &(i as i32), &item.item_id, &item.payload, &QUEUED])?;
            }
            tx.commit()?;
            Ok(true)
        })?;
        match inserted {
            true => Ok(()),
            false => Err(StoreError::Duplicate(job.id.clone())),
        }
    }

    fn spec(&self, job_id: &str) -> Result<Option<JobSpec>> {
        let row = self.with(|c| {
            c.query_opt(
                "SELECT id, kind, settings, created_ms, cancelled_ms FROM quarry_jobs WHERE id = $1",
                &[&job_id],
            )
        })?;
        row.map(|r| spec_row(&r)).transpose()
    }

    fn list(&self, kind: &str, limit: usize, after: Option<&str>) -> Result<Vec<JobSpec>> {
        let rows = self.with(|c| {
            c.query(
                "SELECT id, kind, settings, created_ms, cancelled_ms FROM quarry_jobs
                 WHERE kind = $1 AND ($2::TEXT IS NULL
                     OR (created_ms, id) < (SELECT created_ms, id FROM quarry_jobs WHERE id = $2))
                 ORDER BY created_ms DESC, id DESC LIMIT $3",
                &[&kind, &after, &(limit.min(i64::MAX as usize) as i64)],
            )
        })?;
        rows.iter().map(spec_row).collect()
    }

    fn last_result_ms(&self, job_id: &str) -> Result<Option<i64>> {
        self.with(|c| {
            c.query_one("SELECT MAX(done_ms) FROM quarry_results WHERE job_id = $1", &[&job_id])
                .map(|r| r.get(0))
        })
    }

    fn counts(&self, job_id: &str) -> Result<Option<Counts>> {
        let rows = self.with(|c| {
            if c.query_opt("SELECT 1 FROM quarry_jobs WHERE id = $1", &[&job_id])?
                .is_none()
            {
                return Ok(None);
            }
            c.query(
                "SELECT state, ok, COUNT(*) FROM quarry_items WHERE job_id = $1 GROUP BY state, ok",
                &[&job_id],
            )
            .map(Some)
        })?;
        let Some(rows) = rows else { return Ok(None) };
        let mut counts = Counts::default();
        for row in rows {
            let n = row.get::<_, i64>(2) as usize;
            match (row.get::<_, i16>(0), row.get::<_, Option<bool>>(1)) {
                (QUEUED, _) => counts.queued += n,
                (RUNNING, _) => counts.running += n,
                (_, Some(true)) => counts.ok += n,
                _ => counts.failed += n,
            }
        }
        Ok(Some(counts))
    }

    fn claim(&self, owner: &str, n: usize, lease: Duration) -> Result<Vec<Claim>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let now = now_ms();
        let expiry = now + lease.as_millis() as i64;
        let rows = self.with(|c| {
            c.query(
                "WITH picked AS (
                     SELECT seq FROM quarry_items
                     WHERE state = $1 OR (state = $2 AND lease_expiry < $3)
                     ORDER BY state, seq LIMIT $4
                     FOR UPDATE SKIP LOCKED
                 )
                 UPDATE quarry_items i
                 SET state = $2, lease_owner = $5, lease_expiry = $6, attempt = i.attempt + 1
                 FROM picked WHERE i.seq = picked.seq
                 RETURNING i.seq, i.job_id, i.idx, i.attempt, i.item_id, i.payload, i.max_tokens,
                     (SELECT j.cancelled_ms IS NOT NULL FROM quarry_jobs j WHERE j.id = i.job_id)",
                &[&QUEUED, &RUNNING, &now, &(n as i64), &owner, &expiry],
            )
        })?;
        let mut claims: Vec<(i64, Claim)> = rows
            .into_iter()
            .map(|r| {
                (
                    r.get::<_, i64>(0),
                    Claim {
                        attempt: Attempt {
                            job_id: r.get(1),
                            index: r.get::<_, i32>(2) as usize,
                            attempt: r.get::<_, i32>(3) as u32,
                        },
                        item_id: r.get(4),
                        payload: r.get(5),
                        max_tokens: r.get::<_, Option<i32>>(6).map(|n| n as usize),
                        cancelled: r.get::<_, Option<bool>>(7).unwrap_or(false),
                    },
                )
            })
            .collect();
        claims.sort_by_key(|c| c.0);
        Ok(claims.into_iter().map(|c| c.1).collect())
    }

    fn heartbeat(&self, owner: &str, attempts: &[Attempt], lease: Duration) -> Result<usize> {
        if attempts.is_empty() {
            return Ok(0);
        }
        let expiry = now_ms() + lease.as_millis() as i64;
        let jobs: Vec<&str> = attempts.iter().map(|a| a.job_id.as_str()).collect();
        let indices: Vec<i32> = attempts.iter().map(|a| a.index as i32).collect();
        let numbers: Vec<i32> = attempts.iter().map(|a| a.attempt as i32).collect();
        let n = self.with(|c| {
            c.execute(
                "UPDATE quarry_items i SET lease_expiry = $1
                 FROM unnest($2::text[], $3::int[], $4::int[]) AS a(job_id, idx, attempt)
                 WHERE i.job_id = a.job_id AND i.idx = a.idx AND i.attempt = a.attempt
                     AND i.lease_owner = $5 AND i.state = $6",
                &[&expiry, &jobs, &indices, &numbers, &owner, &RUNNING],
            )
        })?;
        Ok(n as usize)
    }

    fn complete(&self, owner: &str, a: &Attempt, ok: bool, result: &Value) -> Result<bool> {
        self.with(|c| {
            let mut tx = c.transaction()?;
            let marked = tx.execute(
                "UPDATE quarry_items SET state = $1, ok = $2, lease_owner = NULL, lease_expiry = NULL
                 WHERE job_id = $3 AND idx = $4 AND attempt = $5 AND lease_owner = $6 AND state = $7",
                &[
                    &DONE,
                    &ok,
                    &a.job_id,
                    &(a.index as i32),
                    &(a.attempt as i32),
                    &owner,
                    &RUNNING,
                ],
            )?;
            if marked == 0 {
                return Ok(false);
            }
            write_result(&mut tx, &a.job_id, a.index, a.attempt, result)?;
            tx.commit()?;
            Ok(true)
        })
    }

    fn results(&self, job_id: &str, from: usize, limit: usize) -> Result<Vec<(usize, ItemResult)>> {
        let rows = self.with(|c| {
            c.query(
                "SELECT i.idx, i.item_id, i.ok, r.result FROM quarry_items i
                 JOIN quarry_results r ON r.job_id = i.job_id AND r.idx = i.idx
                 WHERE i.job_id = $1 AND i.state = $2 AND i.idx >= $3 ORDER BY i.idx LIMIT $4",
                &[&job_id, &DONE, &(from as i32), &(limit.min(i64::MAX as usize) as i64)],
            )
        })?;
        rows.into_iter()
            .map(|r| {
                let idx = r.get::<_, i32>(0) as usize;
                let json: String = r.get(3);
                let result = serde_json::from_str(&json)
                    .map_err(|e| StoreError::Backend(format!("job {job_id} item {idx}: {e}")))?;
                Ok((
                    idx,
                    ItemResult {
                        item_id: r.get(1),
                        ok: r.get(2),
                        result,
                    },
                ))
            })
            .collect()
    }

    fn payloads(&self, job_id: &str, from: usize, to: usize) -> Result<Vec<(usize, String)>> {
        let rows = self.with(|c| {
            c.query(
                "SELECT idx, payload FROM quarry_items WHERE job_id = $1 AND idx >= $2 AND idx < $3 ORDER BY idx",
                &[
                    &job_id,
                    &(from.min(i32::MAX as usize) as i32),
                    &(to.min(i32::MAX as usize) as i32),
                ],
            )
        })?;
        Ok(rows
            .into_iter()
            .map(|r| (r.get::<_, i32>(0) as usize, r.get(1)))
            .collect())
    }

    fn retry_failed(&self, job_id: &str, max_tokens: Option<usize>) -> Result<usize> {
        let n = self.with(|c| {
            let mut tx = c.transaction()?;
            // Shares the job row's lock with `delete` and `expire` (which take it FOR UPDATE):
            // a job is not deleted under items being queued again.
            tx.query_opt("SELECT 1 FROM quarry_jobs WHERE id = $1 FOR SHARE", &[&job_id])?;
            let n = tx.execute(
                "UPDATE quarry_items SET state = $1, ok = NULL, max_tokens = COALESCE($2, max_tokens)
                 WHERE job_id = $3 AND state = $4 AND ok = false",
                &[&QUEUED, &int(max_tokens), &job_id, &DONE],
            )?;
            tx.commit()?;
            Ok(n)
        })?;
        Ok(n as usize)
    }

    fn release(&self, owner: &str) -> Result<usize> {
        let n = self.with(|c| {
            c.execute(
                "UPDATE quarry_items SET state = $1, lease_owner = NULL, lease_expiry = NULL
                 WHERE lease_owner = $2 AND state = $3",
                &[&QUEUED, &owner, &RUNNING],
            )
        })?;
        Ok(n as usize)
    }

    fn cancel(&self, job_id: &str, result: &Value) -> Result<Option<usize>> {
        self.with(|c| {
            let mut tx = c.transaction()?;
            let marked = tx.execute(
                "UPDATE quarry_jobs SET cancelled_ms = COALESCE(cancelled_ms, $1)
                 WHERE id = $2 AND EXISTS (
                     SELECT 1 FROM quarry_items WHERE job_id = $2 AND state IN ($3, $4))",
                &[&now_ms(), &job_id, &QUEUED, &RUNNING],
            )?;
            if marked == 0 {
                return Ok(None);
            }
            let ended = tx.query(
                "UPDATE quarry_items SET state = $1, ok = false WHERE job_id = $2 AND state = $3 RETURNING idx, attempt",
                &[&DONE, &job_id, &QUEUED],
            )?;
            for r in &ended {
                write_result(&mut tx, job_id, r.get::<_, i32>(0) as usize, r.get::<_, i32>(1) as u32, result)?;
            }
            tx.commit()?;
            Ok(Some(ended.len()))
        })
    }

    fn delete(&self, job_id: &str) -> Result<Deleted> {
        self.with(|c| {
            let mut tx = c.transaction()?;
            // Locks the job row: `retry_failed` waits for it (FOR SHARE), so no item is
            // queued again meanwhile.
            if tx
                .query_opt("SELECT 1 FROM quarry_jobs WHERE id = $1 FOR UPDATE", &[&job_id])?
                .is_none()
            {
                return Ok(Deleted::Missing);
            }
            let open: i64 = tx
                .query_one(
                    "SELECT COUNT(*) FROM quarry_items WHERE job_id = $1 AND state IN ($2, $3)",
                    &[&job_id, &QUEUED, &RUNNING],
                )?
                .get(0);
            if open > 0 {
                return Ok(Deleted::Busy);
            }
            delete_job(&mut tx, job_id)?;
            tx.commit()?;
            Ok(Deleted::Deleted)
        })
    }

    fn expire(&self, before_ms: i64) -> Result<(usize, usize)> {
        self.with(|c| {
            let mut tx = c.transaction()?;
            let ids: Vec<String> = tx
                .query(
                    "SELECT j.id FROM quarry_jobs j
                     WHERE NOT EXISTS (
                         SELECT 1 FROM quarry_items i WHERE i.job_id = j.id AND i.state IN ($1, $2))
                       AND COALESCE(
                         (SELECT MAX(r.done_ms) FROM quarry_results r WHERE r.job_id = j.id), j.created_ms) < $3
                     LIMIT 100
                     FOR UPDATE SKIP LOCKED",
                    &[&QUEUED, &RUNNING, &before_ms],
                )?
                .iter()
                .map(|r| r.get(0))
                .collect();
            for id in &ids {
                delete_job(&mut tx, id)?;
            }
            let files = tx.execute("DELETE FROM quarry_files WHERE created_ms < $1", &[&before_ms])?;
            tx.commit()?;
            Ok((ids.len(), files as usize))
        })
    }

    fn delete_file(&self, id: &str) -> Result<bool> {
        let n = self.with(|c| c.execute("DELETE FROM quarry_files WHERE id = $1", &[&id]))?;
        Ok(n > 0)
    }

    fn put_file(&self, f: &StoredFile) -> Result<()> {
        let n = self.with(|c| {
            c.execute(
                "INSERT INTO quarry_files (id, purpose, filename, bytes, created_ms) VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (id) DO NOTHING",
                &[&f.id, &f.purpose, &f.filename, &f.bytes, &f.created_ms],
            )
        })?;
        match n {
            0 => Err(StoreError::Duplicate(f.id.clone())),
            _ => Ok(()),
        }
    }

    fn file(&self, id: &str) -> Result<Option<StoredFile>> {
        let row = self.with(|c| {
            c.query_opt(
                "SELECT id, purpose, filename, bytes, created_ms FROM quarry_files WHERE id = $1",
                &[&id],
            )
        })?;
        Ok(row.map(|r| StoredFile {
            id: r.get(0),
            purpose: r.get(1),
            filename: r.get(2),
            bytes: r.get(3),
            created_ms: r.get(4),
        }))
    }
}

fn delete_job(tx: &mut postgres::Transaction<'_>, job_id: &str) -> std::result::Result<(), postgres::Error> {
    for sql in [
        "DELETE FROM quarry_results WHERE job_id = $1",
        "DELETE FROM quarry_items WHERE job_id = $1",
        "DELETE FROM quarry_jobs WHERE id = $1",
    ] {
        tx.execute(sql, &[&job_id])?;
    }
    Ok(())
}

fn write_result(
    tx: &mut impl GenericClient,
    job_id: &str,
    idx: usize,
    attempt: u32,
    result: &Value,
) -> std::result::Result<(), postgres::Error> {
    tx.execute(
        "INSERT INTO quarry_results (job_id, idx, attempt, result, done_ms) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (job_id, idx) DO UPDATE SET attempt = excluded.attempt, result = excluded.result,
             done_ms = excluded.done_ms",
        &[
            &job_id,
            &(idx as i32),
            &(attempt as i32),
            &result.to_string(),
            &now_ms(),
        ],
    )?;
    Ok(())
}

fn spec_row(r: &Row) -> Result<JobSpec> {
    let id: String = r.get(0);
    let settings: String = r.get(2);
    let settings = serde_json::from_str(&settings).map_err(|e| StoreError::Backend(format!("job {id}: {e}")))?;
    Ok(JobSpec {
        id,
        kind: r.get(1),
        settings,
        created_ms: r.get(3),
        cancelled_ms: r.get(4),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn passwords_stay_out_of_messages() {
        assert_eq!(
            super::redact("postgres://quarry:secret@db:5432/jobs"),
            "postgres://quarry:***@db:5432/jobs"
        );
        assert_eq!(super::redact("postgres://db/jobs"), "postgres://db/jobs");
    }
}
