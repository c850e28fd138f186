"""A live page of a running pipeline: its plan, drawn, with its counters on it (``onceflow ui``).

``serve(namespace, redis_url, plan_svg)`` starts a small HTTP server (the standard library's
``ThreadingHTTPServer``, on loopback unless told otherwise) in a thread and returns it with its
address. It serves three things:

- ``/``: one HTML page, with no external assets. It shows the physical plan as Graphviz drew it
  (fused stages boxed, boundaries in red), each receiver's counters in a box beside its stage
  or sink, a table of every receiver's counters, the watermark (UTC, and how far it is behind
  now), each source partition's event time, the last committed micro-batch, backups pending,
  the GC floor and last pass, and Redis memory by kind. A script polls ``status.json`` once a
  second and updates the numbers in place.
- ``/status.json``: exactly ``status(client, namespace).as_dict()``, the object that
  ``onceflow status --json`` prints for the namespace.
- ``/plan.svg``: the drawing alone.

Every number on the page carries ``data-field`` naming where it comes from in ``status.json``
and ``data-value`` holding it unformatted (empty when absent), so a test or a scraper can read
it: ``<receiver>.<counter>`` for receivers (``events.in``, ``counts/delivered.delivered``),
the bare name for top-level numbers (``watermark_ms``, ``acked_batch``, ``backups_pending``,
``backups_pending``), and ``<map>:<key>`` for the other maps (``gc:last_pass_ms``,
``memory_by_kind:seen``, ``lanes:<topic>:<partition>.event_time_ms``). Values computed in the
page (the watermark's lag behind now) carry ``data-derived`` instead.

``plan_svg(graph, plan)`` draws a plan for the page: the physical half of ``to_dot`` (the
logical graph and the legend go; the page explains the drawing itself), with every stage box
and node marked ``data-stage`` / ``data-node`` by name. ``pipeline_svg(pipeline)`` does the
same from a ``Pipeline``.

The page reads Redis once per poll, through ``status``: one SCAN of the namespace in bounded
steps. Results are shared between requests for ``STATUS_MAX_AGE_S``, and one read runs at a
time, so several open pages cost no more than one. The Redis URL's password is never shown.
"""

from __future__ import annotations

import html
import json
import logging
import re
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from onceflow.graph_optimizer.draw import render, to_dot
from onceflow.kernel.keyspace import Kind
from onceflow.kernel.scopes import Connect
from onceflow.kernel.settings import RedisSettings, new_redis_client
from onceflow.operations.status import Status, status

if TYPE_CHECKING:
    from onceflow.graph_optimizer.ir import Graph
    from onceflow.graph_optimizer.plan import Plan
    from onceflow.pipeline.api import Pipeline

DEFAULT_HOST = "127.0.0.1"
# How often the page asks for new numbers.
POLL_INTERVAL_MS = 1000
# A status read younger than this answers the next request too (several pages, one SCAN).
STATUS_MAX_AGE_S = 0.5
# The page's Redis client fails fast: an unreachable Redis shows as an error on the page
# within seconds instead of holding requests for the ~30 s a pipeline's client rides out.
REDIS_CONNECT_TIMEOUT_S = 2.0
REDIS_SOCKET_TIMEOUT_S = 10.0
REDIS_RETRIES = 2
# How long ``UiServer.stop`` waits for the serving thread.
STOP_TIMEOUT_S = 5.0

# A sink's receiver is ``<sink>/delivered`` (see ``onceflow.dedup.delivery``).
DELIVERED_SUFFIX = "/delivered"
# Receiver counters, in the order the page shows them (others follow, sorted).
COUNTER_ORDER = (
    "in",
    "committed",
    "out",
    "duplicates",
    "late",
    "ahead",
    "bloom_maybe",
    "redis_lookups",
    "delivered",
    "delivered_again",
    "possible_copies",
    "bloom_journal_entries",
)
# Short column headings for the counters whose names are long.
COUNTER_LABELS = {
    "duplicates": "dups",
    "bloom_maybe": "bloom maybe",
    "redis_lookups": "lookups",
    "delivered_again": "again",
    "possible_copies": "copies?",
    "bloom_journal_entries": "journal",
}
KIND_LABELS = {
    Kind.META.value: "settings",
    Kind.EPOCH.value: "driver epoch",
    Kind.ACKED.value: "acknowledged batch",
    Kind.CLOCK.value: "clock",
    Kind.LANES.value: "lane event times",
    Kind.LANE_ACTIVITY.value: "lane activity",
    Kind.BATCH.value: "batch parameters",
    Kind.GENERATIONS.value: "generations",
    Kind.GC.value: "GC record",
    Kind.TOKEN.value: "task tokens",
    Kind.SEEN.value: "seen IDs",
    Kind.FILTER_SEQ.value: "Bloom sequence",
    Kind.FILTER_JOURNAL.value: "Bloom journal",
    Kind.FILTER_SNAPSHOT.value: "Bloom snapshots",
    Kind.STATS.value: "counters",
    Kind.BACKUP.value: "backups",
    Kind.STATE.value: "keyed state",
    Kind.PENDING.value: "pending deliveries",
    "other": "other",
}

# What ``to_dot`` writes around the parts the page leaves out (see ``physical_dot``).
_LOGICAL_CLUSTER = "  subgraph cluster_logical {"
_CLUSTER_END = "  }"
_LEGEND = "  legend ["
_STAGE_LABEL = "stage "
_LOGICAL = "L_"  # DOT id prefix of the logical graph's nodes
_SVG_NS = "http://www.w3.org/2000/svg"
_XLINK_NS = "http://www.w3.org/1999/xlink"
_JSON = "application/json"

log = logging.getLogger(__name__)


# --- the drawing -------------------------------------------------------------------------


def physical_dot(graph: Graph, plan: Plan) -> str:
    """``to_dot`` without the logical graph and the legend: the plan that runs, for the page.

    When ``to_dot``'s layout is not the one expected, the whole drawing is returned unchanged.
    """
    lines = to_dot(graph, plan).splitlines()
    if _LOGICAL_CLUSTER in lines:
        start = lines.index(_LOGICAL_CLUSTER)
        ends = [i for i in range(start, len(lines)) if lines[i] == _CLUSTER_END]
        if ends:
            lines = lines[:start] + lines[ends[0] + 1 :]
    lines = [line for line in lines if not line.startswith(_LEGEND)]
    return "\n".join(lines) + "\n"


def mark_svg(svg: str) -> str:
    """Name every stage box ``data-stage`` and every node ``data-node``, with readable titles.

    Graphviz titles a node by its DOT id; the page finds a receiver's stage or sink by name.
    In a full ``to_dot`` drawing the logical graph's nodes (DOT ids ``L_...``) stay unmarked,
    so names lead to the physical plan. The XML declaration and DOCTYPE go, so the result can
    be inlined into HTML.
    """
    ET.register_namespace("", _SVG_NS)
    ET.register_namespace("xlink", _XLINK_NS)
    root = ET.fromstring(svg)
    for group in root.iter(f"{{{_SVG_NS}}}g"):
        kind = group.get("class")
        label = group.find(f"{{{_SVG_NS}}}text")
        title = group.find(f"{{{_SVG_NS}}}title")
        if label is None or label.text is None:
            continue
        text = label.text.strip()
        dot_id = (title.text or "") if title is not None else ""
        if kind == "cluster" and text.startswith(_STAGE_LABEL):
            group.set("data-stage", text[len(_STAGE_LABEL) :])
        elif kind == "node" and not dot_id.startswith(_LOGICAL):
            group.set("data-node", text)
        else:
            continue
        if title is not None:
            title.text = text
    return ET.tostring(root, encoding="unicode")


def plan_svg(graph: Graph, plan: Plan) -> str:
    """The page's drawing of ``plan`` (needs Graphviz's ``dot``)."""
    return mark_svg(render(physical_dot(graph, plan), "svg").decode("utf-8"))


def pipeline_svg(pipeline: Pipeline, rules: Iterable[Callable[[Plan], Plan]] | None = None) -> str:
    """The page's drawing of a pipeline's physical plan (optimized with ``rules``)."""
    return plan_svg(pipeline.graph, pipeline.plan(rules))


# --- reading the status ------------------------------------------------------------------


def redis_label(url: str) -> str:
    """Where Redis is, for people: host, port and database; never user names or passwords."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix:{parts.path}"
    host = parts.hostname or "?"
    host = f"[{host}]" if ":" in host else host  # IPv6
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def _secrets(url: str, options: dict[str, Any]) -> list[str]:
    parts = urlsplit(url)
    found = [parts.password, options.get("password")]
    found += re.findall(r"password=([^&]+)", parts.query)
    return [unquote(s) for s in found if s]


def redis_connector(
    redis_url: str | None, namespace: str | None = None
) -> tuple[Callable[[], Any], str, list[str]]:
    """A client factory for ``redis_url`` (or ``$REDIS_URL``), its label and its secrets.

    On a Redis Cluster the client talks to the master serving ``namespace``'s slot.
    """
    settings = RedisSettings.from_env(redis_url)

    def connect() -> Any:
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        return new_redis_client(
            settings,
            namespace,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.1), retries=REDIS_RETRIES),
            socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
            socket_timeout=REDIS_SOCKET_TIMEOUT_S,
        )

    return connect, redis_label(settings.url), _secrets(settings.url, settings.options)


def tag_connector(redis_url: str | None) -> Connect | None:
    """Clients of a Redis Cluster's partition scopes by hash tag (None: one Redis serves all)."""
    settings = RedisSettings.from_env(redis_url)
    if not settings.cluster:
        return None
    clients: dict[str, Any] = {}
    lock = threading.Lock()

    def connect(tag: str) -> Any:
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        with lock:
            if tag not in clients:
                clients[tag] = new_redis_client(
                    settings,
                    tag,
                    retry=Retry(ExponentialBackoff(cap=0.5, base=0.1), retries=REDIS_RETRIES),
                    socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
                    socket_timeout=REDIS_SOCKET_TIMEOUT_S,
                )
            return clients[tag]

    return connect


class StatusSource:
    """A namespace's ``Status``, read at most once per ``max_age`` however many ask."""

    def __init__(
        self,
        namespace: str,
        connect: Callable[[], Any],
        secrets: Iterable[str] = (),
        max_age: float = STATUS_MAX_AGE_S,
        tags: Connect | None = None,
    ) -> None:
        self.namespace = namespace
        self._connect = connect
        self._tags = tags  # partition scopes' clients on a Redis Cluster
        self._secrets = [s for s in secrets if s]
        self._max_age = max_age
        self._client: Any = None
        self._lock = threading.Lock()
        self._last: tuple[float, Status] | None = None

    def read(self) -> Status:
        """The namespace's status, fresh to within ``max_age`` seconds."""
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last[0] < self._max_age:
                return self._last[1]
            if self._client is None:
                self._client = self._connect()
            found = status(self._client, self.namespace, connect=self._tags)
            self._last = (time.monotonic(), found)
            return found

    def scrub(self, text: str) -> str:
        """``text`` with every secret of the Redis settings masked."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text


# --- serving -----------------------------------------------------------------------------


class UiServer(ThreadingHTTPServer):
    """The page's HTTP server: ``start()`` serves in a thread, ``stop()`` ends it."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], page: str, svg: str, source: StatusSource):
        super().__init__(address, UiHandler)
        self.page = page.encode("utf-8")
        self.svg = svg.encode("utf-8")
        self.source = source
        self.errors: list[str] = []  # why a status read failed (the page shows the latest)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port/``."""
        host, port = self.server_address[:2]
        shown = host.decode() if isinstance(host, bytes) else host
        return f"http://{shown}:{port}/"

    def start(self) -> UiServer:
        """Serve in a daemon thread."""
        self._thread = threading.Thread(target=self.serve_forever, name="onceflow-ui", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join(STOP_TIMEOUT_S)
            self._thread = None
        self.server_close()


class UiHandler(BaseHTTPRequestHandler):
    """``/``, ``/status.json`` and ``/plan.svg``; everything else is 404."""

    server: UiServer
    server_version = "onceflow-ui"

    def do_GET(self) -> None:
        """Answer one GET."""
        path = urlsplit(self.path).path
        if path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, "text/html; charset=utf-8", self.server.page)
        elif path == "/status.json":
            self._send_status()
        elif path == "/plan.svg":
            self._send(HTTPStatus.OK, "image/svg+xml", self.server.svg)
        else:
            body = json.dumps({"error": f"no such page {path!r}; try / or /status.json"})
            self._send(HTTPStatus.NOT_FOUND, _JSON, body.encode())

    def _send_status(self) -> None:
        source = self.server.source
        try:
            found = source.read()
        except Exception as exc:  # any failure is shown on the page, as it is
            error = source.scrub(f"cannot read the status from Redis: {type(exc).__name__}: {exc}")
            self.server.errors.append(error)
            log.warning("%s", error)
            body = json.dumps({"error": error}).encode()
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, _JSON, body)
            return
        self._send(HTTPStatus.OK, _JSON, json.dumps(found.as_dict()).encode())

    def _send(self, code: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header(
            "Content-Security-Policy",
            "default-src 'self'; img-src 'self' data:; style-src 'unsafe-inline'; "
            "script-src 'unsafe-inline'",
        )
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the page polls every second."""


def serve(
    namespace: str,
    redis_url: str | None,
    plan_svg: str,
    host: str = DEFAULT_HOST,
    port: int = 0,
    *,
    connect: Callable[[], Any] | None = None,
) -> tuple[UiServer, str]:
    """Serve the page of ``namespace`` in a thread; return the server and its URL.

    ``redis_url`` (or ``$REDIS_URL`` when None) says where the status is read, with
    ``REDIS_PASSWORD`` and TLS settings from the environment as everywhere; ``connect``, when
    given, makes the Redis client instead. ``plan_svg`` is the drawing (``plan_svg`` or
    ``pipeline_svg``). ``port=0`` picks a free port. Stop it with ``server.stop()``.
    """
    tags = None
    if connect is None:
        connect, label, secrets = redis_connector(redis_url, namespace)
        tags = tag_connector(redis_url)
    else:
        label = redis_label(redis_url) if redis_url else "(a client made by the caller)"
        secrets = _secrets(redis_url, {}) if redis_url else []
    source = StatusSource(namespace, connect, secrets, tags=tags)
    page = page_html(namespace, plan_svg, label)
    server = UiServer((host, port), page, plan_svg, source).start()
    return server, server.url


# --- the page ----------------------------------------------------------------------------


def _inline_svg(svg: str) -> str:
    """The ``<svg>`` element alone (no XML declaration, DOCTYPE or comments before it)."""
    start = svg.find("<svg")
    return svg[start:] if start >= 0 else ""


def page_html(namespace: str, svg: str, redis: str) -> str:
    """The page, with its configuration and drawing inlined."""
    config = {
        "namespace": namespace,
        "poll_ms": POLL_INTERVAL_MS,
        "delivered_suffix": DELIVERED_SUFFIX,
        "counter_order": list(COUNTER_ORDER),
        "counter_labels": COUNTER_LABELS,
        "kind_labels": KIND_LABELS,
    }
    values = {
        "TITLE": html.escape(f"{namespace} · onceflow"),
        "NAMESPACE": html.escape(namespace),
        "REDIS": html.escape(redis),
        "CONFIG": json.dumps(config).replace("</", "<\\/"),
        "SVG": _inline_svg(svg),
    }
    return re.sub(r"__([A-Z]+)__", lambda m: values.get(m.group(1), m.group(0)), _PAGE)


_PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<link rel="icon" href="data:,">
<style>
:root {
  --ink: #1f2430; --muted: #6b7280; --line: #e3e6ec; --bg: #f4f5f8; --card: #fff;
  --accent: #4b4fa8; --ok: #1a7f37; --bad: #c62828; --flash: #fff3bf;
  font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif;
  color: var(--ink); background: var(--bg);
}
* { box-sizing: border-box; }
body { margin: 0; }
header {
  display: flex; align-items: baseline; gap: 18px; flex-wrap: wrap;
  padding: 12px 24px; background: #232845; color: #fff;
}
header .brand { font-weight: 700; letter-spacing: .04em; color: #aab0ff; }
header h1 { margin: 0; font-size: 18px; font-weight: 600; }
header .meta { margin-left: auto; color: #c9cce8; font-size: 13px; }
.conn::before {
  content: ""; display: inline-block; width: 8px; height: 8px; border-radius: 50%;
  margin-right: 6px; background: #999; vertical-align: 1px;
}
.conn.ok::before { background: #3ddc84; }
.conn.bad::before { background: #ff5252; }
#error {
  margin: 12px 24px 0; padding: 10px 14px; border-radius: 6px;
  background: #fdecea; color: var(--bad); border: 1px solid #f5c2c0;
}
main {
  display: grid; gap: 16px; padding: 16px 24px 24px;
  grid-template-columns: minmax(0, 3fr) minmax(300px, 2fr);
}
.card {
  background: var(--card); border: 1px solid var(--line); border-radius: 8px;
  padding: 14px 16px; box-shadow: 0 1px 2px rgba(20, 24, 40, .05);
}
.card h2 {
  margin: 0 0 10px; font-size: 12px; font-weight: 600; color: var(--muted);
  text-transform: uppercase; letter-spacing: .06em;
}
aside, .column { display: grid; gap: 16px; align-content: start; min-width: 0; }
#plan { overflow-x: auto; }
#plan svg { display: block; width: 100%; height: auto; margin: 0 auto; }
#plan svg text { font-family: Helvetica, Arial, sans-serif; }
.legend { margin: 8px 0 0; color: var(--muted); font-size: 12px; }
.legend b { color: var(--ink); font-weight: 600; }
.rx-badge rect.frame { fill: #fff; stroke: var(--accent); stroke-width: 1; }
.rx-badge rect.head { fill: #ececf8; }
.rx-badge text { font-size: 11px; fill: var(--ink); }
.rx-badge text.name { font-weight: 700; }
.rx-badge text.kind, .rx-badge text.label { fill: var(--muted); }
.rx-badge text.value { font-variant-numeric: tabular-nums; }
.rx-leader { stroke: var(--accent); stroke-dasharray: 3 3; fill: none; }
text.bump { fill: #d9480f; }
.big { font-size: 22px; font-weight: 600; font-variant-numeric: tabular-nums; }
.sub { color: var(--muted); }
dl { display: grid; grid-template-columns: auto 1fr; gap: 4px 16px; margin: 10px 0 0; }
dt { color: var(--muted); }
dd { margin: 0; text-align: right; font-variant-numeric: tabular-nums; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { padding: 4px 8px; border-bottom: 1px solid var(--line); white-space: nowrap; }
thead th {
  font-size: 12px; color: var(--muted); font-weight: 600; text-align: right;
  border-bottom: 1px solid #cfd4de;
}
thead th:first-child, tbody th { text-align: left; }
tbody th .where { display: block; font-weight: 400; font-size: 12px; color: var(--muted); }
td { text-align: right; transition: background-color .6s; }
td.bump, dd.bump, span.bump { background: var(--flash); transition: none; }
td.none { color: #c0c4cc; }
tbody tr:last-child th, tbody tr:last-child td { border-bottom: 0; }
.bar { height: 6px; background: #e7e8f6; border-radius: 3px; overflow: hidden; }
.bar span { display: block; height: 100%; background: var(--accent); }
#memory-kinds td:first-child { text-align: left; }
#memory-kinds td.barcell { width: 40%; }
.empty { color: var(--muted); font-style: italic; }
@media (max-width: 900px) { main { grid-template-columns: 1fr; } }
</style>
</head>
<body>
<header>
  <span class="brand">onceflow</span>
  <h1>pipeline <span id="namespace">__NAMESPACE__</span></h1>
  <span class="meta">Redis __REDIS__ &middot;
    <span id="conn" class="conn">connecting</span>
    <span id="updated"></span></span>
</header>
<div id="error" hidden></div>
<main>
  <div class="column">
  <section class="card" id="plan-card">
    <h2>Physical plan &mdash; live counters per receiver</h2>
    <div id="plan">__SVG__</div>
    <p class="legend"><b>Shaded box</b>: one fused stage (one Python pass).
      <b>Red edge with a dot</b>: a boundary (backed up before, deduplicated after).
      <b>Dashed red</b>: exchange (repartition by key).
      <b>Boxes on the right</b>: each receiver's counters, updated every second.</p>
  </section>
  <section class="card">
    <h2>Receivers</h2>
    <table id="receivers">
      <thead><tr><th>receiver</th></tr></thead>
      <tbody><tr><td class="empty">no counters yet</td></tr></tbody>
    </table>
  </section>
  </div>
  <aside>
    <section class="card">
      <h2>Event time</h2>
      <div class="big"><span data-field="watermark_ms" data-format="time"
        data-value="">&ndash;</span></div>
      <div class="sub">watermark &middot; <span data-derived="watermark_lag_ms"
        data-value="">&ndash;</span></div>
      <dl>
        <dt>dedup time</dt>
        <dd data-field="dedup_time_ms" data-format="time" data-value="">&ndash;</dd>
        <dt>dedup horizon</dt>
        <dd data-field="horizon_ms" data-format="duration" data-value="">&ndash;</dd>
        <dt>last committed micro-batch</dt>
        <dd data-field="acked_batch" data-format="count" data-value="">&ndash;</dd>
        <dt>driver epoch</dt>
        <dd data-field="epoch" data-format="count" data-value="">&ndash;</dd>
      </dl>
    </section>
    <section class="card">
      <h2>Source partitions</h2>
      <table id="lanes">
        <thead><tr><th>partition</th><th>event time</th><th>last records</th></tr></thead>
        <tbody><tr><td class="empty" colspan="3">none yet</td></tr></tbody>
      </table>
    </section>
    <section class="card">
      <h2>Backups &amp; GC</h2>
      <dl>
        <dt>backups pending</dt>
        <dd data-field="backups_pending" data-format="count" data-value="">&ndash;</dd>
        <dt>acknowledged, awaiting GC</dt>
        <dd data-field="backups_garbage" data-format="count" data-value="">&ndash;</dd>
        <dt>seen-ID generations kept</dt>
        <dd data-derived="generations_kept" data-value="">&ndash;</dd>
        <dt>GC last pass</dt>
        <dd data-field="gc:last_pass_ms" data-format="time" data-value=""
          data-empty="never">&ndash;</dd>
        <dt>GC passes</dt>
        <dd data-field="gc:passes" data-format="count" data-value=""
          data-empty="0">&ndash;</dd>
      </dl>
    </section>
    <section class="card">
      <h2>Redis</h2>
      <div class="big"><span data-field="memory_bytes" data-format="bytes"
        data-value="">&ndash;</span></div>
      <div class="sub">in <span data-field="keys" data-format="count"
        data-value="">&ndash;</span> keys</div>
      <table id="memory-kinds"><tbody></tbody></table>
    </section>
  </aside>
</main>
<script type="application/json" id="onceflow-config">__CONFIG__</script>
<script>
(() => {
  "use strict";
  const config = JSON.parse(document.getElementById("onceflow-config").textContent);
  const SVG = "http://www.w3.org/2000/svg";
  const BADGE = { width: 190, head: 34, line: 15, pad: 8, gap: 28, spacing: 10 };
  const numbers = new Intl.NumberFormat("en-US");
  const plan = document.querySelector("#plan svg");
  const graph = plan ? plan.querySelector("g.graph") : null;
  let shapes = { receivers: "", lanes: "", kinds: "" };
  let seen = false;

  // --- formatting -------------------------------------------------------------------
  function duration(ms) {
    const s = Math.round(Math.abs(ms) / 1000);
    const parts = (big, bigUnit, small, smallUnit) =>
      big + " " + bigUnit + (small ? " " + small + " " + smallUnit : "");
    if (s < 60) return s + " s";
    if (s < 3600) return parts(Math.floor(s / 60), "min", s % 60, "s");
    if (s < 100 * 3600) return parts(Math.floor(s / 3600), "h", Math.floor((s % 3600) / 60), "min");
    return parts(Math.floor(s / 86400), "d", Math.floor((s % 86400) / 3600), "h");
  }
  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
  }
  function utc(ms) {
    return new Date(ms).toISOString().slice(0, 19).replace("T", " ") + " UTC";
  }
  const FORMATS = {
    count: (v) => numbers.format(Number(v)),
    time: (v) => (Number(v) ? utc(Number(v)) : "none"),
    ago: (v) => (Number(v) ? duration(Date.now() - Number(v)) + " ago" : "never"),
    duration: (v) => duration(Number(v)),
    bytes: (v) => bytes(Number(v)),
    text: (v) => String(v),
  };
  function show(el, value) {
    if (value === null || value === undefined || value === "") {
      return el.dataset.empty || "\u2013";
    }
    return (FORMATS[el.dataset.format] || FORMATS.text)(value);
  }

  // --- where each number comes from ---------------------------------------------------
  function values(s) {
    const out = new Map();
    for (const [name, v] of Object.entries(s)) {
      if (v === null || typeof v !== "object") out.set(name, v);
    }
    for (const [rx, counters] of Object.entries(s.receivers || {})) {
      for (const [c, v] of Object.entries(counters)) out.set(rx + "." + c, v);
    }
    for (const [lane, v] of Object.entries(s.lanes || {})) {
      for (const [k, x] of Object.entries(v)) out.set("lanes:" + lane + "." + k, x);
    }
    for (const [k, v] of Object.entries(s.gc || {})) out.set("gc:" + k, v);
    for (const [k, v] of Object.entries(s.memory_by_kind || {})) {
      out.set("memory_by_kind:" + k, v);
    }
    return out;
  }
  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function svgEl(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function number(tag, field, format, extra) {
    return el(tag, Object.assign({ "data-field": field, "data-format": format,
      "data-value": "" }, extra || {}), "\u2013");
  }

  // --- the drawing: stages and sinks by name --------------------------------------------
  function anchorOf(rx) {
    if (!plan) return null;
    const byName = (attr, name) => {
      for (const g of plan.querySelectorAll("[" + attr + "]")) {
        if (g.getAttribute(attr) === name) return g;
      }
      return null;
    };
    if (rx.endsWith(config.delivered_suffix)) {
      const sink = rx.slice(0, -config.delivered_suffix.length);
      const g = byName("data-node", sink);
      if (g) return { g, where: "sink " + sink + " \u00b7 delivery" };
    }
    const stage = byName("data-stage", rx);
    if (stage) return { g: stage, where: "stage " + rx };
    const node = byName("data-node", rx);
    return node ? { g: node, where: "node " + rx } : null;
  }
  function byCounterOrder(a, b) {
    const order = config.counter_order;
    const ia = order.indexOf(a) < 0 ? order.length : order.indexOf(a);
    const ib = order.indexOf(b) < 0 ? order.length : order.indexOf(b);
    return ia - ib || a.localeCompare(b);
  }
  function countersOf(receivers, rx) {
    return Object.keys(receivers[rx]).sort(byCounterOrder);
  }
  function receiverOrder(receivers) {
    const top = (rx) => {
      const a = anchorOf(rx);
      return a ? a.g.getBBox().y : Infinity;
    };
    return Object.keys(receivers).sort((a, b) => top(a) - top(b) || a.localeCompare(b));
  }
  function drawBadges(receivers, order) {
    if (!plan || !graph) return;
    plan.querySelectorAll(".rx-badge, .rx-leader").forEach((n) => n.remove());
    const box = graph.getBBox();
    const x = box.x + box.width + BADGE.gap;
    let next = -Infinity;
    for (const rx of order) {
      const a = anchorOf(rx);
      if (!a) continue;
      const at = a.g.getBBox();
      const counters = countersOf(receivers, rx);
      const h = BADGE.head + counters.length * BADGE.line + BADGE.pad;
      const y = Math.max(at.y, next + BADGE.spacing);
      next = y + h;
      graph.appendChild(svgEl("path", { class: "rx-leader",
        d: `M${at.x + at.width},${at.y + Math.min(at.height / 2, 16)} L${x},${y + 16}` }));
      const badge = svgEl("g", { class: "rx-badge", "data-badge": rx,
        transform: `translate(${x},${y})` });
      badge.appendChild(svgEl("rect", { class: "frame", width: BADGE.width, height: h,
        rx: 6 }));
      badge.appendChild(svgEl("rect", { class: "head", x: 1, y: 1, width: BADGE.width - 2,
        height: BADGE.head - 6, rx: 5 }));
      badge.appendChild(svgEl("text", { class: "name", x: 10, y: 14 }, rx));
      badge.appendChild(svgEl("text", { class: "kind", x: 10, y: 25 }, a.where));
      counters.forEach((c, i) => {
        const ty = BADGE.head + 8 + i * BADGE.line;
        badge.appendChild(svgEl("text", { class: "label", x: 10, y: ty },
          config.counter_labels[c] || c));
        badge.appendChild(svgEl("text", { class: "value", x: BADGE.width - 10, y: ty,
          "text-anchor": "end", "data-field": rx + "." + c, "data-format": "count",
          "data-value": "" }, "\u2013"));
      });
      graph.appendChild(badge);
    }
    const all = plan.getBBox();
    plan.setAttribute("viewBox", [all.x - 6, all.y - 6, all.width + 12, all.height + 12]
      .join(" "));
    plan.style.maxWidth = Math.round((all.width + 12) * 1.25) + "px";
  }
  function fitPlan() {
    if (!plan) return;
    plan.removeAttribute("width");
    plan.removeAttribute("height");
    const all = plan.getBBox();
    plan.style.maxWidth = Math.round(all.width * 1.25) + "px";
  }

  // --- tables whose rows follow the data --------------------------------------------------
  function buildReceivers(receivers) {
    const order = receiverOrder(receivers);
    const columns = [];
    for (const rx of order) {
      for (const c of countersOf(receivers, rx)) if (!columns.includes(c)) columns.push(c);
    }
    columns.sort(byCounterOrder);
    const table = document.getElementById("receivers");
    const head = el("tr");
    head.appendChild(el("th", {}, "receiver"));
    for (const c of columns) {
      head.appendChild(el("th", { title: c }, config.counter_labels[c] || c));
    }
    table.tHead.replaceChildren(head);
    const body = document.createDocumentFragment();
    for (const rx of order) {
      const row = el("tr", { "data-receiver": rx });
      const name = el("th", {}, rx);
      const a = anchorOf(rx);
      name.appendChild(el("span", { class: "where" }, a ? a.where : "not in the drawing"));
      row.appendChild(name);
      for (const c of columns) {
        row.appendChild(c in receivers[rx] ? number("td", rx + "." + c, "count")
          : el("td", { class: "none" }, "\u00b7"));
      }
      body.appendChild(row);
    }
    if (!order.length) {
      body.appendChild(el("tr")).appendChild(el("td", { class: "empty" }, "no counters yet"));
    }
    table.tBodies[0].replaceChildren(body);
    drawBadges(receivers, order);
  }
  function buildLanes(lanes) {
    const body = document.createDocumentFragment();
    for (const lane of Object.keys(lanes).sort()) {
      const row = el("tr", { "data-lane": lane });
      row.appendChild(el("th", {}, lane));
      row.appendChild(number("td", "lanes:" + lane + ".event_time_ms", "time"));
      row.appendChild(number("td", "lanes:" + lane + ".active_ms", "ago"));
      body.appendChild(row);
    }
    if (!Object.keys(lanes).length) {
      body.appendChild(el("tr")).appendChild(el("td", { class: "empty", colspan: 3 },
        "none yet"));
    }
    document.querySelector("#lanes tbody").replaceChildren(body);
  }
  function buildKinds(kinds) {
    const body = document.createDocumentFragment();
    for (const kind of Object.keys(kinds).sort((a, b) => kinds[b] - kinds[a])) {
      const row = el("tr", { "data-kind": kind });
      row.appendChild(el("td", { title: kind }, config.kind_labels[kind] || kind));
      const bar = el("td", { class: "barcell" });
      bar.appendChild(el("div", { class: "bar" })).appendChild(el("span", {
        "data-share": kind }));
      row.appendChild(bar);
      row.appendChild(number("td", "memory_by_kind:" + kind, "bytes"));
      body.appendChild(row);
    }
    document.querySelector("#memory-kinds tbody").replaceChildren(body);
  }
  function shape(obj, inner) {
    return JSON.stringify(Object.keys(obj || {}).sort().map(
      (k) => (inner ? [k, Object.keys(obj[k]).sort()] : k)));
  }

  // --- one update ---------------------------------------------------------------------------
  function flash(node) {
    node.classList.add("bump");
    setTimeout(() => node.classList.remove("bump"), 600);
  }
  function update(s) {
    const next = { receivers: shape(s.receivers, true), lanes: shape(s.lanes),
      kinds: shape(s.memory_by_kind) };
    if (next.receivers !== shapes.receivers) buildReceivers(s.receivers || {});
    if (next.lanes !== shapes.lanes) buildLanes(s.lanes || {});
    if (next.kinds !== shapes.kinds) buildKinds(s.memory_by_kind || {});
    shapes = next;
    const found = values(s);
    for (const node of document.querySelectorAll("[data-field]")) {
      const value = found.get(node.dataset.field);
      const raw = value === null || value === undefined ? "" : String(value);
      const before = node.dataset.value;
      if (raw !== before || !seen || node.dataset.format === "ago") {
        node.dataset.value = raw;
        node.textContent = show(node, value);
        if (seen && before !== "" && Number(raw) > Number(before)) flash(node);
      }
    }
    const kept = document.querySelector('[data-derived="generations_kept"]');
    const generations = Object.keys(s.generations || {}).length;
    kept.dataset.value = String(generations);
    kept.textContent = String(generations);
    const lag = document.querySelector('[data-derived="watermark_lag_ms"]');
    if (s.watermark_ms) {
      const ms = Date.now() - s.watermark_ms;
      lag.dataset.value = String(ms);
      lag.textContent = duration(ms) + (ms >= 0 ? " behind now" : " ahead of now");
    } else {
      lag.dataset.value = "";
      lag.textContent = "none yet";
    }
    const total = s.memory_bytes || 0;
    for (const bar of document.querySelectorAll("[data-share]")) {
      const part = (s.memory_by_kind || {})[bar.dataset.share] || 0;
      bar.style.width = (total ? (100 * part) / total : 0).toFixed(1) + "%";
    }
    seen = true;
  }

  // --- polling ------------------------------------------------------------------------------
  const conn = document.getElementById("conn");
  const updated = document.getElementById("updated");
  const banner = document.getElementById("error");
  async function poll() {
    try {
      const answer = await fetch("status.json", { cache: "no-store" });
      const body = await answer.json();
      if (!answer.ok) throw new Error(body.error || "HTTP " + answer.status);
      update(body);
      conn.className = "conn ok";
      conn.textContent = "live";
      updated.dataset.value = String(Date.now());
      updated.textContent = "\u00b7 updated " + utc(Date.now()).slice(11);
      banner.hidden = true;
    } catch (err) {
      conn.className = "conn bad";
      conn.textContent = "no data";
      banner.textContent = String(err.message || err);
      banner.hidden = false;
    } finally {
      setTimeout(poll, config.poll_ms);
    }
  }
  fitPlan();
  poll();
})();
</script>
</body>
</html>
"""
