"""The JVM's standard error: shutdown noise stays in the log, everything else is shown."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from onceflow.runtime.spark_env.jvm_stderr import StderrFilter

HUNG_UP = [
    "PySpark daemon failed to flush the output to the worker process:",
    "Traceback (most recent call last):",
    '  File "/venv/pyspark/daemon.py", line 95, in worker',
    "    outfile.flush()",
    "BrokenPipeError: [Errno 32] Broken pipe",
]
RESET = [
    "Traceback (most recent call last):",
    '  File "/venv/pyspark/daemon.py", line 264, in manager',
    "    code = worker(sock, authenticated)",
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    "",
    "ConnectionResetError: [Errno 104] Connection reset by peer",
]
FAILED = [
    "Traceback (most recent call last):",
    '  File "/app/pipeline.py", line 21, in enrich',
    "    raise ValueError(event)",
    "ValueError: event boom asked to blow up",
]


def _through_filter(lines: list[str]) -> tuple[list[str], list[str]]:
    shown: list[bytes] = []
    kept: list[bytes] = []
    stream = StderrFilter(shown.append, kept.append)
    for line in lines:
        stream.feed(line.encode() + b"\n")
    stream.close()
    return [b.decode().rstrip("\n") for b in shown], [b.decode().rstrip("\n") for b in kept]


def test_hung_up_tracebacks_and_the_vector_warning_are_logged_not_shown():
    warning = "WARNING: Using incubator modules: jdk.incubator.vector"
    lines = [warning, "user print 1", *HUNG_UP, "user print 2", *RESET, *FAILED, "last"]
    shown, kept = _through_filter(lines)
    assert kept == lines
    assert shown == ["user print 1", "user print 2", *FAILED, "last"]


def test_a_hidden_traceback_takes_its_blank_lines_and_its_chain_with_it():
    """pyspark's daemon prints a note, a traceback and a blank line; chains join tracebacks."""
    chain = [
        *RESET,
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        *HUNG_UP[1:],
        "",
    ]
    shown, kept = _through_filter(["one", *HUNG_UP, "", "", *chain, "two", ""])
    assert shown == ["one", "two", ""]
    assert len(kept) == len(HUNG_UP) + len(chain) + 5


def test_a_chain_that_ends_in_a_real_error_is_shown():
    chain = [*RESET, "", "The above exception was the direct cause of the following exception:"]
    shown, _ = _through_filter([*chain, "", *FAILED])
    assert shown == [*chain[-1:], "", *FAILED], "the hang-up part may go; the error may not"


def test_a_traceback_the_stream_cut_short_is_shown():
    shown, _ = _through_filter(["before", *FAILED[:-1]])
    assert shown == ["before", *FAILED[:-1]]


def test_a_very_long_traceback_is_shown_whatever_it_ends_in():
    frames = ["  frame"] * 1000
    shown, _ = _through_filter(["Traceback (most recent call last):", *frames, HUNG_UP[-1]])
    assert len(shown) == 1002


def test_a_child_started_inside_the_block_writes_through_the_filter(tmp_path):
    """A real child process: its stderr is filtered, this process's own stderr is not."""
    log = tmp_path / "run.log"
    child = tmp_path / "child.py"
    written = "\n".join([*HUNG_UP, "child says hi", ""])
    child.write_text(f"import sys\nsys.stderr.write({written!r})\n")
    parent = tmp_path / "parent.py"
    parent.write_text(
        textwrap.dedent(
            f"""
            import subprocess, sys, threading
            from onceflow.runtime.spark_env.jvm_stderr import filtered_stderr
            with filtered_stderr({str(log)!r}):
                proc = subprocess.Popen([sys.executable, {str(child)!r}])
            print("parent after the block", file=sys.stderr, flush=True)
            proc.wait()
            for thread in threading.enumerate():
                if thread.name == "onceflow-jvm-stderr":
                    thread.join(10)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(parent)], capture_output=True, text=True, timeout=60, check=True
    )
    assert "child says hi" in out.stderr
    assert "parent after the block" in out.stderr
    assert "BrokenPipeError" not in out.stderr, out.stderr
    logged = log.read_text()
    assert "BrokenPipeError" in logged and "child says hi" in logged
    assert "parent after the block" not in logged
