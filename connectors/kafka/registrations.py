"""Which process on this machine registered a transactional id last: a hint, never relied on.

Spark hands a sink partition's task to whichever Python worker is idle, so a partition's
transactional id moves between the worker processes of an executor from one micro-batch to
the next. Registering the id in one process fences the producer another process keeps for
it; that producer only learns so from Kafka, when its next transaction fails, which then has
to be ended, registered anew and redone. Measured at 1,000 orders/s on 2 cores
(``bench/latency.py --phases``): half the tasks of both stages of the README pipeline redid
their transaction, and a batch took 0.8-1.4 s instead of 0.2-0.4 s.

So a registration leaves a note here: one small file per (Kafka cluster, transactional id)
holding a token of the registering process. A process about to reuse its producer of an id
first reads the note: another's token means the producer is fenced, and the id is registered
anew before anything is sent (:meth:`~.transactional_producers.TransactionalProducer.producer`).

Only a shortcut: Kafka's fencing alone keeps the writes exactly-once. A note missing,
unreadable or from another machine's process leaves the producer to find out from Kafka as
before; a wrong one costs one registration more. The folder must be this user's own and
closed to others (as :func:`onceflow.runtime.spark_env.session.private_socket_dir` checks its own),
else no notes are kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import uuid

_FOLDER: list[str | None] = []  # the notes' folder once checked (None: no notes)


def private_folder() -> str | None:
    """This user's folder of notes (made if need be), or None if it is not safe to use.

    Also where :mod:`.leases` keeps its lease files.
    """
    if _FOLDER:
        return _FOLDER[0]
    found: str | None = None
    with contextlib.suppress(OSError):  # no usable temporary folder at all: no notes either
        path = os.path.join(tempfile.gettempdir(), f"onceflow-txn-{os.getuid()}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
        if os.path.isdir(path) and not os.path.islink(path):
            if st.st_uid == os.getuid() and st.st_mode & 0o077 == 0:
                found = path
    _FOLDER.append(found)
    return found


def _note_path(bootstrap: str, tid: str) -> str | None:
    folder = private_folder()
    if folder is None:
        return None
    name = hashlib.sha256(f"{bootstrap}\n{tid}".encode()).hexdigest()[:40]
    return os.path.join(folder, name)


def note_registered(bootstrap: str, tid: str) -> str | None:
    """Note that this process just registered ``tid``; return the note's token (None: none)."""
    path = _note_path(bootstrap, tid)
    if path is None:
        return None
    token = f"{os.getpid()}-{uuid.uuid4().hex}"
    temp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temp, "w", encoding="ascii") as fh:
            fh.write(token)
        os.replace(temp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        return None
    return token


def registered_elsewhere(bootstrap: str, tid: str, token: str | None) -> bool:
    """Whether another process here registered ``tid`` after the registration ``token`` noted."""
    if token is None:
        return False
    path = _note_path(bootstrap, tid)
    if path is None:
        return False
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read() != token
    except (OSError, UnicodeDecodeError):
        return False
