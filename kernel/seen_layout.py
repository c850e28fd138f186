"""How a seen ID is stored in Redis: which shard holds it, its field there, and its mark.

The seen-ID hashes themselves (``seen:<receiver>:<generation>:<shard>``) are named and parsed
by :mod:`onceflow.kernel.keyspace`; this module holds the formulas of what goes in them:
which shard of a generation holds a seen ID (:func:`shard_of`), what its field in that shard
is (:func:`seen_field`, and back: :func:`seen_id`), and its value (:data:`SEEN_MARK`, or a
fingerprint, :func:`fingerprint_value`).

How dedup state is kept is the namespace's seen-ID *layout*, pinned in its meta hash
(``layout``, :data:`LAYOUT`) when it is created. There is one, layout 3: a seen ID's field
is the ID without what its shard already says, its value :data:`SEEN_MARK` (or a source
record's content fingerprint, :func:`fingerprint_value`). The shard is ``prefix % shards``
(``prefix``: the ID's first two bytes), so the field keeps ``prefix // shards`` (one byte
from 256 shards on, two below, none at 65,536) and bytes 2..15: 15 bytes at the default
1,024 shards. The encoding is exact: no two IDs share a shard and a field, and the ID comes
back from both (Bloom filters are rebuilt from the seen-IDs). Who committed an ID is not
kept: a task attempt learns the inputs its earlier attempts committed from its backup
(``i<chunk>`` fields, see :mod:`onceflow.backup.format`). A sink's deliveries are not
seen-IDs: each delivery's IDs go to the backup of the task that made it (``dl:`` fields),
the only task that can deliver them again (see :mod:`onceflow.dedup.delivery`).

Earlier development builds of 0.1.0 also kept layouts 1 (the whole ID, its owner as value),
2 (no delivery log) and 4 (a source stage's seen-IDs spread over hash tags of their own,
claimed before each commit: measured slower per core on one Redis and on a Redis Cluster,
see docs/concepts/dedup.md); a namespace they made is refused with the way out
(:func:`check_layout`).
"""

from __future__ import annotations

from onceflow.kernel.errors import ConfigError
from onceflow.kernel.ids import ID_BYTES


def shard_of(rid: bytes, shards: int) -> int:
    """The shard of a generation that holds a seen ID: its first two bytes, modulo ``shards``.

    The vectorised form in :mod:`onceflow.dedup` must agree; a test checks both.
    """
    return ((rid[0] << 8) | rid[1]) % shards


# The seen-ID layout (see the module docstring) and the meta field that pins a namespace's.
LAYOUT_FIELD = "layout"
LAYOUT = 3
# Layouts of earlier development builds of Onceflow 0.1.0 (unreleased): the last commit that
# read each.
OLD_LAYOUTS = {"1": "7c48c6f", "2": "7c48c6f", "4": "5e4ab38"}
SEEN_MARK = b"1"  # a seen-mark's value (not empty: a lookup takes a falsy answer for "unseen")
FINGERPRINT_BYTES = 4  # a seen-mark that holds its record's content fingerprint instead (sources)


_NO_FINGERPRINT = bytes(FINGERPRINT_BYTES)


def fingerprint_value(fingerprint: int) -> bytes:
    """The seen-mark value of a source record with this content fingerprint (0: unknown)."""
    return fingerprint.to_bytes(FINGERPRINT_BYTES, "big")


def same_content(held: bytes, fingerprint: int) -> bool:
    """Whether a seen-mark's value can be the mark of a record with ``fingerprint``.

    Marks that hold no fingerprint (the constant mark, a record without one) say nothing
    against it: only two known, different fingerprints make an ID conflict.
    """
    if not fingerprint or len(held) != FINGERPRINT_BYTES or held == _NO_FINGERPRINT:
        return True
    return held == fingerprint_value(fingerprint)


_PREFIX_BYTES = 2  # the first bytes of an ID, which pick its shard
_PREFIXES = 1 << (8 * _PREFIX_BYTES)


def prefix_bytes(shards: int) -> int:
    """Bytes of a seen field that hold ``prefix // shards``: what the shard leaves open."""
    top = (_PREFIXES - 1) // shards
    return 0 if top == 0 else 1 if top < 0x100 else 2


def seen_width(shards: int) -> int:
    """Bytes of a seen field."""
    return prefix_bytes(shards) + ID_BYTES - _PREFIX_BYTES


def seen_field(rid: bytes, shards: int) -> bytes:
    """The field of a seen ID in its shard (:func:`shard_of`).

    The vectorised form in :mod:`onceflow.dedup` must agree; a test checks both.
    """
    high = ((rid[0] << 8) | rid[1]) // shards
    return high.to_bytes(prefix_bytes(shards), "big") + rid[_PREFIX_BYTES:]


def seen_id(field: bytes, shard: int, shards: int) -> bytes:
    """The ID a seen field of shard ``shard`` stands for (the inverse of :func:`seen_field`)."""
    width = len(field) - ID_BYTES + _PREFIX_BYTES
    prefix = int.from_bytes(field[:width], "big") * shards + shard
    return prefix.to_bytes(_PREFIX_BYTES, "big") + field[width:]


def check_layout(stored: bytes | str | None, has_state: bool, namespace: str) -> None:
    """Refuse a namespace whose seen-IDs are not in :data:`LAYOUT`, saying what to do.

    ``stored``: its meta hash's ``layout`` field; ``has_state``: whether it had runs. One
    with runs but no layout was made before layouts existed (layout 1).
    """
    if stored is None:
        if not has_state:
            return
        stored = b"1"
    text = stored.decode() if isinstance(stored, bytes) else stored
    if text == str(LAYOUT):
        return
    if text in OLD_LAYOUTS:
        msg = (
            f"namespace {namespace!r} was made by an older version of onceflow (seen-ID layout "
            f"{text}): run `onceflow reset --namespace {namespace} --checkpoint CHECKPOINT_DIR "
            "--yes` to start it over (its dedup history, backups and keyed state go), or use "
            f"onceflow 0.1.0 at commit {OLD_LAYOUTS[text]}, the last that reads it"
        )
    else:
        msg = (
            f"namespace {namespace!r} keeps its seen-IDs in layout {text}, which this onceflow "
            f"does not know (it knows {LAYOUT}): run the onceflow version that created it, or "
            "a newer one"
        )
    raise ConfigError(msg)
