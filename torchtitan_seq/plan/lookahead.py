"""Answers worked out ahead of a search in forked processes: how the planner uses more than one core.

A search asks questions 0, 1, 2, ... in order, skips some and stops where it likes; each answer is
a pure function of the question and of earlier answers within the question's share (the planner:
a candidate configuration, its schedule shape's share). A helper process, forked with the
search's state, takes one share, works through it in order as fast as it can (skipping what
``work`` says the search skips) and sends each answer as it has it. The search takes the answers
of a helper's share from it, waiting where the helper is behind, and works out its own share
itself. They are the answers the search would have worked out, so its result is the one it gives
in one process.

Nothing waits for ever: a helper that fails, or sends nothing for ``patience`` seconds, is stopped
and the search works out the rest of its share itself (and so raises what the work raises).
Helpers are stopped when the search ends, wherever they are.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["SKIP", "Lookahead", "available_processes"]

SKIP = object()
"""What a helper's ``work`` returns for a question the search will skip (nothing is sent)."""

_MISSING = object()
"""No answer from a helper (skipped, failed or stopped): the search works it out itself."""


def available_processes() -> int:
    """CPUs this process may run on, where processes can be forked (else 1: Windows, and macOS,
    where forking a process that loaded torch is not safe)."""
    if os.name != "posix" or "fork" not in multiprocessing.get_all_start_methods() or os.uname().sysname == "Darwin":
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class _Helper:
    """One forked helper and the answers it sent that the search has not taken yet."""

    def __init__(self, process: BaseProcess, conn: Connection, patience: float) -> None:
        self.process, self.conn, self.patience = process, conn, patience
        self.answers: dict[int, Any] = {}
        self.last = -1
        """The latest question it answered (it answers in order)."""
        self.alive = True

    def take(self, i: int) -> Any:
        """Its answer to question ``i`` (_MISSING where it skipped ``i``, failed or was stopped)."""
        while self.alive and self.last < i:
            try:
                message = self.conn.recv() if self.conn.poll(self.patience) else ("stalled",)
            except (EOFError, OSError):
                message = ("failed",)
            if message[0] == "answer":
                _, j, answer = message
                self.last, self.answers[j] = j, answer
            else:  # done, failed or stalled: the search works the rest of the share out itself
                self.stop()
        return self.answers.pop(i, _MISSING)

    def stop(self) -> None:
        if self.alive:
            self.alive = False
            self.process.kill()
            self.process.join()
            self.conn.close()


def _serve(questions: Sequence[int], work: Callable[[int], Any], conn: Connection) -> None:
    """A helper's life: ``work`` on its share in order, each answer sent as soon as it is known."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the search's to handle: it stops its helpers
    try:
        for i in questions:
            if (answer := work(i)) is not SKIP:
                conn.send(("answer", i, answer))
        conn.send(("done",))
    except Exception:  # the search works the question out itself, and raises what it raises
        conn.send(("failed",))


class Lookahead:
    """Helpers for the shares of a search's questions; see the module docstring."""

    def __init__(self, shares: Sequence[int], helpers: dict[int, _Helper]) -> None:
        self.shares, self.helpers = shares, helpers

    @classmethod
    @contextlib.contextmanager
    def start(
        cls, shares: Sequence[int], work: Callable[[int], Any], processes: int, patience: float = 30.0
    ) -> Iterator[Lookahead]:
        """Fork a helper for each share 1 .. processes - 1 (``shares[i]``: the share of question i;
        share 0 is the caller's) running ``work`` (question -> answer, or :data:`SKIP`) from the state
        at the fork; stop them on leaving. With ``processes`` 1, none: every answer is the caller's."""
        context = multiprocessing.get_context("fork") if processes > 1 else None
        helpers: dict[int, _Helper] = {}
        try:
            for share in range(1, processes):
                receive, send = context.Pipe(duplex=False)
                questions = [i for i, s in enumerate(shares) if s == share]
                process = context.Process(target=_serve, args=(questions, work, send), daemon=True)
                process.start()
                send.close()  # the helper's end: once it exits, recv() ends instead of waiting
                helpers[share] = _Helper(process, receive, patience)
            yield cls(shares, helpers)
        finally:
            for helper in helpers.values():
                helper.stop()

    def answer(self, i: int, work: Callable[[int], Any]) -> Any:
        """The answer to question ``i``: its helper's, else ``work(i)`` here."""
        helper = self.helpers.get(self.shares[i])
        answer = _MISSING if helper is None else helper.take(i)
        return work(i) if answer is _MISSING else answer

    @property
    def forked(self) -> bool:
        """Whether helpers were forked (some of the answers may be theirs)."""
        return bool(self.helpers)
