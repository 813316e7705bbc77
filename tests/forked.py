"""Run a test's action in a forked child as another user: a real non-root client, not a mocked policy."""
import os
import signal
import traceback
from collections.abc import Callable

import pytest

from harness import require_marker

NOBODY = 65534


def become(uid: int = NOBODY, groups: list[int] | tuple = ()) -> None:
    """This (forked) process becomes ``uid``, its gid the same number, with exactly ``groups`` as its supplementary
    groups: an ordinary user, as far as SO_PEERCRED and the socket's mode can tell."""
    os.setgroups(list(groups))
    os.setgid(uid)
    os.setuid(uid)


def as_user(action, groups: list[int] | None = ()) -> str:
    """Run ``action()`` in a forked child that is uid/gid 65534 with exactly ``groups`` as its supplementary groups
    (None: the child stays root). Returns what it returned (as a str), or "<ExceptionName>: <text>" for what it
    raised. Torch's thread pool does not survive a fork: gathers run in the child, never before it in the parent."""
    require_marker("root", "runs a process as another uid")
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another uid")

    return in_child(action, before=None if groups is None else lambda: become(NOBODY, groups))


def in_child(action: Callable[[], object], before: Callable[[], None] | None = None) -> str:
    """``action()`` in a forked child, after ``before()`` there: what it returned (as a str), "<ExceptionName>:
    <text>" for what it raised, or "killed by SIGBUS" and the like."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            try:
                if before is not None:
                    before()
                said = str(action())
            except Exception as err:  # the test reports whatever escaped
                said = f"{type(err).__name__}: {err}"
            except BaseException:
                said = traceback.format_exc()
            os.write(w, said.encode())
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        said = f.read()
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return said
