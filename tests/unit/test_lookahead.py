"""Answers worked out ahead in forked helpers: the same as the search's own, whatever a helper
does (answers, skips, fails, stalls), and never a wait for ever."""

from __future__ import annotations

import os
import time

import pytest

from torchtitan_seq.plan import lookahead
from torchtitan_seq.plan.lookahead import SKIP, Lookahead

pytestmark = pytest.mark.skipif(lookahead.available_processes() < 2, reason="needs fork and two CPUs")

QUESTIONS = 40
SHARES = [(i // 3) % 2 for i in range(QUESTIONS)]  # runs of three questions, two shares


def search_plans(processes: int, helper_work=None, patience: float = 30.0) -> tuple[list, set[int]]:
    """A search whose skips depend on earlier answers of the same share (as the planner's do): it
    skips a question whose share's last answer was a multiple of 5. Returns its answers, as
    (question, answer) pairs, and the processes that worked them out."""
    last = {0: 1, 1: 1}

    def answer(i: int) -> tuple[int, int]:
        return i * i + 1, os.getpid()

    def skipped(i: int) -> bool:
        return last[SHARES[i]] % 5 == 0

    def work(i: int):
        if skipped(i):
            return SKIP
        last[SHARES[i]] = answer(i)[0]
        return answer(i)

    answers, pids = [], set()
    with Lookahead.start(SHARES, helper_work or work, processes, patience) as ahead:
        for i in range(QUESTIONS):
            if skipped(i):
                continue
            value, pid = ahead.answer(i, answer)
            last[SHARES[i]] = value
            answers.append((i, value))
            pids.add(pid)
    return answers, pids


def test_helpers_answer_their_share_and_the_search_is_the_same_as_alone():
    alone, alone_pids = search_plans(1)
    ahead, pids = search_plans(2)
    assert ahead == alone and alone_pids == {os.getpid()}
    assert len(pids) == 2, "a helper answered none of its share"
    assert len(alone) < QUESTIONS, "the search skipped nothing: the skips were not tested"


def test_a_failing_helper_leaves_its_share_to_the_search():
    parent = os.getpid()

    def failing(i: int):
        if os.getpid() != parent and i > 10:
            raise RuntimeError("helper only")
        return i * i + 1, os.getpid()

    answers, _ = search_plans(2, failing)
    assert answers == search_plans(1)[0]


def test_a_stalled_helper_is_stopped_after_its_patience():
    def stalling(i: int):
        time.sleep(3600)

    start = time.monotonic()
    answers, pids = search_plans(2, stalling, patience=0.5)
    assert answers == search_plans(1)[0] and pids == {os.getpid()}
    assert time.monotonic() - start < 30


def test_a_helper_that_skips_what_the_search_asks_leaves_it_to_the_search():
    answers, _ = search_plans(2, lambda i: SKIP)
    assert answers == search_plans(1)[0]


def test_helpers_are_stopped_on_leaving():
    with Lookahead.start(SHARES, lambda i: time.sleep(3600), 3) as ahead:
        processes = [helper.process for helper in ahead.helpers.values()]
        assert len(processes) == 2 and all(p.is_alive() for p in processes)
    assert not any(p.is_alive() for p in processes)
