"""Run a test's action in a forked child as another user: a real non-root client, not a mocked policy."""
import os
import traceback

import pytest

from harness import require_marker

NOBODY = 65534


def as_user(action, groups: list[int] | None = ()) -> str:
    """Run ``action()`` in a forked child that is uid/gid 65534 with exactly ``groups`` as its supplementary groups
    (None: the child stays root). Returns what it returned (as a str), or "<ExceptionName>: <text>" for what it
    raised. Torch's thread pool does not survive a fork: gathers run in the child, never before it in the parent."""
    require_marker("root", "runs a process as another uid")
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another uid")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            if groups is not None:
                os.setgroups(list(groups))
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            try:
                said = str(action())
            except Exception as err:  # the test reports whatever escaped
                said = f"{type(err).__name__}: {err}"
            except BaseException:
                said = traceback.format_exc()
            os.write(w, said.encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return f.read()
