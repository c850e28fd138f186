#!/usr/bin/env bash
# Onceflow quick start. Installs what it needs, then runs the demo or the test suite.
#
#   ./quickstart.sh demo            the main job on embedded defaults (Redis + broker started
#                                    for you unless REDIS_URL / KAFKA_BOOTSTRAP_SERVERS are set)
#   ./quickstart.sh test [ARGS...]   the whole test suite (ARGS go to pytest)
#   ./quickstart.sh bench [NAME [ARGS...]]
#                                    a benchmark, bench/NAME.py (default: peers, Onceflow beside
#                                    Quix Streams, Spark's own operators and Apache Flink), in a
#                                    virtual env of its own (.venv-bench: the peers pin other
#                                    client versions; PyFlink gets one more, made by
#                                    bench/flink_peer.py on first use)
#
# Safe to run again: each step checks before it installs. Needs Debian with Python >= 3.11
# and Java 17; as root it installs missing Debian packages itself (otherwise via sudo).
set -euo pipefail
cd "$(dirname "$0")"

# redis-tools: redis-cli builds local Redis Clusters; maven fetches Apache Kafka's jars.
DEBIAN_PACKAGES=(redis-server redis-tools graphviz maven)
TEST_DEBIAN_PACKAGES=(gcc libc6-dev podman runc uidmap slirp4netns fuse-overlayfs debootstrap chromium chromium-driver faketime postgresql)
VENV=.venv
EXTRAS=dev  # the optional dependencies installed into $VENV

log() { printf '[quickstart] %s\n' "$*" >&2; }
export PIP_DISABLE_PIP_VERSION_CHECK=1  # pip's own update check is noise to a new user

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else log "need root to run: $*"; return 1; fi
}

ensure_debian_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # a machine whose package lists are missing or stale fails the first try quietly: update, retry
  if ! as_root apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    as_root apt-get update -q >/dev/null
    as_root apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

find_python() {
  for candidate in "${PYTHON:-}" python3.13 python3.12 python3.11 python3; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
      echo "$candidate"; return 0
    fi
  done
  log "Python >= 3.11 not found (set PYTHON=/path/to/python3.11)"; return 1
}

ensure_java() {
  command -v java >/dev/null 2>&1 && return 0
  log "Java not found; installing openjdk-17-jre-headless"
  ensure_debian_packages openjdk-17-jre-headless
}

ensure_venv() {
  [ -x "$VENV/bin/python" ] && return 0
  local py; py=$(find_python)
  log "creating virtual environment $VENV with $py"
  if ! "$py" -m venv "$VENV" 2>/dev/null; then
    rm -rf "$VENV"
    ensure_debian_packages python3-venv
    "$py" -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
}

ensure_python_packages() {
  local stamp="$VENV/.onceflow-installed" want
  want="$(sha256sum pyproject.toml | cut -d' ' -f1) $EXTRAS"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  log "installing Python packages into $VENV (first time: a few minutes, PySpark is large)"
  # setuptools warns at every editable install that folders named like a package may shadow
  # it; ours install as onceflow's subpackages (package-dir), none is named onceflow
  PYTHONWARNINGS="ignore:Editable installation" "$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"
  echo "$want" > "$stamp"
}

ensure_kafka() {
  # Apache Kafka's jars from Maven Central, into a cache reused by every run (quiet when cached).
  "$VENV/bin/python" -c 'from onceflow.testing.kafka_jars import fetch_kafka; fetch_kafka()'
}

ensure_registry() {
  # Apicurio Registry (the schema registry codecs' tests) from Maven Central, once (cached).
  "$VENV/bin/python" -c 'from onceflow.testing.registry import fetch_registry; fetch_registry()'
}

ensure_connect() {
  # Kafka Connect and Debezium's PostgreSQL connector (the change data capture tests), once.
  "$VENV/bin/python" -c 'from onceflow.testing.kafka_connect import fetch_connect; fetch_connect()'
}

ensure_jvm_cache() {
  # The Spark driver's class-data archive (~20 s once): runs and restarts start ~1.5 s sooner.
  # Only an optimization: without it everything works, a little slower.
  "$VENV/bin/onceflow" jvm-cache >/dev/null || log "no JVM class-data archive; runs start without it"
}

# The whole suite fails fast: the checks that need no service (lint, types, layers, sizes, the
# kernel's and the optimizer's unit tests: ~2 min) first; the service tests (~25 min) only after.
FAST_TESTS=(tests/architecture tests/kernel tests/graph_optimizer)

run_suite() {
  log "fast checks first: ${FAST_TESTS[*]}"
  if ! "$VENV/bin/python" -m pytest "${FAST_TESTS[@]}"; then
    log "fast checks failed: the service tests were not run (fix these first)"; exit 1
  fi
  local skip=(); for t in "${FAST_TESTS[@]}"; do skip+=(--ignore="$t"); done
  log "the service tests"
  exec "$VENV/bin/python" -m pytest "${skip[@]}"
}

main() {
  local cmd="${1:-}"; shift || true
  case "$cmd" in
    demo)
      ensure_debian_packages "${DEBIAN_PACKAGES[@]}"; ensure_java; ensure_venv; ensure_python_packages
      ensure_kafka; ensure_jvm_cache
      exec "$VENV/bin/onceflow" demo "$@" ;;
    test)
      ensure_debian_packages "${DEBIAN_PACKAGES[@]}" "${TEST_DEBIAN_PACKAGES[@]}"
      ensure_java; ensure_venv; ensure_python_packages; ensure_kafka; ensure_registry
      ensure_connect; ensure_jvm_cache
      if [ $# -eq 0 ]; then run_suite; else exec "$VENV/bin/python" -m pytest "$@"; fi ;;
    bench)
      VENV=.venv-bench; EXTRAS=bench
      ensure_debian_packages "${DEBIAN_PACKAGES[@]}"; ensure_java; ensure_venv; ensure_python_packages
      ensure_kafka; ensure_jvm_cache
      local name="${1:-peers}"; shift || true
      exec "$VENV/bin/python" "bench/${name%.py}.py" "$@" ;;
    *)
      echo "usage: $0 demo [ARGS...] | test [PYTEST ARGS...] | bench [NAME [ARGS...]]" >&2; exit 2 ;;
  esac
}

main "$@"
