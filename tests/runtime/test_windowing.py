"""The windowed combine's state machine against a plain-Python reference, batch by batch.

The operator runs as the streaming runtime drives it (chunks committed, then the end-of-task
fire), with its state kept in dictionaries the way Redis keeps it (encoded values, timer
sets). The reference knows nothing of encoding, timers or triggers: per key it keeps the open
windows' sums, adds the records each micro-batch accepts and closes windows once the
watermark passes their end plus the allowed lateness. Every pane the operator fires must
carry the reference's sum at that moment (accumulating) or the sum since the previous pane
(discarding), every closed window must end with exactly one final pane, and the windows left
open must hold what the reference holds.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceflow.kernel import codec
from onceflow.kernel.records import StateWrite
from onceflow.kernel.windows import (
    Fixed,
    Global,
    Pane,
    Sessions,
    Sliding,
    Trigger,
    Windowing,
    windowing,
)
from onceflow.pipeline.combiners import Sum
from onceflow.runtime.ops.windowed_combine import WindowClosedError, WindowedCombine
from onceflow.runtime.spec import OpKind, OpSpec, Phase

NODE = "total"


@dataclass
class Store:
    """Redis, as far as one combine partition sees it."""

    values: dict[bytes, bytes] = field(default_factory=dict)
    timers: dict[str, dict[bytes, int]] = field(default_factory=lambda: defaultdict(dict))

    def read(self, node, keys):
        return {k: self.values.get(k) for k in keys}

    def due(self, watermark, now):
        return [k for k, at in self.timers["event"].items() if at <= watermark] + [
            k for k, at in self.timers["processing"].items() if at <= now
        ]

    def apply(self, write: StateWrite):
        for k, v in write.values.items():
            if v is None:
                self.values.pop(k, None)
            else:
                self.values[k] = v
        for kind, members in write.timers.items():
            for k, at in members.items():
                if at is None:
                    self.timers[kind].pop(k, None)
                else:
                    self.timers[kind][k] = at


def run_operator(w: Windowing, batches, phase=Phase.FULL):
    """Drive the operator; return panes as (batch, key, Pane), dead records, and the store."""
    spec = OpSpec(NODE, OpKind.COMBINE, (), (), combine_fn=Sum(), phase=phase, windowing=w)
    store = Store()
    panes, dead = [], []
    for b, (wm, now, chunks) in enumerate(batches):
        op = WindowedCombine(spec, True, False, (wm, None), now)

        def emit(kb, key, pane, ts, b=b):
            panes.append((b, key, pane))

        for chunk in chunks:
            for key, ts, v in chunk:
                try:
                    op.add(codec.encode(key), key, v, ts)
                except WindowClosedError:
                    dead.append((b, key, ts))
            store.apply(op.updates(store.read, emit))
            op.chunk_committed()
        store.apply(op.fire(store.read, store.due(wm, now), emit))
    return panes, dead, store


def run_reference(w: Windowing, batches):
    """Per key, the open windows' sums; closed windows' final sums; sums at every batch end;
    and how many records each window took in each batch."""
    open_: dict[str, dict[tuple[int, int], int]] = defaultdict(dict)
    final: dict[tuple[str, int, int], int] = {}
    sums_at: dict[tuple[int, str, int, int], int] = {}
    received: dict[tuple[int, str, int, int], int] = defaultdict(int)
    dead = []
    for b, (wm, _now, chunks) in enumerate(batches):
        for chunk in chunks:
            for key, ts, v in chunk:
                spans = [s for s in w.fn.assign(ts) if not _closed(w, s[1], wm)]
                if not spans:
                    dead.append((b, key, ts))
                    continue
                for span in spans:
                    _add(open_[key], span, v, merging=w.fn.merging)
                    received[(b, key, *span)] += 1
        for key, windows in open_.items():
            for (s, e), total in list(windows.items()):
                sums_at[(b, key, s, e)] = total
                if _closed(w, e, wm):
                    final[(key, s, e)] = total
                    del windows[(s, e)]
    return open_, final, sums_at, dead, received


def _closed(w, end, wm):
    """A window closes once the watermark reaches its end plus the allowed lateness."""
    return not isinstance(w.fn, Global) and end + w.allowed_lateness_ms <= wm


def _add(windows, span, v, merging):
    if not merging:
        windows[span] = windows.get(span, 0) + v
        return
    start, end, total = span[0], span[1], v
    for s, e in list(windows):
        if s < end and start < e:
            start, end = min(start, s), max(end, e)
            total += windows.pop((s, e))
    windows[(start, end)] = total


def window_fns():
    return st.one_of(
        st.builds(Fixed, st.sampled_from([5, 10, 30])),
        st.builds(
            lambda size, r: Sliding(size, size / r),
            st.sampled_from([10, 30]),
            st.sampled_from([2, 5]),
        ),
        st.builds(Sessions, st.sampled_from([3, 8])),
    )


def triggers():
    return st.builds(
        Trigger,
        early_every=st.sampled_from([None, 1, 3]),
        early_seconds=st.sampled_from([None, 2.0]),
        on_time=st.booleans(),
        late=st.sampled_from(["batch", "record", "none"]),
    )


@st.composite
def scenarios(draw):
    w = windowing(
        draw(window_fns()),
        trigger=draw(triggers()),
        allowed_lateness=draw(st.sampled_from([0, 5, 20])),
        accumulation=draw(st.sampled_from(["accumulating", "discarding"])),
    )
    batches = []
    wm, now = 0, 1_000_000
    for _ in range(draw(st.integers(2, 8))):
        wm += draw(st.sampled_from([0, 1000, 4000, 15000]))
        now += draw(st.sampled_from([500, 1500, 3000]))
        chunks = []
        for _ in range(draw(st.integers(1, 3))):
            rows = draw(
                st.lists(
                    st.tuples(
                        st.sampled_from(["a", "b", "c"]),
                        st.integers(wm - 40_000, wm + 20_000),
                        st.integers(1, 5),
                    ),
                    max_size=12,
                )
            )
            chunks.append(rows)
        batches.append((wm, now, chunks))
    # and the end of time: every window closes
    batches.append((wm + 10**9, now + 1000, []))
    return w, batches


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_panes_match_the_reference_batch_by_batch(scenario):
    w, batches = scenario
    panes, dead, store = run_operator(w, batches)
    ref_open, ref_final, sums_at, ref_dead, received = run_reference(w, batches)
    assert sorted(dead) == sorted(ref_dead), "records refused as too late differ"
    assert not store.values and not any(store.timers.values()), "state outlived its windows"
    assert not any(ref_open.values())
    by_window = defaultdict(list)
    for b, key, pane in panes:
        by_window[(key, pane.start, pane.end)].append((b, pane))
    assert set(by_window) >= set(ref_final), "a closed window without panes"
    per_record = w.trigger.late_mode.value == "record"
    for window, fired in by_window.items():
        key, start, end = window
        assert [p.index for _, p in fired] == list(range(len(fired))), "pane indexes"
        timings = [p.timing for _, p in fired]
        assert timings.count("on_time") <= 1
        if "on_time" in timings:
            at = timings.index("on_time")
            assert set(timings[:at]) <= {"early"} and set(timings[at + 1 :]) <= {"late"}
        if window in ref_final:
            assert [p.final for _, p in fired] == [False] * (len(fired) - 1) + [True]
        else:  # a session that later merged into a larger one: it never closed on its own
            assert w.fn.merging and not any(p.final for _, p in fired)
        if w.discarding:
            continue
        for b, pane in fired:
            if per_record and pane.timing == "late" and not pane.final:
                continue  # fired mid-chunk, after each record: checked below
            assert pane.value == sums_at[(b, key, start, end)], (window, b, pane)
        values = [p.value for _, p in fired]
        assert values == sorted(values), "accumulating panes only grow"
    if not w.fn.merging:
        _panes_fire_when_due(w, batches, by_window, received, sums_at)
    if w.discarding:  # every record leaves in exactly one pane of each of its windows
        emitted = defaultdict(int)
        for _, key, pane in panes:
            emitted[key] += pane.value
        expected = defaultdict(int)
        for (key, _s, _e), total in ref_final.items():
            expected[key] += total
        assert emitted == expected


def _panes_fire_when_due(w, batches, by_window, received, sums_at):
    """Liveness: the panes the trigger promises do fire, in the batch they are due."""
    trigger = w.trigger
    fired_at = defaultdict(list)  # (batch, key, start, end) -> timings
    for (key, start, end), fired in by_window.items():
        for b, pane in fired:
            fired_at[(b, key, start, end)].append(pane.timing)
    wms = [wm for wm, _, _ in batches]
    for b, key, start, end in sums_at:
        timings = fired_at.get((b, key, start, end), [])
        n = received.get((b, key, start, end), 0)
        closing = _closed(w, end, wms[b])
        # late: the window was there at the end of an earlier batch whose watermark had
        # passed its end (a window first seen after that fires on time)
        passed_before = any((b2, key, start, end) in sums_at and end <= wms[b2] for b2 in range(b))
        if end > wms[b] and n and trigger.early_every == 1:
            assert "early" in timings, ("early pane missing", b, key, start, end)
        if trigger.on_time and not passed_before and end <= wms[b] and not closing:
            assert "on_time" in timings, ("on-time pane missing", b, key, start, end)
        if passed_before and n and not closing and trigger.late_mode.value == "batch":
            assert "late" in timings, ("late pane missing", b, key, start, end)
        if passed_before and trigger.late_mode.value == "record":
            late = timings.count("late") - (1 if closing else 0)
            assert late == n, ("one late pane per late record", b, key, start, end)


def test_a_late_record_per_record_fires_one_pane_each():
    w = windowing(Fixed(10), allowed_lateness=60, trigger=Trigger(late="record"))
    batches = [
        (0, 0, [[("k", 1000, 1), ("k", 2000, 1)]]),
        (20_000, 1000, [[]]),  # on time: 2
        (30_000, 2000, [[("k", 3000, 5), ("k", 4000, 7)]]),  # two late records: 7, then 14
        (10**9, 3000, []),
    ]
    panes, dead, _ = run_operator(w, batches)
    assert not dead
    assert [(p.timing, p.value, p.final) for _, _, p in panes] == [
        ("on_time", 2, False),
        ("late", 7, False),
        ("late", 14, False),
        ("late", 14, True),
    ]


def test_early_panes_by_count_and_by_processing_time():
    w = windowing(Global(), trigger=Trigger(early_every=3, early_seconds=5))
    batches = [
        (0, 0, [[("k", 1, 1), ("k", 2, 1)]]),  # 2 records: not yet
        (0, 1000, [[("k", 3, 1)]]),  # 3 since the last pane: early pane 3
        (0, 2000, [[("k", 4, 1)]]),  # 1 record, 0 s since its first: not yet
        (0, 7500, []),  # 5.5 s later: early pane by time, with no new record
    ]
    panes, _, store = run_operator(w, batches)
    assert [(b, p.timing, p.value) for b, _, p in panes] == [(1, "early", 3), (3, "early", 4)]
    assert store.values, "the global window never closes"


def test_sessions_merge_and_a_closed_window_refuses_records():
    w = windowing(Sessions(10))
    batches = [
        (0, 0, [[("k", 0, 1)], [("k", 18_000, 1)]]),  # two sessions
        (0, 1, [[("k", 9_000, 1)]]),  # bridges them: [0, 28000)
        (40_000, 2, []),  # closes it: one final pane of 3
        (40_000, 3, [[("k", 1_000, 1)]]),  # too late for every window: a dead letter
    ]
    panes, dead, _ = run_operator(w, batches)
    assert [(p.start, p.end, p.value, p.final) for _, _, p in panes] == [(0, 28_000, 3, True)]
    assert dead == [(3, "k", 1_000)]


def test_a_lifted_partial_carries_windows_across_the_exchange():
    w = windowing(Sessions(10))
    partial_spec = OpSpec(
        "p", OpKind.COMBINE, (), (), combine_fn=Sum(), phase=Phase.PARTIAL, windowing=w
    )
    partial = WindowedCombine(partial_spec, False, False, (0, None), 0)
    for ts in (0, 5_000, 40_000):
        partial.add(b"k", "k", 1, ts)
    sent = partial.drain()
    assert len(sent) == 1, "one partial per key crosses the exchange, with all its windows"
    _kb, _key, newest, windows = sent[0]
    assert newest == 40_000
    assert sorted(windows) == [[0, 15_000, 2, 2, 5_000], [40_000, 50_000, 1, 1, 40_000]]
    batches = [(0, 0, [[("k", newest, windows)]]), (10**9, 1, [])]
    panes, _, _ = run_operator(w, batches, phase=Phase.FINAL)
    assert sorted((p.start, p.end, p.value) for _, _, p in panes) == [
        (0, 15_000, 2),
        (40_000, 50_000, 1),
    ]


def test_the_final_combine_takes_one_window_partials_of_older_backups():
    w = windowing(Fixed(10))
    batches = [(0, 0, [[("k", 5_000, [0, 10_000, 3, 3]), ("k", 6_000, [0, 10_000, 2, 2])]])]
    panes, _, _ = run_operator(w, [*batches, (10**9, 1, [])], phase=Phase.FINAL)
    assert [(p.start, p.end, p.value) for _, _, p in panes] == [(0, 10_000, 5)]


def test_a_partials_closed_windows_are_dead_letters_and_its_open_ones_count():
    w = windowing(Fixed(10))
    spec = OpSpec(NODE, OpKind.COMBINE, (), (), combine_fn=Sum(), phase=Phase.FINAL, windowing=w)
    op = WindowedCombine(spec, True, False, (20_000, None), 0)  # windows ending by 20 s have closed
    letters = []
    op.closed_windows = lambda reason, part: letters.append((reason, part))
    mixed = [[0, 10_000, 4, 4, 9_000], [20_000, 30_000, 1, 1, 25_000]]
    op.add(codec.encode("k"), "k", mixed, 25_000)
    assert [part for _, part in letters] == [("k", [[0, 10_000, 4, 4, 9_000]])]
    assert "closed" in letters[0][0]
    with pytest.raises(WindowClosedError):  # every window closed: the whole record
        op.add(codec.encode("j"), "j", [[0, 10_000, 1, 1, 9_000]], 9_000)
    store = Store()
    store.apply(op.updates(store.read, lambda *a: None))
    assert list(store.values) == [codec.encode("k")]


def test_a_pane_is_a_pane_after_the_store():
    pane = Pane(3, 0, 10, "on_time", 0, True)
    assert codec.decode(codec.encode(pane)) == pane


def test_window_state_keeps_its_stored_layout():
    """Named records inside, the old positional lists in Redis and backups: a stored value
    reads back and writes out byte for byte, and a lifted partial keeps its wire form."""
    from onceflow.kernel import codec
    from onceflow.runtime.ops.window_records import (
        Delta,
        decode_entries,
        encode_entries,
        partial_windows,
        to_wire,
    )

    stored = codec.encode(
        [
            [0, 60_000, {"s": 5}, 2, 1, True, 123, 59_000],
            [60_000, 120_000, None, 0, 3, False, 0, 61_000],
        ]
    )
    entries = decode_entries(stored)
    assert entries[0].acc == {"s": 5} and entries[0].passed and entries[1].index == 3
    assert encode_entries(entries) == stored
    wire = to_wire([((0, 10), Delta(4, 2, 9))])
    assert wire == [[0, 10, 4, 2, 9]]
    assert partial_windows(wire, 0)[0].records == 2
    assert partial_windows([0, 10, 4, 2], 7)[0].newest == 7  # the older one-window form
