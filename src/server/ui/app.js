// The review page: runs /extract (or pages a job's results) and shows the record as a table
// beside its document, each field linked both ways to the words it came from. Plain DOM, no
// build step; the API key, where the server asks for one, lives in this tab's sessionStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { items: [], at: 0 };

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers);
  const key = sessionStorage.getItem("quarry-key");
  if (key) headers.Authorization = "Bearer " + key;
  const res = await fetch(path, Object.assign({}, options, { headers }));
  if (res.status === 401) {
    $("key-form").hidden = false;
    throw new Error("this server wants an API key (top right)");
  }
  const text = await res.text();
  if (!res.ok) {
    let message = text;
    try {
      const e = JSON.parse(text).error;
      message = `${e.type}: ${e.message}`;
    } catch (_) { /* not JSON: show it as it came */ }
    throw new Error(`${res.status} ${message}`);
  }
  return text;
}

function say(text, error = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", error);
}

async function loadSchemas() {
  const { schema_ids } = JSON.parse(await api("/schemas"));
  const select = $("schema-id");
  for (const id of schema_ids) {
    const o = document.createElement("option");
    o.value = o.textContent = id;
    select.appendChild(o);
  }
  if (schema_ids.length) select.value = schema_ids.includes("invoice") ? "invoice" : schema_ids[0];
  $("schema-text").hidden = select.value !== "";
}

// A JSON pointer's reference token.
const token = (s) => s.replace(/~/g, "~0").replace(/\//g, "~1");

// The record as rows: objects and arrays open a row and indent their members; every leaf
// (a scalar, or an empty array or object) is a row of its own with its pointer.
function recordRows(node, pointer, label, depth, out) {
  const array = Array.isArray(node);
  const object = node !== null && typeof node === "object" && !array;
  const members = array ? node.map((v, i) => [String(i), v, `[${i}]`])
    : object ? Object.entries(node).map(([k, v]) => [k, v, k]) : [];
  if (members.length === 0) {
    out.push({ depth, label: label ?? "(record)", pointer, value: node, leaf: true });
    return out;
  }
  if (label !== null) out.push({ depth, label, pointer, leaf: false });
  for (const [seg, v, l] of members) recordRows(v, `${pointer}/${token(seg)}`, l, label === null ? depth : depth + 1, out);
  return out;
}

// The document as text with every field's span marked. Spans count Unicode scalar values, so
// the text is cut by code points; where spans overlap, a piece belongs to each of them.
function renderDocument(text, fields) {
  const view = $("doc-view");
  view.replaceChildren();
  const marks = new Map();
  if (text === null) {
    view.textContent = "(the document is not available here)";
    return marks;
  }
  const chars = Array.from(text);
  const spans = fields.filter((f) => f.span).map((f) => [f.span.start, f.span.end, f.pointer]);
  const cuts = new Set([0, chars.length]);
  for (const [s, e] of spans) { cuts.add(s); cuts.add(e); }
  const points = [...cuts].filter((c) => c >= 0 && c <= chars.length).sort((a, b) => a - b);
  for (let i = 0; i + 1 < points.length; i++) {
    const [a, b] = [points[i], points[i + 1]];
    const piece = chars.slice(a, b).join("");
    const covering = spans.filter(([s, e]) => s <= a && b <= e).map(([, , p]) => p);
    if (covering.length === 0) {
      view.appendChild(document.createTextNode(piece));
      continue;
    }
    const el = document.createElement("span");
    el.className = "span";
    el.textContent = piece;
    el.dataset.pointers = JSON.stringify(covering);
    el.addEventListener("mouseenter", () => covering.forEach((p) => highlight(p, true)));
    el.addEventListener("mouseleave", () => covering.forEach((p) => highlight(p, false)));
    view.appendChild(el);
    for (const p of covering) {
      if (!marks.has(p)) marks.set(p, []);
      marks.get(p).push(el);
    }
  }
  return marks;
}

let docMarks = new Map();

function highlight(pointer, on) {
  for (const row of document.querySelectorAll("#record tbody tr")) {
    if (row.dataset.pointer === pointer) row.classList.toggle("hl", on);
  }
  for (const el of docMarks.get(pointer) || []) el.classList.toggle("hl", on);
  if (on && docMarks.has(pointer)) docMarks.get(pointer)[0].scrollIntoView({ block: "nearest" });
}

function renderRecord(result, documentText, min) {
  const fields = result.fields || [];
  const byPointer = new Map(fields.map((f) => [f.pointer, f]));
  const review = new Set(result.review || fields.filter((f) => f.confidence !== null && f.confidence < min).map((f) => f.pointer));
  docMarks = renderDocument(documentText, fields);
  const body = $("record").querySelector("tbody");
  body.replaceChildren();
  const rows = result.data === null || result.data === undefined ? [] : recordRows(result.data, "", null, 0, []);
  for (const r of rows) {
    const tr = document.createElement("tr");
    tr.dataset.pointer = r.pointer;
    const key = document.createElement("td");
    key.className = "key";
    key.style.paddingLeft = `${0.4 + 1.2 * r.depth}rem`;
    key.textContent = r.label;
    const value = document.createElement("td");
    value.className = "value";
    const conf = document.createElement("td");
    if (r.leaf) {
      tr.classList.add("leaf");
      value.textContent = typeof r.value === "string" ? r.value : JSON.stringify(r.value);
      const f = byPointer.get(r.pointer);
      if (f && f.confidence !== null && f.confidence !== undefined) {
        conf.innerHTML = `<span class="bar"><span style="width:${(100 * f.confidence).toFixed(1)}%"></span></span>` +
          `<span class="conf">${f.confidence.toFixed(2)}</span>`;
      }
      if (review.has(r.pointer)) tr.classList.add("review");
      if (f && typeof r.value === "string" && r.value.trim() && !f.span && documentText !== null) tr.classList.add("unfound");
      tr.addEventListener("mouseenter", () => highlight(r.pointer, true));
      tr.addEventListener("mouseleave", () => highlight(r.pointer, false));
    }
    tr.append(key, value, conf);
    body.appendChild(tr);
  }
  const notes = $("notes");
  notes.replaceChildren();
  for (const n of result.notes || []) {
    const li = document.createElement("li");
    li.textContent = `${n.keyword} at "${n.pointer}": ${n.status}${n.detail ? ", " + n.detail : ""}`;
    notes.appendChild(li);
  }
  const parts = [`outcome: ${result.outcome}`];
  if (review.size) parts.push(`${review.size} of ${fields.length} fields to review (confidence below ${min})`);
  if (result.usage) parts.push(`${result.usage.completion_tokens} output tokens`);
  if (result.timings) parts.push(`${Math.round(result.timings.total_ms)} ms`);
  if (result.error) parts.push(result.error);
  $("summary").textContent = parts.join(" · ");
}

async function extract(event) {
  event.preventDefault();
  const min = Number($("min-confidence").value);
  const documentText = $("document").value;
  const body = { document: documentText, options: { min_confidence: min } };
  const id = $("schema-id").value;
  try {
    if (id) body.schema_id = id;
    else body.schema = JSON.parse($("schema-text").value);
  } catch (e) {
    say(`the schema is not JSON: ${e.message}`, true);
    return;
  }
  $("pager").hidden = true;
  say("extracting…");
  $("run").disabled = true;
  try {
    const result = JSON.parse(await api("/extract", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    }));
    renderRecord(result, documentText, min);
    say("done");
  } catch (e) {
    say(e.message, true);
  } finally {
    $("run").disabled = false;
  }
}

function showItem() {
  const item = state.items[state.at];
  $("position").textContent = `${item.id} (${state.at + 1} of ${state.items.length})`;
  renderRecord(item, item.document ?? null, Number($("min-confidence").value));
}

async function loadJob(event) {
  event.preventDefault();
  const id = $("job-id").value.trim();
  if (!id) return;
  say("loading results…");
  try {
    const text = await api(`/jobs/${encodeURIComponent(id)}/results?documents=true`);
    state.items = text.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l));
    state.at = 0;
    if (state.items.length === 0) {
      say("no finished items yet");
      return;
    }
    $("pager").hidden = false;
    showItem();
    say(`${state.items.length} results`);
  } catch (e) {
    say(e.message, true);
  }
}

function page(step) {
  if (!state.items.length) return;
  state.at = Math.min(state.items.length - 1, Math.max(0, state.at + step));
  showItem();
}

$("schema-id").addEventListener("change", () => { $("schema-text").hidden = $("schema-id").value !== ""; });
$("file").addEventListener("change", async () => {
  const f = $("file").files[0];
  if (f) $("document").value = await f.text();
});
$("extract-form").addEventListener("submit", extract);
$("job-form").addEventListener("submit", loadJob);
$("prev").addEventListener("click", () => page(-1));
$("next").addEventListener("click", () => page(1));
$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  sessionStorage.setItem("quarry-key", $("key").value);
  $("key-form").hidden = true;
  say("");
  try { await loadSchemas(); } catch (e) { say(e.message, true); }
});
loadSchemas().catch((e) => say(e.message, true));
