"""A bounded run's bar of Spark tasks is drawn on a terminal only, never into a log file."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import struct
import termios
import threading
import time

import pytest

from onceflow.runtime.driver.progress import TaskProgress

pytestmark = pytest.mark.spark


def _slow_job(spark):
    return spark.sparkContext.parallelize(range(4), 4).map(lambda x: time.sleep(0.4) or x).sum()


def test_no_progress_frames_go_to_a_stream_that_is_not_a_terminal(spark):
    log = io.StringIO()  # stderr sent to a file: issue 42 found \r frames in such a log
    with TaskProgress(spark.sparkContext, "progress-log", stream=log, interval=0.05):
        assert _slow_job(spark) == 6
    assert log.getvalue() == ""


def test_a_terminal_gets_the_bar(spark):
    reader, writer = os.openpty()
    fcntl.ioctl(writer, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    drawn = bytearray()

    def drain():  # a terminal's buffer is small: read as the bar draws
        with contextlib.suppress(OSError):
            while chunk := os.read(reader, 4096):
                drawn.extend(chunk)

    pump = threading.Thread(target=drain, daemon=True)
    pump.start()
    with os.fdopen(writer, "w") as terminal:
        with TaskProgress(spark.sparkContext, "progress-tty", stream=terminal, interval=0.05):
            assert _slow_job(spark) == 6
    pump.join(5)
    os.close(reader)
    assert b"\r" in drawn and b"task" in drawn
