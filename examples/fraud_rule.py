"""A per-card fraud rule over each card's history, with user state and a timer.

``onceflow run examples/fraud_rule.py`` writes ``onceflow-output/fraud-rule.jsonl``.

For every payment, the card's last ``HISTORY`` amounts (a bag) decide: an amount more than
``FACTOR`` times their mean is an alert. A map counts the card's payments per merchant, a
combining state sums its amounts, and an event-time timer ``IDLE_MS`` after the card's last
payment emits the card's summary and clears its state (a quiet card costs nothing).
"""

from __future__ import annotations

from typing import Any

from onceflow import Pipeline, sinks, sources
from onceflow.combiners import Sum
from onceflow.state import BagSpec, CombiningSpec, Context, MapSpec, Timer

HISTORY = 5
FACTOR = 3.0
IDLE_MS = 3_600_000  # an hour of event time

RECENT = BagSpec[float]("recent")  # the last HISTORY amounts, oldest first
MERCHANTS = MapSpec[str, int]("merchants")  # merchant -> payments
TOTAL = CombiningSpec[float]("total", Sum())


def check_payment(card: str, payment: dict[str, Any], ctx: Context) -> list[dict[str, Any]]:
    """An alert when the amount is far above the card's recent mean; remembers the payment."""
    recent = ctx.state(RECENT)
    history = recent.read()
    amount = payment["amount"]
    out = []
    if len(history) >= 3 and amount > FACTOR * sum(history) / len(history):
        out.append({"alert": card, "amount": amount, "mean": sum(history) / len(history)})
    recent.write([*history, amount][-HISTORY:])
    merchants = ctx.state(MERCHANTS)
    merchants.put(payment["merchant"], (merchants.get(payment["merchant"]) or 0) + 1)
    ctx.state(TOTAL).add(amount)
    ctx.timers.set_event_time(ctx.timestamp + IDLE_MS)  # moves the card's one timer on
    return out


def card_idle(card: str, timer: Timer, ctx: Context) -> list[dict[str, Any]]:
    """The card has been quiet for IDLE_MS: its summary, then its state goes."""
    merchants = ctx.state(MERCHANTS)
    summary = {
        "card": card,
        "payments": sum(n for _, n in merchants.items()),
        "merchants": len(merchants),
        "total": ctx.state(TOTAL).read(),
        "idle_since": timer.time - IDLE_MS,
    }
    for spec in (RECENT, MERCHANTS, TOTAL):
        ctx.state(spec).clear()
    return [summary]


def payments() -> list[dict[str, Any]]:
    """A few payments: card c1 has one outlier."""
    rows = []
    for i, amount in enumerate([20.0, 25.0, 22.0, 18.0, 300.0, 21.0]):
        rows.append({"card": "c1", "merchant": f"m{i % 2}", "amount": amount, "ts": i * 60_000})
    for i, ts in enumerate([0, 600_000, 1_200_000, 1_800_000]):
        rows.append({"card": "c2", "merchant": "m9", "amount": 10.0 + i, "ts": ts})
    return rows


pipeline = Pipeline("fraud-rule")
(
    pipeline.read("payments", sources.Collection(payments(), timestamp=lambda p: p["ts"]))
    .key_by("by-card", lambda p: p["card"])
    .process(
        "rule",
        check_payment,
        states=[RECENT, MERCHANTS, TOTAL],
        on_timer=card_idle,
        state_ttl="30d",
    )
    .write("alerts", sinks.JsonLines("onceflow-output/fraud-rule.jsonl"))
)
