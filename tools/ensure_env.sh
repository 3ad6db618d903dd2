#!/usr/bin/env bash
# Prints the path of the project's Python environment, building it first if needed.
#
#   tools/ensure_env.sh            the environment of requirements.lock
#   tools/ensure_env.sh --stack    the same, plus what `ctr-pipeline stack` needs (docker/requirements-production.txt:
#                                  PostgreSQL drivers and Celery, pinned against the lock, so nothing in it moves)
#                                  and what `make test-stack`'s browser checks need (tools/requirements-browser.txt:
#                                  Playwright; Debian's chromium package, installed with apt-get when missing)
#
# Outside Python it needs Java 17 (Spark), Debian's docker-compose (the compose-file tests) and clang with
# libFuzzer's and the sanitizers' runtimes (tests/serving/test_native_rows_fuzz.py and `make fuzz-native` fuzz
# serving/native/rows.c: Debian's clang-14 and libclang-rt-14-dev); each is installed with apt-get when missing
# and this runs as root. Without clang the fuzzing test skips and says how to install it.
#
# The environment is ~4 GB and takes ~5 minutes to install, so it lives outside the clone,
# keyed by the hash of requirements.lock: every clone (and CI) with the same lock reuses it,
# and a changed lock builds a new one. A build that was interrupted is detected by the
# missing ".complete" marker and redone from scratch.
set -euo pipefail

with_stack=0
if [ "${1:-}" = "--stack" ]; then with_stack=1; fi

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
lock="$root/requirements.lock"
python_bin="${CTR_PYTHON:-python3.11}"
cache="${CTR_ENV_CACHE:-$HOME/.cache/ctr-pipeline}"
lock_hash=$(sha256sum "$lock" | cut -c1-16)
venv="$cache/venv-py311-$lock_hash"

log() { echo "[env] $*" >&2; }

if ! command -v java >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    log "Java is missing (Spark needs Java 17): installing openjdk-17-jre-headless with apt-get"
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >&2
  else
    log "Java 17 is required by Spark and was not found on PATH. Install it (e.g. 'sudo apt-get install openjdk-17-jre-headless') and retry."
    exit 1
  fi
fi
# The compose-file tests validate docker-compose.yml with Debian's docker-compose 1.29.2 (no engine needed).
if ! command -v docker-compose >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    log "docker-compose is missing (the compose-file tests validate docker-compose.yml with it): installing it with apt-get"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose) >&2 \
      || log "warning: could not install docker-compose; the compose-file tests will fail and say how to install it"
  else
    log "warning: docker-compose is not on PATH and cannot be installed here (not root): the compose-file tests will fail; install Debian's docker-compose"
  fi
fi
# The fuzzing test builds a libFuzzer harness with AddressSanitizer and UndefinedBehaviorSanitizer
# (tools/fuzz_native_rows.sh): clang-14 and libclang-rt-14-dev, which holds libclang_rt.fuzzer and the sanitizers.
has_libfuzzer() {
  local compiler resource
  for compiler in clang-14 clang; do
    command -v "$compiler" >/dev/null 2>&1 || continue
    resource=$("$compiler" -print-resource-dir 2>/dev/null) || continue
    compgen -G "$resource/lib/*/libclang_rt.fuzzer*.a" >/dev/null && return 0
  done
  return 1
}
if ! has_libfuzzer; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    log "clang with libFuzzer is missing (the fuzzing test of the native row reader needs it): installing clang-14 and libclang-rt-14-dev with apt-get"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends clang-14 libclang-rt-14-dev) >&2 \
      || log "warning: could not install clang-14 and libclang-rt-14-dev; the fuzzing test of the native row reader will skip"
  else
    log "warning: no clang with libFuzzer here and it cannot be installed (not root): the fuzzing test of the native row reader will skip; install clang-14 and libclang-rt-14-dev"
  fi
fi
if ! command -v "$python_bin" >/dev/null 2>&1; then
  log "$python_bin was not found on PATH. Install Python 3.11 or set CTR_PYTHON to its path."
  exit 1
fi

mkdir -p "$cache"
# One build at a time per environment: two clones (CI beside a benchmark's worktree) starting at once would
# otherwise both build into the same directory, the second removing what the first installs.
exec 9>"$cache/.venv-py311-$lock_hash.lock"
if ! flock -n 9; then
  log "another process is building or updating $venv: waiting for it"
  flock 9
fi
uv_bin=$(command -v uv || true)
if [ -z "$uv_bin" ]; then
  if [ ! -x "$cache/uv/bin/uv" ]; then
    log "bootstrapping uv into $cache/uv"
    "$python_bin" -m venv "$cache/uv" >&2 && "$cache/uv/bin/pip" install -q uv >&2
  fi
  uv_bin="$cache/uv/bin/uv"
fi

if [ ! -f "$venv/.complete" ]; then
  log "building the environment for lock $lock_hash in $venv (first use: ~5 minutes, ~4 GB)"
  rm -rf "$venv"
  "$uv_bin" venv -q -p "$python_bin" "$venv" >&2
  "$uv_bin" pip install -p "$venv/bin/python" --compile-bytecode -r "$lock" >&2
  touch "$venv/.complete" "$venv/.bytecode"
  log "environment ready"
fi

# Byte-code is compiled once, at install: with PYTHONDONTWRITEBYTECODE set (common in containers and CI) every
# process would otherwise re-compile what it imports (great-expectations alone: ~15 s instead of ~3 s), and
# every Airflow task pays its imports again. Environments built before this step get it here, once.
if [ ! -f "$venv/.bytecode" ]; then
  log "compiling byte-code in $venv (once, ~2 minutes)"
  "$venv/bin/python" -m compileall -q -j 0 "$venv/lib" >/dev/null 2>&1 || true
  touch "$venv/.bytecode"
fi

if [ "$with_stack" = 1 ]; then
  production="$root/docker/requirements-production.txt"
  stack_marker="$venv/.stack-$(sha256sum "$production" | cut -c1-16)"
  if [ ! -f "$stack_marker" ]; then
    log "installing the stack's extras (docker/requirements-production.txt) into $venv"
    "$uv_bin" pip install -q -p "$venv/bin/python" --compile-bytecode -c "$lock" -r "$production" >&2
    touch "$stack_marker"
  fi
  browser="$root/tools/requirements-browser.txt"
  browser_marker="$venv/.browser-$(sha256sum "$browser" | cut -c1-16)"
  if [ ! -f "$browser_marker" ]; then
    log "installing the browser checks' client (tools/requirements-browser.txt) into $venv"
    "$uv_bin" pip install -q -p "$venv/bin/python" -r "$browser" >&2
    touch "$browser_marker"
  fi
  if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      log "installing Debian's chromium (the browser checks' browser)"
      export DEBIAN_FRONTEND=noninteractive
      apt-get install -y -q chromium >&2 || { apt-get update -q >&2 && apt-get install -y -q chromium >&2; }
    else
      log "no chromium: the browser checks of make test-stack need it (sudo apt-get install chromium)"
    fi
  fi
fi

# The project itself is installed editable from this clone (cheap; keeps the `ctr-pipeline` script pointing here).
# Checked in isolated mode from / so that a checkout in the current directory does not pass for an install.
if [ ! -x "$venv/bin/ctr-pipeline" ] || ! (cd / && "$venv/bin/python" -I - "$root") <<'PY' >/dev/null 2>&1
import sys, pathlib, importlib.util
spec = importlib.util.find_spec("pipelines")
sys.exit(0 if spec and pathlib.Path(spec.origin).resolve().is_relative_to(pathlib.Path(sys.argv[1]).resolve()) else 1)
PY
then
  "$uv_bin" pip install -q -p "$venv/bin/python" --no-deps -e "$root" >&2
fi
echo "$venv"
