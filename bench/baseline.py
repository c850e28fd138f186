"""This code's keyed count beside an older commit's, alternating, on one broker and one Redis.

Checks ``--ref`` (issue 15's baseline, bdcd83f, by default) out into a temporary git worktree
and runs its own ``bench/exactly_once.py`` (its default workload, the keyed count) and this
checkout's ``bench/exactly_once.py --workloads keyed-count``, one after the other, ``--pairs``
times, each with ``--records`` and ``--repeat``, against the same Redis and Kafka broker
(``REDIS_URL`` / ``KAFKA_BOOTSTRAP_SERVERS`` when set, else the local ones this benchmark
starts: Apache Kafka). Prints each pair's medians (records/s overall and steady) and the
exactly-once ratio, then the ratio of the medians over every single run.

The same broker matters: the baseline's benchmark starts tansu when it is given none, which
made its exactly-once runs 25-45% slower on one machine than against Apache Kafka.

    python bench/baseline.py [--ref bdcd83f] [--records 200000] [--repeat 2] [--pairs 2]

The baseline runs with ``PYTHONPATH`` set to its worktree: that serves commits from before the
folders became subpackages of ``onceflow`` (they import ``pipeline``, ``dedup`` ... at the top
level). A later commit's ``onceflow.*`` imports would reach this checkout's installed package
through its editable install's import hook; for such a ref ``PYTHONPATH`` is a tree of links
laid out as installed (``tools/typecheck.py``'s, built from the ref's own ``pyproject.toml``),
which Python's path finder serves before that hook, and both benchmarks run from a folder
without an ``onceflow`` folder in it (Spark's Python workers put their working folder first on
their path). Such a ref runs ``--workloads`` (the keyed count by default) as this code does:

    python bench/baseline.py --ref 83c769b --pairs 2   # the byte budgets' before/after

``--this-bench`` runs this checkout's ``bench/exactly_once.py`` on the ref's code too (such a
ref only), for a workload the ref's benchmark does not have yet:

    python bench/baseline.py --ref 5e4ab38 --workloads join --this-bench   # issue 37, R1
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ISSUE_15_BASELINE = "bdcd83f"
_MEDIAN = re.compile(r"^(exactly-once|at-least-once)\s+([\d,]+)\s+([\d,]+)", re.MULTILINE)
_RUN = re.compile(r"^\s+run \d+ (exactly-once|at-least-once)\s+[\d.]+ s\s+([\d,]+) rec/s", re.M)


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def medians(output: str) -> dict[str, tuple[float, float]]:
    """``{mode: (overall, steady)}`` from a benchmark's median table (its first rows of the
    mode: a memory table follows)."""
    found: dict[str, tuple[float, float]] = {}
    for mode, overall, steady in _MEDIAN.findall(output):
        found.setdefault(mode, (_number(overall), _number(steady)))
    return found


def single_runs(output: str, mode: str) -> list[float]:
    """Overall records/s of each run of ``mode``."""
    return [_number(rate) for m, rate in _RUN.findall(output) if m == mode]


def installed_layout(ref: str) -> bool:
    """Whether a commit's code imports as ``onceflow.*`` (see the module docstring)."""
    pyproject = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{ref}:pyproject.toml"],
        capture_output=True,
        text=True,
        check=False,
    )
    if pyproject.returncode != 0:
        sys.exit(f"no pyproject.toml at {ref}: {pyproject.stderr.strip()}")
    return '"onceflow.pipeline"' in pyproject.stdout


def link_tree(worktree: Path, tree: Path) -> None:
    """The ref's folders laid out as installed, as links (``tools/typecheck.py``'s tree)."""
    sys.path.insert(0, str(REPO / "tools"))
    import typecheck

    typecheck.ROOT = worktree  # its own pyproject.toml's package-dir mapping
    typecheck.build_tree(tree)


def run(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> str:
    """Run a benchmark; keep and return its output (a failure stops with its tail)."""
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    output = done.stdout + done.stderr
    log.write_text(output, encoding="utf-8")
    if done.returncode != 0 or not medians(output):
        tail = "\n".join(output.splitlines()[-15:])
        sys.exit(f"{' '.join(cmd)} failed in {cwd} (log {log}):\n{tail}")
    return output


def line(name: str, found: dict[str, tuple[float, float]]) -> str:
    eo, alo = found["exactly-once"], found["at-least-once"]
    return (
        f"  {name:<10} exactly-once {eo[0]:>8,.0f} / {eo[1]:<8,.0f} "
        f"at-least-once {alo[0]:>8,.0f} / {alo[1]:<8,.0f} "
        f"EO/ALO {eo[0] / alo[0]:.0%} / {eo[1] / alo[1]:.0%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default=ISSUE_15_BASELINE)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--workloads", default="keyed-count")
    parser.add_argument("--batch", type=int, help="records per micro-batch (the benchmark's)")
    parser.add_argument(
        "--client",
        choices=("python", "confluent"),
        help="Kafka client of both sides (default: each benchmark's own default)",
    )
    parser.add_argument(
        "--this-bench", action="store_true", help="this checkout's benchmark on the ref's code"
    )
    args = parser.parse_args()
    installed = installed_layout(args.ref)
    if args.this_bench and not installed:
        sys.exit(f"--this-bench needs a ref laid out as installed; {args.ref} is not")
    sys.path.insert(0, str(HERE))
    from exactly_once import services

    sizes = ["--records", str(args.records), "--repeat", str(args.repeat)]
    if args.batch:
        sizes += ["--batch", str(args.batch)]
    if args.client:  # the two benchmarks' defaults may differ: one client for both sides
        sizes += ["--client", args.client]
    logs = Path(tempfile.mkdtemp(prefix="onceflow-baseline-"))
    worktree = logs / "baseline"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), args.ref],
        check=True,
        capture_output=True,
    )
    singles: dict[str, list[float]] = {"baseline": [], "this code": []}
    workloads = ["--workloads", args.workloads]
    bench = HERE if args.this_bench else worktree / "bench"
    base_cmd = [sys.executable, str(bench / "exactly_once.py"), *sizes]
    base_path, base_cwd, our_cwd = str(worktree), worktree, REPO
    if installed:
        link_tree(worktree, logs / "tree")
        base_cmd += workloads
        base_path, base_cwd = str(logs / "tree"), logs
        our_cwd = logs  # the same working folder for both
    try:
        with services(False) as (redis_url, bootstrap, _):
            env = {**os.environ, "REDIS_URL": redis_url, "KAFKA_BOOTSTRAP_SERVERS": bootstrap}
            base_env = {**env, "PYTHONPATH": base_path}
            print(f"baseline {args.ref} and this checkout, {args.records:,} records, logs {logs}")
            for pair in range(1, args.pairs + 1):
                base = run(base_cmd, base_cwd, base_env, logs / f"baseline-{pair}.txt")
                ours = run(
                    [sys.executable, str(HERE / "exactly_once.py"), *sizes, *workloads],
                    our_cwd,
                    env,
                    logs / f"this-{pair}.txt",
                )
                b, o = medians(base), medians(ours)
                print(f"pair {pair} (median rec/s overall / steady)")
                print(line("baseline", b))
                print(line("this code", o))
                ratio = o["exactly-once"][0] / b["exactly-once"][0]
                print(f"  exactly-once, this code / baseline: {ratio:.2f}x", flush=True)
                singles["baseline"] += single_runs(base, "exactly-once")
                singles["this code"] += single_runs(ours, "exactly-once")
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)],
            check=False,
            capture_output=True,
        )
    b, o = statistics.median(singles["baseline"]), statistics.median(singles["this code"])
    spread = {k: f"{min(v):,.0f}..{max(v):,.0f}" for k, v in singles.items()}
    print(
        f"exactly-once over every run: baseline {b:,.0f} ({spread['baseline']}), "
        f"this code {o:,.0f} ({spread['this code']}): {o / b:.2f}x"
    )


if __name__ == "__main__":
    main()
