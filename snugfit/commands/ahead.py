"""Work started ahead in a second process: `snugfit plan` traces and searches the compiled blocks on the machine's
second core while this one searches the eager ones (plan.compile_choice)."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any


def in_second_process(work: Callable[[], Any]) -> Callable[[], Any]:
    """Start `work` in a forked child and return what waits for its result (pickled back through a pipe). The
    wait gives None wherever it could not be had (no fork, one core, the child failed): the caller then does the
    work itself, as without it. The child shares the parent's files, so what it caches (profiles) is there too."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS
    if not hasattr(os, "fork") or cores < 2:
        return lambda: None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its result is its only output, and it leaves without the parent's exit handlers
        code = 1
        try:
            os.close(read)
            with os.fdopen(write, "wb") as out:
                pickle.dump(work(), out)
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    done: list = []

    def wait() -> Any:
        if not done:
            with os.fdopen(read, "rb") as got:
                data = got.read()  # before waiting: a result larger than the pipe holds blocks the child until read
            _, status = os.waitpid(pid, 0)
            try:
                done.append(pickle.loads(data) if status == 0 else None)
            except Exception:  # noqa: BLE001 - an unreadable result is none: the caller does the work
                done.append(None)
        return done[0]
    return wait
