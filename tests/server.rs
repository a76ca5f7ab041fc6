//! The HTTP service over the real model, driven over a loopback socket: /extract returns a
//! record that validates (checked with the `jsonschema` crate) with usage and timings, or a
//! typed outcome; bad requests get 4xx JSON bodies naming the problem; the API key is
//! enforced; a client that hangs up has its request aborted and its KV blocks freed; the
//! committed OpenAPI document matches the code.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use quarry::extract::spelling;
use serde_json::{json, Value};

const KEY: &str = "test-key-123";

struct Server {
    child: Child,
    port: u16,
    /// Its stderr so far, a line each.
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// Its state directory (the job store), removed with it unless another server shares it.
    state: Option<StateDir>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh state directory, removed on drop.
struct StateDir(std::path::PathBuf);

impl StateDir {
    fn new() -> StateDir {
        let dir = std::env::temp_dir().join(format!("quarry-test-state-{:x}", rand_u64()));
        std::fs::create_dir_all(&dir).unwrap();
        StateDir(dir)
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    h.finish()
}

/// A server with a state directory of its own.
fn start(extra: &[&str]) -> Option<Server> {
    let state = StateDir::new();
    let mut server = start_in(&state.0, extra)?;
    server.state = Some(state);
    Some(server)
}

/// A server keeping its jobs in `state_dir`.
fn start_in(state_dir: &std::path::Path, extra: &[&str]) -> Option<Server> {
    let model = common::model_path()?;
    let mut child = Command::new(env!("CARGO_BIN_EXE_quarry"))
        .args(["serve", "--port", "0", "--api-key", KEY, "--kv-cache-tokens", "8192"])
        .arg("--state-dir")
        .arg(state_dir)
        .args(extra)
        .arg("--model")
        .arg(&model)
        .arg("--schemas")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/schemas"))
        .stderr(Stdio::piped())
        .spawn()
        .expect("start quarry serve");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let port = loop {
        let line = lines.next().expect("the server printed its address").unwrap();
        log.lock().unwrap().push(line.clone());
        // A text line, or with --log-format json a JSON line whose message it is.
        let message = serde_json::from_str::<Value>(&line)
            .ok()
            .and_then(|v| v["fields"]["message"].as_str().map(str::to_string))
            .unwrap_or(line);
        if let Some(addr) = message.strip_prefix("quarry: listening on http://") {
            break addr.rsplit(':').next().unwrap().parse().unwrap();
        }
    };
    // Keep reading stderr so the server never blocks on a full pipe.
    let kept = log.clone();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            kept.lock().unwrap().push(line);
        }
    });
    Some(Server {
        child,
        port,
        log,
        state: None,
    })
}

/// One HTTP/1.1 request; returns the status and the body parsed as JSON.
fn http(port: u16, method: &str, path: &str, key: Option<&str>, body: &[u8]) -> (u16, Value) {
    let (status, body) = http_text(port, method, path, key, body);
    let value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{status} not JSON ({e}): {body}"));
    (status, value)
}

fn http_text(port: u16, method: &str, path: &str, key: Option<&str>, body: &[u8]) -> (u16, String) {
    let (status, _, body) = http_raw(port, method, path, key, body);
    (status, body)
}

/// Status, head (lower-cased) and body.
fn http_raw(port: u16, method: &str, path: &str, key: Option<&str>, body: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    // A server refusing an oversized body may answer and close before reading all of it.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").expect("a full response");
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_string()
    };
    (status, head.to_ascii_lowercase(), body)
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        body = &rest[n + 2..];
    }
    out
}

/// A schema whose `not` the grammar cannot enforce, broken by the only record the grammar
/// allows ({"n": 0}): every answer is a schema violation.
fn refuted() -> Value {
    json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 0}},
        "required": ["n"], "additionalProperties": false, "not": {"required": ["n"]}})
}

fn post(port: u16, body: &Value) -> (u16, Value) {
    http(port, "POST", "/extract", Some(KEY), body.to_string().as_bytes())
}

#[test]
fn extract_over_http_with_typed_errors() {
    let Some(server) = start(&[]) else { return };
    let port = server.port;

    let (status, health) = http(port, "GET", "/health", None, b"");
    assert_eq!(status, 200);
    assert!(health["kv_blocks_total"].as_u64().unwrap() > 0, "{health}");
    // The CPU's rows never depend on the batch; a GPU's do unless --batch-invariant.
    let on_cpu = health["device"].as_str().unwrap().starts_with("cpu");
    assert_eq!(health["batch_invariant"], on_cpu, "{health}");

    // A ready-made schema by id: the record validates, with usage and timings.
    let schema: Value =
        serde_json::from_str(include_str!("../schemas/invoice.json")).expect("schemas/invoice.json is JSON");
    let document = include_str!("../examples/documents/invoice.txt");
    let (status, out) = post(port, &json!({"schema_id": "invoice", "document": document}));
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["outcome"], "ok", "{out}");
    assert!(
        jsonschema::validator_for(&schema).unwrap().is_valid(&out["data"]),
        "{out}"
    );
    assert!(out["usage"]["prompt_tokens"].as_u64().unwrap() > 50);
    assert!(out["usage"]["completion_tokens"].as_u64().unwrap() > 5);
    assert!(out["timings"]["total_ms"].as_f64().unwrap() > 0.0);

    // The same schema inline, with fewer tokens than its shortest record: refused, naming the
    // minimum; with exactly that many, a record that validates.
    let (status, out) = post(
        port,
        &json!({"schema": schema, "document": document, "options": {"max_tokens": 5}}),
    );
    assert_eq!(
        (status, out["error"]["type"].as_str()),
        (400, Some("max_tokens_too_small")),
        "{out}"
    );
    let minimum = out["error"]["minimum"].as_u64().expect("the minimum is named");
    assert!(minimum > 5, "{out}");
    let (status, out) = post(
        port,
        &json!({"schema": schema, "document": document, "options": {"max_tokens": minimum}}),
    );
    assert_eq!((status, out["outcome"].as_str()), (200, Some("ok")), "{out}");
    assert!(
        jsonschema::validator_for(&schema).unwrap().is_valid(&out["data"]),
        "{out}"
    );
    assert!(out["usage"]["completion_tokens"].as_u64().unwrap() <= minimum, "{out}");

    // A keyword the grammar cannot enforce (`not`), broken by the only record it allows: the
    // outcome is schema_violation with the validator's errors, never an `ok` that fails.
    let refuted = refuted();
    let (status, out) = post(port, &json!({"schema": refuted, "document": "n is zero"}));
    assert_eq!(
        (status, out["outcome"].as_str()),
        (200, Some("schema_violation")),
        "{out}"
    );
    assert!(out["data"].is_null(), "{out}");
    assert_eq!(
        (
            &out["violations"][0]["keyword"],
            &out["violations"][0]["schema_pointer"]
        ),
        (&json!("not"), &json!("/not")),
        "{out}"
    );

    // Bad requests: a 4xx with a JSON body that names the problem.
    let cases: Vec<(Vec<u8>, u16, &str)> = vec![
        (b"{\"schema_id\": ".to_vec(), 400, "invalid_json"),
        (
            json!({"schema_id": "invoice", "document": "x", "colour": 1})
                .to_string()
                .into_bytes(),
            422,
            "unknown_field",
        ),
        (
            json!({"schema_id": "invoice"}).to_string().into_bytes(),
            422,
            "invalid_field",
        ),
        (
            json!({"schema_id": "no-such", "document": "x"})
                .to_string()
                .into_bytes(),
            404,
            "unknown_schema_id",
        ),
        (json!({"document": "x"}).to_string().into_bytes(), 400, "bad_request"),
        (
            json!({"schema_id": "invoice", "document": "x", "options": {"max_tokens": 0}})
                .to_string()
                .into_bytes(),
            400,
            "bad_request",
        ),
        (
            json!({"schema_id": "invoice", "document": "x".repeat(5 << 20)})
                .to_string()
                .into_bytes(),
            413,
            "body_too_large",
        ),
        (
            json!({"schema_id": "invoice", "document": "word ".repeat(20_000)})
                .to_string()
                .into_bytes(),
            400,
            "input_too_long",
        ),
    ];
    for (body, want_status, want_type) in cases {
        let (status, out) = http(port, "POST", "/extract", Some(KEY), &body);
        assert_eq!(
            (status, out["error"]["type"].as_str()),
            (want_status, Some(want_type)),
            "{out}"
        );
        assert!(!out["error"]["message"].as_str().unwrap().is_empty());
    }
    let (status, out) = post(
        port,
        &json!({"schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "document": "x"}),
    );
    assert_eq!(status, 400);
    assert_eq!(
        (
            &out["error"]["type"],
            &out["error"]["keyword"],
            &out["error"]["pointer"]
        ),
        (&json!("schema_rejected"), &json!("$ref"), &json!("/properties/a")),
        "{out}"
    );
    // Refused by its Content-Length, and its body read off before the refusal goes out: the
    // client sends all of it and gets the 413, not a connection reset mid-send.
    let big = json!({"schema_id": "invoice", "document": "x".repeat(20 << 20)}).to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "POST /extract HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        big.len()
    )
    .unwrap();
    s.write_all(big.as_bytes()).expect("the whole body is taken, not reset");
    let mut reply = String::new();
    s.read_to_string(&mut reply).expect("the reply, not a reset");
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    assert!(reply.contains("\"body_too_large\""), "{reply}");
    let (status, out) = http(port, "POST", "/extract", None, b"{}");
    assert_eq!((status, out["error"]["type"].as_str()), (401, Some("unauthorized")));
    let (status, out) = http(port, "POST", "/extract", Some("wrong"), b"{}");
    assert_eq!((status, out["error"]["type"].as_str()), (401, Some("unauthorized")));

    // Schemas: every ready-made one compiles; a registered one gets a report of every keyword
    // (those it cannot enforce named with their pointers) and an id that /extract takes.
    let (status, list) = http(port, "GET", "/schemas", Some(KEY), b"");
    assert_eq!(status, 200);
    let ids: Vec<&str> = list["schema_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    for want in ["contact", "invoice", "job_posting", "receipt", "resume"] {
        assert!(ids.contains(&want), "{list}");
        let (status, info) = http(port, "GET", &format!("/schemas/{want}"), Some(KEY), b"");
        assert_eq!(status, 200, "{info}");
        assert!(
            info["report"]
                .as_array()
                .unwrap()
                .iter()
                .all(|k| k["status"] != "rejected"),
            "{info}"
        );
    }
    let tagged = json!({
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "uniqueItems": true}},
        "required": ["tags"],
        "additionalProperties": false
    });
    let (status, info) = http(
        port,
        "POST",
        "/schemas",
        Some(KEY),
        json!({"schema": tagged}).to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{info}");
    let report = info["report"].as_array().unwrap();
    let unique = report
        .iter()
        .find(|k| k["keyword"] == "uniqueItems")
        .expect("uniqueItems is reported");
    assert_eq!(
        (&unique["status"], &unique["pointer"]),
        (&json!("rejected"), &json!("/properties/tags")),
        "{info}"
    );
    assert!(
        report
            .iter()
            .any(|k| k["keyword"] == "maxLength" && k["status"] == "enforced"),
        "{info}"
    );
    let id = info["schema_id"].as_str().unwrap().to_string();
    let (status, again) = http(
        port,
        "POST",
        "/schemas",
        Some(KEY),
        json!({"schema": tagged}).to_string().as_bytes(),
    );
    assert_eq!(
        (status, again["schema_id"].as_str()),
        (200, Some(id.as_str())),
        "the same schema, the same id"
    );
    let (status, out) = post(port, &json!({"schema_id": id, "document": "Tags: red, green."}));
    assert_eq!(status, 200, "{out}");
    // The model may repeat a tag (a CPU under load has given either record): the outcome says so.
    let tags_violate = usize::from(out["outcome"] == "schema_violation");
    if out["outcome"] == "ok" {
        assert!(out["data"]["tags"].is_array(), "{out}");
    }
    assert!(
        out["notes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["keyword"] == "uniqueItems"),
        "{out}"
    );
    let strict = json!({"schema": tagged, "strict": true}).to_string();
    let (status, out) = http(port, "POST", "/schemas", Some(KEY), strict.as_bytes());
    assert_eq!(
        (
            status,
            &out["error"]["type"],
            &out["error"]["keyword"],
            &out["error"]["pointer"]
        ),
        (
            400,
            &json!("schema_rejected"),
            &json!("uniqueItems"),
            &json!("/properties/tags")
        ),
        "{out}"
    );
    let (status, out) = http(port, "GET", "/schemas/s-0000000000000000", Some(KEY), b"");
    assert_eq!(
        (status, out["error"]["type"].as_str()),
        (404, Some("unknown_schema_id"))
    );

    // Prometheus metrics: outcomes by type, latency histograms, engine gauges.
    let (status, text) = http_text(port, "GET", "/metrics", None, b"");
    assert_eq!(status, 200);
    let violations = format!(
        "quarry_requests_total{{endpoint=\"extract\",outcome=\"schema_violation\"}} {}",
        1 + tags_violate
    );
    for line in [
        "quarry_requests_total{endpoint=\"extract\",outcome=\"ok\"}",
        "quarry_requests_total{endpoint=\"extract\",outcome=\"max_tokens_too_small\"} 1",
        violations.as_str(),
        "quarry_budget_closed_total",
        "quarry_grammar_failures_total 0",
        "quarry_requests_total{endpoint=\"extract\",outcome=\"unknown_schema_id\"} 1",
        "quarry_requests_total{endpoint=\"extract\",outcome=\"schema_rejected\"} 1",
        "quarry_time_to_first_token_seconds_count",
        "quarry_completion_tokens_total",
        "quarry_kv_cache_usage_ratio",
        "quarry_prefix_cache_hit_ratio",
    ] {
        assert!(text.contains(line), "{line} missing from:\n{text}");
    }

    // A client that hangs up mid-generation: its request is aborted and its blocks freed.
    let s = start_long_request(port);
    drop(s);
    let hung_up = Instant::now();
    loop {
        let (_, h) = http(port, "GET", "/health", None, b"");
        if h["running"] == 0 && h["waiting"] == 0 && h["kv_blocks_free"] == h["kv_blocks_total"] {
            break;
        }
        assert!(hung_up.elapsed() < Duration::from_secs(5), "not aborted: {h}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Folds case and whitespace runs, as grounding matches.
fn fold(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ").to_lowercase()
}

#[test]
fn ten_documents_over_five_schemas_validate_and_ground() {
    let Some(server) = start(&[]) else { return };
    let port = server.port;
    let cases = [
        ("contact", include_str!("../examples/documents/contact.txt").to_string()),
        ("contact", "Call Dr. Wei Zhang (Umbrella Labs) on +44 20 7946 0018 or write to wei.zhang@umbrella.example.".into()),
        ("invoice", include_str!("../examples/documents/invoice.txt").to_string()),
        ("invoice", "Invoice INV-2044, 2026-01-15. Two chairs 240.00 EUR, one desk 310.00 EUR. Total 550.00 EUR.".into()),
        ("receipt", "CORNER CAFE\n2026-02-01 08:14\n2 x Espresso 2.40\n1 x Croissant 1.90\nTax 0.43\nTOTAL 6.70\nPaid by card".into()),
        ("receipt", "Hardware Hut, 12 May 2026. Hammer 19.99, nails (box) 4.50. Total 24.49, cash.".into()),
        ("resume", "Priya Nair - priya.nair@mail.example - +91 98200 12345\nSkills: Rust, SQL, Kubernetes\nExperience: Backend engineer at Zeta Systems, 2019-2024.\nEducation: B.Tech, IIT Bombay, 2018".into()),
        ("resume", "Tom Becker. Python developer at DataWorks since 2021; before that analyst at Finlytics (2017-2021). Skills: Python, pandas, Airflow.".into()),
        ("job_posting", "Senior Data Engineer at Acme Analytics, Berlin (hybrid). Full-time. 70,000-85,000 EUR per year. Requirements: 5+ years Python, Spark, SQL.".into()),
        ("job_posting", "Remote internship: Junior Web Developer at Pixel Forge. 15 USD/hour. You know HTML, CSS and JavaScript.".into()),
    ];
    // All ten at once, as clients would send them.
    let handles: Vec<_> = cases
        .iter()
        .map(|(schema_id, document)| {
            let body = json!({"schema_id": schema_id, "document": document, "grounding": true,
                              "options": {"min_confidence": 0.9}});
            std::thread::spawn(move || post(port, &body))
        })
        .collect();
    let mut grounded = 0;
    for ((schema_id, document), h) in cases.iter().zip(handles) {
        let (status, out) = h.join().unwrap();
        assert_eq!(status, 200, "{out}");
        let schema: Value = serde_json::from_str(
            &std::fs::read_to_string(format!("{}/schemas/{schema_id}.json", env!("CARGO_MANIFEST_DIR"))).unwrap(),
        )
        .unwrap();
        match out["outcome"].as_str().unwrap() {
            "ok" => assert!(
                jsonschema::validator_for(&schema).unwrap().is_valid(&out["data"]),
                "{out}"
            ),
            "truncated" => assert!(out["data"].is_null() && out["partial"].is_string(), "{out}"),
            other => panic!("untyped or unexpected outcome {other}: {out}"),
        }
        if out["outcome"] != "ok" {
            assert_eq!(out["fields"], json!([]), "{out}");
            continue;
        }
        check_fields(&out, 0.9);
        // Every span slices the document to the value: a string up to case and whitespace, a
        // date or a number in a spelling that reads as it; every value the document does
        // contain (so spelled) has a span.
        let chars: Vec<char> = document.chars().collect();
        let numbers = spelling::numbers(&chars);
        let dates = spelling::dates(&chars);
        for g in out["grounding"].as_array().expect("grounding was asked for") {
            let value = out["data"].pointer(g["pointer"].as_str().unwrap()).unwrap();
            let reads = |start: usize, end: usize| match value {
                Value::String(s) => {
                    let text: String = chars[start..end].iter().collect();
                    fold(&text) == fold(s)
                        || spelling::iso_date(s).is_some_and(|d| {
                            dates
                                .iter()
                                .any(|t| (t.start, t.end) == (start, end) && t.dates.contains(&d))
                        })
                }
                Value::Number(n) => numbers
                    .iter()
                    .any(|t| (t.start, t.end) == (start, end) && spelling::same_number(n.as_f64().unwrap(), t)),
                other => panic!("grounding of {other}"),
            };
            match g["span"].as_object() {
                Some(span) => {
                    let (a, b) = (
                        span["start"].as_u64().unwrap() as usize,
                        span["end"].as_u64().unwrap() as usize,
                    );
                    assert!(reads(a, b), "{g} in {document:?}");
                    grounded += 1;
                }
                None => {
                    let anywhere = match value {
                        Value::String(s) => {
                            fold(document).contains(&fold(s))
                                || spelling::iso_date(s).is_some_and(|d| dates.iter().any(|t| t.dates.contains(&d)))
                        }
                        Value::Number(n) => numbers.iter().any(|t| spelling::same_number(n.as_f64().unwrap(), t)),
                        _ => false,
                    };
                    assert!(!anywhere, "{value} is in the document: {g}");
                }
            }
        }
    }
    assert!(grounded >= 10, "only {grounded} values grounded");
}

/// The leaves of a record (an empty array or object is one), by pointer.
fn leaf_pointers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, x) in m {
                leaf_pointers(x, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), out);
            }
        }
        Value::Array(a) if !a.is_empty() => {
            for (i, x) in a.iter().enumerate() {
                leaf_pointers(x, format!("{at}/{i}"), out);
            }
        }
        _ => out.push(at),
    }
}

/// `fields` names every leaf of `data` once, each with a confidence from 0 to 1 (the CPU
/// computes them all) and, for strings and numbers, the span grounding gives; `review` lists
/// exactly the fields under `min`, in the order of `fields`.
fn check_fields(out: &Value, min: f64) {
    let fields = out["fields"].as_array().expect("fields in every response");
    let mut want = Vec::new();
    leaf_pointers(&out["data"], String::new(), &mut want);
    let mut got: Vec<String> = fields
        .iter()
        .map(|f| f["pointer"].as_str().unwrap().to_string())
        .collect();
    let review: Vec<&str> = fields
        .iter()
        .filter(|f| f["confidence"].as_f64().unwrap() < min)
        .map(|f| f["pointer"].as_str().unwrap())
        .collect();
    assert_eq!(out["review"], json!(review), "{out}");
    want.sort();
    got.sort();
    assert_eq!(got, want, "{out}");
    for f in fields {
        let c = f["confidence"].as_f64().expect("a confidence on the CPU");
        assert!((0.0..=1.0).contains(&c), "{f}");
        let pointer = f["pointer"].as_str().unwrap();
        let value = out["data"].pointer(pointer).unwrap();
        if value.is_string() || value.is_number() {
            let grounded = out["grounding"]
                .as_array()
                .and_then(|g| g.iter().find(|g| g["pointer"] == pointer));
            if let Some(g) = grounded {
                assert_eq!(f["span"], g["span"], "{f}");
            }
        } else {
            assert!(f["span"].is_null(), "{f}");
        }
    }
}

/// Sends an extraction that runs for thousands of tokens (its shortest record is 4,001 bytes)
/// and waits until it runs;
/// dropping the returned socket hangs up.
fn start_long_request(port: u16) -> TcpStream {
    let long = json!({
        "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 2000},
        "document": "Write numbers.",
        "options": {"max_tokens": 4096}
    })
    .to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "POST /extract HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {}\r\n\r\n{long}",
        long.len()
    )
    .unwrap();
    let started = Instant::now();
    loop {
        let (_, h) = http(port, "GET", "/health", None, b"");
        if h["running"] == 1 {
            return s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the long request never started: {h}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_full_queue_answers_429_with_retry_after() {
    let Some(server) = start(&["--max-pending", "1"]) else {
        return;
    };
    let busy = start_long_request(server.port);
    let body = json!({"schema_id": "contact", "document": "Ada, ada@example.org"}).to_string();
    let (status, head, out) = http_raw(server.port, "POST", "/extract", Some(KEY), body.as_bytes());
    assert_eq!(status, 429, "{out}");
    assert!(head.contains("retry-after: 1"), "{head}");
    assert!(out.contains("\"queue_full\""), "{out}");
    // The OpenAI endpoints go through the same door.
    let (_, models) = http(server.port, "GET", "/v1/models", Some(KEY), b"");
    let model = models["data"][0]["id"].clone();
    let chat = json!({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    let (status, _, out) = http_raw(
        server.port,
        "POST",
        "/v1/chat/completions",
        Some(KEY),
        chat.to_string().as_bytes(),
    );
    assert_eq!(status, 429, "{out}");
    assert!(out.contains("\"queue_full\""), "{out}");
    // More choices than the whole queue holds could never be admitted: a 400, not a 429 to
    // retry forever.
    let mut many = chat.clone();
    many["n"] = json!(2);
    let (status, head, out) = http_raw(
        server.port,
        "POST",
        "/v1/chat/completions",
        Some(KEY),
        many.to_string().as_bytes(),
    );
    assert_eq!(status, 400, "{out}");
    assert!(
        out.contains("\"too_many_choices\"") && out.contains("--max-pending"),
        "{out}"
    );
    assert!(!head.contains("retry-after"), "{head}");
    drop(busy);
}

/// The most engine requests waiting or running at once while it watches (`/health` every
/// 5 ms, on a thread of its own).
struct PendingWatch {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl PendingWatch {
    fn start(port: u16) -> Self {
        use std::sync::atomic::Ordering;
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop = done.clone();
        let thread = std::thread::spawn(move || {
            let mut most = 0;
            while !stop.load(Ordering::Relaxed) {
                let (_, h) = http(port, "GET", "/health", None, b"");
                most = most.max(h["waiting"].as_u64().unwrap() + h["running"].as_u64().unwrap());
                std::thread::sleep(Duration::from_millis(5));
            }
            most
        });
        PendingWatch { done, thread }
    }

    fn most(self) -> u64 {
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// Many clients at once, each asking for `n: 8` (eight engine requests): the server admits
/// what `--max-pending` holds and answers the rest 429, and its queue never grows past the
/// bound while they come.
#[test]
fn a_flood_of_chat_choices_is_held_to_max_pending() {
    let Some(server) = start(&["--max-pending", "16"]) else {
        return;
    };
    let port = server.port;
    let (_, models) = http(port, "GET", "/v1/models", Some(KEY), b"");
    let chat = json!({
        "model": models["data"][0]["id"],
        "messages": [{"role": "user", "content": "Count from one to fifty in words."}],
        "max_tokens": 48, "n": 8, "temperature": 0.8, "seed": 3,
    })
    .to_string();
    let watch = PendingWatch::start(port);
    let clients: Vec<_> = (0..12)
        .map(|_| {
            let chat = chat.clone();
            std::thread::spawn(move || http_raw(port, "POST", "/v1/chat/completions", Some(KEY), chat.as_bytes()))
        })
        .collect();
    let answers: Vec<_> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let most = watch.most();
    let (mut ok, mut full) = (0, 0);
    for (status, head, body) in &answers {
        match status {
            200 => {
                let v: Value = serde_json::from_str(body).unwrap();
                assert_eq!(v["choices"].as_array().unwrap().len(), 8, "{body}");
                ok += 1;
            }
            429 => {
                assert!(
                    body.contains("\"queue_full\"") && head.contains("retry-after"),
                    "{head}\n{body}"
                );
                full += 1;
            }
            _ => panic!("{status}: {body}"),
        }
    }
    // Twelve clients of eight choices against a bound of sixteen: two at a time get in.
    assert!(
        ok >= 2 && full >= 1,
        "{ok} answered, {full} refused, {most} pending at most"
    );
    assert!(
        most <= 16,
        "{most} engine requests were pending at once, over --max-pending 16"
    );
    let (_, h) = http(port, "GET", "/health", None, b"");
    assert_eq!(
        (h["waiting"].as_u64(), h["running"].as_u64()),
        (Some(0), Some(0)),
        "{h}"
    );
}

/// Job items pass the same door: with `--max-pending 4` and 32 item slots, at most four are
/// in the engine at once, and the others wait their turn rather than fail.
#[test]
fn job_items_wait_within_max_pending() {
    let Some(server) = start(&["--max-pending", "4"]) else {
        return;
    };
    let port = server.port;
    let mut body = String::new();
    for i in 0..24 {
        body.push_str(&json!({"id": format!("d{i}"), "document": contact_document(i)}).to_string());
        body.push('\n');
    }
    let watch = PendingWatch::start(port);
    let job = submit_job(port, "schema_id=contact", body.as_bytes());
    let st = wait_for_job(port, &job);
    let most = watch.most();
    assert_eq!((st["ok"].as_u64(), st["failed"].as_u64()), (Some(24), Some(0)), "{st}");
    assert!(
        (1..=4).contains(&most),
        "{most} engine requests were pending at once, against --max-pending 4"
    );
}

#[test]
fn sigterm_lets_running_requests_finish() {
    let Some(mut server) = start(&[]) else { return };
    let port = server.port;
    let schema = json!({"type": "array", "items": {"type": "integer"}, "minItems": 20});
    let body = json!({"schema": schema, "document": "Write numbers.", "options": {"max_tokens": 48}}).to_string();
    let client = std::thread::spawn(move || http(port, "POST", "/extract", Some(KEY), body.as_bytes()));
    let started = Instant::now();
    while http(port, "GET", "/health", None, b"").1["running"] != 1 {
        assert!(started.elapsed() < Duration::from_secs(20), "the request never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let killed = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let (status, out) = client.join().unwrap();
    assert_eq!((status, out["outcome"].as_str()), (200, Some("ok")), "{out}");
    assert!(
        jsonschema::validator_for(&schema).unwrap().is_valid(&out["data"]),
        "{out}"
    );
    assert!(out["usage"]["completion_tokens"].as_u64().unwrap() <= 48, "{out}");
    let exit = server.child.wait().unwrap();
    assert!(exit.success(), "{exit:?}");
}

#[test]
fn openai_chat_completions_with_json_schema_and_streaming() {
    let Some(server) = start(&[]) else { return };
    let port = server.port;
    let (status, models) = http(port, "GET", "/v1/models", Some(KEY), b"");
    assert_eq!(status, 200, "{models}");
    let model = models["data"][0]["id"].as_str().unwrap().to_string();
    let schema = json!({
        "type": "object",
        "properties": {"color": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["color", "n"],
        "additionalProperties": false
    });
    let body = json!({
        "model": model,
        "messages": [{"role": "user", "content": "Name a color and a number."}],
        "temperature": 0.8, "seed": 3, "n": 2, "max_tokens": 60, "logprobs": true, "top_logprobs": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": true}}
    });
    let (status, out) = http(
        port,
        "POST",
        "/v1/chat/completions",
        Some(KEY),
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["object"], "chat.completion");
    let choices = out["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    let validator = jsonschema::validator_for(&schema).unwrap();
    for c in choices {
        assert_eq!(c["finish_reason"], "stop", "{c}");
        let value: Value = serde_json::from_str(c["message"]["content"].as_str().unwrap()).unwrap();
        assert!(validator.is_valid(&value), "{value}");
        let lp = c["logprobs"]["content"].as_array().unwrap();
        assert!(
            !lp.is_empty() && lp.iter().all(|t| t["logprob"].as_f64().unwrap() <= 0.0),
            "{c}"
        );
    }
    let u = &out["usage"];
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap())
    );

    // A lenient schema with a keyword the grammar cannot enforce (`not`), broken by the only
    // answer it allows: the choice says so, with the validator's errors.
    let refuted = refuted();
    for stream in [false, true] {
        let body = json!({
            "model": model, "messages": [{"role": "user", "content": "n?"}], "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": refuted}}
        });
        let (status, text) = http_text(
            port,
            "POST",
            "/v1/chat/completions",
            Some(KEY),
            body.to_string().as_bytes(),
        );
        assert_eq!(status, 200, "{text}");
        let finish: Value = if stream {
            let events: Vec<Value> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter(|e| *e != "[DONE]")
                .map(|e| serde_json::from_str(e).unwrap())
                .collect();
            events
                .into_iter()
                .find(|e| e["choices"][0]["finish_reason"] == "stop")
                .unwrap()
        } else {
            serde_json::from_str(&text).unwrap()
        };
        assert_eq!(finish["choices"][0]["violations"][0]["keyword"], "not", "{text}");
    }

    let body = json!({
        "model": model, "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}, "temperature": 0
    });
    let (status, text) = http_text(
        port,
        "POST",
        "/v1/chat/completions",
        Some(KEY),
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{text}");
    let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!content.is_empty());
    let finish = chunks.iter().find_map(|c| c["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish, Some("length"));
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 8, "{text}");

    let wrong = json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).to_string();
    let (status, out) = http(port, "POST", "/v1/chat/completions", Some(KEY), wrong.as_bytes());
    assert_eq!((status, out["error"]["type"].as_str()), (404, Some("model_not_found")));

    // Through the same door as /extract: every request counted by its outcome or error, and
    // every choice's tokens and times (2 + 1 + 1 + 1 choices).
    let (_, text) = http_text(port, "GET", "/metrics", None, b"");
    for line in [
        "quarry_requests_total{endpoint=\"chat_completions\",outcome=\"ok\"} 1",
        "quarry_requests_total{endpoint=\"chat_completions\",outcome=\"schema_violation\"} 2",
        "quarry_requests_total{endpoint=\"chat_completions\",outcome=\"truncated\"} 1",
        "quarry_requests_total{endpoint=\"chat_completions\",outcome=\"model_not_found\"} 1",
        "quarry_request_seconds_count 5",
    ] {
        assert!(text.contains(line), "{line} missing from:\n{text}");
    }
}

/// The official OpenAI Python client, from the venv scripts/test sets up
/// (`$QUARRY_CLIENT_PYTHON`, made by scripts/setup-clients).
#[test]
fn the_official_openai_python_client_works_unchanged() {
    let Some(python) = client_python() else { return };
    let Some(server) = start(&[]) else { return };
    let out = Command::new(python)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/openai_client.py"))
        .arg(format!("http://127.0.0.1:{}/v1", server.port))
        .arg(KEY)
        .output()
        .expect("run the client");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    eprintln!("{stdout}");
}

/// The official OpenAI Python client runs a batch end to end: upload, create, poll, output
/// and error files matched by custom_id, list, cancel, and a repeated custom_id refused
/// (`tests/clients/openai_batch.py`).
#[test]
fn the_official_openai_python_client_runs_a_batch() {
    let Some(python) = client_python() else { return };
    let Some(server) = start(&[]) else { return };
    let out = Command::new(python)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/openai_batch.py"))
        .arg(format!("http://127.0.0.1:{}/v1", server.port))
        .arg(KEY)
        .output()
        .expect("run the client");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    eprintln!("{stdout}");
}

/// A batch file over the size limit is a 413 with a JSON body, and a body that is not a
/// multipart form a 400 with one.
#[test]
fn an_oversized_batch_file_is_a_413() {
    let Some(server) = start(&[]) else { return };
    let (status, out) = http(server.port, "POST", "/v1/files", Some(KEY), br#"{"purpose": "batch"}"#);
    assert_eq!(
        (status, out["error"]["type"].as_str()),
        (400, Some("bad_request")),
        "{out}"
    );
    let boundary = "quarry-boundary";
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n"
    )
    .into_bytes();
    body.extend(std::iter::repeat_n(b'x', (256 << 20) + 1024));
    body.extend(format!("\r\n--{boundary}--\r\n").into_bytes());
    let mut stream = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    let head = format!(
        "POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    // The server may answer and close before reading it all.
    let _ = stream.write_all(&body);
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    assert!(
        response.starts_with("HTTP/1.1 413"),
        "{}",
        &response[..response.len().min(300)]
    );
    assert!(response.contains("\"type\":\"body_too_large\""), "{response}");
}

/// Polls `GET /jobs/{id}` until every item has a result. A job that stops finishing items
/// fails the test; a slow machine (two cores shared with the other tests) only makes it wait.
fn wait_for_job(port: u16, id: &str) -> Value {
    let finished = |st: &Value| st["ok"].as_u64().unwrap_or(0) + st["failed"].as_u64().unwrap_or(0);
    let (mut last, mut since) = (u64::MAX, Instant::now());
    loop {
        let (status, st) = http(port, "GET", &format!("/jobs/{id}"), Some(KEY), b"");
        assert_eq!(status, 200, "{st}");
        if st["done"] == true {
            return st;
        }
        if finished(&st) != last {
            (last, since) = (finished(&st), Instant::now());
        }
        assert!(
            since.elapsed() < Duration::from_secs(300),
            "job {id} finished no item for 300 s: {st}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn submit_job(port: u16, query: &str, body: &[u8]) -> String {
    let (status, job) = http(port, "POST", &format!("/jobs?{query}"), Some(KEY), body);
    assert_eq!(status, 202, "{job}");
    job["job_id"].as_str().unwrap().to_string()
}

fn contact_document(i: usize) -> String {
    const NAMES: [&str; 5] = [
        "Ada Lovelace",
        "Grace Hopper",
        "Alan Turing",
        "Edsger Dijkstra",
        "Barbara Liskov",
    ];
    let name = NAMES[i % NAMES.len()];
    let first = name.split(' ').next().unwrap().to_lowercase();
    format!("{name} <{first}{i}@example.org>, phone +1 555 {i:04}, works at Initech.")
}

fn csv_table(text: &str) -> (Vec<String>, Vec<Vec<String>>) {
    let mut r = csv::Reader::from_reader(text.as_bytes());
    let header = r.headers().unwrap().iter().map(str::to_string).collect();
    let rows = r
        .records()
        .map(|row| row.unwrap().iter().map(str::to_string).collect())
        .collect();
    (header, rows)
}

#[test]
fn batch_jobs_over_jsonl_and_csv_run_every_item_once_and_retry_the_failed() {
    let Some(server) = start(&[]) else { return };
    let port = server.port;
    let contact: Value = serde_json::from_str(include_str!("../schemas/contact.json")).unwrap();
    let valid = jsonschema::validator_for(&contact).unwrap();

    // 200 documents as JSONL; item 7 is far too long for the model: it fails alone.
    let mut body = String::new();
    let mut ids = Vec::new();
    for i in 0..200 {
        let id = format!("doc-{i}");
        let document = if i == 7 {
            "word ".repeat(20_000)
        } else {
            contact_document(i)
        };
        body.push_str(&json!({"id": id, "document": document}).to_string());
        body.push('\n');
        ids.push(id);
    }
    let job = submit_job(port, "schema_id=contact", body.as_bytes());
    let st = wait_for_job(port, &job);
    assert_eq!(
        (st["total"].as_u64(), st["failed"].as_u64()),
        (Some(200), Some(1)),
        "{st}"
    );
    assert_eq!(
        (st["ok"].as_u64(), st["progress"].as_f64()),
        (Some(199), Some(1.0)),
        "{st}"
    );
    let (status, text) = http_text(port, "GET", &format!("/jobs/{job}/results"), Some(KEY), b"");
    assert_eq!(status, 200);
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let got: Vec<&str> = lines.iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(got, ids, "every item exactly once, in input order");
    assert_eq!(lines[7]["outcome"], "input_too_long", "{}", lines[7]);
    assert!(lines[7].get("fields").is_none(), "{}", lines[7]);
    for l in lines.iter().filter(|l| l["outcome"] == "ok") {
        assert!(valid.is_valid(&l["data"]), "{l}");
        // Each ok result names every leaf of its record, with a confidence in [0, 1].
        let (mut want, mut got) = (Vec::new(), Vec::new());
        leaf_pointers(&l["data"], String::new(), &mut want);
        for f in l["fields"].as_array().expect("fields in an ok job result") {
            got.push(f["pointer"].as_str().unwrap().to_string());
            assert!(
                f["confidence"].as_f64().is_some_and(|c| (0.0..=1.0).contains(&c)),
                "{l}"
            );
        }
        want.sort();
        got.sort();
        assert_eq!(got, want, "{l}");
    }

    // A retry runs the failed item only: the ok count stays, one more input_too_long.
    let count = |outcome: &str| -> u64 {
        let (_, m) = http_text(port, "GET", "/metrics", None, b"");
        let key = format!("quarry_requests_total{{endpoint=\"extract\",outcome=\"{outcome}\"}} ");
        m.lines()
            .find_map(|l| l.strip_prefix(&key))
            .map_or(0, |v| v.trim().parse().unwrap())
    };
    let (ok_before, long_before) = (count("ok"), count("input_too_long"));
    let (status, again) = http(port, "POST", &format!("/jobs/{job}/retry"), Some(KEY), b"");
    assert_eq!(status, 202, "{again}");
    let st = wait_for_job(port, &job);
    assert_eq!((st["ok"].as_u64(), st["failed"].as_u64()), (Some(199), Some(1)), "{st}");
    assert_eq!((count("ok"), count("input_too_long")), (ok_before, long_before + 1));
    let (_, text) = http_text(port, "GET", &format!("/jobs/{job}/results"), Some(KEY), b"");
    assert_eq!(text.lines().count(), 200);

    // The same kind of documents as CSV (quoted, with commas), text in a named column;
    // results as CSV with the schema's columns.
    let mut w = csv::Writer::from_writer(Vec::new());
    w.write_record(["ref", "note"]).unwrap();
    for i in 0..200 {
        w.write_record([format!("r{i}"), contact_document(i)]).unwrap();
    }
    let body = w.into_inner().unwrap();
    let job = submit_job(port, "schema_id=contact&format=csv&text_column=note", &body);
    let st = wait_for_job(port, &job);
    assert_eq!(
        (st["total"].as_u64(), st["ok"].as_u64()),
        (Some(200), Some(200)),
        "{st}"
    );
    let (status, head, text) = http_raw(port, "GET", &format!("/jobs/{job}/results?format=csv"), Some(KEY), b"");
    assert_eq!(status, 200);
    assert!(head.contains("content-type: text/csv"), "{head}");
    let (header, rows) = csv_table(&text);
    assert_eq!(header, ["id", "outcome", "name", "email", "phone", "company", "error"]);
    assert_eq!(rows.len(), 200);
    let email = regex_lite_email();
    for (i, row) in rows.iter().enumerate() {
        // No `id` column in the input: rows are numbered.
        assert_eq!(
            (row[0].as_str(), row[1].as_str()),
            ((i + 1).to_string().as_str(), "ok"),
            "{row:?}"
        );
        assert!(email(&row[3]), "{row:?}");
        assert_eq!(row[6], "", "{row:?}");
    }

    // An exploded array: one row per invoice line, as many as the JSONL results hold.
    let invoices = [
        "Invoice INV-1 dated 2026-03-02. Widgets 120.00 USD, shipping 15.50 USD. Total 135.50 USD.",
        "Invoice INV-2 dated 2026-03-05. Consulting EUR 480.00. Total EUR 480.00.",
        "Invoice INV-3 dated 2026-03-09. License GBP 990.00, support GBP 10.00. Total GBP 1000.00.",
    ];
    let body: String = invoices
        .iter()
        .map(|d| json!({"document": d}).to_string() + "\n")
        .collect();
    let job = submit_job(port, "schema_id=invoice", body.as_bytes());
    wait_for_job(port, &job);
    let (_, text) = http_text(port, "GET", &format!("/jobs/{job}/results"), Some(KEY), b"");
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(lines.iter().all(|l| l.get("document").is_none()));
    // With documents=true, each line carries its item's document as submitted.
    let (_, text) = http_text(
        port,
        "GET",
        &format!("/jobs/{job}/results?documents=true"),
        Some(KEY),
        b"",
    );
    let documents: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["document"].clone())
        .collect();
    assert_eq!(documents, invoices.map(Value::from));
    let (status, text) = http_text(
        port,
        "GET",
        &format!("/jobs/{job}/results?format=csv&explode=lines"),
        Some(KEY),
        b"",
    );
    assert_eq!(status, 200, "{text}");
    let (header, rows) = csv_table(&text);
    assert_eq!(
        header,
        [
            "id",
            "outcome",
            "invoice_number",
            "date",
            "total",
            "currency",
            "lines.item",
            "lines.amount",
            "error"
        ]
    );
    let mut want = Vec::new();
    for l in &lines {
        match l["data"]["lines"].as_array() {
            Some(items) => want.extend(items.iter().map(|x| (l["id"].clone(), x["item"].clone()))),
            None => want.push((l["id"].clone(), Value::Null)),
        }
    }
    let got: Vec<(Value, Value)> = rows.iter().map(|r| (json!(r[0]), json!(r[6]))).collect();
    assert_eq!(got.len(), want.len(), "{text}");
    for ((gid, gitem), (wid, witem)) in got.iter().zip(&want) {
        assert_eq!(gid, wid);
        assert!(witem.is_null() || gitem == witem, "{gitem} != {witem}");
    }
    // With confidence, each column is followed by its confidence: the JSONL field's, to three
    // places (a null's too: how sure the model was that there is none).
    let (status, text) = http_text(
        port,
        "GET",
        &format!("/jobs/{job}/results?format=csv&explode=lines&confidence=true"),
        Some(KEY),
        b"",
    );
    assert_eq!(status, 200, "{text}");
    let (header, rows) = csv_table(&text);
    assert_eq!(header.len(), 2 + 2 * 6 + 1, "{header:?}");
    let mut element = std::collections::HashMap::new();
    for row in &rows {
        let line = lines.iter().find(|l| l["id"] == row[0].as_str()).unwrap();
        let i = element.entry(row[0].clone()).or_insert(0usize);
        for (c, name) in header.iter().enumerate().skip(2).step_by(2).take(6) {
            assert_eq!(header[c + 1], format!("{name}__confidence"));
            let pointer = match name.strip_prefix("lines.") {
                Some(key) => format!("/lines/{i}/{key}"),
                None => format!("/{name}"),
            };
            let want = line["fields"]
                .as_array()
                .and_then(|f| f.iter().find(|f| f["pointer"] == pointer.as_str()))
                .and_then(|f| f["confidence"].as_f64());
            assert_eq!(
                row[c + 1],
                want.map(|c| format!("{c:.3}")).unwrap_or_default(),
                "{pointer}: {row:?}"
            );
        }
        *i += 1;
    }
    let (status, out) = http(
        port,
        "GET",
        &format!("/jobs/{job}/results?format=csv&explode=total"),
        Some(KEY),
        b"",
    );
    assert_eq!(
        (status, out["error"]["type"].as_str()),
        (400, Some("bad_request")),
        "{out}"
    );

    // Too small an output budget fails every item (below the shortest record); a retry with
    // a larger one fixes them.
    let body: String = (0..5)
        .map(|i| json!({"document": contact_document(i)}).to_string() + "\n")
        .collect();
    let job = submit_job(port, "schema_id=contact&max_tokens=6", body.as_bytes());
    let st = wait_for_job(port, &job);
    assert_eq!(st["failed"], 5, "{st}");
    let (_, text) = http_text(port, "GET", &format!("/jobs/{job}/results"), Some(KEY), b"");
    for l in text.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()) {
        assert_eq!(l["outcome"], "max_tokens_too_small", "{l}");
        assert!(
            l["data"].is_null() && l["error"].as_str().is_some_and(|e| e.contains("at least")),
            "{l}"
        );
    }
    let (status, _) = http(
        port,
        "POST",
        &format!("/jobs/{job}/retry"),
        Some(KEY),
        br#"{"max_tokens": 128}"#,
    );
    assert_eq!(status, 202);
    let st = wait_for_job(port, &job);
    assert_eq!((st["ok"].as_u64(), st["failed"].as_u64()), (Some(5), Some(0)), "{st}");

    // An inline schema (URL-encoded JSON) is compiled and registered for the job.
    let inline = json!({"type": "object", "properties": {"email": {"type": "string", "maxLength": 40}},
                        "required": ["email"], "additionalProperties": false});
    let encoded: String = inline
        .to_string()
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let body: String = (0..3)
        .map(|i| json!({"document": contact_document(i)}).to_string() + "\n")
        .collect();
    let (status, job) = http(
        port,
        "POST",
        &format!("/jobs?schema={encoded}"),
        Some(KEY),
        body.as_bytes(),
    );
    assert_eq!(status, 202, "{job}");
    assert!(job["schema_id"].as_str().unwrap().starts_with("s-"), "{job}");
    let st = wait_for_job(port, job["job_id"].as_str().unwrap());
    assert_eq!(st["ok"], 3, "{st}");

    // Bad job requests: 4xx JSON bodies naming the line, the column or the parameter.
    let bad: Vec<(&str, &[u8], u16, &str, &str)> = vec![
        (
            "schema_id=contact",
            b"{\"document\": \"a\"}\nnot json\n",
            400,
            "bad_request",
            "line 2",
        ),
        (
            "schema_id=contact&format=csv",
            b"id,text\n1,hello\n",
            400,
            "bad_request",
            "`document` column",
        ),
        ("schema_id=contact", b"", 400, "bad_request", "no items"),
        (
            "schema_id=nope",
            b"{\"document\": \"a\"}\n",
            404,
            "unknown_schema_id",
            "nope",
        ),
        (
            "schema_id=contact&format=xml",
            b"{\"document\": \"a\"}\n",
            400,
            "invalid_query",
            "format",
        ),
        (
            "schema_id=contact&max_tokens=0",
            b"{\"document\": \"a\"}\n",
            400,
            "bad_request",
            "max_tokens",
        ),
        (
            "schema_id=contact&schema=%7B%7D",
            b"{\"document\": \"a\"}\n",
            400,
            "bad_request",
            "exactly one",
        ),
        (
            "schema=%7Bnope",
            b"{\"document\": \"a\"}\n",
            400,
            "invalid_json",
            "schema",
        ),
    ];
    for (query, body, want_status, want_type, mentions) in bad {
        let (status, out) = http(port, "POST", &format!("/jobs?{query}"), Some(KEY), body);
        assert_eq!(
            (status, out["error"]["type"].as_str()),
            (want_status, Some(want_type)),
            "{query}: {out}"
        );
        assert!(
            out["error"]["message"].as_str().unwrap().contains(mentions),
            "{query}: {out}"
        );
    }
    let (status, out) = http(port, "GET", "/jobs/job-999", Some(KEY), b"");
    assert_eq!((status, out["error"]["type"].as_str()), (404, Some("unknown_job")));

    // Deleting: a job with items out is refused (409); a finished one goes with its results.
    let body: String = (0..20)
        .map(|i| json!({"document": contact_document(i)}).to_string() + "\n")
        .collect();
    let busy = submit_job(port, "schema_id=contact", body.as_bytes());
    let (status, out) = http(port, "DELETE", &format!("/jobs/{busy}"), Some(KEY), b"");
    assert_eq!(
        (status, out["error"]["type"].as_str()),
        (409, Some("job_running")),
        "{out}"
    );
    wait_for_job(port, &busy);
    let (status, out) = http(port, "DELETE", &format!("/jobs/{busy}"), Some(KEY), b"");
    assert_eq!((status, &out), (200, &json!({"job_id": busy, "deleted": true})));
    for (method, path) in [
        ("GET", format!("/jobs/{busy}")),
        ("GET", format!("/jobs/{busy}/results")),
        ("DELETE", format!("/jobs/{busy}")),
    ] {
        let (status, out) = http(port, method, &path, Some(KEY), b"");
        assert_eq!(
            (status, out["error"]["type"].as_str()),
            (404, Some("unknown_job")),
            "{path}"
        );
    }
}

/// The contact schema's email pattern, checked by hand (no regex crate in the tests).
fn regex_lite_email() -> impl Fn(&str) -> bool {
    |s: &str| {
        let part = |p: &str| {
            (1..=24).contains(&p.len())
                && p.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.')
        };
        matches!(s.split_once('@'), Some((a, b)) if part(a) && part(b))
    }
}

/// The clients venv's python (scripts/test sets it up), or `None` with a message outside CI.
fn client_python() -> Option<std::path::PathBuf> {
    let Some(python) = std::env::var_os("QUARRY_CLIENT_PYTHON") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the tests through scripts/test"
        );
        eprintln!("skipping: QUARRY_CLIENT_PYTHON unset (scripts/test sets it up)");
        return None;
    };
    Some(python.into())
}

#[test]
fn the_spec_validates_and_a_client_generated_from_it_extracts() {
    let Some(python) = client_python() else { return };
    let root = env!("CARGO_MANIFEST_DIR");
    let run = |cmd: &mut Command| {
        let out = cmd.output().expect("run");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "{cmd:?}\n{stdout}\n{stderr}");
        stdout.to_string()
    };
    // An OpenAPI validator from PyPI accepts the committed document.
    run(Command::new(&python).args(["-m", "openapi_spec_validator", &format!("{root}/openapi/openapi.json")]));
    // A client generated from it now, as a user would, drives a live server.
    let dir = std::env::temp_dir().join(format!("quarry-client-{}", std::process::id()));
    let generator = python.with_file_name("openapi-python-client");
    run(Command::new(format!("{root}/examples/python/generate-client.sh"))
        .arg(dir.join("quarry_client"))
        .env("OPENAPI_PYTHON_CLIENT", generator));
    let Some(server) = start(&[]) else { return };
    let stdout = run(Command::new(&python)
        .arg(format!("{root}/examples/python/extract.py"))
        .arg(format!("http://127.0.0.1:{}", server.port))
        .arg(KEY)
        .env("QUARRY_CLIENT_DIR", &dir));
    std::fs::remove_dir_all(&dir).ok();
    let out: Value = serde_json::from_str(stdout.trim()).unwrap();
    let contact: Value = serde_json::from_str(include_str!("../schemas/contact.json")).unwrap();
    assert_eq!(out["outcome"], "ok", "{out}");
    assert!(
        jsonschema::validator_for(&contact).unwrap().is_valid(&out["data"]),
        "{out}"
    );
    assert!(out["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{out}");
    assert!(out["grounding"].as_array().is_some_and(|g| !g.is_empty()), "{out}");
    // The generated client's fields: every leaf with its confidence, and review listing
    // exactly those under 0.5.
    let mut leaves = Vec::new();
    leaf_pointers(&out["data"], String::new(), &mut leaves);
    let fields = out["fields"].as_array().expect("fields through the client");
    assert_eq!(fields.len(), leaves.len(), "{out}");
    let under: Vec<&Value> = fields
        .iter()
        .filter(|f| f["confidence"].as_f64().unwrap() < 0.5)
        .map(|f| &f["pointer"])
        .collect();
    assert_eq!(
        out["review"].as_array().unwrap().iter().collect::<Vec<_>>(),
        under,
        "{out}"
    );
    assert_eq!(out["error_type"], "unknown_schema_id", "{out}");
}

#[test]
fn the_committed_openapi_document_matches_the_code() {
    let committed = include_str!("../openapi/openapi.json");
    let generated = quarry::server::openapi::spec_json();
    assert!(
        committed == generated,
        "openapi/openapi.json is stale: run `cargo run -- openapi --output openapi/openapi.json`"
    );
    let spec: Value = serde_json::from_str(&generated).unwrap();
    assert!(spec["paths"]["/extract"]["post"].is_object());
    assert!(spec["components"]["schemas"]["ErrorBody"].is_object());
}

/// A speculating server gives each extraction the record it gives without speculation, and
/// says what its drafts did in `usage.speculation` and `/metrics`; `options.speculate: false`
/// opts a request out.
#[test]
fn speculation_is_reported_per_request_and_changes_no_record() {
    let Some(server) = start(&["--speculative-tokens", "6", "--speculative-always"]) else {
        return;
    };
    let port = server.port;
    let document = include_str!("../examples/documents/invoice.txt");
    let (status, spec) = post(port, &json!({"schema_id": "invoice", "document": document}));
    assert_eq!(status, 200, "{spec}");
    let (status, plain) = post(
        port,
        &json!({"schema_id": "invoice", "document": document, "options": {"speculate": false}}),
    );
    assert_eq!(status, 200, "{plain}");
    assert_eq!(spec["outcome"], "ok", "{spec}");
    assert_eq!(spec["data"], plain["data"], "speculation changed the record");
    assert!(plain["usage"].get("speculation").is_none(), "{plain}");

    let s = &spec["usage"]["speculation"];
    let proposers = s["proposers"].as_array().expect("usage.speculation.proposers");
    let (mut checked, mut kept) = (0, 0);
    for p in proposers {
        let (c, k) = (p["checked"].as_u64().unwrap(), p["kept"].as_u64().unwrap());
        assert!(k <= c, "{p}");
        checked += c;
        kept += k;
    }
    assert!(checked > 0 && kept > 0, "{s}");
    let checks = s["checks"].as_u64().unwrap();
    assert!(checks > 0, "{s}");
    let mean = s["mean_accepted"].as_f64().unwrap();
    assert!((mean - kept as f64 / checks as f64).abs() < 1e-9, "{s}");

    // The same counts in /metrics, which has seen only these two requests.
    let (status, metrics) = http_text(port, "GET", "/metrics", None, b"");
    assert_eq!(status, 200);
    let counter = |name: &str| -> u64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    assert_eq!(counter("quarry_spec_draft_tokens_total"), checked, "{metrics}");
    assert_eq!(counter("quarry_spec_accepted_tokens_total"), kept, "{metrics}");
}

/// `--data-parallel-size 2`: two copies of the model behind one server give every extraction
/// the record one engine gives (the CPU's rows never depend on the batch), posted all at once,
/// and `/metrics` shows each copy's requests.
#[test]
fn two_copies_give_one_engines_records_and_report_each_copy() {
    let Some(one) = start(&[]) else { return };
    let Some(two) = start(&["--data-parallel-size", "2"]) else {
        return;
    };
    same_records_at_once(&one, &two, "two copies");
    let log = two.log.lock().unwrap().join("\n");
    assert!(log.contains("2 copies: cpu"), "the start log names the copies:\n{log}");
}

/// `--prefill-device cpu --decode-device cpu,cpu`: one engine computes the prompts of two
/// decode engines, each joined to it by a host link; the records are one engine's.
#[test]
fn one_prefill_engine_for_two_decode_engines_gives_one_engines_records() {
    let Some(one) = start(&[]) else { return };
    let Some(split) = start(&["--prefill-device", "cpu", "--decode-device", "cpu,cpu"]) else {
        return;
    };
    same_records_at_once(&one, &split, "one prefill and two decode engines");
    let log = split.log.lock().unwrap().join("\n");
    assert!(
        log.contains("prefill cpu") && log.contains("decode cpu"),
        "the start log names both sides:\n{log}"
    );
}

/// Invoices and contacts (each document twice, and once behind another line) posted at once to
/// `other` give `one`'s records, and `/metrics` shows two engines serving.
fn same_records_at_once(one: &Server, other: &Server, what: &str) {
    let bodies: Vec<Value> = [("invoice", "invoice.txt"), ("contact", "contact.txt")]
        .iter()
        .flat_map(|(schema, file)| {
            let path = format!("{}/examples/documents/{file}", env!("CARGO_MANIFEST_DIR"));
            let document = std::fs::read_to_string(path).unwrap();
            // The same document twice, and once more with a line before it: another prompt.
            [
                document.clone(),
                document.clone(),
                format!("Forwarded message.\n{document}"),
            ]
            .map(|d| json!({"schema_id": schema, "document": d}))
        })
        .collect();
    let expected: Vec<Value> = bodies.iter().map(|b| post(one.port, b).1).collect();
    let port = other.port;
    let got: Vec<(u16, Value)> = std::thread::scope(|s| {
        let posts: Vec<_> = bodies.iter().map(|b| s.spawn(move || post(port, b))).collect();
        posts.into_iter().map(|p| p.join().unwrap()).collect()
    });
    for ((status, record), want) in got.iter().zip(&expected) {
        assert_eq!(*status, 200, "{record}");
        assert_eq!(record["outcome"], "ok", "{record}");
        assert_eq!(
            record["data"], want["data"],
            "{what} gave another record than one engine"
        );
    }
    let (status, metrics) = http_text(port, "GET", "/metrics", None, b"");
    assert_eq!(status, 200);
    for engine in ["0", "1"] {
        let line = format!("quarry_engine_requests{{engine=\"{engine}\"}} 0");
        assert!(metrics.lines().any(|l| l == line), "no `{line}` in\n{metrics}");
    }
    // Every request was placed on one of the two.
    let placed: Vec<u64> = ["0", "1"]
        .iter()
        .map(|engine| {
            let name = format!("quarry_engine_requests_placed_total{{engine=\"{engine}\"}} ");
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(&name))
                .unwrap_or_else(|| panic!("no `{name}` in\n{metrics}"))
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(placed.iter().sum::<u64>(), bodies.len() as u64, "placed {placed:?}");
}

/// A job outlives its server: killed (SIGKILL) mid-job, a new server on the same state
/// directory finds the job, takes back the dead one's items once their leases run out, and
/// every item ends with exactly one result, in input order.
#[test]
fn a_job_survives_its_server_being_killed() {
    let state = StateDir::new();
    let lease = ["--job-lease", "2"];
    let Some(first) = start_in(&state.0, &lease) else {
        return;
    };
    let ids: Vec<String> = (0..60).map(|i| format!("c{i}")).collect();
    let body: String = ids
        .iter()
        .enumerate()
        .map(|(i, id)| json!({"id": id, "document": contact_document(i)}).to_string() + "\n")
        .collect();
    let job = submit_job(first.port, "schema_id=contact", body.as_bytes());
    let started = Instant::now();
    loop {
        let (_, st) = http(first.port, "GET", &format!("/jobs/{job}"), Some(KEY), b"");
        if st["ok"].as_u64().unwrap_or(0) >= 5 {
            assert_ne!(st["done"], true, "the job ended before the kill: {st}");
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(300), "no progress: {st}");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(first);

    let second = start_in(&state.0, &lease).expect("the model loaded once already");
    let st = wait_for_job(second.port, &job);
    assert_eq!((st["total"].as_u64(), st["ok"].as_u64()), (Some(60), Some(60)), "{st}");
    let (status, text) = http_text(second.port, "GET", &format!("/jobs/{job}/results"), Some(KEY), b"");
    assert_eq!(status, 200);
    let got: Vec<String> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(got, ids, "every item exactly once, in input order");
}

/// Scale-out on one store: a server that runs no job items itself (`--job-concurrency 0`)
/// accepts a job, a `quarry worker` on the same store (serving no HTTP) runs every item, and
/// the server serves the results.
#[test]
fn a_worker_process_runs_the_jobs_a_server_accepts() {
    let state = StateDir::new();
    let Some(server) = start_in(&state.0, &["--job-concurrency", "0"]) else {
        return;
    };
    let model = common::model_path().unwrap();
    let mut worker = Command::new(env!("CARGO_BIN_EXE_quarry"))
        .args(["worker", "--kv-cache-tokens", "8192", "--state-dir"])
        .arg(&state.0)
        .arg("--model")
        .arg(&model)
        .stderr(Stdio::null())
        .spawn()
        .expect("start quarry worker");
    let body: String = (0..12)
        .map(|i| json!({"id": format!("w{i}"), "document": contact_document(i)}).to_string() + "\n")
        .collect();
    let job = submit_job(server.port, "schema_id=contact", body.as_bytes());
    let st = wait_for_job(server.port, &job);
    let _ = worker.kill();
    let _ = worker.wait();
    assert_eq!((st["ok"].as_u64(), st["total"].as_u64()), (Some(12), Some(12)), "{st}");
    let (_, text) = http_text(server.port, "GET", &format!("/jobs/{job}/results"), Some(KEY), b"");
    assert_eq!(text.lines().count(), 12);
}

/// A load balancer can tell starting from ready: the port answers at once, `GET /health` is a
/// 503 `{"status": "starting"}` (and the API a 503 `starting` with Retry-After) while the model
/// loads, then 200 `{"status": "ok"}`.
#[test]
fn health_tells_starting_from_ready() {
    let Some(model) = common::model_path() else { return };
    let state = StateDir::new();
    // A KV cache that takes a moment to back, so the starting state is seen.
    let mut child = Command::new(env!("CARGO_BIN_EXE_quarry"))
        .args(["serve", "--port", "0", "--kv-cache-memory", "2GiB", "--state-dir"])
        .arg(&state.0)
        .arg("--model")
        .arg(&model)
        .stderr(Stdio::piped())
        .spawn()
        .expect("start quarry serve");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let port: u16 = loop {
        let line = lines.next().expect("the server printed its address").unwrap();
        if let Some(addr) = line.strip_prefix("quarry: starting on http://") {
            break addr.rsplit(':').next().unwrap().parse().unwrap();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    let mut server = Server {
        child,
        port,
        log: Default::default(),
        state: Some(state),
    };
    let mut seen = Vec::new();
    let started = Instant::now();
    loop {
        let (status, body) = http(port, "GET", "/health", None, b"");
        if seen.last() != Some(&(status, body["status"].clone())) {
            seen.push((status, body["status"].clone()));
        }
        if status == 200 {
            break;
        }
        if seen.len() == 1 {
            let (status, err) = post(port, &json!({"schema_id": "contact", "document": "x"}));
            if status == 503 {
                assert_eq!(err["error"]["type"], "starting", "{err}");
            }
        }
        assert!(started.elapsed() < Duration::from_secs(120), "never ready: {seen:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        seen,
        vec![(503, json!("starting")), (200, json!("ok"))],
        "what /health said, in order"
    );
    let _ = server.child.kill();
    server.state.take();
}

/// Debian's chromium and chromium-driver, where installed (`apt-get install chromium
/// chromium-driver`; .ci/run installs them).
fn browser() -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    let on_path = |name: &str| {
        std::env::split_paths(&std::env::var_os("PATH")?)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    };
    Some((on_path("chromium")?, on_path("chromedriver")?))
}

/// A chromedriver on a loopback port, stopped on drop.
struct Driver {
    child: Child,
    port: u16,
}

impl Driver {
    fn start(binary: &std::path::Path) -> Driver {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(binary)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not listen on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        Driver { child, port }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One row of the page's record table: its pointer, value cell and confidence cell, and
/// whether it is flagged for review.
#[derive(Debug)]
struct PageRow {
    pointer: String,
    value: String,
    confidence: String,
    review: bool,
}

/// The review page in headless Chromium, as a user drives it: the page asks for the API key,
/// lists the ready-made schemas, takes the README's invoice, and shows the record as a table
/// whose fields, values, confidences and review flags are those `/extract` returns for the
/// same request; hovering a field marks its words in the document and hovering those words
/// marks the field. Saves a screenshot (ui-invoice.png in the test's temporary folder, or
/// QUARRY_UI_SCREENSHOT).
#[test]
fn the_review_page_shows_the_invoice_beside_its_document_in_a_browser() {
    let Some((chromium, chromedriver)) = browser() else {
        eprintln!("skipping: no chromium or chromedriver on PATH (apt-get install chromium chromium-driver)");
        return;
    };
    let Some(server) = start(&[]) else { return };
    let root = env!("CARGO_MANIFEST_DIR");
    let invoice = std::fs::read_to_string(format!("{root}/examples/documents/invoice.txt")).unwrap();
    let request = json!({"schema_id": "invoice", "document": invoice, "options": {"min_confidence": 0.5}});
    let (status, want) = http(
        server.port,
        "POST",
        "/extract",
        Some(KEY),
        request.to_string().as_bytes(),
    );
    assert_eq!((status, want["outcome"].as_str()), (200, Some("ok")), "{want}");
    let fields = want["fields"].as_array().unwrap().clone();
    let spanned = fields
        .iter()
        .find(|f| !f["span"].is_null())
        .expect("a field of the invoice found in the document")
        .clone();

    // A job of two invoices, to page through.
    let other = "INVOICE INV-77\nDate: 2025-04-01\n1 x Gadget ..... 9.99 USD\nTOTAL DUE: 9.99 USD\n";
    let docs = [invoice.clone(), other.to_string()];
    let body: String = docs.iter().map(|d| json!({"document": d}).to_string() + "\n").collect();
    let job = submit_job(server.port, "schema_id=invoice", body.as_bytes());
    wait_for_job(server.port, &job);

    let driver = Driver::start(&chromedriver);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (rows, marked, row_marked, shot, paged) = runtime.block_on(async {
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({"binary": chromium, "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                   "--disable-dev-shm-usage", "--window-size=1400,1000"]}),
        );
        let c = fantoccini::ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{}", driver.port))
            .await
            .expect("a chromium session");
        let seen = drive(&c, server.port, &invoice, &spanned, &job).await;
        c.close().await.ok();
        seen
    });

    // The table holds every field of the API's answer, once, with its value and confidence;
    // exactly the fields under min_confidence are flagged.
    let mut got: Vec<&str> = rows.iter().map(|r| r.pointer.as_str()).collect();
    let mut want_pointers: Vec<&str> = fields.iter().map(|f| f["pointer"].as_str().unwrap()).collect();
    got.sort();
    want_pointers.sort();
    assert_eq!(got, want_pointers, "{rows:?}");
    for f in &fields {
        let pointer = f["pointer"].as_str().unwrap();
        let row = rows.iter().find(|r| r.pointer == pointer).unwrap();
        let value = &want["data"].pointer(pointer).unwrap();
        // A number as the page's script prints it (20.0 reads 20): the same number.
        match value.as_f64() {
            Some(n) => assert_eq!(row.value.parse::<f64>().ok(), Some(n), "{pointer}: {}", row.value),
            None => {
                let shown = value.as_str().map_or_else(|| value.to_string(), str::to_string);
                assert_eq!(row.value, shown, "{pointer}");
            }
        }
        let c = f["confidence"].as_f64().unwrap();
        let on_page: f64 = row.confidence.parse().unwrap_or_else(|_| panic!("{row:?}"));
        assert!((on_page - c).abs() <= 0.005 + 1e-9, "{pointer}: {on_page} against {c}");
    }
    let mut flagged: Vec<&str> = rows.iter().filter(|r| r.review).map(|r| r.pointer.as_str()).collect();
    let mut review: Vec<&str> = want["review"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    flagged.sort();
    review.sort();
    assert_eq!(flagged, review);

    // Hovering the field marked exactly its span's words; hovering them marked the field.
    let span = &spanned["span"];
    let chars: Vec<char> = invoice.chars().collect();
    let words: String = chars[span["start"].as_u64().unwrap() as usize..span["end"].as_u64().unwrap() as usize]
        .iter()
        .collect();
    assert_eq!(marked, words, "{spanned}");
    assert!(row_marked, "hovering the words of {spanned} did not mark its row");

    // The job's results page one item at a time, each beside its own document.
    assert_eq!(paged.len(), 2, "{paged:?}");
    for (i, (position, document, leaves)) in paged.iter().enumerate() {
        assert!(position.ends_with(&format!("({} of 2)", i + 1)), "{position}");
        assert_eq!(document.trim(), docs[i].trim());
        assert!(*leaves > 0, "item {i} shows no fields");
    }

    let path = std::env::var("QUARRY_UI_SCREENSHOT")
        .unwrap_or_else(|_| format!("{}/ui-invoice.png", env!("CARGO_TARGET_TMPDIR")));
    std::fs::write(&path, &shot).unwrap();
    assert!(shot.starts_with(b"\x89PNG"), "a PNG screenshot");
    eprintln!("screenshot: {path}");
}

/// What the page showed of one job item: the pager's position, the document, how many fields.
type PagedItem = (String, String, usize);

/// Drives the page: key, schema, document, run; reads the table, hovers `spanned`'s row and
/// then its words; then loads `job` and pages through it. Returns the rows, the text marked by
/// the first hover, whether the second marked the row, a screenshot taken while the row is
/// hovered, and what each job item showed.
async fn drive(
    c: &fantoccini::Client,
    port: u16,
    invoice: &str,
    spanned: &Value,
    job: &str,
) -> (Vec<PageRow>, String, bool, Vec<u8>, Vec<PagedItem>) {
    use fantoccini::actions::{InputSource, MouseActions, PointerAction};
    use fantoccini::Locator::Css;
    let wait = Duration::from_secs(180);
    c.goto(&format!("http://127.0.0.1:{port}/ui")).await.unwrap();
    // The server has a key: the page asks for it.
    c.wait()
        .at_most(wait)
        .for_element(Css("#key-form:not([hidden])"))
        .await
        .unwrap();
    c.find(Css("#key")).await.unwrap().send_keys(KEY).await.unwrap();
    c.find(Css("#key-form button")).await.unwrap().click().await.unwrap();
    c.wait()
        .at_most(wait)
        .for_element(Css("#schema-id option[value='invoice']"))
        .await
        .unwrap();
    c.find(Css("#schema-id"))
        .await
        .unwrap()
        .select_by_value("invoice")
        .await
        .unwrap();
    c.find(Css("#document"))
        .await
        .unwrap()
        .send_keys(invoice)
        .await
        .unwrap();
    c.find(Css("#run")).await.unwrap().click().await.unwrap();
    c.wait()
        .at_most(wait)
        .for_element(Css("#record tbody tr.leaf"))
        .await
        .unwrap();
    let mut rows = Vec::new();
    for tr in c.find_all(Css("#record tbody tr.leaf")).await.unwrap() {
        let cells = tr.find_all(Css("td")).await.unwrap();
        rows.push(PageRow {
            pointer: tr.attr("data-pointer").await.unwrap().unwrap_or_default(),
            value: cells[1].text().await.unwrap(),
            confidence: cells[2]
                .text()
                .await
                .unwrap()
                .split_whitespace()
                .last()
                .unwrap_or("")
                .to_string(),
            review: tr.attr("class").await.unwrap().unwrap_or_default().contains("review"),
        });
    }
    let pointer = spanned["pointer"].as_str().unwrap();
    let selector = format!("#record tbody tr[data-pointer='{pointer}']");
    let hover = |element: fantoccini::elements::Element| {
        MouseActions::new("mouse".into()).then(PointerAction::MoveToElement {
            element,
            duration: None,
            x: 0.0,
            y: 0.0,
        })
    };
    let row = c.find(Css(&selector)).await.unwrap();
    c.perform_actions(hover(row)).await.unwrap();
    let mut marked = String::new();
    for el in c.find_all(Css("#doc-view .span.hl")).await.unwrap() {
        marked.push_str(&el.text().await.unwrap());
    }
    let shot = c.screenshot().await.unwrap();
    // Its words: the first piece of the document that names the field.
    let mut row_marked = false;
    for el in c.find_all(Css("#doc-view .span")).await.unwrap() {
        let pointers: Vec<String> =
            serde_json::from_str(&el.attr("data-pointers").await.unwrap().unwrap_or_default()).unwrap_or_default();
        if pointers.iter().any(|p| p == pointer) {
            c.perform_actions(hover(el)).await.unwrap();
            let class = c.find(Css(&selector)).await.unwrap().attr("class").await.unwrap();
            row_marked = class.is_some_and(|k| k.split(' ').any(|k| k == "hl"));
            break;
        }
    }
    c.find(Css("#job-id")).await.unwrap().send_keys(job).await.unwrap();
    c.find(Css("#job-form button[type=submit]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    c.wait()
        .at_most(wait)
        .for_element(Css("#pager:not([hidden])"))
        .await
        .unwrap();
    let mut paged = Vec::new();
    for i in 0..2 {
        if i > 0 {
            c.find(Css("#next")).await.unwrap().click().await.unwrap();
        }
        paged.push((
            c.find(Css("#position")).await.unwrap().text().await.unwrap(),
            c.find(Css("#doc-view")).await.unwrap().text().await.unwrap(),
            c.find_all(Css("#record tbody tr.leaf")).await.unwrap().len(),
        ));
    }
    (rows, marked, row_marked, shot, paged)
}

/// With `--log-format json` every log line is a JSON object, and a request's lines carry its
/// id: the caller's `X-Request-Id`, or one the server makes; the response names it either way.
#[test]
fn json_logs_carry_each_requests_id() {
    let Some(server) = start(&["--log-format", "json"]) else {
        return;
    };
    let get = |extra: &str| {
        let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
        write!(
            s,
            "GET /schemas HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n{extra}Connection: close\r\n\r\n"
        )
        .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        let head = raw.split_once("\r\n\r\n").unwrap().0.to_ascii_lowercase();
        head.lines()
            .find_map(|l| l.strip_prefix("x-request-id: ").map(str::to_string))
            .expect("an x-request-id in the response")
    };
    assert_eq!(get("X-Request-Id: trace-me-42\r\n"), "trace-me-42");
    let made = get("");
    assert!(!made.is_empty() && made != "trace-me-42");
    // A header no log should carry (a space) is replaced.
    assert_ne!(get("X-Request-Id: two words\r\n"), "two words");
    let deadline = Instant::now() + Duration::from_secs(10);
    let done = |id: &str| {
        server.log.lock().unwrap().iter().find_map(|l| {
            let v: Value = serde_json::from_str(l).ok()?;
            (v["span"]["id"] == id && v["fields"]["message"] == "quarry: request done").then_some(v)
        })
    };
    let (mine, theirs) = loop {
        if let (Some(a), Some(b)) = (done("trace-me-42"), done(&made)) {
            break (a, b);
        }
        assert!(Instant::now() < deadline, "{:?}", server.log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(50));
    };
    for v in [&mine, &theirs] {
        assert_eq!(v["fields"]["status"], 200, "{v}");
        assert_eq!(
            (v["span"]["method"].as_str(), v["span"]["path"].as_str()),
            (Some("GET"), Some("/schemas")),
            "{v}"
        );
        assert_eq!(v["level"], "INFO", "{v}");
    }
    for line in server.log.lock().unwrap().iter() {
        assert!(serde_json::from_str::<Value>(line).is_ok(), "not JSON: {line}");
    }
}
