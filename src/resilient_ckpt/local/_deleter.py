"""Deleting old checkpoint files off the critical path.

Unlinking a large file is not free (a file system mounted with ``discard``, common for SSDs
and virtual disks, trims the freed blocks synchronously), and retention deletes a whole
iteration after every save. So a file is first *renamed* to ``.deleting-<name>`` (atomic;
readers ignore hidden names, so none sees a half-deleted iteration), then unlinked by one
daemon thread per process. Hidden files left by a dead process are handed to the thread by
the next scan of the directory.
"""

from __future__ import annotations

import os
import queue
import threading

from .._logging import get_logger

logger = get_logger(__name__)

PREFIX = ".deleting-"

_queue: queue.Queue[str] = queue.Queue()
_thread: threading.Thread | None = None
_lock = threading.Lock()


def _run() -> None:
    while True:
        path = _queue.get()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not delete %s: %s", path, exc)
        finally:
            _queue.task_done()


def _start() -> None:
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="resilient_ckpt-deleter", daemon=True)
            _thread.start()


def unlink_later(path: str) -> None:
    """Unlink ``path`` (already hidden) in the background."""
    _start()
    _queue.put(path)


def delete(path: str) -> None:
    """Hide ``path`` now (rename), unlink it in the background. Absent is fine."""
    head, tail = os.path.split(path)
    hidden = os.path.join(head, PREFIX + tail)
    try:
        os.replace(path, hidden)
    except FileNotFoundError:
        return
    unlink_later(hidden)


def wait_idle() -> None:
    """Block until every queued deletion is done (tests and benchmarks)."""
    _queue.join()
