"""``onceflow audit``: count records per ID in an output topic, against an input topic.

Every record Onceflow writes carries its ID in the ``onceflow-id`` header. The audit reads a
whole topic and reports IDs written more than once (the documented crash window of the Kafka
sink: a second copy with the same ID, which Onceflow readers drop) and, split from those,
IDs written twice with *different* values (which would be a real bug). Against an input topic
it reports the input's own upstream duplicates and, with ``--match-field`` (a JSON field
present in both, such as an event ID), the inputs with no output (gaps) and the outputs with
no input.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import TopicRecord, read_topic
from onceflow.kernel.ids import ID_HEADER


@dataclass
class AuditReport:
    """What the audit found."""

    topic: str
    records: int
    distinct_ids: int
    without_id: int
    duplicated_ids: int
    extra_copies: int
    conflicting_ids: int
    input_topic: str | None = None
    input_records: int | None = None
    input_distinct: int | None = None
    input_duplicates: int | None = None
    match_field: str | None = None
    gaps: int | None = None
    unmatched_outputs: int | None = None
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No conflicting copies and no gaps (copies with equal values are tolerated)."""
        return self.conflicting_ids == 0 and not self.gaps

    def text(self) -> str:
        """A human-readable report."""
        lines = [
            f"output topic {self.topic}: {self.records:,} records, {self.distinct_ids:,} "
            f"distinct IDs, {self.without_id:,} without an {ID_HEADER} header",
            f"  IDs written more than once: {self.duplicated_ids:,} "
            f"({self.extra_copies:,} extra copies; Onceflow readers drop them)",
            f"  IDs written with different values: {self.conflicting_ids:,}",
        ]
        if self.input_topic is not None:
            lines.append(
                f"input topic {self.input_topic}: {self.input_records:,} records, "
                f"{self.input_distinct:,} distinct, {self.input_duplicates:,} upstream duplicates"
            )
        if self.match_field is not None:
            lines.append(
                f"  matched on {self.match_field!r}: {self.gaps:,} inputs with no output (gaps), "
                f"{self.unmatched_outputs:,} outputs with no input"
            )
        for name, ids in self.examples.items():
            if ids:
                lines.append(f"  e.g. {name}: {', '.join(ids[:5])}")
        lines.append("verdict: " + ("OK" if self.ok else "PROBLEMS FOUND"))
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """For ``--json``."""
        return {**asdict(self), "ok": self.ok}


def _field(record: TopicRecord, name: str) -> Any:
    try:
        value = json.loads(record.value or b"null")
    except ValueError:
        return None
    return value.get(name) if isinstance(value, dict) else None


def _input_key(record: TopicRecord, match_field: str | None) -> Any:
    if match_field is not None:
        return _field(record, match_field)
    header = record.headers.get(ID_HEADER)
    return header if header is not None else (record.partition, record.offset)


def audit(
    settings: KafkaSettings,
    topic: str,
    input_topic: str | None = None,
    match_field: str | None = None,
) -> AuditReport:
    """Audit ``topic`` (and compare with ``input_topic``); see the module docstring."""
    out = read_topic(settings, topic)
    values: dict[bytes, set[bytes | None]] = defaultdict(set)
    copies: Counter[bytes] = Counter()
    without = 0
    for rec in out:
        rid = rec.headers.get(ID_HEADER)
        if rid is None:
            without += 1
            continue
        copies[rid] += 1
        values[rid].add(rec.value)
    duplicated = [rid for rid, n in copies.items() if n > 1]
    conflicting = [rid for rid, v in values.items() if len(v) > 1]
    report = AuditReport(
        topic=topic,
        records=len(out),
        distinct_ids=len(copies),
        without_id=without,
        duplicated_ids=len(duplicated),
        extra_copies=sum(copies[r] - 1 for r in duplicated),
        conflicting_ids=len(conflicting),
        examples={
            "duplicated": [r.hex() for r in duplicated[:5]],
            "conflicting": [r.hex() for r in conflicting[:5]],
        },
    )
    if input_topic is None:
        return report
    inp = read_topic(settings, input_topic)
    keys = Counter(_input_key(r, match_field) for r in inp)
    report.input_topic = input_topic
    report.input_records = len(inp)
    report.input_distinct = len(keys)
    report.input_duplicates = len(inp) - len(keys)
    if match_field is not None:
        produced = {_field(r, match_field) for r in out}
        missing = [k for k in keys if k not in produced]
        report.match_field = match_field
        report.gaps = len(missing)
        report.unmatched_outputs = len(produced - set(keys))
        report.examples["gaps"] = [str(k) for k in missing[:5]]
    return report
