"""The bad-requests group of bench-reliability against the real model server, with short phases."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from bench.reliability.bad_requests import Answer, Case, judge, run_request_cases

LOST_KEYS = {"rows", "minutes", "versions", "requests"}


def case(status: int) -> Case:
    return Case("probe", status, f"{status}", "POST /", lambda target: Answer(None, ""))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("answers", "as_expected", "observed"),
    [
        ([Answer(400, "bad I1")] * 3, True, "400: bad I1"),
        ([Answer(400, "bad I1"), Answer(500, "internal error"), Answer(400, "bad I1")], False,
         "500: internal error (400 x2, 500 x1)"),
        ([Answer(200, "")], False, "200"),
        ([Answer(None, "connection dropped: reset")], False, "no answer: connection dropped: reset"),
        ([Answer(400, "  ")], False, "400"),  # a 4xx with no reason
        ([Answer(400, "x" * 5000)], False, "400: " + "x" * 157 + "..."),  # an echo of the request, not a reason
    ],
)
def test_a_bad_request_is_as_expected_only_with_its_status_and_a_reason(
        answers: list[Answer], as_expected: bool, observed: str) -> None:
    assert judge(case(400), answers) == (as_expected, observed)


@pytest.mark.unit
def test_a_documented_200_needs_no_reason() -> None:
    assert judge(case(200), [Answer(200, "")] * 2) == (True, "200")
    assert judge(case(200), [Answer(400, "instance 0: feature 'I1' ...")]) == (
        False, "400: instance 0: feature 'I1' ...")


@pytest.mark.integration
def test_every_bad_request_gets_its_documented_4xx_while_good_traffic_runs(tmp_path: Path) -> None:
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}

    result = run_request_cases(tmp_path, good_rate_per_s=20.0, seconds_per_phase=3.0)

    cases = result["cases"]
    names = [c["case"] for c in cases]
    assert len(names) == len(set(names))
    bad = [c for c in cases if c["detail"].get("status", 0) >= 400]
    assert len(bad) >= 20
    assert {"grpc_wrong_dtype_for_number", "body_over_limit", "nested_10000_deep", "server_unaffected"} <= set(names)
    for c in cases:
        assert set(c) == {"group", "case", "expected", "observed", "as_expected", "lost", "manual_recovery",
                          "recover_s", "detail"}
        assert c["group"] == "requests"
        assert all(isinstance(c[key], str) and c[key] for key in ("case", "expected", "observed"))
        assert isinstance(c["as_expected"], bool)
        assert set(c["lost"]) == LOST_KEYS and all(type(v) is int for v in c["lost"].values())
        assert c["manual_recovery"] is False
        assert c["recover_s"] is None or isinstance(c["recover_s"], float)
        assert isinstance(c["detail"], dict)
    not_as_expected = {c["case"]: c["observed"] for c in cases if not c["as_expected"]}
    assert not_as_expected == {}
    assert all(c["lost"]["requests"] == 0 and c["recover_s"] is None for c in cases)
    good = result["good_traffic"]
    # 20 requests a second for the 3 s of each phase at least; none failed, and the p99 was measured in both.
    assert good["requests"] >= 50 and good["steady_requests"] >= 50
    assert (good["failed"], good["steady_failed"]) == (0, 0)
    assert good["p99_ratio"] == pytest.approx(good["during_p99_ms"] / good["steady_p99_ms"])
    # The server is stopped: no process this test started is left.
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children_before
