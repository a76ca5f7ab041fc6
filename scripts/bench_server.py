"""Load and abuse benchmarks of a running `quarry serve` (scripts/bench-load, scripts/bench-abuse
start one and call this). Needs httpx (in the clients venv of scripts/setup-clients).

  bench_server.py load  URL KEY PID [--clients 64] [--seconds 60] [--job-items 100] [--procs N]
  bench_server.py store URL KEY PID [--clients 32] [--seconds 60] [--rounds 2]
  bench_server.py abuse URL KEY PID [--bad 1000]

load: CLIENTS concurrent clients (spread over PROCS processes) post /extract back to back for
SECONDS while a batch job of JOB_ITEMS documents runs beside them; prints latency percentiles,
throughput, status counts, the server's memory over time, and checks the job's results hold
every item exactly once.
store: what the job store costs the extraction throughput. The same documents at the same
concurrency, alternately posted to /extract by CLIENTS clients and run as a batch (endpoint
/extract) by the server's worker (its --job-concurrency, 32 by default: keep CLIENTS equal to
it), SECONDS each, ROUNDS times; engine output tokens/s from /metrics over each window.
abuse: BAD malformed, oversized or unauthorized requests (to /extract, /jobs, the OpenAI and
the Batch endpoints) interleaved with good extractions; every bad one must get a 4xx with a
JSON error body (no transport error), every good one an `ok` record.
Exits non-zero when a check fails."""
import argparse
import asyncio
import concurrent.futures
import os
import json
import random
import statistics
import sys
import time

import httpx

NAMES = ["Ada Lovelace", "Grace Hopper", "Alan Turing", "Edsger Dijkstra", "Barbara Liskov", "Ken Thompson"]
COMPANIES = ["Initech", "Globex", "Umbrella", "Hooli", "Acme", "Stark Industries"]


def contact_document(i):
    name = NAMES[i % len(NAMES)]
    first = name.split()[0].lower()
    return f"{name} <{first}{i}@example.org>, phone +1 555 {i % 10000:04d}, works at {COMPANIES[i % len(COMPANIES)]}."


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def load_clients(url, key, clients, seconds, first, stride):
    """One process's share of the load's clients (Python's HTTP stack costs more CPU a request
    than the server does: one process would set the pace). Document i goes to the process with
    i = first (mod stride)."""
    return asyncio.run(load_clients_async(url, key, clients, seconds, first, stride))


async def load_clients_async(url, key, clients, seconds, first, stride):
    headers = {"authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    latencies, statuses, outcomes, tokens, failures = [], {}, {}, 0, []
    counter = iter(range(first, 10**9, stride))
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as http:

        async def client():
            nonlocal tokens
            while time.monotonic() < deadline:
                i = next(counter)
                t = time.monotonic()
                try:
                    r = await http.post("/extract", json={"schema_id": "contact", "document": contact_document(i)})
                except httpx.HTTPError as e:
                    statuses["transport"] = statuses.get("transport", 0) + 1
                    failures.append(f"transport error: {e!r}")
                    continue
                latencies.append(time.monotonic() - t)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    out = r.json()
                    outcomes[out["outcome"]] = outcomes.get(out["outcome"], 0) + 1
                    tokens += out["usage"]["completion_tokens"]

        await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, statuses, outcomes, tokens, failures


async def load(args):
    headers = {"authorization": f"Bearer {args.key}"}
    failures = []
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600) as http:
        # A batch job beside the interactive traffic.
        ids = [f"job-item-{i}" for i in range(args.job_items)]
        body = "".join(json.dumps({"id": id_, "document": contact_document(1000 + i)}) + "\n" for i, id_ in enumerate(ids))
        r = await http.post("/jobs", params={"schema_id": "contact"}, content=body)
        job = r.json()["job_id"] if r.status_code == 202 else None
        if job is None:
            failures.append(f"job not accepted: {r.status_code} {r.text}")

        procs = max(1, min(args.procs, args.clients))
        shares = [args.clients // procs + (p < args.clients % procs) for p in range(procs)]
        deadline = time.monotonic() + args.seconds
        memory = [(0.0, rss_mib(args.pid))]
        started = time.monotonic()

        async def sample_memory():
            while time.monotonic() < deadline:
                await asyncio.sleep(5)
                memory.append((time.monotonic() - started, rss_mib(args.pid)))

        loop = asyncio.get_running_loop()
        with concurrent.futures.ProcessPoolExecutor(procs) as pool:
            parts = [
                loop.run_in_executor(pool, load_clients, args.url, args.key, n, args.seconds, p, procs)
                for p, n in enumerate(shares)
            ]
            done = (await asyncio.gather(sample_memory(), *parts))[1:]
        elapsed = time.monotonic() - started
        memory.append((elapsed, rss_mib(args.pid)))
        latencies, statuses, outcomes, tokens = [], {}, {}, 0
        for lat, st, out, tok, fail in done:
            latencies += lat
            tokens += tok
            failures += fail
            for k, v in st.items():
                statuses[k] = statuses.get(k, 0) + v
            for k, v in out.items():
                outcomes[k] = outcomes.get(k, 0) + v

        job_line = "no job"
        if job:
            while True:
                st = (await http.get(f"/jobs/{job}")).json()
                if st["done"]:
                    break
                await asyncio.sleep(0.5)
            text = (await http.get(f"/jobs/{job}/results")).text
            got = [json.loads(line)["id"] for line in text.splitlines()]
            lost = set(ids) - set(got)
            dup = len(got) - len(set(got))
            job_line = f"{len(got)} results for {len(ids)} items, {len(lost)} lost, {dup} duplicated, {st['ok']} ok"
            if lost or dup or got != ids:
                failures.append(f"job results wrong: {job_line}")
        health = (await http.get("/health")).json()

    n = len(latencies)
    fivexx = sum(c for s, c in statuses.items() if isinstance(s, int) and s >= 500)
    if fivexx:
        failures.append(f"{fivexx} responses were 5xx")
    mem = [m for _, m in memory]
    print(f"## load: {args.clients} clients, {args.seconds} s, POST /extract (contact schema), a {args.job_items}-item job beside")
    print()
    print("| requests | req/s | output tok/s | p50 s | p90 s | p99 s | max s | statuses | outcomes |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {n} | {n / elapsed:.2f} | {tokens / elapsed:.1f} | {percentile(latencies, 50):.2f} | "
        f"{percentile(latencies, 90):.2f} | {percentile(latencies, 99):.2f} | {max(latencies, default=float('nan')):.2f} | "
        f"{json.dumps({str(k): v for k, v in statuses.items()})} | {json.dumps(outcomes)} |"
    )
    print()
    print(f"job: {job_line}")
    print("server RSS (MiB) every 5 s: " + " ".join(f"{m:.0f}" for m in mem))
    # Stable: over the second half of the run memory stays within 10% (allocator noise).
    warm = mem[len(mem) // 2 :]
    growth = (max(warm) - warm[0]) / warm[0] if warm and warm[0] else float("nan")
    print(f"RSS growth over the second half: {growth * 100:.1f}%")
    if growth > 0.10:
        failures.append(f"memory grew {growth * 100:.1f}% under steady load")
    if health["kv_blocks_free"] != health["kv_blocks_total"] or health["running"] or health["waiting"]:
        failures.append(f"after the run the engine is not idle with every KV block free: {health}")
    print(f"after: {health}")
    return failures


async def completion_tokens(http):
    text = (await http.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("quarry_completion_tokens_total "):
            return float(line.split()[1])
    raise RuntimeError("no quarry_completion_tokens_total in /metrics")


async def wait_idle(http):
    while True:
        h = (await http.get("/health")).json()
        if not h["running"] and not h["waiting"]:
            return
        await asyncio.sleep(0.2)


async def store(args):
    headers = {"authorization": f"Bearer {args.key}"}
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    failures, rows = [], []
    counter = iter(range(10**9))
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600, limits=limits) as http:

        async def direct():
            deadline = time.monotonic() + args.seconds
            done = 0

            async def client():
                nonlocal done
                while time.monotonic() < deadline:
                    r = await http.post("/extract", json={"schema_id": "contact", "document": contact_document(next(counter))})
                    if r.status_code != 200 or r.json()["outcome"] != "ok":
                        failures.append(f"/extract: {r.status_code} {r.text[:200]}")
                    done += 1

            await asyncio.gather(*(client() for _ in range(args.clients)))
            return done

        async def through_store():
            # More lines than the window can run; the rest are cancelled after it.
            lines = "".join(
                json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/extract",
                            "body": {"schema_id": "contact", "document": contact_document(next(counter))}}) + "\n"
                for i in range(args.clients * int(args.seconds) * 4)
            )
            f = (await http.post("/v1/files", files={"file": ("in.jsonl", lines.encode())}, data={"purpose": "batch"})).json()
            b = (await http.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/extract", "completion_window": "24h"})).json()
            await asyncio.sleep(args.seconds)
            before = (await http.get(f"/v1/batches/{b['id']}")).json()["request_counts"]["completed"]
            r = await http.post(f"/v1/batches/{b['id']}/cancel")
            if r.status_code != 200:
                failures.append(f"cancel: {r.status_code} {r.text[:200]}")
            return before

        for round_ in range(args.rounds):
            for name, phase in (("POST /extract", direct), ("batch through the store", through_store)):
                await wait_idle(http)
                t0, c0 = time.monotonic(), await completion_tokens(http)
                n = await phase()
                t1, c1 = time.monotonic(), await completion_tokens(http)
                rows.append((round_ + 1, name, n, (c1 - c0) / (t1 - t0)))
        await wait_idle(http)

    print(f"## store: {args.clients} at a time, {args.seconds} s windows, {args.rounds} rounds; engine output tok/s from /metrics")
    print()
    print("| round | path | requests finished | output tok/s |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} |")
    direct_tps = statistics.mean(r[3] for r in rows if r[1] == "POST /extract")
    store_tps = statistics.mean(r[3] for r in rows if r[1] != "POST /extract")
    print()
    print(f"mean: direct {direct_tps:.1f} tok/s, through the store {store_tps:.1f} tok/s, "
          f"ratio {store_tps / direct_tps:.3f} (store cost {100 * (1 - store_tps / direct_tps):.1f}%)")
    return failures


def multipart(fields, boundary="quarry-bench"):
    body = b""
    for name, value, filename in fields:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"
    return body + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def bad_requests(rng, key):
    """(method, path, headers, body, expected status or None for any 4xx), varied."""
    auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    big = "x" * (5 << 20)
    files_wrong_purpose, files_type = multipart([("purpose", b"fine-tune", None), ("file", b"{}\n", "a.jsonl")])
    files_no_file, _ = multipart([("purpose", b"batch", None)])
    deep = {"type": "object", "properties": {}}
    node = deep
    for _ in range(200):
        child = {"type": "object", "properties": {}}
        node["properties"]["a"] = child
        node = child
    cases = [
        ("POST", "/extract", auth, b'{"schema_id": ', 400),
        ("POST", "/extract", auth, b"\xff\xfe not utf-8", 400),
        ("POST", "/extract", auth, json.dumps({"schema_id": "contact", "document": "x", "colour": 1}), 422),
        ("POST", "/extract", auth, json.dumps({"schema_id": "contact"}), 422),
        ("POST", "/extract", auth, json.dumps({"schema_id": "contact", "document": 12}), 422),
        ("POST", "/extract", auth, json.dumps({"schema_id": "no-such", "document": "x"}), 404),
        ("POST", "/extract", auth, json.dumps({"document": "x"}), 400),
        ("POST", "/extract", auth, json.dumps({"schema_id": "contact", "document": "x", "options": {"max_tokens": 0}}), 400),
        ("POST", "/extract", auth, json.dumps({"schema_id": "contact", "document": "x", "options": {"max_tokens": -3}}), 422),
        ("POST", "/extract", auth, json.dumps({"schema_id": "contact", "document": "x", "options": {"whitespace": "lots"}}), 422),
        ("POST", "/extract", auth, json.dumps({"schema_id": "contact", "document": big}), 413),
        ("POST", "/extract", auth, json.dumps({"schema_id": "contact", "document": "word " * 20000}), 400),
        ("POST", "/extract", auth, json.dumps({"schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}, "document": "x"}), 400),
        ("POST", "/extract", auth, json.dumps({"schema": {"type": "strnig"}, "document": "x"}), 400),
        ("POST", "/extract", auth, json.dumps({"schema": {"type": "string", "pattern": "(unclosed"}, "document": "x"}), 400),
        ("POST", "/extract", auth, json.dumps({"schema": {"type": "array", "uniqueItems": True}, "document": "x", "options": {"strict": True}}), 400),
        ("POST", "/extract", auth, json.dumps({"schema": deep, "document": "x"}), None),
        ("POST", "/extract", auth, json.dumps({"schema": 17, "document": "x"}), None),
        ("POST", "/extract", {"content-type": "application/json"}, json.dumps({"schema_id": "contact", "document": "x"}), 401),
        ("POST", "/extract", {**auth, "authorization": "Bearer wrong"}, json.dumps({"schema_id": "contact", "document": "x"}), 401),
        ("POST", "/extract", {**auth, "content-type": "text/plain"}, json.dumps({"schema_id": "contact", "document": "x"}), 415),
        ("POST", "/schemas", auth, json.dumps({"schema": {"type": "object", "required": 5}}), 400),
        ("POST", "/schemas", auth, b"[]", 422),
        ("GET", "/schemas/s-nope", auth, b"", 404),
        ("POST", "/jobs?schema_id=contact", auth, b'{"document": "a"}\nnot json\n', 400),
        ("POST", "/jobs?schema_id=contact&format=csv", auth, b"id,text\n1,a\n", 400),
        ("POST", "/jobs?schema_id=contact&format=yaml", auth, b'{"document": "a"}\n', 400),
        ("POST", "/jobs?schema_id=nope", auth, b'{"document": "a"}\n', 404),
        ("GET", "/jobs/job-999999", auth, b"", 404),
        ("POST", "/jobs/job-999999/retry", auth, b"", 404),
        ("GET", "/no/such/route", auth, b"", 404),
        ("POST", "/v1/chat/completions", auth, json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}), 404),
        ("POST", "/v1/chat/completions", auth, json.dumps({"messages": "hi"}), 422),
        ("POST", "/v1/chat/completions", auth, json.dumps({"model": "x", "messages": [], "n": 1000}), None),
        ("POST", "/v1/completions", auth, json.dumps({"model": "x", "prompt": "hi", "max_tokens": -1}), 422),
        ("POST", "/v1/completions", auth, json.dumps({"model": "x", "prompt": "hi", "stream": "yes"}), 422),
        ("POST", "/v1/chat/completions", auth, json.dumps({"model": "x", "messages": [{"role": "user", "content": big}]}), 413),
        ("POST", "/v1/chat/completions", auth, json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strnig"}}}}), 400),
        ("POST", "/v1/chat/completions", {"content-type": "application/json"}, json.dumps({"model": "x", "messages": []}), 401),
        # The Batch and Files API.
        ("POST", "/v1/files", auth, json.dumps({"purpose": "batch"}), None),
        ("POST", "/v1/files", {**auth, "content-type": files_type}, files_wrong_purpose, 400),
        ("POST", "/v1/files", {**auth, "content-type": files_type}, files_no_file, 400),
        ("POST", "/v1/files", {**auth, "content-type": files_type}, b"--quarry-bench\r\nnot a part", None),
        ("GET", "/v1/files/file-nope", auth, b"", 404),
        ("GET", "/v1/files/file-nope/content", auth, b"", 404),
        ("GET", "/v1/files/batch_output_nope/content", auth, b"", 404),
        ("POST", "/v1/batches", auth, json.dumps({"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"}), 404),
        ("POST", "/v1/batches", auth, json.dumps({"input_file_id": "file-nope", "endpoint": "/v1/embeddings", "completion_window": "24h"}), 400),
        ("POST", "/v1/batches", auth, json.dumps({"input_file_id": "file-nope", "endpoint": "/extract", "completion_window": "1h"}), 400),
        ("POST", "/v1/batches", auth, json.dumps({"endpoint": "/extract"}), 422),
        ("POST", "/v1/batches", auth, b"[", 400),
        ("GET", "/v1/batches/batch_nope", auth, b"", 404),
        ("POST", "/v1/batches/batch_nope/cancel", auth, b"", 404),
        ("GET", "/v1/batches?limit=0", auth, b"", 400),
        ("GET", "/v1/batches?limit=many", auth, b"", 400),
        ("GET", "/v1/batches", {}, b"", 401),
    ]
    while True:
        yield rng.choice(cases)


async def abuse(args):
    rng = random.Random(7)
    headers_json = {"authorization": f"Bearer {args.key}"}
    failures = []
    bad_statuses, good_outcomes = {}, {}
    async with httpx.AsyncClient(base_url=args.url, timeout=600, limits=httpx.Limits(max_connections=40)) as http:
        models = (await http.get("/v1/models", headers=headers_json)).json()
        model = models["data"][0]["id"]
        cases = bad_requests(rng, args.key)
        sem = asyncio.Semaphore(32)

        async def send_bad(case):
            method, path, headers, body, want = case
            if path.startswith("/v1/") and "gpt-4" not in str(body) and isinstance(body, str):
                body = body.replace('"x"', json.dumps(model))
            async with sem:
                try:
                    r = await http.request(method, path, headers=headers, content=body)
                except httpx.HTTPError as e:
                    failures.append(f"{method} {path}: transport error {e!r}")
                    return
            bad_statuses[r.status_code] = bad_statuses.get(r.status_code, 0) + 1
            try:
                err = r.json()["error"]
                typed = isinstance(err["type"], str) and isinstance(err["message"], str) and err["message"]
            except (ValueError, KeyError, TypeError):
                typed = False
            if not (400 <= r.status_code < 500) or (want is not None and r.status_code != want) or not typed:
                failures.append(f"{method} {path} {str(body)[:80]!r}: {r.status_code} (want {want or '4xx'}) {r.text[:200]}")

        async def send_good(i):
            async with sem:
                r = await http.post("/extract", headers=headers_json, json={"schema_id": "contact", "document": contact_document(i), "options": {"max_tokens": 128}})
            outcome = r.json().get("outcome") if r.status_code == 200 else r.status_code
            good_outcomes[outcome] = good_outcomes.get(outcome, 0) + 1
            if outcome != "ok":
                failures.append(f"good request {i}: {r.status_code} {r.text[:200]}")

        tasks = []
        good = 0
        started = time.monotonic()
        for i in range(args.bad):
            tasks.append(send_bad(next(cases)))
            if i % 10 == 0:
                tasks.append(send_good(good))
                good += 1
        rng.shuffle(tasks)
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - started
        health = (await http.get("/health")).json()
    print(f"## abuse: {args.bad} bad requests interleaved with {good} good extractions, {elapsed:.1f} s")
    print()
    print(f"bad requests by status: {json.dumps({str(k): v for k, v in sorted(bad_statuses.items())})}")
    print(f"good requests by outcome: {json.dumps({str(k): v for k, v in good_outcomes.items()})}")
    print(f"server RSS after: {rss_mib(args.pid):.0f} MiB; {health}")
    if health["kv_blocks_free"] != health["kv_blocks_total"]:
        failures.append(f"KV blocks leaked: {health}")
    return failures


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["load", "store", "abuse"])
    p.add_argument("url")
    p.add_argument("key")
    p.add_argument("pid", type=int)
    p.add_argument("--clients", type=int, default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--job-items", type=int, default=100)
    p.add_argument("--procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)), help="client processes (load)")
    p.add_argument("--bad", type=int, default=1000)
    args = p.parse_args()
    if args.clients is None:
        args.clients = 32 if args.mode == "store" else 64
    failures = asyncio.run({"load": load, "store": store, "abuse": abuse}[args.mode](args))
    print()
    if failures:
        print(f"FAILED: {len(failures)} problems")
        kinds = {}
        for f in failures:
            kinds.setdefault(f[:160], []).append(f)
        for same in list(kinds.values())[:30]:
            print(f"  {len(same)} x {same[0][:400]}")
        sys.exit(1)
    print("PASSED: every check held")


if __name__ == "__main__":
    main()
