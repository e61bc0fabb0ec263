"""One engine holds one sequence: the calls that run or change it take it for their duration (a
generate iterator from its first token to its end), and a call from another thread meanwhile
raises :class:`EngineBusyError` instead of interleaving with it."""
from __future__ import annotations

import contextlib
import functools
import threading


class EngineBusyError(RuntimeError):
    """A call on an engine whose sequence another call holds: one running in another thread,
    or a :meth:`pyimp.engine.Engine.generate` iterator that has not finished."""


class SequenceLock:
    """Who holds an engine's sequence: a thread running a call, or (between the tokens of a
    generate iterator) no thread, with the iterator's thread remembered."""

    def __init__(self):
        self._busy = threading.Lock()        # held by the call (or generate iterator) running
        self.owner: int | None = None        # ident of the thread running it (None: suspended)
        self.suspended_in: int | None = None  # that thread, while a generate iterator waits

    @contextlib.contextmanager
    def hold(self, what: str):
        """Hold the sequence inside (calls nested in one of this thread's are inside it
        already); EngineBusyError, naming ``what``, when another call holds it."""
        if self.owner == threading.get_ident():
            yield
            return
        self.take(what)
        try:
            yield
        finally:
            self.give_back()

    def take(self, what: str) -> None:
        if not self._busy.acquire(blocking=False):
            if self.owner == threading.get_ident():
                raise EngineBusyError(f"Engine.{what}: called from inside another call of this "
                                      f"engine in this thread (a callback)")
            if self.suspended_in == threading.get_ident():
                raise EngineBusyError(f"Engine.{what}: the engine is in use by an unfinished "
                                      f"generate() iterator of this thread: run it to its end "
                                      f"or close() it first")
            raise EngineBusyError(f"Engine.{what}: the engine is in use by another thread (one "
                                  f"engine holds one sequence: give each thread an engine of its "
                                  f"own, or let one call finish before the next starts)")
        self.owner = threading.get_ident()
        self.suspended_in = None

    def give_back(self) -> None:
        self.owner = None
        self.suspended_in = None
        self._busy.release()

    def suspend(self) -> None:
        """A generate iterator yields: it keeps the sequence, and no thread runs it."""
        self.owner, self.suspended_in = None, threading.get_ident()

    def resume(self) -> None:
        self.owner, self.suspended_in = threading.get_ident(), None

    def suspended_here(self) -> bool:
        return self.suspended_in == threading.get_ident()


def exclusive(method):
    """The method holds its engine's sequence (``self._seq``) while it runs."""
    @functools.wraps(method)
    def held(self, *args, **kwargs):
        with self._seq.hold(method.__name__):
            return method(self, *args, **kwargs)
    return held
