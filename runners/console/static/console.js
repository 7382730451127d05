// deferline console: renders the snapshot pushed on /api/stream; no framework, no build step.
"use strict";

let snapshot = null;
let taskPage = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fmt(n, digits) {
  if (n === null || n === undefined) return "–";
  return typeof n === "number" ? n.toLocaleString(undefined, {maximumFractionDigits: digits ?? 2}) : String(n);
}

function secs(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function taskLink(subject, text) {
  return el("a", {href: `#/task/${encodeURIComponent(subject)}`, class: "mono task-link"}, text || subject);
}

function table(headers, rows, empty) {
  if (!rows.length) return el("p", {class: "empty"}, empty);
  return el("table", {class: "grid"},
    el("tr", {}, headers.map((h) => el("th", {}, h))),
    rows);
}

function route() {
  const hash = decodeURIComponent(location.hash.replace(/^#\/?/, ""));
  if (hash.startsWith("task/")) return {view: "task", subject: hash.slice(5)};
  return {view: ["groups", "stuck", "dead"].includes(hash) ? hash : "overview"};
}

function overview(s) {
  const o = s.overview;
  if (!o) return el("p", {class: "empty"}, "No figures yet.");
  const rate = (state) => {
    const r = o.change_per_s[state] || 0;
    return el("div", {class: "d " + (r > 0 ? "up" : r < 0 ? "down" : "")},
      `${r > 0 ? "+" : ""}${fmt(r)}/s`);
  };
  const states = Object.keys(o.tasks);
  const cards = states.map((state) => el("div", {class: "card", "data-state": state},
    el("div", {class: "d"}, `tasks ${state}`),
    el("div", {class: "n", "data-count": state}, fmt(o.tasks[state])),
    rate(state)));
  return [
    el("div", {class: "cards"},
      el("div", {class: "card"}, el("div", {class: "d"}, "deferrals waiting"),
        el("div", {class: "n", id: "deferrals-waiting"}, fmt(o.deferrals_waiting))),
      el("div", {class: "card"}, el("div", {class: "d"}, "events per second"),
        el("div", {class: "n", id: "events-per-s"}, fmt(o.events_per_s))),
      el("div", {class: "card"}, el("div", {class: "d"}, `resume latency p50 (last ${o.window_s} s)`),
        el("div", {class: "n", id: "resume-p50"}, secs(o.resume_p50_s))),
      el("div", {class: "card"}, el("div", {class: "d"}, `resume latency p99 · ${o.resumes_in_window} resumes`),
        el("div", {class: "n", id: "resume-p99"}, secs(o.resume_p99_s)))),
    el("section", {class: "box"}, el("h2", {}, "Tasks by state"),
      states.length ? el("div", {class: "cards", id: "task-counts"}, cards)
        : el("p", {class: "empty"}, "No task on the tasks topic yet.")),
  ];
}

function groups(s) {
  const out = [];
  if (s.groups_error) out.push(el("div", {class: "status bad"}, s.groups_error));
  if (!s.groups.length) out.push(el("p", {class: "empty"}, "No triggerer or scheduler group found yet."));
  for (const g of s.groups) {
    const members = g.members.map((m) => el("tr", {class: "member", "data-member": m.member},
      el("td", {class: "mono"}, m.member), el("td", {class: "mono"}, m.host),
      el("td", {class: "mono partitions"}, g.assignments_known ? (m.partitions.join(" ") || "none") : "not reported by this broker")));
    const parts = g.partitions.map((p) => el("tr", {"data-partition": `${p.topic}[${p.partition}]`},
      el("td", {class: "mono"}, `${p.topic}[${p.partition}]`), el("td", {class: "mono owner"}, p.owner || "–"),
      el("td", {class: "mono"}, fmt(p.committed)), el("td", {class: "mono"}, fmt(p.end)),
      el("td", {class: "mono lag"}, fmt(p.lag))));
    const moves = g.moves.map((m) => el("tr", {class: "move"},
      el("td", {class: "mono"}, m.at), el("td", {class: "mono"}, `${m.topic}[${m.partition}]`),
      el("td", {class: "mono"}, m.from || "–"), el("td", {class: "mono"}, m.to || "–"),
      el("td", {class: "mono"}, secs(m.paused_s))));
    const left = g.left.map((m) => el("tr", {class: "left"}, el("td", {class: "mono"}, m.at), el("td", {class: "mono"}, m.member)));
    out.push(el("section", {class: "box group", "data-group": g.group},
      el("h2", {}, `${g.role}: ${g.group} `, el("span", {class: "meta"}, `(${g.state}, ${g.members.length} member(s))`)),
      table(["member", "host", "partitions"], members, "No live member."),
      el("details", {open: ""}, el("summary", {}, "partitions, committed offsets and lag"),
        table(["partition", "owner", "committed", "end", "lag"], parts, "No partition.")),
      el("h2", {}, "Last rebalances"),
      table(["seen at", "partition", "from", "to", "paused"], moves, "No partition moved since the console started."),
      el("h2", {}, "Members that left"),
      table(["seen at", "member"], left, "None since the console started.")));
  }
  return out;
}

function verdictBadge(v) {
  const ok = ["resumed", "not_deferred"].includes(v.verdict);
  const wait = ["running", "waiting"].includes(v.verdict);
  return el("span", {class: "badge" + (ok ? " ok" : wait ? " wait" : "")}, v.verdict + (v.cause ? ` (${v.cause})` : ""));
}

function stuck(s) {
  const st = s.stuck;
  const out = [];
  if (s.stuck_error) out.push(el("div", {class: "status bad"}, s.stuck_error));
  const waiting = st.waiting.map((v) => el("tr", {class: "stuck-row", "data-verdict": v.verdict},
    el("td", {}, taskLink(v.ti_key || v.subject)), el("td", {}, verdictBadge(v)),
    el("td", {}, secs(v.age_s)), el("td", {}, v.summary)));
  const ended = st.ended.map((v) => el("tr", {class: "stuck-row ended", "data-verdict": v.verdict},
    el("td", {}, taskLink(v.ti_key || v.subject)), el("td", {}, verdictBadge(v)),
    el("td", {class: "mono"}, v.ended_at || "–"), el("td", {}, v.summary)));
  out.push(el("section", {class: "box"},
    el("h2", {}, `Waiting longer than ${secs(st.older_than_s)}: ${st.count}` + (st.count > st.waiting.length ? ` (the ${st.waiting.length} oldest shown)` : "")),
    table(["task", "verdict", "waiting", "why"], waiting, st.at ? "No deferral is stuck." : "Not read yet.")),
    el("section", {class: "box"},
      el("h2", {}, "Deferrals that ended in failure (newest first)"),
      table(["task", "verdict", "ended", "why"], ended, "None seen since the console started.")),
    el("p", {class: "meta"}, `read at ${st.at || "–"}`));
  return out;
}

function dead(s) {
  const rows = s.dead.map((d) => el("tr", {class: "dead-row"},
    el("td", {class: "mono"}, d.at), el("td", {class: "mono"}, d.error_type),
    el("td", {}, d.error || "", d.value ? el("details", {}, el("summary", {}, "record"), el("pre", {}, d.value)) : null),
    el("td", {}, d.ti_key ? taskLink(d.ti_key) : (d.trigger_id || "–")),
    el("td", {class: "mono"}, d.source || d.position)));
  return el("section", {class: "box"}, el("h2", {}, "Dead letters, newest first"),
    table(["at", "error", "why", "task", "record"], rows, "No dead letter."));
}

async function redrive(triggerId) {
  let token = sessionStorage.getItem("deferline-token");
  if (!token) token = prompt("Re-drive token (printed by `deferline console --allow-redrive`)");
  if (!token) return;
  const res = await fetch("/api/redrive", {method: "POST", headers: {"Authorization": `Bearer ${token}`, "Content-Type": "application/json"}, body: JSON.stringify({trigger_id: triggerId})});
  const body = await res.json();
  if (res.ok) sessionStorage.setItem("deferline-token", token);
  else sessionStorage.removeItem("deferline-token");
  alert(res.ok ? `${body.action}: ${body.reason}` : body.error);
}

function task(subject) {
  if (!taskPage || taskPage.subject !== subject) {
    taskPage = {subject, loading: true};
    fetch(`/api/task?subject=${encodeURIComponent(subject)}`).then(async (res) => {
      const body = await res.json();
      taskPage = {subject, ...body, failed: !res.ok};
      render();
    });
  }
  if (taskPage.loading) return el("p", {class: "empty"}, `Reading the topics for ${subject}…`);
  if (taskPage.failed) return el("div", {class: "status bad"}, taskPage.error);
  const v = taskPage.verdict;
  const box = el("section", {class: "box", id: "task-page"},
    el("h2", {}, subject),
    el("p", {id: "task-verdict"}, verdictBadge(v), " ", v.summary),
    el("p", {class: "meta"}, `trigger ${v.trigger_id || "–"} · ${taskPage.classpath || "no recorded classpath"} · ${taskPage.events} event(s) · ${taskPage.duplicates_dropped} duplicate(s) dropped`,
      " ", el("button", {onclick: () => { taskPage = null; render(); }}, "read again")));
  if (taskPage.redrive && v.trigger_id) box.append(el("button", {id: "redrive", onclick: () => redrive(v.trigger_id)}, "Re-drive this trigger"));
  const report = el("div", {class: "report"});
  report.innerHTML = taskPage.html;  // rendered and escaped by the replay package
  box.append(report);
  return box;
}

function render() {
  renderView();
  renderStatus();
}

function renderView() {
  const r = route();
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("on", a.dataset.view === r.view);
  const view = document.getElementById("view");
  if (r.view === "task") {
    view.replaceChildren(task(r.subject));
  } else if (snapshot) {
    const build = {overview, groups, stuck, dead}[r.view];
    view.replaceChildren(...[build(snapshot)].flat());
  }
}

function renderStatus() {
  if (!snapshot) return;
  const status = document.getElementById("status");
  const st = snapshot.status;
  status.hidden = st.state === "live";
  status.className = "status" + (st.ok ? "" : " bad");
  status.dataset.state = st.state;
  status.textContent = st.state === "catching_up" ? `Reading the topics' history: ${Math.round((st.progress || 0) * 100)} %` : st.message;
  document.getElementById("cluster").textContent = `${snapshot.cluster.bootstrap_servers} · prefix ${snapshot.cluster.prefix}`;
  const c = snapshot.console;
  document.getElementById("footer").textContent = `console: ${fmt(c.records_read, 0)} records read, ${fmt(c.tasks_known, 0)} tasks, ${fmt(c.fetched_bytes / 1048576, 1)} MiB fetched, ${fmt(c.max_rss_mib, 0)} MiB max RSS`;
}

function connect() {
  const live = document.getElementById("live");
  const source = new EventSource("/api/stream");
  source.onmessage = (msg) => {
    snapshot = JSON.parse(msg.data);
    live.textContent = `updated ${snapshot.taken_at.slice(11, 19)} UTC`;
    if (route().view !== "task") renderView();  // a task's page is read once, on demand
    renderStatus();
  };
  source.onerror = () => { live.textContent = "console unreachable; retrying…"; };
}

window.addEventListener("hashchange", render);
connect();
render();
