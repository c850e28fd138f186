"""What a streaming pipeline's stored state depends on, pinned on its first run.

Parallelism, the seen-ID bucket and shard layout, and the physical plan's layout (stages,
boundaries, keyed state and its combiners; see :mod:`onceflow.graph_optimizer.fingerprint`)
are stored in the namespace's meta hash on the first run and compared on every start. A
change is refused with a message that says what changed and how to proceed. The seen-ID
layout (how a seen ID is stored, see :mod:`onceflow.kernel.seen_layout`) is pinned the same way:
a namespace an older Onceflow made in another layout is refused with the way out.

The namespace and the Spark checkpoint are two halves of one pipeline's progress: Spark knows
which input was read, Redis what it did. Both hold the same identity (:func:`pin_checkpoint`):
a fresh checkpoint over an old namespace (it would re-read input the namespace has already
backed up under the same batch numbers), or an old checkpoint over a namespace whose state is
gone, is refused with the way to start over (``onceflow reset``). So is a checkpoint that
fell behind the namespace (:func:`check_not_behind`): its last committed micro-batch is older
than one the namespace was told Spark committed.
"""

from __future__ import annotations

import json
import sys
import uuid
from typing import TYPE_CHECKING, Any

from onceflow.backup.store import acknowledged
from onceflow.dedup.config import DedupConfig
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import STAGING_FIELD, Keyspace, Kind
from onceflow.kernel.scopes import PLAN_FIELD
from onceflow.kernel.seen_layout import LAYOUT, LAYOUT_FIELD, check_layout
from onceflow.kernel.store import store_for

if TYPE_CHECKING:
    from onceflow.kernel.store import Connection
from onceflow.runtime.driver.checkpoint import IDENTITY_FILE, Checkpoint
from onceflow.runtime.errors import PlanChangedError
from onceflow.runtime.spec import Job

PLAN_FINGERPRINT_FIELD = "plan_fingerprint"
IDENTITY_FIELD = "identity"
CHECKPOINT_FIELD = "checkpoint"  # where the run that owns the namespace keeps its checkpoint
# A namespace that has these had runs before (of an Onceflow that wrote no identity yet).
_STATE_FIELDS = ("parallelism", PLAN_FIELD)


def _decode_meta(client: Connection, keyspace: Keyspace) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in store_for(client).hgetall(keyspace.meta).items()}


def pin_settings(
    client: Connection,
    keyspace: Keyspace,
    parallelism: int,
    config: DedupConfig,
) -> None:
    """Settings that must not change while state exists (partition, bucket, seen-ID layout)."""
    pin_layout(client, keyspace)
    wanted = {
        "parallelism": str(parallelism),
        "bucket_ms": str(config.bucket_ms),
        "shards": str(config.shards),
    }
    for name, value in wanted.items():
        store_for(client).hsetnx(keyspace.meta, name, value)
    store_for(client).hset(keyspace.meta, "horizon_ms", str(config.horizon_ms))
    stored = _decode_meta(client, keyspace)
    for name, value in wanted.items():
        if stored.get(name) != value:
            msg = (
                f"pipeline namespace {keyspace.namespace!r} was created with {name}="
                f"{stored.get(name)}, this run asks for {value}: keyed state and dedup history "
                f"depend on it. Keep {name}={stored.get(name)}, or start a new namespace "
                "(rename the pipeline)"
            )
            raise ConfigError(msg)


def pin_layout(client: Connection, keyspace: Keyspace) -> None:
    """Pin the seen-ID layout on a new namespace; refuse one an older Onceflow made.

    A namespace that holds state but no layout was made before layouts existed (layout 1).
    """
    cmds = store_for(client).batch()
    for name in _STATE_FIELDS:
        cmds.hexists(keyspace.meta, name)
    cmds.exists(keyspace.epoch)
    cmds.hget(keyspace.meta, LAYOUT_FIELD)
    *state, stored = cmds.execute()
    check_layout(stored, any(state), keyspace.namespace)
    store_for(client).hsetnx(keyspace.meta, LAYOUT_FIELD, LAYOUT)


def note_staging(client: Connection, keyspace: Keyspace, folders: list[str]) -> None:
    """Add the file sinks' staging folders to those the namespace lists (for ``onceflow gc``).

    Folders of earlier runs stay listed: a sink removed from the pipeline can still hold
    leftovers.
    """
    if not folders:
        return
    store = store_for(client)
    raw = store.hget(keyspace.meta, STAGING_FIELD)
    known = set(json.loads(raw)) if raw else set()
    if not set(folders) <= known:
        store.hset(keyspace.meta, STAGING_FIELD, json.dumps(sorted(known | set(folders))))


def pin_plan(
    client: Connection,
    keyspace: Keyspace,
    job: Job,
    parallelism: int,
    accept_change: bool,
    exactly_once: bool = True,
) -> None:
    """Store the plan's layout on the first run; refuse (or, if accepted, adopt) another one.

    Stage names key seen-IDs, tokens and backups, so resuming a namespace with another plan
    (other ``--rules``, ``--no-optimize``, a stage added or renamed) would silently start
    part of its dedup history over. A change is never accepted while an exactly-once
    micro-batch is in flight (:func:`in_flight`): its replay must find its tasks' backups
    under the task numbers its first attempt had, and another plan numbers them otherwise.
    """
    current = {**job.layout, "parallelism": parallelism}
    text = json.dumps(current, sort_keys=True)
    store_for(client).hsetnx(keyspace.meta, PLAN_FIELD, text)
    store_for(client).hsetnx(keyspace.meta, PLAN_FINGERPRINT_FIELD, job.fingerprint)
    stored_text = _decode_meta(client, keyspace).get(PLAN_FIELD, text)
    stored = json.loads(stored_text)
    changes = differences(stored, current)
    if not changes:
        return
    if accept_change:
        pending = in_flight(client, keyspace) if exactly_once else None
        if pending is not None:
            raise PlanChangedError(in_flight_message(keyspace, pending, changes))
        store_for(client).hset_many(
            keyspace.meta, {PLAN_FIELD: text, PLAN_FINGERPRINT_FIELD: job.fingerprint}
        )
        print(
            f"[{job.pipeline}] plan changed and accepted: " + "; ".join(changes),
            file=sys.stderr,
            flush=True,
        )
        return
    listed = "\n  - ".join(changes)
    msg = (
        f"pipeline namespace {keyspace.namespace!r} holds state built by another physical "
        f"plan:\n  - {listed}\nStage names key dedup history, backups and state, so resuming "
        "would silently start part of it over. Run the same plan (same --rules / "
        "--no-optimize, stages and combiners), or start afresh under a new pipeline name (its "
        "namespace) with a new --checkpoint, or pass --accept-plan-change to resume anyway"
    )
    raise PlanChangedError(msg)


def in_flight(client: Connection, keyspace: Keyspace) -> int | None:
    """The newest micro-batch that started (fixed its parameters) but is not acknowledged.

    None when every started batch is acknowledged: a run that ended normally acknowledges
    its last; a crash may leave one started (a batch Spark committed but the crash kept
    from acknowledging looks the same, and is treated the same: finished first).
    """
    acked = acknowledged(client, keyspace)
    started = [
        parsed.batch
        for key in store_for(client).scan_iter(keyspace.pattern(Kind.BATCH), 1000)
        if (parsed := keyspace.parse(key)) is not None and parsed.batch is not None
    ]
    newest = max(started, default=-1)
    return newest if newest > acked else None


def in_flight_message(keyspace: Keyspace, batch: int, changes: list[str]) -> str:
    """Why a plan change is refused while a batch is in flight, and what to do."""
    return (
        f"pipeline namespace {keyspace.namespace!r} has micro-batch {batch} in flight (started "
        "by the stored plan, not acknowledged: the last run stopped in it). Its replay must "
        "find its tasks' backups under the task numbers the stored plan gave them, which the "
        f"new plan ({'; '.join(changes)}) numbers otherwise. Finish it with the pipeline as "
        "it was (run it once more, e.g. with --stop-after-batches 1), then accept the change"
    )


def differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What changed between two layouts, one line each, in words a user can act on."""
    lines: list[str] = []
    old_stages, new_stages = stored.get("stages", {}), current.get("stages", {})
    for name in sorted(set(old_stages) - set(new_stages)):
        lines.append(f"stage {name!r} is gone (was {' -> '.join(old_stages[name])})")
    for name in sorted(set(new_stages) - set(old_stages)):
        lines.append(f"stage {name!r} is new ({' -> '.join(new_stages[name])})")
    for name in sorted(set(old_stages) & set(new_stages)):
        if old_stages[name] != new_stages[name]:
            lines.append(
                f"stage {name!r} now runs {' -> '.join(new_stages[name])} "
                f"(was {' -> '.join(old_stages[name])})"
            )
    for key, what in (("boundaries", "boundary"), ("state", "keyed state")):
        old, new = set(stored.get(key, [])), set(current.get(key, []))
        lines.extend(f"{what} removed: {x}" for x in sorted(old - new))
        lines.extend(f"{what} added: {x}" for x in sorted(new - old))
    for key in sorted(set(stored) | set(current)):
        if key not in ("stages", "boundaries", "state") and stored.get(key) != current.get(key):
            lines.append(f"{key} was {stored.get(key)}, now {current.get(key)}")
    return lines


def _reset_hint(keyspace: Keyspace, checkpoint: Checkpoint) -> str:
    return (
        f"To start this pipeline over, delete both halves: onceflow reset --namespace "
        f"{keyspace.namespace} --checkpoint {checkpoint.location} --yes (or rename the "
        "pipeline, whose name is its namespace, and give onceflow run a new --checkpoint)"
    )


def pin_checkpoint(client: Connection, keyspace: Keyspace, checkpoint: Checkpoint) -> str:
    """Tie the checkpoint and the namespace together (see the module docstring)."""
    stored = store_for(client).hget(keyspace.meta, IDENTITY_FIELD)
    stored_id: str | None = stored.decode() if stored is not None else None
    found = checkpoint.identity()
    if stored_id is not None and found == stored_id:
        return stored_id
    if stored_id is not None:
        owner = store_for(client).hget(keyspace.meta, CHECKPOINT_FIELD)
        resume = (
            f"Pass --checkpoint {owner.decode()} to resume it"
            if owner is not None
            else "Pass that run's --checkpoint to resume it"
        )
        what = (
            f"holds another run's identity ({found})"
            if found is not None
            else "has no progress of this pipeline (a relative --checkpoint or --output-dir "
            "resolves against the folder a run starts from: was this run started from "
            "another folder?)"
            if not checkpoint.has_progress()
            else "was not written by the run that owns the namespace"
        )
        msg = (
            f"the checkpoint {checkpoint.location} {what}, but namespace "
            f"{keyspace.namespace!r} holds the state of run {stored_id}: resuming would "
            "re-read input the namespace has already backed up and lose or double records. "
            f"{resume}. {_reset_hint(keyspace, checkpoint)}"
        )
        raise ConfigError(msg)
    has_state = any(store_for(client).hexists(keyspace.meta, f) for f in _STATE_FIELDS)
    if found is not None and not has_state:
        msg = (
            f"the checkpoint {checkpoint.location} belongs to run {found}, but namespace "
            f"{keyspace.namespace!r} has no state in this Redis (was it wiped, or is REDIS_URL "
            "another server?): resuming would count everything it held afresh. "
            + _reset_hint(keyspace, checkpoint)
        )
        raise ConfigError(msg)
    identity = found or uuid.uuid4().hex
    store_for(client).hsetnx(keyspace.meta, IDENTITY_FIELD, identity)
    store_for(client).hsetnx(keyspace.meta, CHECKPOINT_FIELD, checkpoint.location)
    if found is None:
        checkpoint.write(identity + "\n", IDENTITY_FILE)
    return identity


def check_not_behind(client: Connection, keyspace: Keyspace, checkpoint: Checkpoint) -> None:
    """Refuse a checkpoint whose commits stop before the batch Redis says Spark committed.

    An exactly-once run acknowledges a micro-batch once Spark's commit log holds it, and GC
    then deletes its backups (:mod:`onceflow.backup.store`). A checkpoint that lost those
    commits (restored from an older copy, or a local folder that lost recent writes in a
    power failure) would replay acknowledged batches without their backups: records whose
    IDs are their input positions, and sink records, would count twice.
    """
    acked = acknowledged(client, keyspace)
    if acked < 0:
        return
    done = checkpoint.last_committed()
    if done is not None and done >= acked:
        return
    found = f"ends at micro-batch {done}" if done is not None else "has no committed micro-batch"
    msg = (
        f"the checkpoint {checkpoint.location} {found}, but namespace "
        f"{keyspace.namespace!r} holds the results of micro-batch {acked}, which Spark had "
        "committed: the checkpoint lost its latest commits (restored from an older copy? a "
        "folder that lost writes?). Resuming would replay batches whose backups are gone and "
        "double their results. Put back the checkpoint the run left, or start over: "
        + _reset_hint(keyspace, checkpoint)
    )
    raise ConfigError(msg)
