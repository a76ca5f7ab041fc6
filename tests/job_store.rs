//! Both job stores against the same checks: claims under leases, a late writer fenced out by
//! the attempt number, exactly one result per item, retries, release on shutdown, and state
//! that outlives the process. SQLite in a temporary directory; Postgres in a throwaway cluster
//! (scripts/pg-throwaway), skipped with a message where Postgres is not installed.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use quarry::jobs::{
    now_ms, Counts, Deleted, JobStore, NewItem, NewJob, PostgresStore, SqliteStore, StoreError, StoredFile,
};

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

impl Cluster {
    /// `scripts/pg-throwaway down|up`: the server stops (as if the database went away), or
    /// starts again on the same port.
    fn set(&self, state: &str) {
        let ok = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/pg-throwaway"))
            .arg(state)
            .arg(&self.dir.0)
            .status()
            .unwrap()
            .success();
        assert!(ok, "pg-throwaway {state}");
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
        kind: "test".into(),
        settings: json!({"max_tokens": 64}),
        items: (0..n)
            .map(|i| NewItem {
                item_id: format!("item-{i}"),
                payload: format!("document {i}"),
            })
            .collect(),
    }
}

fn result(ok: bool) -> (bool, Value) {
    match ok {
        true => (true, json!({"outcome": "ok", "data": {"a": 1}})),
        false => (false, json!({"outcome": "truncated"})),
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
    assert!(matches!(s.create(&job("j", 1)), Err(StoreError::Duplicate(_))));
    let long = Duration::from_secs(60);
    let a0 = s.claim("a", 1, long).unwrap();
    assert_eq!(indices(&a0), vec![0]);
    assert_eq!(a0[0].payload, "document 0");
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
    assert!(!s
        .complete("a", &a1[0].attempt, result(true).0, &result(true).1)
        .unwrap());
    assert!(s.complete("b", &b1.attempt, result(false).0, &result(false).1).unwrap());
    assert!(
        !s.complete("b", &b1.attempt, result(true).0, &result(true).1).unwrap(),
        "done once"
    );
    assert!(s
        .complete("a", &a0[0].attempt, result(true).0, &result(true).1)
        .unwrap());
    // Heartbeats renew the attempts named, where their owner still holds them: a's are
    // done or taken; b's item 2 is renewed, and so nothing b did not name.
    let a_all: Vec<_> = a0.iter().chain(&a1).map(|c| c.attempt.clone()).collect();
    assert_eq!(s.heartbeat("a", &a_all, long).unwrap(), 0);
    let b_all: Vec<_> = b.iter().map(|c| c.attempt.clone()).collect();
    assert_eq!(s.heartbeat("b", &b_all, long).unwrap(), 1);
    assert_eq!(s.heartbeat("b", &[], long).unwrap(), 0);
    assert_eq!(s.heartbeat("c", &b_all, long).unwrap(), 0, "not c's leases");

    let c = s.counts("j").unwrap().unwrap();
    assert_eq!((c.ok, c.failed, c.running, c.queued), (1, 1, 1, 0));
    let results = s.results("j", 0, 10).unwrap();
    assert_eq!(
        results
            .iter()
            .map(|r| (r.0, r.1.item_id.as_str(), r.1.ok))
            .collect::<Vec<_>>(),
        vec![(0, "item-0", true), (1, "item-1", false)]
    );
    assert_eq!(results[1].1.result, result(false).1);
    assert_eq!(s.results("j", 1, 10).unwrap().len(), 1, "paged by item index");
    // Payloads by index, whatever the items' state, within the range asked.
    let payloads = s.payloads("j", 1, 3).unwrap();
    assert_eq!(
        payloads.iter().map(|p| p.0).collect::<Vec<_>>(),
        vec![1, 2],
        "{payloads:?}"
    );
    let want = job("j", 3);
    assert_eq!(payloads[0].1, want.items[1].payload);
    assert_eq!(payloads[1].1, want.items[2].payload);
    assert!(s.payloads("nope", 0, 10).unwrap().is_empty());

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
        assert!(s.complete("c", &c.attempt, result(true).0, &result(true).1).unwrap());
    }
    assert_eq!(s.counts("j").unwrap().unwrap().ok, 3);

    assert!(s.counts("nope").unwrap().is_none());
    assert!(s.spec("nope").unwrap().is_none());
    let spec = s.spec("j").unwrap().unwrap();
    assert_eq!(
        (spec.kind.as_str(), spec.settings["max_tokens"].as_u64()),
        ("test", Some(64))
    );
    assert!(spec.cancelled_ms.is_none());
    assert!(s.last_result_ms("j").unwrap().unwrap() >= spec.created_ms);

    // Cancelling ends the queued items with the given result; a running one finishes, and
    // one whose worker died (its lease ran out) comes back marked cancelled, not to be run.
    s.create(&job("k", 4)).unwrap();
    let running = s.claim("d", 1, long).unwrap();
    let dead = s.claim("d2", 1, Duration::from_millis(1)).unwrap();
    assert!(!dead[0].cancelled);
    let cancelled = json!({"outcome": "cancelled"});
    assert_eq!(s.cancel("k", &cancelled).unwrap(), Some(2));
    assert!(s.spec("k").unwrap().unwrap().cancelled_ms.is_some());
    std::thread::sleep(Duration::from_millis(20));
    let again = s.claim("e", 5, long).unwrap();
    assert_eq!(indices(&again), vec![dead[0].attempt.index]);
    assert!(again[0].cancelled, "claimed after its job was cancelled");
    assert!(s.complete("e", &again[0].attempt, false, &cancelled).unwrap());
    assert!(s
        .complete("d", &running[0].attempt, true, &json!({"outcome": "ok"}))
        .unwrap());
    let c = s.counts("k").unwrap().unwrap();
    assert_eq!((c.ok, c.failed), (1, 3));
    assert_eq!(s.results("k", 2, 10).unwrap()[0].1.result, cancelled);
    // A job with nothing left to run is not cancelled (a finished one stays finished).
    assert_eq!(s.cancel("k", &cancelled).unwrap(), None);
    assert_eq!(s.cancel("nope", &cancelled).unwrap(), None);
    s.create(&job("done", 1)).unwrap();
    let only = s.claim("f", 1, long).unwrap();
    assert!(s.complete("f", &only[0].attempt, true, &json!({})).unwrap());
    assert_eq!(s.cancel("done", &cancelled).unwrap(), None);
    assert!(s.spec("done").unwrap().unwrap().cancelled_ms.is_none());

    // Text no store can keep is the caller's error, named, and nothing is created.
    let mut nul = job("nul", 2);
    nul.items[1].payload = "a\0b".into();
    match s.create(&nul) {
        Err(StoreError::Invalid(m)) => assert!(m.contains("item 1") && m.contains("NUL"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(s.spec("nul").unwrap().is_none());

    // Listing: newest first, paged by the last id seen, one kind at a time.
    let listed: Vec<String> = s.list("test", 10, None).unwrap().into_iter().map(|j| j.id).collect();
    assert_eq!(listed.len(), 3);
    assert_eq!(s.list("test", 1, Some(&listed[0])).unwrap()[0].id, listed[1]);
    assert!(s.list("other", 10, None).unwrap().is_empty());

    // Files keep their bytes, and an id once.
    let f = StoredFile {
        id: "file-1".into(),
        purpose: "batch".into(),
        filename: "in.jsonl".into(),
        bytes: b"{\"a\": 1}\n\x00\xff".to_vec(),
        created_ms: 1,
    };
    s.put_file(&f).unwrap();
    assert!(matches!(s.put_file(&f), Err(StoreError::Duplicate(_))));
    let back = s.file("file-1").unwrap().unwrap();
    assert_eq!(
        (back.bytes, back.filename, back.purpose),
        (f.bytes, f.filename, f.purpose)
    );
    assert!(s.file("file-2").unwrap().is_none());
}

/// Deleting a job, by hand or past the retention: only finished ones, with their results;
/// old files go too.
fn deletion(s: &dyn JobStore) {
    let long = Duration::from_secs(60);
    assert_eq!(s.delete("del-nope").unwrap(), Deleted::Missing);
    s.create(&job("del", 2)).unwrap();
    let out = s.claim("g", 2, long).unwrap();
    assert_eq!(out.len(), 2);
    assert_eq!(s.delete("del").unwrap(), Deleted::Busy, "items still running");
    assert!(s.spec("del").unwrap().is_some());
    for c in &out {
        assert!(s.complete("g", &c.attempt, true, &json!({"n": 1})).unwrap());
    }
    assert_eq!(s.delete("del").unwrap(), Deleted::Deleted);
    assert!(s.spec("del").unwrap().is_none() && s.counts("del").unwrap().is_none());
    assert!(s.results("del", 0, 10).unwrap().is_empty());
    assert_eq!(s.delete("del").unwrap(), Deleted::Missing);

    // Past the retention: the job finished before the cutoff goes; one with an item still
    // running stays, and so does one finished after the cutoff.
    s.create(&job("old", 1)).unwrap();
    let c = s.claim("g", 1, long).unwrap();
    assert!(s.complete("g", &c[0].attempt, true, &json!({})).unwrap());
    s.create(&job("running", 1)).unwrap();
    assert_eq!(s.claim("h", 1, long).unwrap().len(), 1);
    let file = |id: &str, created_ms| StoredFile {
        id: id.into(),
        purpose: "batch".into(),
        filename: "f.jsonl".into(),
        bytes: b"{}".to_vec(),
        created_ms,
    };
    s.put_file(&file("old-file", 5)).unwrap();
    s.put_file(&file("new-file", now_ms() + 60_000)).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let cutoff = now_ms();
    std::thread::sleep(Duration::from_millis(5));
    s.create(&job("late", 1)).unwrap();
    let c = s.claim("g", 1, long).unwrap();
    assert!(s.complete("g", &c[0].attempt, true, &json!({})).unwrap());
    let (jobs, files) = s.expire(cutoff).unwrap();
    assert!(jobs >= 1 && files >= 1, "{jobs} {files}");
    assert!(s.spec("old").unwrap().is_none(), "finished before the cutoff");
    assert!(s.spec("running").unwrap().is_some() && s.spec("late").unwrap().is_some());
    assert!(s.file("old-file").unwrap().is_none() && s.file("new-file").unwrap().is_some());
    assert!(s.delete_file("new-file").unwrap());
    assert!(!s.delete_file("new-file").unwrap());
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
    deletion(&SqliteStore::open(&dir.0.join("deletion.sqlite3")).unwrap());
}

#[test]
fn postgres_store() {
    let Some(cluster) = Cluster::start() else { return };
    conformance(&PostgresStore::open(&cluster.url).unwrap());
    no_item_claimed_twice(|| Box::new(PostgresStore::open(&cluster.url).unwrap()));
    // Opening again migrates nothing and finds everything.
    let s = PostgresStore::open(&cluster.url).unwrap();
    assert_eq!(s.counts("j").unwrap().unwrap().ok, 3);

    // The database goes away mid-job: calls fail (the worker retries them with backoff), and
    // once it is back the same store reconnects and nothing is lost.
    s.create(&job("m", 2)).unwrap();
    let claimed = s.claim("w", 1, Duration::from_secs(60)).unwrap();
    cluster.set("down");
    assert!(matches!(s.counts("m"), Err(StoreError::Backend(_))));
    assert!(s
        .complete("w", &claimed[0].attempt, true, &json!({"outcome": "ok"}))
        .is_err());
    cluster.set("up");
    assert!(s
        .complete("w", &claimed[0].attempt, true, &json!({"outcome": "ok"}))
        .unwrap());
    let c = s.counts("m").unwrap().unwrap();
    assert_eq!((c.ok, c.queued), (1, 1));

    // A worker told to stop while the store is away waits for it about a lease, then gives
    // up: it does not hang, and its items come back to the queue when their leases run out.
    use quarry::jobs::{Worker, WorkerConfig};
    use std::sync::Arc;
    s.create(&job("n", 2)).unwrap();
    let store: Arc<dyn JobStore> = Arc::new(PostgresStore::open(&cluster.url).unwrap());
    let lease = Duration::from_secs(1);
    let worker = Worker::new(
        store.clone(),
        WorkerConfig {
            slots: 2,
            lease,
            poll: Duration::from_millis(20),
            retention: None,
        },
    );
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let g = gate.clone();
    let running = runtime.spawn(worker.clone().run(
        move |_| {
            let g = g.clone();
            async move {
                let _ = g.acquire().await;
                (true, json!({"outcome": "ok"}))
            }
        },
        |_, m| json!({"failed": m}),
    ));
    let started = std::time::Instant::now();
    while s.counts("n").unwrap().unwrap().running + s.counts("m").unwrap().unwrap().running < 2 {
        assert!(started.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(20));
    }
    cluster.set("down");
    let stopping = std::time::Instant::now();
    worker.stop();
    gate.add_permits(10);
    runtime.block_on(async {
        tokio::time::timeout(Duration::from_secs(30), running)
            .await
            .expect("the worker stops")
            .unwrap()
    });
    let stopped_in = stopping.elapsed();
    assert!(stopped_in < lease * 6, "stopped in {stopped_in:?}");
    cluster.set("up");
    std::thread::sleep(lease);
    // The first call finds the connection the restart broke, and drops it; the next reconnects.
    let _ = s.counts("n");
    let redo = s.claim("x", 10, Duration::from_secs(60)).unwrap();
    assert_eq!(
        redo.len(),
        3,
        "the two in flight (leases run out) and the one still queued"
    );
    for c in &redo {
        assert!(s.complete("x", &c.attempt, true, &json!({})).unwrap());
    }
    deletion(&s);
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

/// The worker runs every item once, and an item whose runner panics fails alone (its result
/// says so) instead of staying leased to the process.
#[test]
fn the_worker_finishes_every_item_and_a_panicking_runner_fails_only_its_item() {
    use quarry::jobs::{Worker, WorkerConfig};
    let dir = TempDir::new("worker");
    std::fs::create_dir_all(&dir.0).unwrap();
    let store: std::sync::Arc<dyn JobStore> =
        std::sync::Arc::new(SqliteStore::open(&dir.0.join("jobs.sqlite3")).unwrap());
    store.create(&job("w", 20)).unwrap();
    let config = WorkerConfig {
        slots: 4,
        lease: Duration::from_secs(3),
        poll: Duration::from_millis(20),
        retention: None,
    };
    let worker = Worker::new(store.clone(), config);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let running = tokio::spawn(worker.clone().run(
            |work| async move {
                if work.item_id == "item-7" {
                    panic!("a runner bug");
                }
                (true, json!({"echo": work.payload}))
            },
            |job, message| json!({"job": job.id, "failed": message}),
        ));
        let started = std::time::Instant::now();
        while store.counts("w").unwrap().unwrap().ok + store.counts("w").unwrap().unwrap().failed < 20 {
            assert!(started.elapsed() < Duration::from_secs(30), "{:?}", store.counts("w"));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        worker.stop();
        running.await.unwrap();
    });
    let c = store.counts("w").unwrap().unwrap();
    assert_eq!((c.ok, c.failed, c.running, c.queued), (19, 1, 0, 0));
    let results = store.results("w", 0, 100).unwrap();
    assert_eq!(results.len(), 20);
    assert_eq!(results[3].1.result, json!({"echo": "document 3"}));
    assert_eq!(
        results[7].1.result,
        json!({"job": "w", "failed": "the item's runner failed"}),
        "the caller's shape for a failed item"
    );
}

/// Processes opening a new state file at the same moment: each migration runs once, and every
/// one of them opens it.
#[test]
fn sqlite_files_opened_at_once_by_many_are_migrated_once() {
    let dir = TempDir::new("migrate");
    std::fs::create_dir_all(&dir.0).unwrap();
    let path = dir.0.join("jobs.sqlite3");
    let barrier = std::sync::Barrier::new(6);
    std::thread::scope(|scope| {
        for _ in 0..6 {
            scope.spawn(|| {
                barrier.wait();
                SqliteStore::open(&path).unwrap();
            });
        }
    });
    let s = SqliteStore::open(&path).unwrap();
    s.create(&job("after", 1)).unwrap();
    assert_eq!(s.counts("after").unwrap().unwrap().queued, 1);
}
