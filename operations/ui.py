"""A live page of a running pipeline: its plan, drawn, with its counters on it (``onceflow ui``).

``serve(namespace, redis_url, plan_svg)`` starts a small HTTP server (the standard library's
``ThreadingHTTPServer``, on loopback unless told otherwise) in a thread and returns it with its
address. It serves four things:

- ``/``: one HTML page, with no external assets (``ui.html``, ``ui.css`` and ``ui.js`` beside
  this module, read once). It shows the physical plan as Graphviz drew it (fused stages boxed,
  boundaries in red), each receiver's counters in a box beside its stage or sink, a table of
  every receiver's counters, the watermark (UTC, and how far it is behind now), each source
  partition's event time, the last committed micro-batch, backups pending, the GC floor and
  last pass, and Redis memory by kind. A script polls ``status.json`` once a second and
  updates the numbers in place.
- ``/status.json``: exactly ``status(client, namespace).as_dict()``, the object that
  ``onceflow status --json`` prints for the namespace. While the namespace has no state (its
  pipeline has not started yet, or the name is wrong) it is ``{"namespace", "waiting"}``, the
  latter saying why, and the page says it waits; a failed read answers 503 and ``{"error"}``.
- ``/plan.svg``: the drawing alone.
- ``/state.json?step=NAME`` (``&key=TEXT`` or ``&key_json=JSON``, or ``&limit=N``: 100 keys
  unless asked, 10,000 at most): a stateful step's keyed state, as ``onceflow state`` reads it
  (:mod:`~.state_read`): ``{"namespace", "step", "entries": [{"key", "state",
  "partition"}]}``; a wrong step is a 400 naming the stateful ones.

Every number on the page carries ``data-field`` naming where it comes from in ``status.json``
and ``data-value`` holding it unformatted (empty when absent), so a test or a scraper can read
it: ``<receiver>.<counter>`` for receivers (``events.in``, ``counts/delivered.delivered``),
the bare name for top-level numbers (``watermark_ms``, ``acked_batch``, ``backups_pending``,
``backups_pending``), and ``<map>:<key>`` for the other maps (``gc:last_pass_ms``,
``memory_by_kind:seen``, ``lanes:<topic>:<partition>.event_time_ms``). Values computed in the
page (the watermark's lag behind now) carry ``data-derived`` instead.

``plan_svg(graph, plan)`` draws a plan for the page (``to_svg(..., for_page=True)``): the
physical plan alone (the page explains the drawing itself), with every stage box and node
marked ``data-stage`` / ``data-node`` by name. ``pipeline_svg(pipeline)`` does the same from
a ``Pipeline``.

The page reads Redis once per poll, through ``status``: one SCAN of the namespace in bounded
steps. Results are shared between requests for ``STATUS_MAX_AGE_S``, and one read runs at a
time, so several open pages cost no more than one. The Redis URL's password is never shown.
"""

from __future__ import annotations

import functools
import html
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

from onceflow.graph_optimizer.draw import to_svg
from onceflow.kernel.errors import OnceflowError
from onceflow.kernel.keyspace import Kind
from onceflow.kernel.scopes import Connect
from onceflow.kernel.settings import RedisSettings, new_redis_client, retry_options
from onceflow.operations.gc import NoStateError
from onceflow.operations.state_read import key_from_json, read_state
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
# within seconds instead of holding requests for the ~40 s a pipeline's client rides out
# (the same retry policy, kernel.settings.retry_options, with fewer retries and a lower cap).
REDIS_CONNECT_TIMEOUT_S = 2.0
REDIS_SOCKET_TIMEOUT_S = 10.0
REDIS_RETRIES = 2
REDIS_RETRY_CAP_S = 0.5
# How long ``UiServer.stop`` waits for the serving thread.
STOP_TIMEOUT_S = 5.0
STATE_LIMIT = 100  # keys /state.json shows unless asked for more
STATE_MAX = 10_000

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

_JSON = "application/json"
# The page's files (package data beside this module): the HTML with ``__NAME__`` slots, its
# style and its script.
_PAGE_FILES = {"PAGE": "ui.html", "STYLE": "ui.css", "SCRIPT": "ui.js"}

log = logging.getLogger(__name__)


# --- the drawing -------------------------------------------------------------------------


def plan_svg(graph: Graph, plan: Plan) -> str:
    """The page's drawing of ``plan`` (needs Graphviz's ``dot``)."""
    return to_svg(graph, plan, for_page=True)


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
        return new_redis_client(
            settings,
            namespace,
            **retry_options(REDIS_RETRIES, REDIS_RETRY_CAP_S),
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
        with lock:
            if tag not in clients:
                clients[tag] = new_redis_client(
                    settings,
                    tag,
                    **retry_options(REDIS_RETRIES, REDIS_RETRY_CAP_S),
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

    def state(self, step: str, key: Any, limit: int) -> list[dict[str, Any]]:
        """A stateful step's keyed state (see :mod:`~.state_read`): one key's, or ``limit``."""
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            client = self._client
        entries = read_state(client, self.namespace, step, key=key, limit=limit, connect=self._tags)
        return [entry.as_json() for entry in entries]

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
    """``/``, ``/status.json``, ``/state.json`` and ``/plan.svg``; everything else is 404."""

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
        elif path == "/state.json":
            self._send_state(parse_qs(urlsplit(self.path).query))
        else:
            body = json.dumps({"error": f"no such page {path!r}; try / or /status.json"})
            self._send(HTTPStatus.NOT_FOUND, _JSON, body.encode())

    def _send_status(self) -> None:
        source = self.server.source
        try:
            found = source.read()
        except NoStateError as exc:  # not an error: the pipeline has not written anything yet
            waiting = {"namespace": source.namespace, "waiting": source.scrub(str(exc))}
            self._send(HTTPStatus.OK, _JSON, json.dumps(waiting).encode())
            return
        except Exception as exc:  # any failure is shown on the page, as it is
            error = source.scrub(f"cannot read the status from Redis: {type(exc).__name__}: {exc}")
            self.server.errors.append(error)
            log.warning("%s", error)
            body = json.dumps({"error": error}).encode()
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, _JSON, body)
            return
        self._send(HTTPStatus.OK, _JSON, json.dumps(found.as_dict()).encode())

    def _send_state(self, query: dict[str, list[str]]) -> None:
        """``/state.json?step=NAME`` (``&key=``, ``&key_json=`` or ``&limit=N``, default 100)."""
        source = self.server.source
        step, key = query.get("step", [""])[0], query.get("key", [None])[0]
        try:
            if "key_json" in query:  # an int, a tuple or bytes, as --key-json takes it
                key = key_from_json(query["key_json"][0])
            limit = min(int(query.get("limit", [str(STATE_LIMIT)])[0]), STATE_MAX)
            entries = source.state(step, key, max(limit, 1))
        except (ValueError, OnceflowError) as exc:  # a wrong step or limit: the asker's error
            body = json.dumps({"error": source.scrub(str(exc))}).encode()
            self._send(HTTPStatus.BAD_REQUEST, _JSON, body)
            return
        except Exception as exc:  # Redis away: said, as the status is
            error = source.scrub(f"cannot read the state from Redis: {type(exc).__name__}: {exc}")
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, _JSON, json.dumps({"error": error}).encode())
            return
        found = {"namespace": source.namespace, "step": step, "entries": entries}
        self._send(HTTPStatus.OK, _JSON, json.dumps(found).encode())

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


@functools.cache
def _page_files() -> dict[str, str]:
    """The page's HTML, style and script, read once."""
    folder = resources.files("onceflow.operations")
    return {slot: (folder / name).read_text(encoding="utf-8") for slot, name in _PAGE_FILES.items()}


def page_html(namespace: str, svg: str, redis: str) -> str:
    """The page, with its style, script, configuration and drawing inlined."""
    config = {
        "namespace": namespace,
        "poll_ms": POLL_INTERVAL_MS,
        "delivered_suffix": DELIVERED_SUFFIX,
        "counter_order": list(COUNTER_ORDER),
        "counter_labels": COUNTER_LABELS,
        "kind_labels": KIND_LABELS,
    }
    files = _page_files()
    values = {
        "STYLE": files["STYLE"],
        "SCRIPT": files["SCRIPT"],
        "TITLE": html.escape(f"{namespace} · onceflow"),
        "NAMESPACE": html.escape(namespace),
        "REDIS": html.escape(redis),
        "CONFIG": json.dumps(config).replace("</", "<\\/"),
        "SVG": _inline_svg(svg),
    }
    return re.sub(r"__([A-Z]+)__", lambda m: values.get(m.group(1), m.group(0)), files["PAGE"])
