"""How one step's groups are shared between tasks (trainer/mix.py): pure rules, no broker."""

from __future__ import annotations

from collections import Counter

import pytest

from agentarium.trainer.mix import TaskMix, apportion, compose, quotas


def keys(*ages: int) -> list[tuple[int, float]]:
    """Sort keys of ready groups: (oldest policy version, first arrival)."""
    return [(0, float(a)) for a in ages]


def test_parse_names_every_form_and_says_what_to_write():
    assert TaskMix.parse("proportional").weights_for(["a", "b"]) is None
    assert TaskMix.parse("balanced").weights_for(["a", "b", "c"]) == pytest.approx(
        {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}
    )
    mix = TaskMix.parse("a=0.7, b=0.3")
    assert str(mix) == "a=0.7,b=0.3"
    assert mix.weights_for(["b", "a"]) == pytest.approx({"b": 0.3, "a": 0.7})
    assert TaskMix.parse("a=2,b=1").weights_for(["a", "b"]) == pytest.approx(
        {"a": 2 / 3, "b": 1 / 3}
    )
    for text, message in (
        ("equal", "write proportional, balanced, or weights"),
        ("a=0,b=1", "must be > 0"),
        ("a=x", "must be a number"),
        ("a=1,a=2", "weighted twice"),
        ("a.b=1", "not a valid name"),
    ):
        with pytest.raises(ValueError, match=message):
            TaskMix.parse(text)
    with pytest.raises(ValueError, match=r"no weight for c; d not trained"):
        TaskMix.parse("a=1,b=1,d=1").weights_for(["a", "b", "c"])


def test_proportional_takes_the_oldest_groups_whatever_their_task():
    ready = {"a": keys(1, 2, 3, 7), "b": keys(4, 5), "c": []}
    assert compose(4, ready, weights=None) == {"a": 3, "b": 1, "c": 0}
    # an older policy version goes first, whatever its arrival
    ready = {"a": [(1, 1.0), (1, 2.0)], "b": [(0, 9.0)]}
    assert compose(2, ready, weights=None) == {"a": 1, "b": 1}
    # never waits on a task: only on B groups in total
    assert compose(4, {"a": keys(1, 2, 3), "b": []}, weights=None) is None
    assert compose(3, {"a": keys(1, 2, 3), "b": []}, weights=None) == {"a": 3, "b": 0}


def test_balanced_splits_evenly_and_rotates_when_b_is_smaller_than_the_tasks():
    weights = TaskMix.parse("balanced").weights_for(["a", "b"])
    assert quotas(8, weights, {}) == {"a": 4, "b": 4}
    assert quotas(5, weights, {}) == {"a": 3, "b": 2}  # a tie: agent order
    assert quotas(5, weights, {"a": 3, "b": 2}) == {"a": 2, "b": 3}  # then the one behind
    # B = 2 groups per step over 3 tasks: every task gets its turn, shares stay even
    three = TaskMix.parse("balanced").weights_for(["a", "b", "c"])
    taken: Counter[str] = Counter()
    for _ in range(30):
        step = quotas(2, three, taken)
        assert sum(step.values()) == 2 and max(step.values()) == 1
        taken.update(step)
    assert taken == {"a": 20, "b": 20, "c": 20}


def test_weights_converge_on_their_shares_through_the_leftover_slots():
    weights = TaskMix.parse("a=0.7,b=0.3").weights_for(["a", "b"])
    taken: Counter[str] = Counter()
    steps = []
    for _ in range(10):
        step = quotas(4, weights, taken)
        steps.append((step["a"], step["b"]))
        taken.update(step)
    assert steps[:3] == [(3, 1), (3, 1), (2, 2)]
    assert taken == {"a": 28, "b": 12}  # exactly 70 % of 40
    assert apportion(5, {"x": 1.0, "y": 1.0, "z": 2.0}) == {"x": 1, "y": 1, "z": 3}


def test_a_short_task_is_waited_for_until_the_deadline_then_its_share_moves():
    weights = TaskMix.parse("balanced").weights_for(["a", "b"])
    ready = {"a": keys(*range(8)), "b": keys(100)}
    assert compose(4, ready, weights=weights, waited_out=False) is None  # b has 1 of its 2
    assert compose(4, ready, weights=weights, waited_out=True) == {"a": 3, "b": 1}
    # a task with nothing at all: the whole batch from the others
    assert compose(4, {"a": keys(*range(8)), "b": []}, weights=weights, waited_out=True) == {
        "a": 4,
        "b": 0,
    }
    # fewer than B groups in total: the step keeps waiting, deadline or not
    assert compose(4, {"a": keys(1, 2), "b": keys(3)}, weights=weights, waited_out=True) is None
    # every quota met: no need to wait
    assert compose(4, {"a": keys(1, 2), "b": keys(3, 4)}, weights=weights) == {"a": 2, "b": 2}


def test_the_shortfall_goes_to_the_others_in_proportion_to_their_weights():
    weights = TaskMix.parse("a=2,b=1,c=1").weights_for(["a", "b", "c"])
    assert quotas(8, weights, {}) == {"a": 4, "b": 2, "c": 2}
    ready = {"a": keys(*range(10)), "b": keys(*range(10)), "c": []}
    # c's 2 slots: 2/3 and 1/3 of them to a and b, largest remainder -> 1 each
    assert compose(8, ready, weights=weights, waited_out=True) == {"a": 5, "b": 3, "c": 0}
    # capped by what a task has ready: c's 4 slots split 2/2 between a and b, but b has one
    # spare group; a takes the rest
    even = TaskMix.parse("a=1,b=1,c=2").weights_for(["a", "b", "c"])
    ready = {"a": keys(*range(10)), "b": keys(*range(3)), "c": []}
    assert compose(8, ready, weights=even, waited_out=True) == {"a": 5, "b": 3, "c": 0}
    ready = {"a": keys(*range(10)), "b": keys(*range(2)), "c": keys(1)}
    assert compose(8, ready, weights=weights, waited_out=True) == {"a": 5, "b": 2, "c": 1}
