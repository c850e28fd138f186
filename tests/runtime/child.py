"""A ``python -m onceflow`` child process whose output is read as it comes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from onceflow.testing.harness import kill_session


class Child:
    """``onceflow ARGS`` in its own session; ``wait_for`` a line, signal it, reap it."""

    def __init__(self, args, env=None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "onceflow", *args],
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self):
        return "\n".join(self.lines)

    def wait_for(self, pattern, timeout=300):
        """The first match of ``pattern`` in a line of output (waiting for it)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for line in self.lines[seen:]:
                found = regex.search(line)
                if found:
                    return found
            seen = len(self.lines)
            if self.proc.poll() is not None and seen == len(self.lines):
                self._reader.join(5)
                if not any(regex.search(line) for line in self.lines):
                    break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n{self.output[-4000:]}")

    def signal(self, sig=signal.SIGTERM):
        """Send ``sig`` to the driver only (not its JVM or Python workers)."""
        os.kill(self.proc.pid, sig)

    def wait(self, timeout=300):
        """The exit status; every process of the run is gone afterwards."""
        try:
            return self.proc.wait(timeout)
        finally:
            kill_session(self.proc.pid)
            self._reader.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        kill_session(self.proc.pid)
