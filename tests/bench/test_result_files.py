"""bench/results/*.json against the benchmarks that write them: every top-level key of a file is one its script
writes, and every file says which command wrote it, at which commit, on which machine (bench/provenance.py)."""

from __future__ import annotations

import ast
import json
import re
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
RESULT_FILES = sorted((BENCH / "results").glob("*.json"))
PROVENANCE_KEYS = ("command", "commit", "machine")

# Files whose "command" names no make target or bench script: the script that writes each.
SCRIPT_BY_FILE = {
    "scale.json": "bench_scale.py",  # bench/gpu_bench_scale.sh, which runs bench_scale.py on a GPU host
    "scale_run2.json": "bench_scale.py",  # the same
}

# Modules under bench/ that build part of a script's result (their keys come back into it).
RESULT_BUILDERS = {
    "bench_reliability.py": ("reliability/raw_data.py", "reliability/bad_requests.py", "reliability/faults.py",
                             "reliability/live.py"),
    "bench_row_cache_eviction.py": ("bench_row_cache_calls.py",),  # paired_main writes the result
}

# Written before the scripts merged bench/provenance.py into their results: without "commit" (and some without
# "command" or "machine"). Rerun a file's command to take it off the list; the test fails once a listed file
# carries all three, so the list only shrinks.
WRITTEN_BEFORE_PROVENANCE = frozenset({
    "gpu.json",
    "quality_tuned.json", "real_run2.json", "scale.json", "scale_run2.json",
    "serving_run1.json", "serving_run2.json",
})

# Keys added to a file by hand, which no version of its script writes. The file must be rewritten by its command
# (gpu.json: `make bench-gpu` on a GPU host); the test fails once a key leaves the file or the script writes it,
# so the list only shrinks.
ADDED_BY_HAND = {
    "gpu.json": frozenset({"goals", "batch_size_sweep_same_session",
                           "previous_design_same_device_earlier_in_session"}),
}


def read_result(name: str) -> dict:
    return json.loads((BENCH / "results" / name).read_text())


@cache
def make_target_scripts() -> dict[str, str]:
    """Makefile target -> the bench script its recipe runs."""
    text = (REPO / "Makefile").read_text()
    return dict(re.findall(r"^(bench-[\w-]+):\n\t[^\n]*?bench/(\w+\.py)", text, flags=re.MULTILINE))


def script_from_command(command: str | None) -> str | None:
    """The bench script a result's command runs: `make bench-x ...`, `python -m bench.x`, `python bench/x.py`."""
    if not command:
        return None
    if target := re.match(r"make (bench-[\w-]+)", command):
        return make_target_scripts().get(target[1])
    if module := re.match(r"python3? (?:-m bench\.(\w+)|bench/(\w+)\.py)\b", command):
        return f"{module[1] or module[2]}.py"
    return None


def script_for(name: str) -> str:
    script = script_from_command(read_result(name).get("command")) or SCRIPT_BY_FILE.get(name)
    assert script, f"bench/results/{name}: no script found from its command; add it to SCRIPT_BY_FILE"
    assert (BENCH / script).is_file(), f"bench/results/{name}: its script bench/{script} does not exist"
    return script


class WrittenKeys:
    """The keys a script's sources can write: whole string literals, keyword names of dict(...) and .update(...),
    and f-strings as patterns. An f-string whose constant parts hold a letter (f"p99_ms_{size}") matches any
    value in its fields; one of only punctuation (f"{group}_{key}") matches literals of the same sources joined
    by it, so that it does not match every key."""

    def __init__(self, sources: list[Path]):
        trees = [ast.parse(path.read_text()) for path in sources]
        in_fstrings = {id(value) for tree in trees for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                       for value in node.values}
        self.literals = {node.value for tree in trees for node in ast.walk(tree)
                         if isinstance(node, ast.Constant) and isinstance(node.value, str)
                         and id(node) not in in_fstrings}
        self.literals |= {keyword.arg for tree in trees for node in ast.walk(tree) if isinstance(node, ast.Call)
                          and (isinstance(node.func, ast.Name) and node.func.id == "dict"
                               or isinstance(node.func, ast.Attribute) and node.func.attr == "update")
                          for keyword in node.keywords if keyword.arg}
        any_literal = "(?:" + "|".join(map(re.escape, sorted(self.literals, key=len, reverse=True))) + ")"
        self.patterns = [re.compile(pattern_of(node, any_literal)) for tree in trees for node in ast.walk(tree)
                         if isinstance(node, ast.JoinedStr)]

    def __contains__(self, key: str) -> bool:
        return key in self.literals or any(pattern.fullmatch(key) for pattern in self.patterns)


def pattern_of(node: ast.JoinedStr, any_literal: str) -> str:
    constants = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
    field = ".+" if re.search(r"[A-Za-z]", constants) else any_literal
    return "".join(re.escape(v.value) if isinstance(v, ast.Constant) else field for v in node.values)


@cache
def written_keys(script: str) -> WrittenKeys:
    return WrittenKeys([BENCH / script, BENCH / "provenance.py",
                        *(BENCH / builder for builder in RESULT_BUILDERS.get(script, ()))])


def result_names() -> list[str]:
    return [path.name for path in RESULT_FILES]


def test_there_are_result_files_to_check():
    assert len(RESULT_FILES) >= 20


@pytest.mark.parametrize("name", result_names())
def test_every_key_is_written_by_the_files_benchmark(name):
    script = script_for(name)
    keys = written_keys(script)
    unwritten = sorted(key for key in read_result(name) if key not in keys and key not in ADDED_BY_HAND.get(name, ()))
    assert not unwritten, (f"bench/results/{name} holds keys that bench/{script} does not write: {unwritten}; "
                           f"rerun its command ({read_result(name).get('command')}) instead of editing the file")


@pytest.mark.parametrize("name", result_names())
def test_every_file_says_its_command_commit_and_machine(name):
    missing = [key for key in PROVENANCE_KEYS if key not in read_result(name)]
    if name in WRITTEN_BEFORE_PROVENANCE:
        assert missing, (f"bench/results/{name} carries {', '.join(PROVENANCE_KEYS)}: take it off "
                         f"WRITTEN_BEFORE_PROVENANCE")
    else:
        assert not missing, (f"bench/results/{name} lacks {missing}: its script should merge "
                             f"bench.provenance.provenance(command) into what it writes")


@pytest.mark.parametrize(("name", "keys"), sorted(ADDED_BY_HAND.items()))
def test_keys_added_by_hand_are_still_in_the_file_and_unwritten(name, keys):
    script = script_for(name)
    gone = sorted(keys - set(read_result(name)))
    written = sorted(key for key in keys if key in written_keys(script))
    assert not gone, f"bench/results/{name} no longer holds {gone}: take them off ADDED_BY_HAND"
    assert not written, f"bench/{script} now writes {written}: take them off ADDED_BY_HAND['{name}']"


def test_the_lists_name_only_result_files_and_mappings_only_unresolved_commands():
    names = set(result_names())
    listed = WRITTEN_BEFORE_PROVENANCE | set(ADDED_BY_HAND) | set(SCRIPT_BY_FILE)
    assert listed <= names, f"no such files in bench/results: {sorted(listed - names)}"
    resolved = sorted(name for name in SCRIPT_BY_FILE if script_from_command(read_result(name).get("command")))
    assert not resolved, f"the commands of {resolved} now name their script: take them off SCRIPT_BY_FILE"


@pytest.mark.parametrize(("command", "script"), [
    ("make bench-serving BENCH_SERVING_ARGS='--precision bfloat16'", "bench_serving.py"),
    ("make bench-real (--only movielens --output bench/results/real_run2.json)", "bench_real.py"),
    ("make bench-encode", "bench_block_encode.py"),
    ("python -m bench.bench_events --minutes 5", "bench_events.py"),
    ("python bench/bench_history.py --only spread", "bench_history.py"),
    ("bench/gpu_bench_scale.sh --passes 4", None),
    ("make bench-nothing", None),
])
def test_script_from_command(command, script):
    assert script_from_command(command) == script


def test_fstring_keys_match_their_constant_parts_and_a_made_up_key_does_not(tmp_path):
    source = tmp_path / "bench_x.py"
    source.write_text('SIZES = (1, 10)\nGROUP = "requests"\n'
                      'result = {**{f"p99_ms_{size}": 0 for size in SIZES}, "seconds": 1}\n'
                      'extra = {f"{GROUP}_{key}": 0 for key in ("good_traffic",)}\n'
                      'result.update(ex_per_s=1)\n')
    keys = WrittenKeys([source])
    assert [key for key in ("p99_ms_1", "p99_ms_1000", "seconds", "requests_good_traffic", "ex_per_s")
            if key not in keys] == []
    assert "p50_ms_1" not in keys
    assert "requests_bad_traffic" not in keys
    assert "goals" not in keys
