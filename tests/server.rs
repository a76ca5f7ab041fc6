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

use serde_json::{json, Value};

const KEY: &str = "test-key-123";

struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(extra: &[&str]) -> Option<Server> {
    let model = common::model_path()?;
    let mut child = Command::new(env!("CARGO_BIN_EXE_quarry"))
        .args(["serve", "--port", "0", "--api-key", KEY, "--kv-cache-tokens", "8192"])
        .args(extra)
        .arg("--model")
        .arg(&model)
        .arg("--schemas")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/schemas"))
        .stderr(Stdio::piped())
        .spawn()
        .expect("start quarry serve");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let port = loop {
        let line = lines.next().expect("the server printed its address").unwrap();
        if let Some(addr) = line.strip_prefix("quarry: listening on http://") {
            break addr.rsplit(':').next().unwrap().parse().unwrap();
        }
    };
    // Keep draining stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Some(Server { child, port })
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

    // The same schema inline, with too few tokens to close: truncated, never ok.
    let (status, out) = post(
        port,
        &json!({"schema": schema, "document": document, "options": {"max_tokens": 5}}),
    );
    assert_eq!((status, out["outcome"].as_str()), (200, Some("truncated")), "{out}");
    assert!(
        out["data"].is_null() && !out["partial"].as_str().unwrap().is_empty(),
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
    for line in [
        "quarry_extractions_total{outcome=\"ok\"}",
        "quarry_extractions_total{outcome=\"truncated\"} 1",
        "quarry_extractions_total{outcome=\"unknown_schema_id\"} 1",
        "quarry_extractions_total{outcome=\"schema_rejected\"} 1",
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

/// Sends an extraction that would run for thousands of tokens and waits until it runs;
/// dropping the returned socket hangs up.
fn start_long_request(port: u16) -> TcpStream {
    let long = json!({
        "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 3000},
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
    drop(busy);
}

#[test]
fn sigterm_lets_running_requests_finish() {
    let Some(mut server) = start(&[]) else { return };
    let port = server.port;
    let body = json!({
        "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 3000},
        "document": "Write numbers.",
        "options": {"max_tokens": 48}
    })
    .to_string();
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
    assert_eq!((status, out["outcome"].as_str()), (200, Some("truncated")), "{out}");
    assert_eq!(out["usage"]["completion_tokens"], 48, "{out}");
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
}

/// The official OpenAI Python client, from the venv scripts/test sets up
/// (`$QUARRY_CLIENT_PYTHON`, made by scripts/setup-clients).
#[test]
fn the_official_openai_python_client_works_unchanged() {
    let Some(python) = std::env::var_os("QUARRY_CLIENT_PYTHON") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the tests through scripts/test"
        );
        eprintln!("skipping: QUARRY_CLIENT_PYTHON unset (scripts/test sets it up)");
        return;
    };
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

#[test]
fn a_jsonl_batch_job_runs_every_item_once_and_retries_the_failed() {
    let Some(server) = start(&[]) else { return };
    let port = server.port;
    let names = [
        "Ada Lovelace",
        "Grace Hopper",
        "Alan Turing",
        "Edsger Dijkstra",
        "Barbara Liskov",
    ];
    let mut body = String::new();
    let mut ids = Vec::new();
    for i in 0..40 {
        let name = names[i % names.len()];
        let id = format!("doc-{i}");
        // Item 7 is far too long for the model: it fails alone, the job goes on.
        let document = if i == 7 {
            "word ".repeat(20_000)
        } else {
            format!(
                "{name} <{}@example.org>, phone +1 555 01{i:02}, works at Initech.",
                name.split(' ').next().unwrap().to_lowercase()
            )
        };
        body.push_str(&json!({"id": id, "document": document}).to_string());
        body.push('\n');
        ids.push(id);
    }
    let (status, job) = http(port, "POST", "/jobs?schema_id=contact", Some(KEY), body.as_bytes());
    assert_eq!(status, 202, "{job}");
    assert_eq!(job["total"], 40);
    let id = job["job_id"].as_str().unwrap().to_string();
    let wait = |what: &str| {
        let started = Instant::now();
        loop {
            let (_, st) = http(port, "GET", &format!("/jobs/{id}"), Some(KEY), b"");
            if st["done"] == true {
                return st;
            }
            assert!(
                started.elapsed() < Duration::from_secs(300),
                "{what} never finished: {st}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let st = wait("the job");
    assert_eq!(
        (st["ok"].as_u64().unwrap() + st["failed"].as_u64().unwrap()),
        40,
        "{st}"
    );
    assert!(st["failed"].as_u64().unwrap() >= 1, "{st}");
    let (status, text) = http_text(port, "GET", &format!("/jobs/{id}/results"), Some(KEY), b"");
    assert_eq!(status, 200);
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let got: Vec<&str> = lines.iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(
        got,
        ids.iter().map(String::as_str).collect::<Vec<_>>(),
        "every item once, in order"
    );
    assert_eq!(lines[7]["outcome"], "input_too_long", "{}", lines[7]);
    let contact: Value = serde_json::from_str(include_str!("../schemas/contact.json")).unwrap();
    let validator = jsonschema::validator_for(&contact).unwrap();
    for l in lines.iter().filter(|l| l["outcome"] == "ok") {
        assert!(validator.is_valid(&l["data"]), "{l}");
    }
    let ok_before = st["ok"].clone();
    let (status, again) = http(port, "POST", &format!("/jobs/{id}/retry"), Some(KEY), b"");
    assert_eq!(status, 202, "{again}");
    let st = wait("the retry");
    assert_eq!(
        st["ok"], ok_before,
        "a retry leaves the items that succeeded alone: {st}"
    );
    let (_, text) = http_text(port, "GET", &format!("/jobs/{id}/results"), Some(KEY), b"");
    assert_eq!(text.lines().count(), 40);

    let (status, out) = http(
        port,
        "POST",
        "/jobs?schema_id=contact",
        Some(KEY),
        b"{\"document\": \"a\"}\nnot json\n",
    );
    assert_eq!(
        (status, out["error"]["type"].as_str()),
        (400, Some("bad_request")),
        "{out}"
    );
    assert!(out["error"]["message"].as_str().unwrap().starts_with("line 2"), "{out}");
    let (status, out) = http(port, "GET", "/jobs/job-999", Some(KEY), b"");
    assert_eq!((status, out["error"]["type"].as_str()), (404, Some("unknown_job")));
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
