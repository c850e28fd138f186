"""What a GC pass found and removed (``onceflow gc``'s report, its log line and metrics).

See :mod:`onceflow.operations.gc` for the pass itself.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

# What a pass removes, by kind (keys of GcPass.removed).
KEY_KINDS = ("seen_ids", "backups", "batch_params")
REMOVED_KINDS = (*KEY_KINDS, "bloom_snapshots", "expired_state", "staged_files")


@dataclass(frozen=True)
class Garbage:
    """Generations a pass deletes: forgotten ones, and all below ``below``."""

    forgotten: frozenset[int]
    below: int | None

    def holds(self, generation: int) -> bool:
        """Whether ``generation`` is garbage."""
        return generation in self.forgotten or (self.below is not None and generation < self.below)

    def __bool__(self) -> bool:
        return bool(self.forgotten) or self.below is not None


@dataclass
class Removed:
    """What one kind of garbage amounted to."""

    keys: int = 0
    fields: int = 0
    ids: int = 0
    bytes: int = 0


@dataclass
class GcPass:
    """The outcome of one pass over one namespace."""

    namespace: str
    dry_run: bool
    horizon_ms: int
    watermark: int
    acked: int
    threshold: int | None  # generations whose newest event time is older are forgotten
    garbage: Garbage = field(default_factory=lambda: Garbage(frozenset(), None))
    removed: dict[str, Removed] = field(default_factory=dict)
    scanned: int = 0
    seconds: float = 0.0

    @property
    def total(self) -> Removed:
        """All kinds together."""
        out = Removed()
        for r in self.removed.values():
            out.keys += r.keys
            out.fields += r.fields
            out.ids += r.ids
            out.bytes += r.bytes
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        data = asdict(self)
        data["garbage"] = {"forgotten": sorted(self.garbage.forgotten), "below": self.garbage.below}
        data["total"] = asdict(self.total)
        return data

    def log_line(self) -> str:
        """One line of structured log."""
        t = self.total
        return json.dumps(
            {
                "event": "onceflow.gc",
                "namespace": self.namespace,
                "dry_run": self.dry_run,
                "threshold_ms": self.threshold,
                "forgotten_generations": sorted(self.garbage.forgotten),
                "acked_batch": self.acked,
                "watermark_ms": self.watermark,
                "horizon_ms": self.horizon_ms,
                "scanned_keys": self.scanned,
                "removed_keys": t.keys,
                "removed_fields": t.fields,
                "removed_ids": t.ids,
                "removed_bytes": t.bytes,
                "by_kind": {k: asdict(v) for k, v in sorted(self.removed.items())},
                "seconds": round(self.seconds, 3),
            },
            sort_keys=False,
        )
