"""The peer benchmark's longest-S search (bench/peers/longest.py) and its per-rank memory cap
(bench/peers/cap.py): the search finds the exact boundary of a monotone predicate, and a process
in a capped cgroup is OOM-killed when it needs more than the cap and not otherwise."""
import os
import sys

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from bench.peers import cap, longest  # noqa: E402


def _fits_below(limit):
    calls = []

    def fits(s):
        calls.append(s)
        return dict(S=s, fits=s <= limit)

    return fits, calls


@pytest.mark.parametrize("limit", [2048, 2560, 5120, 5500, 12287, 65536])
def test_search_finds_the_largest_multiple_of_the_step_that_fits(limit):
    fits, calls = _fits_below(limit)
    got = longest.search(fits, start=2048, step=512, most=65536)
    want = limit // 512 * 512
    assert got["longest"] == want
    assert got["first_over"] == (None if limit >= 65536 else want + 512)
    assert len(calls) == len(set(calls)) and len(calls) <= 12


def test_search_tries_the_largest_s_when_doubling_steps_over_it():
    fits, calls = _fits_below(8000)
    got = longest.search(fits, start=3072, step=512, most=8192)
    assert (got["longest"], got["first_over"]) == (7680, 8192) and calls[:3] == [3072, 6144, 8192]
    fits, calls = _fits_below(9000)
    got = longest.search(fits, start=3072, step=512, most=8192)
    assert (got["longest"], got["first_over"]) == (8192, None)


def test_search_reports_a_start_that_does_not_fit_and_a_failed_probe():
    fits, calls = _fits_below(1000)
    got = longest.search(fits, start=2048, step=512, most=65536)
    assert got["longest"] is None and got["first_over"] == 2048 and calls == [2048]

    def broken(s):
        return dict(S=s, fits=False, failed=True, reason="failed: a rank raised")

    with pytest.raises(RuntimeError, match="a rank raised"):
        longest.search(broken, start=2048, step=512, most=65536)


def _child_touches(group, mib):
    pid = os.fork()
    if pid == 0:
        try:
            cap.join(group.path)
            block = bytearray(mib * 2**20)  # zero-filled by memset: every page touched
            del block
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return status


def test_a_capped_process_is_killed_above_the_cap_and_not_below():
    root, why = cap.find()
    if root is None:
        pytest.skip(f"no memory cgroup to cap a process in: {why}")
    groups = []
    try:
        big = root.make(f"mlacp-test-{os.getpid()}-big", 64 * 2**20)
        groups.append(big)
        small = root.make(f"mlacp-test-{os.getpid()}-small", 64 * 2**20)
        groups.append(small)
        status = _child_touches(big, 160)
        assert os.WIFSIGNALED(status), f"a process touching 160 MiB under a 64 MiB cap was not killed ({status})"
        assert big.oom_kills() >= 1
        status = _child_touches(small, 16)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert small.oom_kills() == 0
        assert small.peak() is None or 16 * 2**20 <= small.peak() <= 64 * 2**20
    finally:
        cap.remove_all(groups)
    assert not any(os.path.exists(g.path) for g in groups)
