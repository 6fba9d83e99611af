"""The fleet page: a read-only web page the admin API serves at ``/``.

Server-rendered HTML, one inline stylesheet and one small inline script; no front-end build, nothing
fetched from anywhere but the API itself. The page is a pure function of the admin API's own JSON
documents (``/api/nodes``, ``/api/models``, ``/api/replicas``), so it shows what ``ctl get`` shows.

    GET /        the page; its fleet part filled in when the request may read the API
    GET /fleet   the fleet part alone (an HTML fragment), which the script fetches every 2 s and
                 swaps in, so the page follows the fleet without a reload

**Who may see it.** ``/fleet`` needs the API's read role like every other GET. ``/`` itself carries
no fleet data unless the request may read (loopback while no tokens are configured, or a bearer
token): a browser sends no bearer token by itself, so with tokens the page shows a small form, keeps
the token in ``sessionStorage`` (gone when the tab closes; never in a URL, where logs and the
Referer header would keep it) and sends it as ``Authorization: Bearer`` on its fetches. Those
fetches are same-origin GETs: the browser adds no ``Origin`` and says ``Sec-Fetch-Site:
same-origin``, which the API's guard (``control.api.ApiGuard``) lets through; a page on another
site still cannot read any answer (no CORS headers) nor send the token (it never sees it).

**Escaping.** Node-supplied strings (labels, GPU names, fabrics, errors, engine output) reach the
page: every one goes through ``html.escape``, and the Content-Security-Policy allows no script but
the page's own (by hash) and no inline event handler, so a string that did slip through would still
not run.
"""

from __future__ import annotations

import base64
import hashlib
import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from control.ctl.text import load_words

#: Lines of a failed engine's output shown under its shard (the API keeps the agent's tail).
TAIL_LINES = 20
#: How often the page fetches ``/fleet``, in milliseconds: at least this, and ten times what the
#: last fetch took, so that a big fleet's page costs the control plane at most a tenth of its time.
REFRESH_MS = 2000
#: Rows the nodes and shards tables show at most (those not ready first); ``ctl get`` lists all.
MAX_ROWS = 300

CONTENT_TYPE = b"text/html; charset=utf-8"

_STYLE = """
:root { color-scheme: light; --ok: #1a7f37; --warn: #9a6700; --bad: #cf222e; --muted: #59636e; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1f2328; }
header { display: flex; align-items: baseline; gap: 1em; padding: .8em 1.5em; background: #f6f8fa;
  border-bottom: 1px solid #d1d9e0; }
header h1 { font-size: 1.2em; margin: 0; }
#status { color: var(--muted); }
#status.stale { color: var(--bad); font-weight: 600; }
main { padding: 0 1.5em 2em; }
h2 { font-size: 1.05em; margin: 1.4em 0 .4em; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .3em .8em .3em 0; border-bottom: 1px solid #eaeef2; vertical-align: top; }
th { color: var(--muted); font-weight: 600; }
td:first-child { white-space: nowrap; }
.summary { margin: 1em 0 0; color: var(--muted); }
.state { font-weight: 600; }
.ready { color: var(--ok); }
.starting, .draining, .unhealthy, .cordoned, .pending, .unreachable, .not-ready { color: var(--warn); }
.failed, .lost, .stopped, .unknown { color: var(--bad); }
.why { color: var(--muted); font-size: .92em; }
.num { font-variant-numeric: tabular-nums; }
pre.tail { margin: .2em 0 .6em; padding: .5em .8em; background: #f6f8fa; border-left: 3px solid var(--bad);
  white-space: pre-wrap; word-break: break-all; font-size: 12px; max-height: 18em; overflow: auto; }
form { padding: 1em 1.5em; }
form input { font: inherit; width: 28em; max-width: 90%; }
.none { color: var(--muted); }
"""

# The page's only script. It never builds HTML from data: it swaps in the server-rendered (escaped)
# fragment, and writes its own messages with textContent.
_SCRIPT = """
(() => {
  "use strict";
  const KEY = "llmgw-api-token";
  const fleet = document.getElementById("fleet");
  const status = document.getElementById("status");
  const form = document.getElementById("login");
  const input = document.getElementById("token");
  let okAt = null;
  const say = (text, stale) => { status.textContent = text; status.className = stale ? "stale" : ""; };
  async function refresh() {
    const token = sessionStorage.getItem(KEY);
    const headers = token ? { Authorization: "Bearer " + token } : {};
    try {
      const resp = await fetch("fleet", { headers, cache: "no-store", credentials: "omit", redirect: "error" });
      if (resp.status === 401) {
        if (token) sessionStorage.removeItem(KEY);
        form.hidden = false;
        say(token ? "that token was refused; enter an API token" : "this admin API wants a token", true);
        return;
      }
      if (!resp.ok) {
        let why = "HTTP " + resp.status;
        try { why += ": " + (await resp.json()).error; } catch (e) {}
        say(why, true);
        return;
      }
      fleet.innerHTML = await resp.text();
      form.hidden = true;
      okAt = new Date();
      say("updated " + okAt.toLocaleTimeString(), false);
    } catch (e) {
      say("the control plane does not answer" + (okAt ? "; showing what it said at " +
          okAt.toLocaleTimeString() : ""), true);
    }
  }
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, input.value.trim());
    input.value = "";
    refresh();
  });
  (async function loop() {
    const started = performance.now();
    await refresh();
    setTimeout(loop, Math.max(REFRESH_MS, 10 * (performance.now() - started)));
  })();
})();
""".replace("REFRESH_MS", str(REFRESH_MS))


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


#: What the browser may do with the page: its own script and style only (by hash), fetches to its own
#: origin, no framing by other pages (clickjacking), no form posting anywhere.
CSP = (
    f"default-src 'none'; script-src {_csp_hash(_SCRIPT)}; style-src {_csp_hash(_STYLE)}; "
    "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

#: Headers for every HTML answer (the page and the fragment).
HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
)


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return ""
    s = max(float(seconds), 0.0)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    if s < 86400:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def _state(state: str) -> str:
    css = "".join(c if c.isalnum() else "-" for c in state.lower())
    return f'<span class="state {css}">{_e(state)}</span>'


def _table(table_id: str, headers: Sequence[str], rows: Iterable[str], empty: str) -> str:
    body = "".join(rows)
    if not body:
        return f'<p class="none" id="{table_id}">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _node_row(n: Mapping[str, Any]) -> str:
    state = str(n.get("state", ""))
    marks = [m for m in ("cordoned", "draining") if n.get(m)]
    why = f'<div class="why">{_e(n.get("reason", ""))} · {_ago(n.get("since_s"))} ago</div>'
    total = int(n.get("gpus", 0))
    used = total - int(n.get("gpus_free", 0))
    gpu_model = f' <span class="why">{_e(n.get("gpu_model", ""))}</span>' if n.get("gpu_model") else ""
    found = [e for e in n.get("engines", ()) if e.get("version")]
    missing = [e for e in n.get("engines", ()) if not e.get("version")]
    # The engines found, with versions; those not found only in a tooltip (a node lists them all).
    engines = ", ".join(f"{e.get('engine', '')} {e.get('version', '')}" for e in found) or "none found"
    absent = "; ".join(f"{e.get('engine', '')}: {e.get('error', '') or 'unknown'}" for e in missing)
    return (
        f"<tr><td>{_e(n.get('node_id', ''))}</td>"
        f"<td>{_state(state)}{''.join(' ' + _state(m) for m in marks)}{why}</td>"
        f'<td class="num">{used}/{total}{gpu_model}</td>'
        f"<td>{_e(', '.join(n.get('fabrics', ())) or '-')}</td>"
        f'<td class="num">{_ago(n.get("heartbeat_age_s"))}</td>'
        f"<td>{_e(n.get('mgmt_addr', ''))}</td>"
        f'<td class="why" title="{_e(absent)}">{_e(engines)}</td></tr>'
    )


def _model_row(m: Mapping[str, Any]) -> str:
    wanted, ready, placed = int(m["replicas_wanted"]), int(m["replicas_ready"]), int(m["replicas_placed"])
    state = "ready" if ready >= wanted else "not ready"
    reasons = "".join(f'<div class="why">{_e(r)}</div>' for r in m.get("unplaced", ()))
    return (
        f"<tr><td>{_e(m['model'])}</td><td>{_e(m.get('engine', ''))}</td>"
        f'<td class="num">{_state(state)} {ready}/{wanted}</td><td class="num">{placed}</td>'
        f"<td>{_e(m.get('rollout') or '-')}</td><td>{reasons or '-'}</td></tr>"
    )


def _shard_rows(r: Mapping[str, Any], s: Mapping[str, Any]) -> Iterable[str]:
    """A shard's row, and the last lines of its engine's output under it when it failed."""
    leaving = "" if s.get("placed", True) else ' <span class="why">(leaving)</span>'
    retry = s.get("retry_in_s")
    failures = int(s.get("failures", 0))
    restarts = f"{failures} failure(s)" + (f", retry in {_ago(retry)}" if retry else "") if failures else ""
    error = s.get("error", "")
    yield (
        f"<tr><td>{_e(r.get('model', ''))}</td><td>{_e(s.get('shard_id', ''))}</td>"
        f"<td>{_state(str(s.get('state', '')))}"
        f"{leaving}</td>"
        f"<td>{_e(s.get('node_id', ''))} {_state(str(s.get('node_state', '')))}</td>"
        f'<td class="num">{_e(s.get("pid") or "-")}</td>'
        f'<td class="num">{_e(",".join(str(g) for g in s.get("gpus", ())) or "-")}</td>'
        f'<td class="num">{_e(s.get("port") or "-")}</td>'
        f'<td class="load">{_e(load_words(s.get("load")) if s.get("load") else "-")}</td>'
        f'<td class="why">{_e(restarts)}{"<br>" if restarts and error else ""}{_e(error)}</td></tr>'
    )
    tail = list(s.get("output_tail", ()))[-TAIL_LINES:]
    if tail and s.get("state") in ("failed", "unhealthy", "stopped"):
        text = "\n".join(str(line) for line in tail)
        yield f'<tr><td></td><td colspan="8"><pre class="tail">{_e(text)}</pre></td></tr>'


def fleet_html(
    nodes: Sequence[Mapping[str, Any]],
    models: Sequence[Mapping[str, Any]],
    replicas: Sequence[Mapping[str, Any]],
) -> str:
    """The fleet part of the page from the API's documents (``nodes_doc``, ``models_doc``,
    ``replicas_doc`` of one view): nodes, models with the reasons a replica cannot be placed, and
    each shard with its engine's last output when it failed. Every string is escaped."""
    states: dict[str, int] = {}
    for n in nodes:
        states[str(n.get("state", ""))] = states.get(str(n.get("state", "")), 0) + 1
    gpus = sum(int(n.get("gpus", 0)) for n in nodes)
    used = gpus - sum(int(n.get("gpus_free", 0)) for n in nodes)
    ready = sum(int(m["replicas_ready"]) for m in models)
    wanted = sum(int(m["replicas_wanted"]) for m in models)
    summary = (
        f'<p class="summary">{len(nodes)} node(s): '
        f"{_e(', '.join(f'{c} {s}' for s, c in sorted(states.items())) or 'none')} · "
        f"GPUs in use {used}/{gpus} · replicas ready {ready}/{wanted}</p>"
    )
    # Problems first, then the rest in the documents' order, up to MAX_ROWS each.
    nodes_shown = sorted(nodes, key=lambda n: n.get("state") == "ready")[:MAX_ROWS]
    shards = [(r, s) for r in replicas for s in r.get("shards", ())]
    shards_shown = sorted(shards, key=lambda rs: rs[1].get("state") == "ready")[:MAX_ROWS]
    return (
        summary
        + "<h2>Nodes</h2>"
        + _table(
            "nodes",
            ("node", "state", "GPUs used/total", "fabrics", "heartbeat", "address", "engines"),
            (_node_row(n) for n in nodes_shown),
            "No node has registered yet: start an agent with --server pointing at this control plane.",
        )
        + _more(len(nodes) - len(nodes_shown), "nodes", "ctl get nodes")
        + "<h2>Models</h2>"
        + _table(
            "models",
            ("model", "engine", "replicas ready/wanted", "placed", "rollout", "why not placed"),
            (_model_row(m) for m in models),
            "The catalog holds no model.",
        )
        + "<h2>Shards</h2>"
        + _table(
            "shards",
            ("model", "shard", "state", "node", "pid", "GPUs", "port", "load", "failures / error"),
            (row for r, shard in shards_shown for row in _shard_rows(r, shard)),
            "No replica is placed.",
        )
        + _more(len(shards) - len(shards_shown), "shards", "ctl get replicas")
    )


def _more(hidden: int, what: str, command: str) -> str:
    return (
        f'<p class="none" id="more-{_e(what)}">and {hidden} more {_e(what)} (those not ready are shown '
        f"first): {_e(command)} lists them all</p>"
        if hidden > 0
        else ""
    )


def page_html(fleet: str | None, *, tokens: bool) -> bytes:
    """The whole page: ``fleet`` is ``fleet_html`` of now when the request may read the API, else
    None (the script fetches it, asking for a token first when ``tokens``)."""
    if fleet is None:
        fleet = f'<p class="none">{"Enter an API token to see the fleet." if tokens else "Loading the fleet..."}</p>'
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="referrer" content="no-referrer">'
        f"<title>llmgw fleet</title><style>{_STYLE}</style></head><body>"
        '<header><h1>llmgw fleet</h1><span id="status"></span></header>'
        '<form id="login" hidden><label for="token">API token (a read token is enough; kept in this tab '
        'only) </label><input id="token" type="password" autocomplete="off" required> '
        '<button type="submit">Show the fleet</button></form>'
        f'<main id="fleet">{fleet}</main>'
        f"<script>{_SCRIPT}</script></body></html>\n"
    ).encode()


__all__ = [
    "CONTENT_TYPE",
    "CSP",
    "HEADERS",
    "MAX_ROWS",
    "REFRESH_MS",
    "TAIL_LINES",
    "fleet_html",
    "page_html",
]
