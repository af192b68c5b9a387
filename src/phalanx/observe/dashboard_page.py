"""The dashboard's one page: a table of the ranks, the straggler line, and three plotly charts,
refreshed from /api/page every second. `__QS__` becomes the token's query string.

Every name on the page (phases, hosts, metrics, runs) comes from the job: the script builds the DOM
from text only (`textContent`, never markup), and it is a file of its own (SCRIPT, served as
dashboard.js) so that the page's Content-Security-Policy can forbid inline script altogether."""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>phalanx: watching a job</title>
<script src="plotly.min.js__QS__"></script>
<style>
 body { font-family: system-ui, sans-serif; margin: 1.2em; color: #222; }
 h1 { font-size: 1.3em; margin: 0 0 .3em 0; }
 #job { color: #555; margin-bottom: .6em; }
 table { border-collapse: collapse; margin: .5em 0; }
 th, td { padding: .25em .7em; text-align: right; border-bottom: 1px solid #ddd; font-variant-numeric: tabular-nums; }
 th { background: #f3f3f3; }
 tr.straggler td { background: #fde2e2; font-weight: bold; }
 tr.bad td { background: #fff3cd; }
 tr.earlier td { color: #999; }
 #straggler { font-weight: bold; margin: .4em 0; }
 #straggler.none { font-weight: normal; color: #2a7a2a; }
 #verdict { white-space: pre-wrap; color: #a00; font-family: monospace; }
 .plots { display: flex; flex-wrap: wrap; gap: 1em; }
 .plot { width: 27em; height: 16em; }
</style></head>
<body>
<h1>phalanx: watching <span id="run">a job</span></h1>
<div id="job">waiting for the job's first status...</div>
<div id="metrics"></div>
<table id="ranks"><thead></thead><tbody></tbody></table>
<div id="straggler" class="none"></div>
<div id="verdict"></div>
<div class="plots"><div id="loss" class="plot"></div><div id="throughput" class="plot"></div>
<div id="steptime" class="plot"></div></div>
<script src="dashboard.js__QS__"></script>
</body></html>
"""

SCRIPT = """const TOKEN = new URLSearchParams(location.search).get("token");
const QS = TOKEN ? "?token=" + encodeURIComponent(TOKEN) : "";
const OK_STATES = ["running", "ended"];  // a rank of a job that ended well is not marked wrong
function cell(row, text) { const td = document.createElement("td"); td.textContent = text; row.appendChild(td); }
function state(r) {
  if (r.state === "silent") return "silent " + Math.round(r.silent_s) + " s (" + r.phase + ", step " + r.step + ")";
  if (r.state === "no progress") return "no progress " + Math.round(r.still_s) + " s (" + r.phase + ", step " + r.step + ")";
  return r.state || "running";
}
function num(v, digits) { return typeof v === "number" ? v.toFixed(digits) : String(v); }
function mem(n) { return n == null ? "-" : (n / 1048576).toFixed(1) + " MiB"; }
function render(page) {
  const s = page.status;
  if (!s) return;
  const raw = s.metrics ? s.metrics.loss : null;
  const loss = typeof raw === "number" ? ", loss " + raw.toPrecision(4) : (raw != null ? ", loss " + raw : "");
  document.getElementById("job").textContent = (page.running ? "running" : (s.ended ? "ended" : "not running (last status " + Math.round(s.age_s) + " s old)"))
    + ": attempt " + s.attempt + ", " + s.world_size + " ranks, step " + s.step + loss
    + (s.not_measured ? " (steps count " + s.steps_count + "; not measured: " + s.not_measured + ")" : "");
  if (page.run) document.getElementById("run").textContent = page.run;
  document.getElementById("metrics").textContent = Object.entries(s.metrics || {}).filter(([k]) => k !== "step")
    .map(([k, v]) => k + " " + (typeof v === "number" ? v.toPrecision(4) : String(v))).join(", ");
  const phases = [];
  s.ranks.forEach(r => Object.keys(r.phases || {}).forEach(p => { if (!phases.includes(p)) phases.push(p); }));
  const head = ["rank", "host", "local rank", "state", "step", "steps/s", ...phases.map(p => p + " ms"), "memory"];
  const headRow = document.createElement("tr");
  head.forEach(h => { const th = document.createElement("th"); th.textContent = h; headRow.appendChild(th); });
  document.querySelector("#ranks thead").replaceChildren(headRow);
  const body = document.querySelector("#ranks tbody");
  body.replaceChildren();
  const slow = s.straggler ? s.straggler.rank : null;
  s.ranks.forEach(r => {
    const tr = document.createElement("tr");
    tr.className = "rank" + (r.rank === slow ? " straggler" : "") + (r.state && !OK_STATES.includes(r.state) ? " bad" : "");
    tr.dataset.rank = r.rank;
    [r.rank, r.host ?? "-", r.local_rank ?? "-", state(r), r.step ?? "-", r.steps_per_s ? num(r.steps_per_s, 2) : "-",
     ...phases.map(p => r.phases && p in r.phases ? num(r.phases[p], 1) : "-"), mem(r.memory)].forEach(v => cell(tr, v));
    body.appendChild(tr);
  });
  let earlier = "";
  Object.entries(page.earlier).forEach(([attempt, past]) => {
    past.ranks.forEach(r => {
      const tr = document.createElement("tr"); tr.className = "earlier";
      [r.rank, r.host ?? "-", r.local_rank ?? "-", "attempt " + attempt + ": " + state(r), r.step ?? "-", "-",
       ...phases.map(() => ""), mem(r.memory)].forEach(v => cell(tr, v));
      body.appendChild(tr);
    });
    if (past.verdict) earlier += "attempt " + attempt + ": " + past.verdict + "\\n";
  });
  const line = document.getElementById("straggler");
  line.textContent = s.straggler_message || "straggler: none";
  line.className = s.straggler_message ? "" : "none";
  document.getElementById("verdict").textContent = earlier + (s.verdict || "");
  const pts = page.points;
  const t = pts.map(p => new Date(p.time * 1000));
  const lossPts = pts.filter(p => typeof p.loss === "number");
  const layout = (title, y) => ({ title: { text: title }, margin: { l: 50, r: 10, t: 35, b: 35 }, yaxis: { title: { text: y } } });
  Plotly.react("loss", [{ x: lossPts.map(p => p.loss_step), y: lossPts.map(p => p.loss), mode: "lines", name: "loss" }],
               { ...layout("loss", "loss"), xaxis: { title: { text: "step" } } }, { displayModeBar: false });
  Plotly.react("throughput", [{ x: t, y: pts.map(p => typeof p.steps_per_s === "number" ? p.steps_per_s : null), mode: "lines", name: "steps/s" }],
               layout("throughput (slowest rank)", "steps/s"), { displayModeBar: false });
  const ranks = [...new Set(pts.flatMap(p => Object.keys(p.step_ms)))];
  Plotly.react("steptime", ranks.map(r => ({ x: t, y: pts.map(p => typeof p.step_ms[r] === "number" ? p.step_ms[r] : null), mode: "lines", name: "rank " + r })),
               layout("step time per rank", "ms/step"), { displayModeBar: false });
}
async function refresh() {
  try { const reply = await fetch("api/page" + QS); if (reply.ok) render(await reply.json()); }
  catch (e) { document.getElementById("job").textContent = "the launcher is not answering (the job has ended?)"; }
  setTimeout(refresh, 1000);
}
refresh();
"""
