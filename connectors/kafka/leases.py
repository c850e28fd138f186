"""A worker process's lease on this machine: the last part of its transactional ids.

Spark runs a sink partition's task in whichever Python worker is idle. With one transactional
id per sink partition, a task landing in another worker than last time had to register the
id anew there (100-250 ms with kafka-python, ~90 ms with confluent-kafka), fencing the
producer the other worker kept: measured, in 38 of 45 micro-batches (``bench/latency.py
--phases``). So each worker process leases a small integer, its *lease number*, and its
transactional ids end with it (:func:`~.transactional_producers.transactional_id`): each
worker registers a partition's id once and reuses its producer in every later micro-batch.

The lease: the lowest ``n`` for which a non-blocking ``flock`` of the file
``<private folder>/slots-<hash of the prefix>/slot-<n>`` succeeds, held for the life of the
process (the file stays open; the files keep the names earlier versions gave them, so that
processes of both take distinct numbers). The operating system releases it when the process
dies, kill -9 included, so the next worker takes the lowest free number again: a machine's
ids number at most its sink partitions times the worker processes it runs at once, and
Kafka's state of transactional ids (kept ``transactional.id.expiration.ms`` after last use,
7 days by default) stays bounded by that.

Safety does not rest on lease numbers being distinct: the runtime records a writer's id in
Redis before its transaction begins, in a call fenced by the attempt's ownership of the
partition, and a later attempt registers every id recorded for its partition anew before it
writes (see :mod:`onceflow.dedup.delivery`). Two processes with one lease number (on two
machines, or here when no number can be leased: then number 0 is shared) fence each other
through Kafka as one-id-per-partition writers did. A forked child does not keep its parent's
lease: it leases its own.
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
except ImportError:  # pragma: no cover - not a POSIX system: every process shares number 0
    fcntl = None  # type: ignore[assignment]

LEASE_NUMBERS = 64  # beyond that many live workers of one prefix on a machine, 0 is shared
SHARED_LEASE = 0
# Leases one process keeps open (one file each); the least recently used beyond that is let
# go: a process that then writes for its prefix again leases anew (maybe another number, so
# one more registration), and a process given the freed number fences the old producer through
# Kafka, as two writers of one id always did.
MAX_LEASES = 16

# prefix -> (the leasing process's id, its lease number, the open lease file or None)
_LEASES: OrderedDict[str, tuple[int, int, int | None]] = OrderedDict()
_LOCK = threading.Lock()


def worker_lease(prefix: str) -> int:
    """This process's lease number for transactional ids of ``prefix``, leased on first use."""
    with _LOCK:
        held = _LEASES.get(prefix)
        if held is not None and held[0] == os.getpid():
            _LEASES.move_to_end(prefix)
            return held[1]
        if held is not None:  # the parent's, inherited by a fork
            _release(held)  # the parent (if alive) keeps its lease through its own file
        number, fd = _take_lease(prefix)
        _LEASES[prefix] = (os.getpid(), number, fd)
        _LEASES.move_to_end(prefix)
        while len(_LEASES) > MAX_LEASES:
            _release(_LEASES.popitem(last=False)[1])
        return number


def _release(held: tuple[int, int, int | None]) -> None:
    """Close a lease's file (for a lease of this process, that frees its number)."""
    if held[2] is not None:
        with contextlib.suppress(OSError):
            os.close(held[2])


def _lease_folder(prefix: str) -> str | None:
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


def _take_lease(prefix: str) -> tuple[int, int | None]:
    """The lowest free number and its locked file; :data:`SHARED_LEASE` unlocked if none is."""
    folder = _lease_folder(prefix)
    if folder is None or fcntl is None:
        return SHARED_LEASE, None
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    for n in range(LEASE_NUMBERS):
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
    return SHARED_LEASE, None
