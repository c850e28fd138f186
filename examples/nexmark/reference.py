"""Each Nexmark query's answer in plain Python, from the events alone (for the tests)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

SLIDE_MS, SLIDING_MS, FIXED_MS, GAP_MS = 2_000, 10_000, 10_000, 10_000


def bids(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "bid"]


def q0(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return list(events)


def q1(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "auction": b["auction"],
            "bidder": b["bidder"],
            "price": b["price"] * 908 // 1000,
            "date_time": b["date_time"],
        }
        for b in bids(events)
    ]


def q2(events: list[dict[str, Any]]) -> list[list[int]]:
    return [[b["auction"], b["price"]] for b in bids(events) if b["auction"] % 123 == 0]


def q5(events: list[dict[str, Any]]) -> dict[tuple[int, int], list[Any]]:
    """``(window start, end) -> [most bids, [auctions]]``."""
    counts: dict[tuple[int, int], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for b in bids(events):
        t = b["date_time"]
        last = t - t % SLIDE_MS
        for start in range(last - SLIDING_MS + SLIDE_MS, last + 1, SLIDE_MS):
            counts[(start, start + SLIDING_MS)][b["auction"]] += 1
    out = {}
    for window, per in counts.items():
        most = max(per.values())
        out[window] = [most, sorted(a for a, n in per.items() if n == most)]
    return out


def winning_prices(
    events: list[dict[str, Any]], auctions: dict[int, dict[str, Any]]
) -> dict[int, int]:
    """``auction -> winning price``: the highest valid bid (ties: the larger event ID) made
    in ``[date_time, expires)`` at or above the reserve, for each auction with one."""
    best: dict[int, list[Any]] = {}
    for b in bids(events):
        a = auctions.get(b["auction"])
        if a is None or not a["date_time"] <= b["date_time"] < a["expires"]:
            continue
        rank = [b["price"], b["event_id"]]
        if b["price"] >= a["reserve"] and (b["auction"] not in best or rank > best[b["auction"]]):
            best[b["auction"]] = rank
    return {aid: rank[0] for aid, rank in best.items()}


def q6(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per closed auction with a winner, in ``(expires, auction)`` order per seller: the
    seller's average winning price over its last 10 such auctions."""
    auctions = {a["id"]: a for a in events if a["type"] == "auction"}
    closed: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for aid, price in winning_prices(events, auctions).items():
        closed[auctions[aid]["seller"]].append((auctions[aid]["expires"], aid, price))
    out = []
    for seller, mine in closed.items():
        last: list[int] = []
        for _expires, aid, price in sorted(mine):
            last = [*last, price][-10:]
            out.append({"seller": seller, "auction": aid, "average": sum(last) / len(last)})
    return out


def _rank(bid: dict[str, Any], by: str) -> tuple[Any, str]:
    return (bid[by], bid["event_id"])


def q7(events: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    """``(window start, end) -> the highest bid``."""
    best: dict[tuple[int, int], dict[str, Any]] = {}
    for b in bids(events):
        start = b["date_time"] - b["date_time"] % FIXED_MS
        window = (start, start + FIXED_MS)
        if window not in best or _rank(b, "price") > _rank(best[window], "price"):
            best[window] = b
    return best


def q11(events: list[dict[str, Any]]) -> dict[tuple[int, int, int], int]:
    """``(bidder, session start, session end) -> bids``; a session ends 10 s after its last."""
    times: dict[int, list[int]] = defaultdict(list)
    for b in bids(events):
        times[b["bidder"]].append(b["date_time"])
    out = {}
    for bidder, ts in times.items():
        ts.sort()
        start, end, n = ts[0], ts[0] + GAP_MS, 0
        for t in ts:
            if t >= end:
                out[(bidder, start, end)] = n
                start, n = t, 0
            end = max(end, t + GAP_MS)
            n += 1
        out[(bidder, start, end)] = n
    return out


def q18(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``"bidder/auction" -> the last bid`` (by event time)."""
    last: dict[str, dict[str, Any]] = {}
    for b in bids(events):
        key = f"{b['bidder']}/{b['auction']}"
        if key not in last or _rank(b, "date_time") > _rank(last[key], "date_time"):
            last[key] = b
    return last


def q8(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Persons who joined and created an auction in the same 10 s window, once per window."""
    window = FIXED_MS
    sellers = {(e["seller"], e["date_time"] // window) for e in events if e["type"] == "auction"}
    return [
        {"id": e["id"], "name": e["name"], "start": e["date_time"] // window * window}
        for e in events
        if e["type"] == "person" and (e["id"], e["date_time"] // window) in sellers
    ]


def q3(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Auctions of category 10 by sellers in OR, ID or CA (the seller as of the auction)."""
    persons = {e["id"]: e for e in events if e["type"] == "person"}
    out = []
    for a in events:
        if a["type"] != "auction" or a["category"] != 10:
            continue
        p = persons.get(a["seller"])
        if p is None or p["date_time"] > a["date_time"] or p["state"] not in ("OR", "ID", "CA"):
            continue
        out.append({"auction": a["id"], "name": p["name"], "city": p["city"], "state": p["state"]})
    return out


def q20(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bids on category-10 auctions with the auction's details (the auction as of the bid)."""
    auctions = {e["id"]: e for e in events if e["type"] == "auction"}
    out = []
    for b in bids(events):
        a = auctions.get(b["auction"])
        if a is None or a["date_time"] > b["date_time"] or a["category"] != 10:
            continue
        out.append(
            {
                "auction": b["auction"],
                "bidder": b["bidder"],
                "price": b["price"],
                "date_time": b["date_time"],
                "item_name": a["item_name"],
                "seller": a["seller"],
                "category": a["category"],
            }
        )
    return out


def q4(events: list[dict[str, Any]]) -> dict[int, float]:
    """``category -> mean winning price`` over every closed auction with a winner."""
    auctions = {a["id"]: a for a in events if a["type"] == "auction"}
    prices: dict[int, list[int]] = defaultdict(list)
    for aid, price in winning_prices(events, auctions).items():
        prices[auctions[aid]["category"]].append(price)
    return {c: sum(p) / len(p) for c, p in prices.items()}


def q12_totals(events: list[dict[str, Any]]) -> dict[int, int]:
    """``bidder -> bids``: what q12's windows add up to, whatever the processing times."""
    totals: dict[int, int] = defaultdict(int)
    for b in bids(events):
        totals[b["bidder"]] += 1
    return dict(totals)


def early_bids(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each bid within 2 s (inclusive) of its auction's start, after it."""
    auctions = {a["id"]: a for a in events if a["type"] == "auction"}
    out = []
    for b in bids(events):
        a = auctions.get(b["auction"])
        if a is not None and 0 <= b["date_time"] - a["date_time"] <= 2_000:
            out.append(
                {
                    "auction": a["id"],
                    "bid": b["event_id"],
                    "after_ms": b["date_time"] - a["date_time"],
                }
            )
    return out
