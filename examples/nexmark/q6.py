"""Nexmark q6: the average selling price per seller, over its last 10 closed auctions.

Two process stages with user state and event-time timers:

1. ``winning-bids`` (keyed by auction): the auction (once it arrives) and its best valid bid
   so far (bids that come before their auction wait in a bag). A timer at the auction's
   ``expires`` closes it: once the watermark passes it, every bid made before it is in, so
   the winner is the highest bid (ties: the larger event ID) with ``date_time`` in
   ``[auction's date_time, expires)`` and a price at least the reserve. It leaves as
   ``{"seller", "auction", "price"}`` with the event time ``expires``. Bids with no auction
   are forgotten by a timer ``FORGET_MS`` after them (the auction closed before they came).
2. ``average-price`` (keyed by seller): closed auctions wait in a bag until the watermark
   passes their ``expires`` (a timer), then join the seller's last 10 prices in
   ``(expires, auction)`` order, whichever stage partition they came from; each one leaves
   as ``{"seller", "auction", "average"}``. The order, and so the answer, is that of event
   time: the same in any run.
"""

from __future__ import annotations

from typing import Any

from onceflow import Stream
from onceflow.state import BagSpec, Context, Timer, ValueSpec

LAST = 10
FORGET_MS = 20_000  # longer than an auction lasts (10 s) plus the out-of-orderness

AUCTION = ValueSpec[dict]("auction")  # seller, date_time, expires, reserve
BEST = ValueSpec[list]("best")  # [price, event_id] of the best valid bid so far
WAITING = BagSpec[list]("waiting")  # bids before their auction: [price, event_id, date_time]
PENDING = BagSpec[list]("pending")  # closed auctions: [expires, auction, price]
PRICES = BagSpec[int]("prices")  # the seller's last LAST prices, oldest first


def _valid(auction: dict[str, Any], price: int, at: int) -> bool:
    return auction["date_time"] <= at < auction["expires"] and price >= auction["reserve"]


def _offer(ctx: Context, auction: dict[str, Any], price: int, event_id: str, at: int) -> None:
    """A bid: the auction's best if it is valid and ranks higher (price, then event ID)."""
    best = ctx.state(BEST)
    current = best.read()
    if _valid(auction, price, at) and (current is None or [price, event_id] > current):
        best.write([price, event_id])


def on_auction_or_bid(aid: int, event: dict[str, Any], ctx: Context) -> None:
    """Remember the auction (a timer at its end) or take a bid."""
    if event["type"] == "auction":
        auction = {k: event[k] for k in ("seller", "date_time", "expires", "reserve", "category")}
        ctx.state(AUCTION).write(auction)
        for price, event_id, at in ctx.state(WAITING).read():
            _offer(ctx, auction, price, event_id, at)
        ctx.state(WAITING).clear()
        ctx.timers.clear("forget")
        ctx.timers.set_event_time(auction["expires"], "close")
        return
    auction = ctx.state(AUCTION).read()
    if auction is None:  # the auction has not come yet, or has closed
        ctx.state(WAITING).add([event["price"], event["event_id"], event["date_time"]])
        if ctx.timers.get("forget") is None:
            ctx.timers.set_event_time(event["date_time"] + FORGET_MS, "forget")
        return
    _offer(ctx, auction, event["price"], event["event_id"], event["date_time"])


def on_close(aid: int, timer: Timer, ctx: Context) -> list[dict[str, Any]]:
    """The auction's end (or bids that never met theirs): its winner, if any; state goes."""
    auction = ctx.state(AUCTION).read()
    best = ctx.state(BEST).read()
    for spec in (AUCTION, BEST, WAITING):
        ctx.state(spec).clear()
    if timer.tag != "close" or auction is None or best is None:
        return []
    return [
        {
            "seller": auction["seller"],
            "auction": aid,
            "price": best[0],
            "category": auction["category"],
        }
    ]


def on_closed_auction(seller: int, closed: dict[str, Any], ctx: Context) -> None:
    """Wait for the watermark to pass the auction's end (its event time)."""
    ctx.state(PENDING).add([ctx.timestamp, closed["auction"], closed["price"]])
    timer = ctx.timers.get()
    if timer is None or timer.time > ctx.timestamp:
        ctx.timers.set_event_time(ctx.timestamp)


def on_watermark(seller: int, timer: Timer, ctx: Context) -> list[dict[str, Any]]:
    """Closed auctions up to the watermark join the last prices, in event-time order."""
    pending = sorted(ctx.state(PENDING).read())
    ready = [p for p in pending if p[0] <= ctx.watermark]
    rest = pending[len(ready) :]
    ctx.state(PENDING).write(rest)
    if rest:
        ctx.timers.set_event_time(rest[0][0])
    prices = ctx.state(PRICES)
    out = []
    for _expires, auction, price in ready:
        last = [*prices.read(), price][-LAST:]
        prices.write(last)
        out.append({"seller": seller, "auction": auction, "average": sum(last) / len(last)})
    return out


def winning_bids(events: Stream) -> Stream:
    """Each closed auction's winning bid: ``{"seller", "auction", "price", "category"}``."""
    return (
        events.filter("auctions-and-bids", lambda e: e["type"] in ("auction", "bid"))
        .key_by("by-auction", lambda e: e["id"] if e["type"] == "auction" else e["auction"])
        .process(
            "winning-bids",
            on_auction_or_bid,
            states=[AUCTION, BEST, WAITING],
            on_timer=on_close,
        )
    )


def q6(events: Stream) -> Stream:
    return (
        winning_bids(events)
        .key_by("by-seller", lambda w: w["seller"])
        .process(
            "average-price", on_closed_auction, states=[PENDING, PRICES], on_timer=on_watermark
        )
    )
