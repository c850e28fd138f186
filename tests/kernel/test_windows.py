"""Window functions, span merging, trigger checks and the pane's trip through the codec."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceflow.kernel import codec
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.windows import (
    GLOBAL_END,
    GLOBAL_START,
    Fixed,
    Global,
    Pane,
    Sessions,
    Sliding,
    Trigger,
    merge_spans,
    windowing,
)

TIMES = st.integers(min_value=-(10**13), max_value=10**13)


@given(TIMES, st.integers(1, 10**7), st.integers(0, 10**7))
def test_a_fixed_window_holds_its_time_and_tiles_the_line(ts, size, offset):
    [(start, end)] = Fixed(size / 1000, offset / 1000).assign(ts)
    assert start <= ts < end and end - start == size
    assert (start - offset) % size == 0


@given(TIMES, st.integers(1, 10_000), st.integers(1, 20), st.integers(0, 10_000))
def test_sliding_windows_are_every_window_that_holds_the_time(ts, every, ratio, offset):
    size = every * ratio
    spans = Sliding(size / 1000, every / 1000, offset / 1000).assign(ts)
    assert len(spans) == ratio
    assert all(s <= ts < e and e - s == size for s, e in spans)
    assert all((s - offset) % every == 0 for s, _ in spans)
    assert spans == sorted(spans) and len(set(spans)) == ratio


def test_durations_read_as_people_write_them():
    assert Fixed("1m").size_ms == 60_000
    assert Sliding("10m", "1m").assign(0)[0] == (-540_000, 60_000)
    assert Sessions(30).gap_ms == 30_000
    assert Global().assign(123) == [(GLOBAL_START, GLOBAL_END)]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Fixed(0), "positive"),
        (lambda: Fixed("ten minutes"), "not valid"),
        (lambda: Sliding("1m", "2m"), "gaps"),
        (lambda: Sessions(-1), "positive"),
        (lambda: Trigger(early_every=0), "at least 1"),
        (lambda: Trigger(late="sometimes"), "late must be"),
        (lambda: windowing(Fixed(1), accumulation="summing"), "accumulation"),
        (lambda: windowing(Fixed(1), allowed_lateness="-1m"), "not valid"),
    ],
)
def test_bad_settings_say_what_is_wrong(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 100)), min_size=1, max_size=30))
def test_merged_spans_cover_exactly_the_union_and_do_not_overlap(raw):
    spans = [(s, s + n) for s, n in raw]
    merged = merge_spans(spans)
    taken = sorted(i for _, members in merged for i in members)
    assert taken == list(range(len(spans)))
    for (start, end), members in merged:
        assert start == min(spans[i][0] for i in members)
        assert end == max(spans[i][1] for i in members)
    bounds = [span for span, _ in merged]
    assert all(a[1] <= b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    points = {p for s, e in spans for p in range(s, e)}
    assert points == {p for s, e in bounds for p in range(s, e)}


def test_a_pane_survives_the_codec_as_a_pane():
    pane = Pane({"n": 3, "k": (1, 2)}, 0, 60_000, "late", 2, True)
    back = codec.decode(codec.encode(("user-1", pane)))
    assert back == ("user-1", pane) and isinstance(back[1], Pane)
    assert pane.window_header() == b"0,60000" and pane.pane_header() == b"late,2,1"


def test_windowing_describes_itself_for_plans():
    w = windowing(
        Sliding("10m", "1m"),
        trigger=Trigger(early_every=100),
        allowed_lateness="5m",
        accumulation="discarding",
    )
    text = w.describe()
    assert "sliding 10m every 1m" in text and "early every 100 records" in text
    assert "lateness 5m" in text and "discarding" in text
    assert windowing(60).fn == Fixed(60)
    assert Trigger.final_only().describe() == "final"
