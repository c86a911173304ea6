"""The swarm page (``GET /``): one HTML document with inline CSS and JS, no build step.

It polls ``v1/swarm`` (relative, so it works behind a path prefix) every two seconds and redraws: a bar of the
model's blocks coloured by how many online nodes serve each, and a table of nodes with their span drawn on the
same scale. Every value from the swarm is set as text (``textContent``), never parsed as HTML: node records come
from other machines. The DOM carries ``data-*`` attributes (block, live count, peer) for tests and scrapers.
"""

from __future__ import annotations

REFRESH_MS = 2000

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>swarmgate</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2430; background: #f7f8fa; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  .muted { color: #667085; }
  .status { display: inline-block; padding: 2px 8px; border-radius: 10px; color: #fff; font-weight: 600; }
  .ready { background: #1a7f37; } .not-ready { background: #c62828; }
  #coverage { display: flex; gap: 2px; margin: 16px 0 4px; height: 40px; }
  .block { flex: 1; border-radius: 3px; display: flex; align-items: flex-end; justify-content: center;
           font-size: 10px; color: #fff; min-width: 6px; }
  .live-0 { background: #c62828; } .live-1 { background: #f0a202; } .live-2 { background: #7cb342; }
  .live-3 { background: #1a7f37; }
  .legend span { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin: 0 4px 0 12px;
                 vertical-align: middle; }
  table { border-collapse: collapse; width: 100%; margin-top: 16px; background: #fff; }
  th, td { text-align: left; padding: 6px 8px; border-bottom: 1px solid #e4e7ec; white-space: nowrap; }
  th { font-weight: 600; background: #eef0f4; }
  .span { position: relative; height: 10px; background: #eef0f4; border-radius: 2px; min-width: 160px; }
  .span div { position: absolute; top: 0; bottom: 0; border-radius: 2px; background: #3b6fd8; }
  .state-online { color: #1a7f37; } .state-joining { color: #b26a00; } .state-draining { color: #b26a00; }
  .state-offline { color: #c62828; } .reach-relayed { color: #b26a00; } .reach-unreachable { color: #c62828; }
  .verify-verified { color: #1a7f37; } .verify-unverified, .verify-probation { color: #b26a00; }
  .verify-failed, .verify-distrusted { color: #c62828; }
  .peer { font-family: ui-monospace, monospace; }
</style>
</head>
<body>
<h1>swarmgate <span id="model" class="muted"></span></h1>
<div><span id="status" class="status not-ready">loading</span>
  <span id="summary" class="muted"></span></div>
<div id="coverage" aria-label="blocks coloured by how many online nodes serve each"></div>
<div class="legend muted">online nodes per block:
  <span class="live-0"></span>0 <span class="live-1"></span>1 <span class="live-2"></span>2
  <span class="live-3"></span>3+</div>
<table>
  <thead><tr><th>node</th><th>span</th><th>blocks</th><th>state</th><th>tokens/s</th><th>cache room</th>
    <th>queue</th><th>rtt</th><th>reached</th><th>banned</th><th>verified</th><th>reputation</th></tr></thead>
  <tbody id="nodes"></tbody>
</table>
<p class="muted">updated <span id="updated">never</span> &middot; refreshes every __REFRESH__ s</p>
<script>
"use strict";
const REFRESH_MS = __REFRESH_MS__;

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function drawCoverage(report) {
  const bar = document.getElementById("coverage");
  bar.replaceChildren();
  for (const block of report.blocks) {
    const cell = el("div", block.live, "block live-" + Math.min(block.live, 3));
    cell.dataset.block = block.block;
    cell.dataset.live = block.live;
    cell.title = "block " + block.block + ": " + block.live + " online node(s)";
    bar.append(cell);
  }
}

function spanBar(node, numBlocks) {
  const outer = el("div", undefined, "span");
  const inner = el("div");
  inner.style.left = (100 * node.start / numBlocks) + "%";
  inner.style.width = (100 * (node.end - node.start) / numBlocks) + "%";
  outer.append(inner);
  return outer;
}

function verification(check) {
  // The verifier's state (probation, verified, unverified, failed, distrusted, off); the reason as a tooltip.
  const state = el("td", check.state || "\u2013", "verify-" + (check.state || "none"));
  state.title = (check.reason || "") + (check.evidence
    ? "\\nreceipt: " + check.evidence.signer + " session " + check.evidence.session + " position "
      + check.evidence.position + " blocks " + check.evidence.blocks + " output sha256 " + check.evidence.output_sha256
    : "");
  const reputation = el("td", check.reputation === null || check.reputation === undefined
    ? "\u2013" : check.reputation.toFixed(2));
  const cells = document.createDocumentFragment();
  cells.append(state, reputation);
  return cells;
}

function drawNodes(report) {
  const body = document.getElementById("nodes");
  body.replaceChildren();
  for (const node of report.nodes) {
    const row = el("tr");
    row.dataset.peer = node.peer_id;
    row.dataset.state = node.state;
    const peer = el("td", node.peer_id.slice(0, 6) + "\u2026" + node.peer_id.slice(-6), "peer");
    peer.title = node.peer_id;
    const span = el("td");
    span.append(spanBar(node, report.num_blocks));
    row.append(peer, span, el("td", node.start + ":" + node.end), el("td", node.state, "state-" + node.state),
      el("td", node.throughput.toFixed(1)), el("td", node.cache_tokens_left.toLocaleString() + " tokens"),
      el("td", node.queue_depth), el("td", node.rtt === null ? "\u2013" : (1000 * node.rtt).toFixed(1) + " ms"),
      el("td", node.reachability, "reach-" + node.reachability),
      el("td", node.banned ? "for " + Math.ceil(node.ban_seconds_left) + " s" : "no"),
      verification(node.verification || {}));
    body.append(row);
  }
}

function draw(report) {
  document.getElementById("model").textContent = report.model;
  const status = document.getElementById("status");
  status.textContent = report.ready ? "ready" : "missing blocks";
  status.className = "status " + (report.ready ? "ready" : "not-ready");
  const covered = report.blocks.filter(b => b.live > 0).length;
  const online = report.nodes.filter(n => n.state === "online").length;
  document.getElementById("summary").textContent = covered + "/" + report.num_blocks + " blocks covered \u00b7 " +
    online + "/" + report.nodes.length + " nodes online";
  drawCoverage(report);
  drawNodes(report);
  document.getElementById("updated").textContent = new Date().toLocaleTimeString();
}

async function refresh() {
  try {
    const response = await fetch("v1/swarm", {cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    draw(await response.json());
  } catch (error) {
    document.getElementById("updated").textContent = "failed (" + error.message + ")";
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
</script>
</body>
</html>
""".replace("__REFRESH_MS__", str(REFRESH_MS)).replace("__REFRESH__", str(REFRESH_MS // 1000))
