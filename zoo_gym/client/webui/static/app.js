"use strict";
// gym-client webui: the page. Everything comes from the console's JSON API (/api/...); no external script.
const $ = (sel) => document.querySelector(sel);
const el = (tag, attrs = {}, ...kids) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) { if (k === "text") e.textContent = v; else e.setAttribute(k, v); }
  for (const k of kids) e.append(k);
  return e;
};
const svg = (tag, attrs = {}) => {  // SVG elements live in their own namespace, or they are not drawn
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) { if (k === "text") e.textContent = v; else e.setAttribute(k, v); }
  return e;
};
let FIELDS = [];
let seen = 0;

async function api(method, path, body) {
  const init = { method, headers: {} };
  if (body !== undefined) { init.headers["content-type"] = "application/json"; init.body = JSON.stringify(body); }
  const r = await fetch(path, init);
  const doc = await r.json().catch(() => ({ detail: `HTTP ${r.status}` }));
  if (!r.ok) throw new Error(doc.detail || `HTTP ${r.status}`);
  return doc;
}

function show(view) {
  document.querySelectorAll(".view").forEach((v) => v.classList.toggle("active", v.id === `view-${view}`));
  document.querySelectorAll("#tabs button").forEach((b) => b.classList.toggle("active", b.dataset.view === view));
  if (view === "rounds") refreshRound();
}

function input(f) {
  const id = `f-${f.name}`;
  let box;
  if (f.choices) {
    box = el("select", { id });
    for (const c of f.choices) box.append(el("option", { value: c, text: c }));
    box.value = f.default;
  } else if (f.kind === "bool" && f.default === null) {
    box = el("select", { id });
    for (const [v, t] of [["", "unset"], ["true", "true"], ["false", "false"]]) box.append(el("option", { value: v, text: t }));
  } else if (f.kind === "bool") {
    box = el("input", { id, type: "checkbox" });
    box.checked = !!f.default;
  } else {
    box = el("input", { id, type: f.kind === "int" || f.kind === "float" ? "number" : "text",
                        placeholder: f.default === null || f.default === undefined ? "" : String(f.default) });
    if (f.kind === "float") box.step = "any";
  }
  box.dataset.name = f.name;
  box.addEventListener("change", () => { if (f.name === "train__stage" || f.name === "train__finetuning_type") relevance(); });
  return box;
}

function value(f) {
  const box = document.getElementById(`f-${f.name}`);
  if (!box) return undefined;
  if (box.type === "checkbox") return box.checked;
  if (f.kind === "bool") return box.value === "" ? undefined : box.value === "true";
  if (box.value.trim() === "") return undefined;
  if (f.kind === "list") return box.value.split(",").map((s) => s.trim()).filter(Boolean);
  return box.value.trim();
}

function values() {
  const out = {};
  for (const f of FIELDS) { const v = value(f); if (v !== undefined) out[f.name] = v; }
  return out;
}

function relevance() {
  const now = { stage: $("#f-train__stage").value, finetuning_type: $("#f-train__finetuning_type").value };
  document.querySelectorAll("details[data-when]").forEach((d) => {
    const when = JSON.parse(d.dataset.when);
    d.hidden = !Object.entries(when).every(([k, allowed]) => allowed.includes(now[k]));
  });
}

async function loadFields() {
  FIELDS = (await api("GET", "/api/fields")).fields;
  const panels = {};
  for (const f of FIELDS) (panels[f.panel] = panels[f.panel] || []).push(f);
  for (const [panel, fields] of Object.entries(panels)) {
    const grid = panel === "Join" ? $("#panel-Join") : el("div", { class: "fields" });
    for (const f of fields) {
      grid.append(el("label", { for: `f-${f.name}`, text: f.flag }), input(f));
      if (f.help) grid.append(el("div", { class: "help", text: `${f.help}${f.default !== null && f.default !== "" ? ` [default: ${f.default}]` : ""}` }));
    }
    if (panel !== "Join") {
      const d = el("details", { "data-panel": panel }, el("summary", { text: `${panel} (${fields.length})` }), grid);
      if (panel === "Training") d.open = true;
      if (fields[0].when) d.dataset.when = JSON.stringify(fields[0].when);
      $("#panels").append(d);
    }
  }
  relevance();
}

function kv(obj) {
  const box = el("div", { class: "kv" });
  for (const [k, v] of Object.entries(obj)) box.append(el("div", { text: k }), el("div", { text: typeof v === "object" && v !== null ? JSON.stringify(v) : String(v) }));
  return box;
}

async function preview() {
  const out = $("#preview-out");
  out.replaceChildren(el("p", { text: "checking (gym-client join --dry-run) ..." }));
  try {
    const doc = await api("POST", "/api/preview", { values: values() });
    out.replaceChildren(el("h3", { text: "The command" }), el("pre", { id: "command", text: doc.command.join(" ") }));
    for (const w of doc.warnings) out.append(el("p", { class: "warning", text: w }));
    if (doc.error) out.append(el("p", { id: "data-error", class: "error", text: doc.error }));
    if (doc.resolved) {
      const d = doc.resolved.data;
      out.append(el("h3", { text: "Data" }), el("p", { id: "data-summary", text: `${d.path}: format ${d.format}, ${d.examples} examples (${d.train_examples} to train on, ${d.held_out_examples} held out)` }));
    }
    if (doc.records.length) {
      out.append(el("h3", { text: "First records" }));
      for (const r of doc.records) out.append(el("pre", { text: `${r.where}: ${JSON.stringify(r.record)}` }));
    }
    if (doc.resolved) out.append(el("h3", { text: "Resolved training settings" }), kv(doc.resolved.training));
  } catch (e) { out.replaceChildren(el("p", { class: "error", text: e.message })); }
}

async function upload(file) {
  const drop = $("#drop");
  try {
    const r = await fetch(`/api/data?name=${encodeURIComponent(file.name)}`, { method: "PUT", body: file });
    const doc = await r.json();
    if (!r.ok) throw new Error(doc.detail);
    $("#f-data").value = doc.path;
    drop.firstChild.textContent = `${file.name}: ${doc.bytes} bytes uploaded. `;
    preview();
  } catch (e) { $("#preview-out").replaceChildren(el("p", { class: "error", text: e.message })); }
}

async function start() {
  $("#join-error").hidden = true;
  try {
    await api("POST", "/api/join", { values: values() });
    seen = 0; $("#log").textContent = "";
    show("rounds");
    poll();
  } catch (e) { $("#join-error").textContent = e.message; $("#join-error").hidden = false; }
}

function drawLoss(points) {
  const box = $("#loss");
  box.replaceChildren();
  if (!points.length) { box.append(svg("text", { x: 10, y: 20, text: "no training step yet" })); return; }
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = 0, x1 = Math.max(...xs, 1), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const X = (x) => 40 + 370 * (x - x0) / (x1 - x0 || 1), Y = (y) => 160 - 140 * (y - y0) / (y1 - y0 || 1);
  box.append(svg("polyline", { points: points.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ") }));
  for (const p of points) box.append(svg("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2.5, fill: "#0b6e4f", "data-step": p[0], "data-loss": p[1] }));
  box.append(svg("text", { x: 2, y: 24, text: y1.toFixed(3) }), svg("text", { x: 2, y: 160, text: y0.toFixed(3) }),
             svg("text", { x: 370, y: 176, text: `step ${x1}` }));
}

function roundsTable(p, result) {
  const rows = {};
  for (const line of p.submitted) { const m = /^round (\d+): submitted (\d+) bytes; local held-out loss (\S+) -> (\S+)/.exec(line); if (m) rows[m[1]] = { bytes: m[2], loss: `${m[3]} → ${m[4]}` }; }
  for (const pay of p.payments) (rows[pay.round] = rows[pay.round] || {}).pay = pay.line;
  const body = $("#rounds-table tbody");
  body.replaceChildren();
  for (const [round, r] of Object.entries(rows)) {
    const accepted = r.pay ? (/refused by validation/.test(r.pay) ? "refused by validation: not in the checkpoint" : "accepted into the checkpoint") : "waiting for the publish";
    const tr = el("tr", { "data-round": round }, el("td", { text: round }), el("td", { text: r.bytes ? `${r.bytes} bytes` : "" }),
                  el("td", { text: r.loss || "" }), el("td", {}, el("div", { class: "accepted", text: accepted }), el("div", { class: "payment", text: r.pay || "" })));
    body.append(tr);
  }
}

async function poll() {
  let doc;
  try { doc = await api("GET", `/api/join?since=${seen}`); } catch (e) { setTimeout(poll, 3000); return; }
  if (doc.lines.length) { $("#log").textContent += doc.lines.join("\n") + "\n"; seen = doc.line_count; $("#log").scrollTop = 1e9; }
  const p = doc.progress;
  if (p) {
    const state = doc.running ? `joined: ${p.phase}${p.round ? ` (round ${p.round})` : ""}` : (doc.exit_code === 0 ? "join finished" : `join stopped (exit ${doc.exit_code})`);
    $("#status").textContent = state;
    $("#phase").replaceChildren(kv({ phase: p.phase, round: p.round ?? "-", "training step": p.steps ? `${p.loss.length ? p.loss[p.loss.length - 1][0] : 0}/${p.steps}` : "-" }));
    if (p.error) $("#phase").append(el("p", { class: "error", id: "join-failed", text: p.error }));
    drawLoss(p.loss);
    roundsTable(p, doc.result);
  }
  if (doc.running) setTimeout(poll, 1500);
}

async function refreshRound() {
  const box = $("#round");
  try {
    const r = await api("POST", "/api/round", { values: values() });
    const left = r.deadline_unix ? `${Math.max(0, Math.round(r.deadline_unix - r.now))} s (${new Date(r.deadline_unix * 1000).toLocaleTimeString()})` : "none (closes at quorum)";
    box.replaceChildren(kv({ round: r.round, state: r.state, deadline: left, submissions: `${r.submissions} of at least ${r.min_contributors}`, mode: r.mode }));
    box.dataset.round = r.round; box.dataset.state = r.state;
  } catch (e) { box.replaceChildren(el("p", { class: "error", text: e.message })); }
}

async function verify() {
  const out = $("#verified");
  out.textContent = "verifying ...";
  try {
    const doc = await api("POST", "/api/rewards", { values: values() });
    const v = doc.verification;
    out.className = v.ok ? "ok" : "error";
    out.textContent = (v.ok ? "verified: every entry's hash and server signature" : `VERIFICATION FAILED at entry ${v.first_bad_seq}: ${v.reason}`)
      + ` — contributor ${doc.contributor_id}: balance ${doc.balance}, reputation ${doc.reputation.toFixed(3)}, ${doc.entries} ledger entries`;
    const body = $("#ledger tbody");
    body.replaceChildren();
    for (const e of doc.recent) body.append(el("tr", { "data-seq": e.seq }, ...[e.seq, e.round_id, e.kind, e.amount, e.score.toFixed(4), e.reason].map((t) => el("td", { text: String(t) }))));
  } catch (e) { out.className = "error"; out.textContent = e.message; }
}

async function waitFor(path, done, ms = 1500, tries = 400) {
  for (let i = 0; i < tries; i++) { const doc = await api("GET", path); if (done(doc)) return doc; await new Promise((r) => setTimeout(r, ms)); }
  throw new Error(`no answer from ${path}`);
}

async function pull() {
  const s = $("#model-status");
  try {
    const { out } = await api("POST", "/api/pull", { values: values(), format: $("#pull-format").value });
    s.textContent = `pulling into ${out} ...`;
    const doc = await waitFor("/api/pull", (d) => !d.running);
    if (!doc.result) throw new Error(doc.progress && doc.progress.error || "the pull failed");
    s.textContent = `pulled round ${doc.result.round} into ${doc.result.out}`;
  } catch (e) { s.textContent = e.message; s.className = "error"; }
}

let PANES = {};  // what each chat pane talks to (/api/serve): a, the current checkpoint; b, your variant

function showPanes() {
  const a = PANES.a, b = PANES.b, note = $("#note-b");
  $("#label-a").textContent = a && a.label ? a.label : "The current checkpoint";
  $("#label-b").textContent = b && b.label ? b.label : "Your variant";
  const why = b && !b.url ? (b.error || b.none || (b.running ? "" : "its gym-serve stopped")) : "";
  note.hidden = !why; note.textContent = why; note.className = b && b.error ? "note error" : "note";
}

async function serve() {
  const s = $("#model-status");
  s.className = "";
  try {
    await api("POST", "/api/serve", { values: values() });
    s.textContent = "starting gym-serve ...";
    const up = (p) => !p || !p.model || p.url || !p.running;
    const doc = await waitFor("/api/serve", (d) => up(d.panes.a) && up(d.panes.b));
    PANES = doc.panes;
    showPanes();
    if (!doc.panes.a.url) throw new Error(doc.panes.a.error || "gym-serve stopped");
    s.textContent = `gym-serve at ${doc.panes.a.url}` + (PANES.b && PANES.b.url ? `, your variant's at ${PANES.b.url}` : "");
    await models();
  } catch (e) { s.textContent = e.message; s.className = "error"; }
}

async function stopServing() {
  const s = $("#model-status");
  try {
    await api("POST", "/api/serve/stop");
    s.textContent = "gym-serve stopped"; s.className = "";
  } catch (e) { s.textContent = e.message; s.className = "error"; }
  PANES = {};
  showPanes();
  $("#model-a").replaceChildren(); $("#model-b").replaceChildren();
}

function fill(sel, names, wanted) {
  sel.replaceChildren(...names.map((m) => el("option", { value: m, text: m })));
  sel.value = names.includes(wanted) ? wanted : (names[0] || "");
}

async function models() {
  const doc = await api("GET", `/api/models?pane=a&url=${encodeURIComponent($("#serve-url").value)}`);
  fill($("#model-a"), doc.models, PANES.a && PANES.a.model);
  if (PANES.b && PANES.b.url) {  // your variant's gym-serve: its variants, not its base (listed first)
    const mine = await api("GET", "/api/models?pane=b");
    fill($("#model-b"), mine.models.slice(1), PANES.b.model);
  } else if (!PANES.b) fill($("#model-b"), doc.models, doc.models[1]);  // a gym-serve at a URL: its second model
  else $("#model-b").replaceChildren();  // no variant: the note says how to make one
}

async function ask() {
  const prompt = $("#prompt").value;
  if (!$("#model-a").value) await models().catch((e) => { $("#model-status").textContent = e.message; });
  for (const side of ["a", "b"]) {
    const log = $(`#chat-${side}`), model = $(`#model-${side}`).value;
    if (!model) continue;
    const pane = side === "b" && PANES.b && PANES.b.url ? "b" : "a";
    log.append(el("p", { class: "you", text: `you: ${prompt}` }));
    api("POST", "/api/chat", { url: pane === "a" ? $("#serve-url").value : "", model, prompt, pane })
      .then((d) => log.append(el("p", { class: "reply", "data-model": d.model, text: `${d.model}: ${d.reply}` })))
      .catch((e) => log.append(el("p", { class: "error", text: e.message })));
  }
}

async function resumeServing() {  // a gym-serve started before the page was reloaded shows at once
  const doc = await api("GET", "/api/serve").catch(() => null);
  if (!doc || !doc.running) return;
  PANES = doc.panes;
  showPanes();
  await models().catch(() => {});
}

document.addEventListener("DOMContentLoaded", async () => {
  document.querySelectorAll("#tabs button").forEach((b) => b.addEventListener("click", () => show(b.dataset.view)));
  await loadFields();
  const drop = $("#drop");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => { e.preventDefault(); drop.classList.remove("over"); if (e.dataTransfer.files[0]) upload(e.dataTransfer.files[0]); });
  $("#file").addEventListener("change", (e) => { if (e.target.files[0]) upload(e.target.files[0]); });
  $("#preview").addEventListener("click", preview);
  $("#start").addEventListener("click", start);
  $("#stop").addEventListener("click", () => api("POST", "/api/join/stop").catch((e) => { $("#log").textContent += e.message + "\n"; }));
  $("#verify").addEventListener("click", verify);
  $("#pull").addEventListener("click", pull);
  $("#serve").addEventListener("click", serve);
  $("#serve-stop").addEventListener("click", stopServing);
  $("#ask").addEventListener("click", ask);
  setInterval(() => { if ($("#view-rounds").classList.contains("active")) refreshRound(); }, 5000);
  resumeServing();
  poll();  // a join started earlier (the page was closed, or reloaded) shows at once
  document.body.dataset.ready = "1";
});
