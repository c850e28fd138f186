"""A worker process's slot on this machine: the last part of its transactional ids.

Spark runs a sink partition's task in whichever Python worker is idle. With one transactional
id per sink partition, a task landing in another worker than last time had to register the
id anew there (100-250 ms with kafka-python, ~90 ms with confluent-kafka), fencing the
producer the other worker kept: measured, in 38 of 45 micro-batches (``bench/latency.py
--phases``). So each worker process leases a *slot*, a small integer, and its transactional
ids end with it (:func:`~.transactional_producers.transactional_id`): each worker registers
a partition's id once and reuses its producer in every later micro-batch.

The lease: the lowest ``n`` for which a non-blocking ``flock`` of the file
``<private folder>/slots-<hash of the prefix>/slot-<n>`` succeeds, held for the life of the
process (the file stays open). The operating system releases it when the process dies, kill
-9 included, so the next worker takes the lowest free slot again: a machine's ids number at
most its sink partitions times the worker processes it runs at once, and Kafka's state of
transactional ids (kept ``transactional.id.expiration.ms`` after last use, 7 days by
default) stays bounded by that.

Safety does not rest on slots being distinct: the runtime records a writer's id in Redis
before its transaction begins, in a call fenced by the attempt's ownership of the partition,
and a later attempt registers every id recorded for its partition anew before it writes
(see :mod:`onceflow.dedup.delivery`). Two processes with one slot (on two machines, or here
when no slot can be leased: then slot 0 is shared) fence each other through Kafka as
one-id-per-partition writers did. A forked child does not keep its parent's lease: it
leases its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections import OrderedDict

from onceflow.connectors.kafka.registrations import private_folder

try:
    import fcntl
except ImportError:  # pragma: no cover - not a POSIX system: every process shares slot 0
    fcntl = None  # type: ignore[assignment]

MAX_SLOTS = 64  # beyond that many live workers of one prefix on a machine, slot 0 is shared
SHARED_SLOT = 0
# Leases one process keeps open (one file each); the least recently used beyond that is let
# go: a process that then writes for its prefix again leases anew (maybe another slot, so
# one more registration), and a process given the freed slot fences the old producer through
# Kafka, as two writers of one id always did.
MAX_LEASES = 16

# prefix -> (the leasing process's id, its slot, the open lease file or None)
_LEASES: OrderedDict[str, tuple[int, int, int | None]] = OrderedDict()
_LOCK = threading.Lock()


def worker_slot(prefix: str) -> int:
    """This process's slot for transactional ids of ``prefix``, leased on first use."""
    with _LOCK:
        held = _LEASES.get(prefix)
        if held is not None and held[0] == os.getpid():
            _LEASES.move_to_end(prefix)
            return held[1]
        if held is not None:  # the parent's, inherited by a fork
            _release(held)  # the parent (if alive) keeps its lease through its own file
        slot, fd = _lease(prefix)
        _LEASES[prefix] = (os.getpid(), slot, fd)
        _LEASES.move_to_end(prefix)
        while len(_LEASES) > MAX_LEASES:
            _release(_LEASES.popitem(last=False)[1])
        return slot


def _release(held: tuple[int, int, int | None]) -> None:
    """Close a lease's file (for a lease of this process, that frees its slot)."""
    if held[2] is not None:
        with contextlib.suppress(OSError):
            os.close(held[2])


def _slots_folder(prefix: str) -> str | None:
    """The folder of ``prefix``'s lease files (made if need be), or None if there is none."""
    folder = private_folder()
    if folder is None:
        return None
    name = "slots-" + hashlib.sha256(prefix.encode()).hexdigest()[:24]
    path = os.path.join(folder, name)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    return path if os.path.isdir(path) and not os.path.islink(path) else None


def _lease(prefix: str) -> tuple[int, int | None]:
    """The lowest free slot and its locked file; :data:`SHARED_SLOT` unlocked if none is."""
    folder = _slots_folder(prefix)
    if folder is None or fcntl is None:
        return SHARED_SLOT, None
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    for n in range(MAX_SLOTS):
        try:
            fd = os.open(os.path.join(folder, f"slot-{n}"), flags, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another live process holds it
            os.close(fd)
            continue
        return n, fd
    return SHARED_SLOT, None
