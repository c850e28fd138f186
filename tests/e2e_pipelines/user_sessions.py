"""The pipeline the user-state tests run: per-user sessions cut by a custom gap timer.

events (Kafka, IDs from event_id, event time from ts) -> by-user -> sessions (process: the
user's events in a bag, an event-time timer at the newest event time + the gap) -> out (Kafka)

When the timer fires (the watermark passed every event of the bag by the gap), the bag is
cut into sessions where two events are a gap or more apart, and each session leaves as
``{"user", "start", "end", "total", "events", "index"}`` (``end``: newest event time + the
gap; ``index``: the user's session count, a combining state). A map of the bag's event IDs
catches an event processed twice (it would leave as ``{"user", "twice": event_id}``).

Non-deterministic on purpose: the first event after a firing draws a random ``token`` (a
value state); every event leaves as ``{"user", "event", "token"}`` and every session carries
the token of its firing and its events' IDs. A replay that ran the function again instead of
restoring what was committed would show another token on some events than on their session.

``US_PIPELINE``, ``US_IN``, ``US_OUT``, ``US_GAP_MS`` and ``US_OUT_OF_ORDER`` (the
watermark's bounded out-of-orderness) come from the environment.
"""

import os
import uuid

from onceflow import EventTime, KafkaSink, KafkaSource, Pipeline
from onceflow.combiners import Count
from onceflow.state import BagSpec, CombiningSpec, Context, MapSpec, Timer, ValueSpec

env = os.environ
GAP_MS = int(env.get("US_GAP_MS", "30000"))
EVENTS = BagSpec[list]("events")  # [ts, v, event_id]
TOKEN = ValueSpec[str]("token")  # drawn at random by the first event after a firing
SEEN = MapSpec[str, int]("seen")  # event_id -> ts, for the events in the bag
SESSIONS = CombiningSpec[int]("sessions", Count())


def on_event(user, event, ctx: Context):
    seen = ctx.state(SEEN)
    if event["event_id"] in seen:
        return [{"user": user, "twice": event["event_id"]}]
    seen.put(event["event_id"], event["ts"])
    ctx.state(EVENTS).add([event["ts"], event["v"], event["event_id"]])
    token = ctx.state(TOKEN)
    if token.read() is None:
        token.write(uuid.uuid4().hex)
    timer = ctx.timers.get()
    end = event["ts"] + GAP_MS
    if timer is None or timer.time < end:
        ctx.timers.set_event_time(end)
    return [{"user": user, "event": event["event_id"], "token": token.read()}]


def on_timer(user, timer: Timer, ctx: Context):
    events = sorted(ctx.state(EVENTS).read())
    token = ctx.state(TOKEN).read()
    for spec in (EVENTS, SEEN, TOKEN):
        ctx.state(spec).clear()
    count = ctx.state(SESSIONS)
    sessions = []
    for ts, v, event_id in events:
        if sessions and ts < sessions[-1]["end"]:
            sessions[-1]["end"] = max(sessions[-1]["end"], ts + GAP_MS)
            sessions[-1]["total"] += v
            sessions[-1]["events"] += 1
            sessions[-1]["ids"].append(event_id)
            continue
        sessions.append(
            {
                "user": user,
                "start": ts,
                "end": ts + GAP_MS,
                "total": v,
                "events": 1,
                "ids": [event_id],
                "token": token,
            }
        )
    for s in sessions:
        s["index"] = count.read()
        count.add(1)
        yield s


pipeline = Pipeline(
    env["US_PIPELINE"],
    event_time=EventTime.of(out_of_orderness=env.get("US_OUT_OF_ORDER", "30s")),
)
(
    pipeline.read(
        "events",
        KafkaSource(env["US_IN"], id=lambda e: e["event_id"], timestamp=lambda e: e["ts"]),
    )
    .key_by("by-user", lambda e: e["user"])
    .process("sessions", on_event, states=[EVENTS, SEEN, SESSIONS, TOKEN], on_timer=on_timer)
    .write("out", KafkaSink(env["US_OUT"]))
)
