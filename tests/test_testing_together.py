"""``fsdpfn.testing.decided_together``: threads that decide together, the single-process stand-in for ranks
whose planner counts every fit over the ranks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpfn.testing import decided_together


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4).flatmap(lambda n: st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=1, max_size=5)))
def test_every_call_gets_whether_all_calls_fit_at_each_decision(votes):
    calls = [lambda everywhere, i=i: [everywhere(v) for v in votes[i]] for i in range(len(votes))]
    want = [all(column) for column in zip(*votes)]
    assert decided_together(calls) == [want] * len(votes)


def test_a_call_that_fails_raises_its_error_and_releases_the_others():
    def fails(everywhere):
        everywhere(True)
        raise KeyError("unit 3")

    def decides(everywhere):
        return [everywhere(True) for _ in range(5)]  # its second decision cannot be made

    with pytest.raises(KeyError, match="unit 3"):
        decided_together([decides, fails, decides])


def test_a_decision_a_failing_call_took_part_in_completes_on_the_others():
    # the failing call votes, then raises at once: the other still learns that decision (no broken
    # barrier), so its own error is the first by call, every time (a barrier's abort raced with it)
    def learns(everywhere):
        if not everywhere(True):
            raise ValueError("another call could not decide")

    def fails(everywhere):
        everywhere(False)
        raise KeyError("unit 3")

    for _ in range(30):
        with pytest.raises(ValueError, match="another call could not decide"):
            decided_together([learns, fails])
