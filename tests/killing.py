"""Kill a writer at its n-th file-system step: the harness of the "any kill leaves the previous or
the new checkpoint" tests (tests/test_train_manifest.py, tests/test_train_loop.py).

``run_killed_at(step, action)`` forks; the child counts every call that changes the file system
or flushes it (``os.open``, ``os.mkdir``, ``os.fsync``, ``os.replace``, ``os.link``,
``os.symlink``, ``os.unlink``, ``os.rmdir``, ``os.chmod``, ...) and dies with ``os._exit`` just
before call number ``step``: no exception handler, no ``finally``, no cleanup runs, as when the
process is killed. The parent then looks at what is on disk.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable

KILLED = 17  # the child's exit code when it was killed at the chosen step
WRITE_CALLS = (
    "open",
    "mkdir",
    "makedirs",
    "fsync",
    "replace",
    "rename",
    "link",
    "symlink",
    "unlink",
    "remove",
    "rmdir",
    "chmod",
    "write",
    "truncate",
    "ftruncate",
)


def run_killed_at(step: int, action: Callable[[], object]) -> int:
    """Run ``action`` in a forked child killed before its ``step``-th write call (1-based).

    Returns ``KILLED`` if it was killed, 0 if ``action`` finished first, 1 if it raised.
    """
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test runner
        code = 1
        try:
            count = [0]

            def wrap(call: Callable) -> Callable:
                def counted(*args: object, **kwargs: object) -> object:
                    count[0] += 1
                    if count[0] == step:
                        os._exit(KILLED)
                    return call(*args, **kwargs)

                return counted

            for name in WRITE_CALLS:
                setattr(os, name, wrap(getattr(os, name)))
            action()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
