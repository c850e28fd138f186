"""Small C libraries preloaded into a test server (``LD_PRELOAD``) to play what hosts do.

* :data:`FSYNC_LOG`: logs each completed ``fsync``/``fdatasync`` with the size it made
  durable (the host-crash simulator, :mod:`onceflow.testing.hostcrash`);
* :data:`CLOCK_OFFSET`: shifts the wall clock the process reads by
  ``ONCEFLOW_CLOCK_OFFSET_MS`` (a server whose clock lies, :func:`lying_clock`). Debian's
  libfaketime does the same but recurses into itself under jemalloc, which Redis uses.

Each is compiled once with the machine's C compiler (``cc``) into ``~/.cache/onceflow/``
(``ONCEFLOW_CACHE`` elsewhere), named by a digest of its source. Redis is dynamically linked
against glibc, so the wrappers see its calls.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from onceflow.kernel.errors import ServiceError

FSYNC_LOG = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

/* Log "<size> <path>" once an fsync of fd returned: size is the file's size before the call,
   which the call made durable (data appended while it ran may not be). */
static void note(int fd, long long size) {
    const char *log = getenv("ONCEFLOW_FSYNC_LOG");
    char link[64], path[4096], line[4200];
    if (!log) return;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return;
    path[n] = 0;
    int len = snprintf(line, sizeof line, "%lld %s\n", size, path);
    int out = open(log, O_WRONLY | O_APPEND | O_CREAT, 0644);
    if (out < 0) return;
    if (write(out, line, len) < 0) { /* nothing to do: the log is best effort */ }
    close(out);
}

static long long size_of(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 ? (long long)st.st_size : -1;
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    long long size = size_of(fd);
    int rc = real(fd);
    if (rc == 0 && size >= 0) note(fd, size);
    return rc;
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    long long size = size_of(fd);
    int rc = real(fd);
    if (rc == 0 && size >= 0) note(fd, size);
    return rc;
}
"""

CLOCK_OFFSET = r"""
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

/* The wall clock, shifted by ONCEFLOW_CLOCK_OFFSET_MS; monotonic clocks are left alone. */
static long long offset_ns(void) {
    static int read_once = 0;
    static long long offset = 0;
    if (!read_once) {
        const char *s = getenv("ONCEFLOW_CLOCK_OFFSET_MS");
        offset = s ? atoll(s) * 1000000LL : 0;
        read_once = 1;
    }
    return offset;
}

static void shift(struct timespec *ts) {
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + offset_ns();
    ts->tv_sec = ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    int rc = (int)syscall(SYS_clock_gettime, clock, ts);
    if (rc == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) shift(ts);
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    if (syscall(SYS_clock_gettime, CLOCK_REALTIME, &ts) != 0) return -1;
    shift(&ts);
    if (tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    if (syscall(SYS_clock_gettime, CLOCK_REALTIME, &ts) != 0) return (time_t)-1;
    shift(&ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}
"""


def _cache_dir() -> Path:
    root = os.environ.get("ONCEFLOW_CACHE") or os.path.join(Path.home(), ".cache", "onceflow")
    return Path(root)


def library(name: str, source: str) -> str:
    """The compiled library of ``source`` (built once per source), or a clear error."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    target = _cache_dir() / f"{name}-{digest}.so"
    if target.exists():
        return str(target)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        msg = f"no C compiler (cc) to build the test library {name}: apt-get install gcc libc6-dev"
        raise ServiceError(msg)
    target.parent.mkdir(parents=True, exist_ok=True)
    src = target.with_suffix(f".{os.getpid()}.c")
    src.write_text(source)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cc, "-shared", "-fPIC", "-O2", "-o", str(partial), str(src), "-ldl"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    src.unlink(missing_ok=True)
    if done.returncode != 0:
        msg = f"building the test library {name} failed: {done.stderr.strip()[-500:]}"
        raise ServiceError(msg)
    partial.replace(target)
    return str(target)


def lying_clock(offset_ms: int) -> dict[str, str]:
    """Environment that makes a server's wall clock lie by ``offset_ms`` (for its ``env``)."""
    return {
        "LD_PRELOAD": library("clock-offset", CLOCK_OFFSET),
        "ONCEFLOW_CLOCK_OFFSET_MS": str(offset_ms),
    }
