"""Run the README's two commands in a fresh Debian 12 container, from a clean clone.

The README promises that ``./quickstart.sh demo`` and ``./quickstart.sh test`` work on a fresh
Debian 12 with its own ``python3`` (3.11.2) and Java 17, as root. This builds that machine as
a container image (Debian's bookworm from debootstrap, as the end-to-end tests build it, plus
``python3``, ``python3-venv``, ``python3-pip``, ``openjdk-17-jre-headless``, ``git`` and
nothing else), clones this repository's ``HEAD`` into it, and runs the commands there with
Podman, printing their output and exit codes. Nothing of this machine's caches goes in but
pip's download cache (``--pip-cache``, read-only: a download is a download), so Onceflow's
own fetches (Kafka's jars, the schema registry) run as on a new machine.

    python tools/fresh_debian.py demo                 # ./quickstart.sh demo
    python tools/fresh_debian.py test [PYTEST ARGS]   # ./quickstart.sh test [PYTEST ARGS]
    python tools/fresh_debian.py both                 # one container, demo then test

Needs what the end-to-end tests need (root, podman, runc, debootstrap: ``./quickstart.sh
test`` installs them); takes the base image they build, or builds it (~1 min).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IMAGE = "onceflow-fresh-debian:12"
CONTAINERFILE = """FROM {base}
RUN apt-get update \\
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \\
    openjdk-17-jre-headless git ca-certificates \\
 && rm -rf /var/lib/apt/lists/*
"""


def _podman(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    from tests.e2e import engine

    env = {**os.environ, "CONTAINERS_CONF": os.path.join(engine.HERE, "containers.conf")}
    return subprocess.run(["podman", *args], env=env, text=True, check=False, **kw)  # type: ignore[call-overload]


def build_image() -> None:
    """The fresh machine: Debian 12's base image plus what the README assumes."""
    from tests.e2e import engine

    log: list[str] = []
    found, why = engine.find_engine(log)
    if found is None or found.kind != "podman":
        sys.exit(f"fresh_debian: needs Podman as the end-to-end tests set it up: {why}")
    if _podman("image", "exists", IMAGE).returncode == 0:
        return
    with tempfile.TemporaryDirectory(prefix="onceflow-fresh-") as ctx:
        Path(ctx, "Containerfile").write_text(CONTAINERFILE.format(base=engine.BASE_IMAGE))
        done = _podman("build", "-t", IMAGE, ctx, capture_output=True)
        if done.returncode:
            sys.exit(f"fresh_debian: building {IMAGE} failed:\n{done.stderr[-2000:]}")


def run(commands: list[str], pip_cache: str | None) -> int:
    """Clone HEAD, run ``commands`` (shell lines) in the container; their exit status."""
    with tempfile.TemporaryDirectory(prefix="onceflow-clone-") as work:
        clone = os.path.join(work, "onceflow")
        subprocess.run(["git", "clone", "-q", str(ROOT), clone], check=True)
        script = " && ".join(
            [
                "cp -a /src /project",
                "cd /project",
                "python3 --version",
                "java -version 2>&1 | head -1",
                *(f"{{ echo '$ {c}'; {c}; }}" for c in commands),
            ]
        )
        mounts = ["-v", f"{clone}:/src:ro"]
        if pip_cache and os.path.isdir(pip_cache):
            mounts += ["-v", f"{pip_cache}:/root/.cache/pip:ro"]
        started = time.monotonic()
        done = _podman(
            "run", "--rm", "--network", "host", "--shm-size", "2g", *mounts, IMAGE,
            "bash", "-c", script,
        )  # fmt: skip
        print(f"fresh_debian: exit {done.returncode} after {time.monotonic() - started:.0f} s")
        return done.returncode


def main() -> int:
    """Build the image if need be, then run the asked commands in it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("demo", "test", "both"))
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER)
    parser.add_argument("--pip-cache", default=os.path.expanduser("~/.cache/pip"))
    args = parser.parse_args()
    build_image()
    test = " ".join(["./quickstart.sh test", *args.pytest_args])
    commands = {"demo": ["./quickstart.sh demo"], "test": [test]}
    commands["both"] = commands["demo"] + [test]
    return run(commands[args.what], args.pip_cache)


if __name__ == "__main__":
    sys.exit(main())
