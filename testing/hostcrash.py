"""A Redis whose *host* can crash: what a power cut or a kernel panic does to its AOF.

A kill -9 of ``redis-server`` loses nothing it acknowledged: its ``write()`` calls are in the
kernel's page cache, and the kernel writes them out. A crash of the machine loses what was
not yet *fsynced*: with ``appendfsync everysec``, up to the last second of acknowledged
writes; with ``always``, nothing. To play that on one machine, :class:`CrashableRedis` runs
the server with a small shared library preloaded (``LD_PRELOAD``) that wraps ``fsync`` and
``fdatasync``: before each call it notes the file's size, and once the call returned it logs
that size as durable. :meth:`CrashableRedis.crash_host` then kills the server with SIGKILL,
cuts each AOF file back to a size between its last durable size and its current one (any
part of the unsynced tail may or may not have reached the disk), and starts the server again
on the same files, as the machine would after a reboot. So the writes a crash can lose are
exactly those the server had not fsynced — no more, or a test would blame the pipeline for a
loss no real crash causes, and no less.

The library is :data:`onceflow.testing.preload.FSYNC_LOG`; AOF rewrites are switched off so
the files only grow.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from onceflow.testing.preload import FSYNC_LOG, library
from onceflow.testing.services import LocalRedis


class CrashableRedis(LocalRedis):
    """A :class:`LocalRedis` whose host can crash (see the module docstring)."""

    def __init__(
        self,
        directory: str | None = None,
        appendfsync: str = "everysec",
        binary: str | None = None,
    ) -> None:
        super().__init__(directory, appendfsync=appendfsync, binary=binary)
        self.fsync_log = os.path.join(self.directory, "fsync.log")
        self.env = {
            "LD_PRELOAD": library("fsync-log", FSYNC_LOG),
            "ONCEFLOW_FSYNC_LOG": self.fsync_log,
        }
        # the AOF only grows: a rewrite would swap files under the durable sizes
        self.extra_args = ["--auto-aof-rewrite-percentage", "0"]
        self.crashes: list[dict[str, tuple[int, int, int]]] = []  # file -> durable, had, kept

    def aof_files(self) -> list[Path]:
        """The files Redis appends to: its incremental AOF files, or an older Redis's one AOF.

        Redis 7 keeps a folder with a base file and a manifest too, both written whole under a
        temporary name, fsynced and renamed, so a crash leaves them as they were.
        """
        folder = Path(self.directory) / "appendonlydir"
        if folder.is_dir():
            return sorted(p for p in folder.glob("*.incr.aof") if p.is_file())
        return [p for p in Path(self.directory).glob("*.aof") if p.is_file()]

    def durable_sizes(self) -> dict[str, int]:
        """Each file's size as of its last completed fsync (0: never fsynced)."""
        sizes: dict[str, int] = {}
        if os.path.exists(self.fsync_log):
            with open(self.fsync_log, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    size, _, path = line.rstrip("\n").partition(" ")
                    if size.lstrip("-").isdigit():
                        sizes[path] = int(size)
        return sizes

    def crash_host(
        self, rng: random.Random | None = None, keep_sizes: dict[str, int] | None = None
    ) -> dict[str, tuple[int, int, int]]:
        """SIGKILL, cut every AOF file back into its unsynced tail, start again.

        With ``rng`` each file keeps a random part of its unsynced tail, else none of it;
        ``keep_sizes`` (file name -> size) cuts a file at a given size instead, for a test
        that needs the cut at one place. Returns, per file, (durable size, size at the crash,
        size kept).
        """
        self.kill()
        durable = self.durable_sizes()
        cut: dict[str, tuple[int, int, int]] = {}
        for path in self.aof_files():
            had = path.stat().st_size
            safe = min(durable.get(str(path), 0), had)
            keep = rng.randint(safe, had) if rng is not None else safe
            if keep_sizes is not None and path.name in keep_sizes:
                keep = min(keep_sizes[path.name], had)
            if keep < had:
                os.truncate(path, keep)
            cut[path.name] = (safe, had, keep)
            self._note_durable(str(path), keep)  # what survived the crash is on disk now
        self.crashes.append(cut)
        self.start()
        return cut

    def _note_durable(self, path: str, size: int) -> None:
        with open(self.fsync_log, "a", encoding="utf-8") as fh:
            fh.write(f"{size} {path}\n")

    def lost_bytes(self) -> int:
        """Acknowledged bytes the crashes so far took away (what the test played)."""
        return sum(had - kept for cut in self.crashes for _, had, kept in cut.values())
