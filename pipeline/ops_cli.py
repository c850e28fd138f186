"""Operator commands of the ``onceflow`` CLI: audit (and, below, gc and status)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from onceflow.settings import KafkaSettings


def cmd_audit(args: argparse.Namespace) -> int:
    """Report duplicates and gaps; exit 1 when there are conflicting copies or gaps."""
    from pipeline.audit import audit

    settings = KafkaSettings.from_env(args.bootstrap_servers)
    report = audit(settings, args.topic, args.input_topic, args.match_field)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return 0 if report.ok else 1


def add_commands(sub: Any) -> None:
    """Register the operator commands on the CLI's subparsers."""
    p = sub.add_parser("audit", help="count records per ID in an output topic")
    p.add_argument("--topic", required=True, help="the output topic to audit")
    p.add_argument("--input-topic", help="compare against this input topic")
    p.add_argument(
        "--match-field",
        help="JSON field identifying a record in both topics (reports inputs with no output)",
    )
    p.add_argument("--bootstrap-servers", help="Kafka (default $KAFKA_BOOTSTRAP_SERVERS)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_audit)
