#!/usr/bin/env bash
# Fuzzes serving/native/rows.c (the native JSON row reader of predict bodies) with libFuzzer, AddressSanitizer
# and UndefinedBehaviorSanitizer: builds tests/serving/fuzz/rows_fuzzer.c against it with clang and runs it on
# the seeds of tests/serving/fuzz/corpus with the tokens of tests/serving/fuzz/json.dict.
#
#   tools/fuzz_native_rows.sh [SECONDS]     fuzz for SECONDS (default: FUZZ_SECONDS, else 300)
#
#   FUZZ_DIR          where the build, the corpus the run grows (corpus/) and crash reproducers (crashes/) go;
#                     default a new temporary directory. Reuse one to go on from the corpus of an earlier run.
#                     The seeds in the repository are only read.
#   FUZZ_ROWS_SOURCE  the rows.c to build against (default serving/native/rows.c)
#   FUZZ_CC           the compiler (default clang-14, else clang, whichever has libFuzzer's runtime)
#
# Exit status: 0 nothing found; 1 a finding (a sanitizer report, an invariant the harness checks, a timeout or
# running out of memory), its reproducer under FUZZ_DIR/crashes/ (run the printed fuzzer binary on it to see it
# again); 2 the harness did not build; 77 no clang with libFuzzer's runtime here (tools/ensure_env.sh installs
# Debian's clang-14 and libclang-rt-14-dev with apt-get where it runs as root).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
seconds="${1:-${FUZZ_SECONDS:-300}}"
source_file="${FUZZ_ROWS_SOURCE:-$root/serving/native/rows.c}"
fuzz="$root/tests/serving/fuzz"

log() { echo "[fuzz] $*" >&2; }

has_libfuzzer() {
  local resource
  resource=$("$1" -print-resource-dir 2>/dev/null) || return 1
  # clang 14 keeps it as lib/linux/libclang_rt.fuzzer-<arch>.a, later ones as lib/<triple>/libclang_rt.fuzzer.a
  compgen -G "$resource/lib/*/libclang_rt.fuzzer*.a" >/dev/null
}

compiler="${FUZZ_CC:-}"
if [ -z "$compiler" ]; then
  for candidate in clang-14 clang; do
    if command -v "$candidate" >/dev/null 2>&1 && has_libfuzzer "$candidate"; then compiler=$candidate; break; fi
  done
fi
if [ -z "$compiler" ] || ! has_libfuzzer "$compiler"; then
  log "no clang with libFuzzer's runtime (${FUZZ_CC:-clang-14 or clang} on PATH): install Debian's clang-14 and libclang-rt-14-dev (sudo apt-get install clang-14 libclang-rt-14-dev; tools/ensure_env.sh does it when run as root) or set FUZZ_CC"
  exit 77
fi
case "$seconds" in
  '' | *[!0-9]*) log "the run's length must be a whole number of seconds, got '$seconds' (FUZZ_SECONDS or the first argument)"; exit 2 ;;
esac

dir="${FUZZ_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/fuzz-native-rows.XXXXXX")}"
mkdir -p "$dir/corpus" "$dir/crashes"
binary="$dir/rows_fuzzer"
log "building $binary with $compiler against $source_file"
if ! "$compiler" -g -O1 -std=c11 -Wall -Wextra -fsanitize=fuzzer,address,undefined \
    -fno-sanitize-recover=undefined "$fuzz/rows_fuzzer.c" "$source_file" -o "$binary"; then
  log "the harness did not build (the compiler's output is above)"
  exit 2
fi

log "fuzzing for $seconds s; corpus $dir/corpus, reproducers $dir/crashes/"
status=0
# New inputs go to the first corpus folder only: the seeds in the repository are read, never written.
ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=0:detect_leaks=1}" "$binary" \
  -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 \
  -dict="$fuzz/json.dict" -artifact_prefix="$dir/crashes/" "$dir/corpus" "$fuzz/corpus" || status=$?
if [ "$status" != 0 ]; then
  for reproducer in "$dir"/crashes/*; do
    [ -e "$reproducer" ] && log "finding: $reproducer (again: $binary $reproducer)"
  done
  exit 1
fi
log "nothing found in $seconds s ($dir)"
