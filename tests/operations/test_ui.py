"""The live page (``onceflow.operations.ui``) in a real headless browser, on a running pipeline.

A streaming keyed count runs in a child process against the session's Redis and broker; the
page is served for its namespace and opened in Debian's chromium through chromedriver before
the pipeline starts. The page must wait for the pipeline without an error, show counters
while it runs, update them, and once the pipeline is stopped show exactly what
``onceflow status --json`` prints, at window widths 1280, 1440 and 1920 with no counter
covered or cut off. A screenshot per width is kept under ``tests/artifacts/``.

Needs ``chromium`` and ``chromium-driver`` (apt) and ``selenium`` (pip); skipped without them.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from onceflow.cli.loader import load_pipeline
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import produce
from onceflow.operations.ui import pipeline_svg, redis_label, serve
from onceflow.testing.harness import kill_session

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROME_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1440,1000",
)
RECORDS = 4000
COPIES = 200  # re-sent copies of the first events, after all of them: dropped as duplicates
LATE = 5  # events older than the dedup horizon (24 h): dead letters
READ = RECORDS + COPIES + LATE
# The dead letters' sink is not a node of the plan: its counters are in the table only.
DEAD_LETTERS = "events/dead-letters/delivered"
USERS = 13
PARTITIONS = 2
FIRST_COUNTS_TIMEOUT_S = 240
DRAINED_TIMEOUT_S = 240
SETTLED_S = 3.0
PAGE_MATCH_TIMEOUT_S = 15
WIDTHS = (1280, 1440, 1920)

PIPELINE = """\
from onceflow import KafkaSink, KafkaSource, Pipeline

pipeline = Pipeline({name!r})
(
    pipeline.read(
        "events",
        KafkaSource({topic_in!r}, id=lambda e: e["id"], timestamp=lambda e: e["ts"]),
    )
    .key_by("by-user", lambda e: e["user"])
    .count_per_key("count")
    .write("counts", KafkaSink({topic_out!r}))
)
"""

# Every number on the page: [data-field, data-value, text].
PAGE_FIELDS_JS = """
return Array.from(document.querySelectorAll('[data-field]')).map(
  (e) => [e.dataset.field, e.dataset.value, e.textContent]);
"""

# The layout at the window's width: [counter boxes, counters, counter boxes meeting a side
# panel, counters not readable]. A counter is readable when, scrolled into view, it lies
# within the viewport's width and is what the browser finds at its centre (nothing covers it).
LAYOUT_JS = """
const meets = (a, b) => a.left < b.right && b.left < a.right && a.top < b.bottom
  && b.top < a.bottom;
const panels = Array.from(document.querySelectorAll('aside .card'));
const boxes = Array.from(document.querySelectorAll('#plan [data-badge]'));
const overlaps = [];
for (const box of boxes) {
  for (const panel of panels) {
    if (meets(box.getBoundingClientRect(), panel.getBoundingClientRect())) {
      overlaps.push(box.dataset.badge + ' under ' + panel.querySelector('h2').textContent);
    }
  }
}
const counters = document.querySelectorAll(
  '#plan [data-badge] [data-field], #receivers [data-field]');
const hidden = [];
for (const e of counters) {
  e.scrollIntoView({ block: 'center', inline: 'center' });
  const r = e.getBoundingClientRect();
  const found = document.elementFromPoint((r.left + r.right) / 2, (r.top + r.bottom) / 2);
  const inside = r.width > 0 && r.left >= 0
    && r.right <= document.documentElement.clientWidth;
  if (!inside || !(found === e || e.contains(found))) hidden.push(e.dataset.field);
}
window.scrollTo(0, 0);
document.querySelectorAll('.card, #plan').forEach((c) => { c.scrollLeft = 0; });
return [boxes.length, counters.length, overlaps, hidden];
"""


def _chrome(profile: Path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
    for exe in (CHROMIUM, CHROMEDRIVER):
        if not os.path.exists(exe):
            pytest.skip(f"{exe} missing: apt-get install -y chromium chromium-driver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    for flag in (*CHROME_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def _produce(bootstrap: str, topic: str) -> None:
    """Events, then copies of some and a few late ones: the table gets dups and late too."""
    base = (int(time.time()) // 3600 - 1) * 3_600_000  # event times of the last hour or two
    events = [
        {"id": f"e{i}", "user": f"u{i % USERS}", "ts": base + 100 * i} for i in range(RECORDS)
    ]
    events += events[:COPIES]
    events += [{"id": f"late{i}", "user": "u0", "ts": base - 3 * 86_400_000} for i in range(LATE)]
    records = [(None, json.dumps(e).encode(), None) for e in events]
    produce(KafkaSettings(bootstrap), topic, records, partitions=PARTITIONS)


def _cli_status(namespace: str, redis_url: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "onceflow", "status", "--json", "--namespace", namespace]
        + ["--redis-url", redis_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    (found,) = json.loads(proc.stdout)
    return found


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def _served_status(url: str) -> dict:
    code, kind, body = _get(url + "status.json")
    assert code == 200, body
    assert kind == "application/json"
    return json.loads(body)


def _expected_fields(status: dict) -> dict[str, str]:
    """The page's ``data-field`` -> ``data-value`` for a status (see the module's docstring)."""
    found = {k: v for k, v in status.items() if not isinstance(v, dict)}
    for rx, counters in status["receivers"].items():
        found.update({f"{rx}.{c}": v for c, v in counters.items()})
    for lane, values in status["lanes"].items():
        found.update({f"lanes:{lane}.{k}": v for k, v in values.items()})
    found.update({f"gc:{k}": v for k, v in status["gc"].items()})
    found.update({f"memory_by_kind:{k}": v for k, v in status["memory_by_kind"].items()})
    return {k: "" if v is None else str(v) for k, v in found.items()}


def _page_fields(driver) -> list[tuple[str, str, str]]:
    return [tuple(row) for row in driver.execute_script(PAGE_FIELDS_JS)]


def _mismatches(driver, status: dict) -> list[str]:
    """Every number on the page that differs from ``status``, and every one missing."""
    expected = _expected_fields(status)
    shown = _page_fields(driver)
    wrong = [
        f"{field}: page {value!r}, status {expected.get(field, '')!r}"
        for field, value, _ in shown
        if value != expected.get(field, "")
    ]
    on_page = {field for field, _, _ in shown}
    required = [f for f in expected if "." in f or ":" in f]  # receivers, lanes, gc, memory
    required += ["watermark_ms", "acked_batch", "backups_pending", "dedup_time_ms"]
    wrong += [f"{f}: not on the page" for f in required if f not in on_page]
    return wrong


def _screenshot(driver, path: Path) -> None:
    """The whole page, not just the window (Chrome DevTools: capture beyond the viewport)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        },
    )
    path.write_bytes(base64.b64decode(shot["data"]))


def _check_layout(driver, width: int, boxes: int) -> None:
    """At ``width``: no counter box under a side panel, every counter readable; a screenshot."""
    driver.set_window_size(width, 1000)
    _screenshot(driver, ARTIFACTS / f"ui_status_page_{width}.png")
    drawn, counters, overlaps, hidden = driver.execute_script(LAYOUT_JS)
    assert drawn == boxes and counters > 0, (width, drawn, counters)
    assert not overlaps, f"at {width} px counter boxes meet side panels: {overlaps}"
    assert not hidden, f"at {width} px counters cannot be read: {hidden}"


def _wait(condition, timeout: float, what: str, proc=None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log else ""
            pytest.fail(f"the pipeline exited ({proc.returncode}) before {what}:\n{tail}")
        time.sleep(0.25)
    tail = log.read_text(errors="replace")[-4000:] if log else ""
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{tail}")


@pytest.mark.redis
@pytest.mark.kafka
@pytest.mark.browser
def test_the_page_shows_a_running_pipeline(redis_server, broker, tmp_path):
    name = f"ui-{uuid.uuid4().hex[:8]}"
    topic_in, topic_out = f"{name}-in", f"{name}-out"
    _produce(broker.bootstrap, topic_in)
    pipeline_file = tmp_path / "clicks.py"
    pipeline_file.write_text(PIPELINE.format(name=name, topic_in=topic_in, topic_out=topic_out))
    svg = pipeline_svg(load_pipeline(str(pipeline_file)))

    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "onceflow", "run", str(pipeline_file)]
    cmd += ["--redis-url", redis_server.url, "--checkpoint", str(tmp_path / "checkpoint")]
    cmd += ["--output-dir", str(tmp_path / "out"), "--trigger-seconds", "1"]
    cmd += ["--max-records-per-batch", "500", "--no-progress"]
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap}
    server = driver = proc = None
    try:
        # Before the pipeline starts its namespace has no state, and the page waits without an
        # error (a page opened first, or a run slow to start under load, used to see a 503).
        server, url = serve(name, redis_server.url, svg)
        assert url.startswith("http://127.0.0.1:")
        driver = _chrome(tmp_path / "chrome-profile")
        driver.get(url)
        assert name in driver.title
        conn = "return document.getElementById('conn').textContent;"
        _wait(lambda: driver.execute_script(conn) != "connecting", 30, "the first poll")
        assert driver.execute_script(conn) == "waiting", server.errors
        code, _, body = _get(url + "status.json")
        assert code == 200 and "no exactly-once state" in json.loads(body)["waiting"], body
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

        # While it runs: counters appear, then grow (the page polls status.json every second).
        def events_in() -> int:
            rows = driver.execute_script(
                "const e = document.querySelector('[data-field=\"events.in\"]');"
                "return e ? e.dataset.value : '';"
            )
            return int(rows or 0)

        seen = {_wait(events_in, FIRST_COUNTS_TIMEOUT_S, "counters on the page", proc, log)}

        def drained() -> bool:
            seen.add(events_in())
            rx = _served_status(url)["receivers"]
            return rx.get("events", {}).get("in", 0) >= READ and "counts/delivered" in rx

        _wait(drained, DRAINED_TIMEOUT_S, f"all {READ} records read", proc, log)

        def settled() -> bool:  # no counter moved for SETTLED_S: the last batch is done
            before = _served_status(url)["receivers"]
            time.sleep(SETTLED_S)
            seen.add(events_in())
            return _served_status(url)["receivers"] == before

        _wait(settled, DRAINED_TIMEOUT_S, "the counters to settle", proc, log)
        assert len({v for v in seen if v > 0}) >= 2, f"the page never updated: {seen}"
        kill_session(proc.pid)
        proc.wait(30)

        # Stopped: the page, /status.json and `onceflow status --json` say the same.
        cli = _cli_status(name, redis_server.url)
        assert cli["receivers"]["events"]["in"] == READ
        assert cli["receivers"]["events"]["duplicates"] == COPIES
        assert cli["receivers"]["events"]["late"] == LATE
        assert cli["receivers"]["counts/delivered"]["delivered"] > 0
        assert _served_status(url) == cli
        deadline = time.monotonic() + PAGE_MATCH_TIMEOUT_S
        while (wrong := _mismatches(driver, cli)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not wrong, "page differs from `onceflow status --json`:\n" + "\n".join(wrong)
        for field, value, text in _page_fields(driver):
            if field.endswith((".in", ".out", ".committed", ".delivered")):
                assert text.replace(",", "") == value, (field, text)
        watermark = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(cli["watermark_ms"] / 1000))
        shown = driver.execute_script(
            "return document.querySelector('[data-field=\"watermark_ms\"]').textContent;"
        )
        assert shown == watermark
        lag = driver.execute_script(
            "return document.querySelector('[data-derived=\"watermark_lag_ms\"]').textContent;"
        )
        assert lag.endswith("behind now"), lag

        # The drawing: the physical plan's stages and nodes, each receiver's box beside it.
        stages = driver.execute_script(
            "return Array.from(document.querySelectorAll('#plan svg [data-stage]'))"
            ".map((g) => g.dataset.stage);"
        )
        assert sorted(stages) == ["count", "events"]
        nodes = set(
            driver.execute_script(
                "return Array.from(document.querySelectorAll('#plan svg [data-node]'))"
                ".map((g) => g.dataset.node);"
            )
        )
        assert {"events", "by-user", "count", "counts"} <= nodes
        badges = driver.execute_script(
            "return Array.from(document.querySelectorAll('#plan svg [data-badge]'))"
            ".map((g) => g.dataset.badge);"
        )
        assert set(badges) == set(cli["receivers"]) - {DEAD_LETTERS}, badges
        where = driver.execute_script(
            "return Object.fromEntries(Array.from("
            "document.querySelectorAll('#receivers tr[data-receiver]')).map("
            "(r) => [r.dataset.receiver, r.querySelector('.where').textContent]));"
        )
        assert where == {
            "events": "stage events",
            "count": "stage count",
            "counts/delivered": "sink counts · delivery",
            DEAD_LETTERS: "not in the drawing",
        }
        code, kind, body = _get(url + "plan.svg")
        assert (code, kind) == (200, "image/svg+xml")
        assert 'data-stage="events"' in body and "stage count" in body

        for width in WIDTHS:
            _check_layout(driver, width, len(badges))
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, (errors, server.errors)
    finally:
        if proc is not None:
            kill_session(proc.pid)
        if driver is not None:
            driver.quit()
        if server is not None:
            server.stop()


def test_redis_passwords_stay_off_the_page():
    """An unreachable Redis shows as an error; neither it nor the page shows the password."""
    secret = "s3cret-" + uuid.uuid4().hex[:6]
    url_with_secret = f"redis://admin:{secret}@127.0.0.1:1/0"  # nothing listens on port 1
    assert secret not in redis_label(url_with_secret)
    assert redis_label(url_with_secret) == "redis://127.0.0.1:1/0"
    server, url = serve("nowhere", url_with_secret, "<svg xmlns='http://www.w3.org/2000/svg'/>")
    try:
        code, kind, body = _get(url + "status.json")
        assert (code, kind) == (503, "application/json")
        assert "cannot read the status from Redis" in json.loads(body)["error"]
        assert secret not in body
        code, _, page = _get(url)
        assert code == 200 and "nowhere" in page and secret not in page
        assert _get(url + "nothing-here")[0] == 404
    finally:
        server.stop()
