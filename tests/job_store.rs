//! Both job stores against the same checks: claims under leases, a late writer fenced out by
//! the attempt number, exactly one result per item, retries, release on shutdown, and state
//! that outlives the process. SQLite in a temporary directory; Postgres in a throwaway cluster
//! (scripts/pg-throwaway), skipped with a message where Postgres is not installed.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use quarry::extract::records::{Record, RecordResult};
use quarry::jobs::{Counts, JobStore, NewJob, PostgresStore, SqliteStore, StoreError};

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        TempDir(std::env::temp_dir().join(format!("quarry-{tag}-{}-{nanos:x}", std::process::id())))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A throwaway Postgres cluster, stopped and removed on drop.
struct Cluster {
    dir: TempDir,
    url: String,
}

impl Cluster {
    fn start() -> Option<Cluster> {
        let dir = TempDir::new("pg");
        let out = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/pg-throwaway"))
            .arg("start")
            .arg(&dir.0)
            .output()
            .expect("run scripts/pg-throwaway");
        if out.status.code() == Some(3) {
            eprintln!(
                "skipping the Postgres store: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return None;
        }
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let url = String::from_utf8(out.stdout).unwrap().trim().to_string();
        Some(Cluster { dir, url })
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/pg-throwaway"))
            .arg("stop")
            .arg(&self.dir.0)
            .status();
    }
}

fn job(id: &str, n: usize) -> NewJob {
    NewJob {
        id: id.into(),
        schema_id: "s".into(),
        schema: serde_json::json!({"type": "object"}),
        max_tokens: Some(64),
        items: (0..n)
            .map(|i| Record {
                id: format!("item-{i}"),
                document: format!("document {i}"),
            })
            .collect(),
    }
}

fn result(ok: bool) -> RecordResult {
    match ok {
        true => RecordResult {
            outcome: "ok".into(),
            data: Some(serde_json::json!({"a": 1})),
            partial: None,
            error: None,
        },
        false => RecordResult::failed("truncated", "too long".into()),
    }
}

fn indices(claims: &[quarry::jobs::Claim]) -> Vec<usize> {
    let mut v: Vec<usize> = claims.iter().map(|c| c.attempt.index).collect();
    v.sort();
    v
}

/// The checks every store passes.
fn conformance(s: &dyn JobStore) {
    s.create(&job("j", 3)).unwrap();
    assert!(matches!(s.create(&job("j", 1)), Err(StoreError::DuplicateJob(_))));
    let long = Duration::from_secs(60);
    let a0 = s.claim("a", 1, long).unwrap();
    assert_eq!(indices(&a0), vec![0]);
    assert_eq!(a0[0].document, "document 0");
    assert_eq!(a0[0].item_id, "item-0");
    // a's claim on item 1 runs out at once.
    let a1 = s.claim("a", 1, Duration::from_millis(1)).unwrap();
    assert_eq!(indices(&a1), vec![1]);
    std::thread::sleep(Duration::from_millis(20));
    // b gets the queued item and the expired one; item 0 is still a's.
    let b = s.claim("b", 5, long).unwrap();
    assert_eq!(indices(&b), vec![1, 2]);
    assert!(s.claim("c", 5, long).unwrap().is_empty());
    let b1 = b.iter().find(|c| c.attempt.index == 1).unwrap();
    assert_eq!(b1.attempt.attempt, a1[0].attempt.attempt + 1);
    assert_eq!(
        s.counts("j").unwrap().unwrap(),
        Counts {
            running: 3,
            ..Default::default()
        }
    );

    // a finishes item 1 late: refused. b's result stands, once.
    assert!(!s.complete("a", &a1[0].attempt, &result(true)).unwrap());
    assert!(s.complete("b", &b1.attempt, &result(false)).unwrap());
    assert!(!s.complete("b", &b1.attempt, &result(true)).unwrap(), "done once");
    assert!(s.complete("a", &a0[0].attempt, &result(true)).unwrap());
    // Heartbeats count what an owner holds.
    assert_eq!(s.heartbeat("a", long).unwrap(), 0);
    assert_eq!(s.heartbeat("b", long).unwrap(), 1);

    let c = s.counts("j").unwrap().unwrap();
    assert_eq!((c.ok, c.failed, c.running, c.queued), (1, 1, 1, 0));
    let results = s.results("j", 0, 10).unwrap();
    assert_eq!(
        results.iter().map(|r| (r.0, r.1.as_str())).collect::<Vec<_>>(),
        vec![(0, "item-0"), (1, "item-1")]
    );
    assert_eq!(results[1].2, result(false));
    assert_eq!(s.results("j", 1, 10).unwrap().len(), 1, "paged by item index");

    // Retry queues the failed item with a new budget; b's shutdown queues item 2 again.
    assert_eq!(s.retry_failed("j", Some(128)).unwrap(), 1);
    assert_eq!(s.release("b").unwrap(), 1);
    let c = s.counts("j").unwrap().unwrap();
    assert_eq!((c.ok, c.failed, c.running, c.queued), (1, 0, 0, 2));
    assert_eq!(s.results("j", 0, 10).unwrap().len(), 1, "only done items have results");
    let redo = s.claim("c", 5, long).unwrap();
    assert_eq!(indices(&redo), vec![1, 2]);
    let budget = |i| redo.iter().find(|c| c.attempt.index == i).unwrap().max_tokens;
    assert_eq!((budget(1), budget(2)), (Some(128), None));
    for c in &redo {
        assert!(s.complete("c", &c.attempt, &result(true)).unwrap());
    }
    assert_eq!(s.counts("j").unwrap().unwrap().ok, 3);

    assert!(s.counts("nope").unwrap().is_none());
    assert!(s.spec("nope").unwrap().is_none());
    let spec = s.spec("j").unwrap().unwrap();
    assert_eq!(
        (spec.max_tokens, spec.schema["type"].as_str()),
        (Some(64), Some("object"))
    );
}

/// Claimers racing for the same items: each item goes to exactly one of them.
fn no_item_claimed_twice(open: impl Fn() -> Box<dyn JobStore> + Sync) {
    let s = open();
    s.create(&job("race", 400)).unwrap();
    let claimed: Vec<Vec<usize>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|w| {
                let open = &open;
                scope.spawn(move || {
                    let s = open();
                    let mut mine = Vec::new();
                    loop {
                        let got = s.claim(&format!("w{w}"), 7, Duration::from_secs(60)).unwrap();
                        if got.is_empty() {
                            return mine;
                        }
                        mine.extend(got.iter().map(|c| c.attempt.index));
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut all: Vec<usize> = claimed.concat();
    all.sort();
    assert_eq!(all, (0..400).collect::<Vec<_>>(), "every item once");
}

#[test]
fn sqlite_store() {
    let dir = TempDir::new("sqlite");
    std::fs::create_dir_all(&dir.0).unwrap();
    let path = dir.0.join("jobs.sqlite3");
    conformance(&SqliteStore::open(&path).unwrap());
    // Several processes (here: connections) may share the file.
    no_item_claimed_twice(|| Box::new(SqliteStore::open(&path).unwrap()));
    // As after a crash: the file alone has everything.
    let s = SqliteStore::open(&path).unwrap();
    assert_eq!(s.counts("j").unwrap().unwrap().ok, 3);
    assert_eq!(s.results("j", 0, 10).unwrap().len(), 3);
}

#[test]
fn postgres_store() {
    let Some(cluster) = Cluster::start() else { return };
    conformance(&PostgresStore::open(&cluster.url).unwrap());
    no_item_claimed_twice(|| Box::new(PostgresStore::open(&cluster.url).unwrap()));
    // Opening again migrates nothing and finds everything.
    let s = PostgresStore::open(&cluster.url).unwrap();
    assert_eq!(s.counts("j").unwrap().unwrap().ok, 3);
}

#[test]
fn an_unreachable_store_is_a_clear_error_at_open() {
    // Nothing listens on port 1.
    let err = PostgresStore::open("postgres://quarry:pw@127.0.0.1:1/quarry")
        .err()
        .unwrap();
    let message = err.to_string();
    assert!(message.contains("127.0.0.1:1") && !message.contains("pw"), "{message}");
    let err = SqliteStore::open(std::path::Path::new("/nonexistent-dir/jobs.sqlite3"))
        .err()
        .unwrap();
    assert!(err.to_string().contains("/nonexistent-dir/jobs.sqlite3"), "{err}");
}
