"""The plan's identity: what a streaming pipeline's stored state depends on.

Stage names key seen-IDs, fencing tokens, backups and Bloom filters; boundaries decide which
stage receives which records and how their IDs are derived; combine nodes key state (and their
combiner, window function and time-to-live decide that state's format; so do a process stage's
declared states). If any of that changes between two runs of one namespace (other ``--rules``,
``--no-optimize``, a stage added or renamed), the new run would silently start part of its
dedup history over.
So the layout is stored with the state and compared on every start
(:func:`onceflow.runtime.driver.pinning.pin_plan`).

What is *not* in it: labels and the user's functions (changing a function's body is allowed, and
so is changing a combiner's code or arguments: only its class counts), connector settings
(topics may move), and anything about speed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from onceflow.graph_optimizer.ir import Combine, Process
from onceflow.graph_optimizer.plan import Plan
from onceflow.runtime.combine_fn import CombineFn


def layout(plan: Plan) -> dict[str, Any]:
    """Stages (name and nodes), boundaries and stateful nodes, as plain JSON-able data."""
    return {
        "stages": {s.name: list(s.nodes) for s in plan.ordered},
        "boundaries": sorted(
            f"{b.kind.value} {b.name}: {b.sender or '-'} -> {b.receiver}" for b in plan.boundaries()
        ),
        "state": sorted(
            [_state(n) for n in plan.graph if isinstance(n, Combine)]
            + [f"{n.name} {_process(n)}" for n in plan.graph if isinstance(n, Process)]
        ),
    }


def _state(node: Combine) -> str:
    """A stateful node and what its stored state's format depends on."""
    text = f"{node.name} ({node.phase.value}) {_combiner(node.combine_fn)}"
    if node.windowing is not None:
        text += f" {node.windowing.fn.describe()}"
    if node.ttl_ms is not None:
        text += " ttl"
    if node.expiry_deletes:  # its expiries are timers the pipeline fires, not GC's
        text += " expiry-deletes"
    return text


def _process(node: Process) -> str:
    """A process stage's declared state (kinds and names; a combining one's combiner)."""
    return node.process.describe() if node.process is not None else "process"


def _combiner(fn: CombineFn | None) -> str:
    """Which combiner writes the state: its class's qualified name (``Sum``, ``Mean``, ``TopK``).

    Another combiner keeps its state in another format (a sum's number is no mean's ``[sum,
    count]``) and would merge with what the old one wrote. The instance (its repr, its
    arguments) and the code are left out, as a map function's body is: they change with every
    edit. So is the module: a pipeline file's module name depends on how it is started.
    """
    return type(fn).__qualname__ if fn is not None else "-"


def fingerprint(described: dict[str, Any]) -> str:
    """A short, stable hash of a layout."""
    text = json.dumps(described, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
