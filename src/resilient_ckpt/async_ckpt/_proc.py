"""Process hygiene shared by the background workers: parent-death handling and QoS.

A worker must never outlive its trainer. Two mechanisms, because each has a gap:
``PR_SET_PDEATHSIG`` delivers SIGKILL the moment the parent dies (but is tied to the
parent *thread* that started the child), and a watchdog thread compares ``getppid()``
with the pid recorded at start (catching the race where the parent died before the
signal was armed).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

from .._logging import get_logger

logger = get_logger(__name__)

_PR_SET_PDEATHSIG = 1


def arm_parent_death_signal(parent_pid: int) -> None:
    """Kill this process when its parent dies; exit now if the parent is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watchdog alone has to do
        pass
    if os.getppid() != parent_pid:
        os._exit(70)


def start_parent_watchdog(parent_pid: int, interval: float = 0.5) -> threading.Thread:
    """A daemon thread that exits the process once ``parent_pid`` is no longer its parent."""

    def _watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(71)
            time.sleep(interval)

    thread = threading.Thread(target=_watch, name="resilient_ckpt-parent-watchdog", daemon=True)
    thread.start()
    return thread


def set_qos(cpu_priority: int | None, io_priority: int | None) -> None:
    """Lower this process's CPU and I/O priority; never fatal.

    ``cpu_priority`` (a nice value) also moves the process to ``SCHED_BATCH``, inherited by
    the threads it starts afterwards. A worker is woken by every request the trainer sends;
    under the default policy the woken worker may preempt the trainer on its own core while
    the trainer is still inside its save call (seen on a machine with fewer cores than
    processes as 1-3 ms more stall per save at 2000 tensors). A batch process is never
    favoured at wake-up: it runs on an idle core, or after the trainer yields. Its
    throughput is unchanged.
    """
    if cpu_priority is not None and 0 <= cpu_priority <= 19:
        _batch_scheduling()
        try:
            current = os.nice(0)
            if cpu_priority > current:
                os.nice(cpu_priority - current)
        except OSError as exc:
            logger.warning("could not set nice %s: %s", cpu_priority, exc)
    if io_priority is not None:
        try:
            import psutil

            psutil.Process().ionice(int(io_priority))
        except (OSError, ValueError, ImportError, AttributeError) as exc:
            logger.warning("could not set ionice class %s: %s", io_priority, exc)


def _batch_scheduling() -> None:
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:  # not Linux
        return
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as exc:
        logger.warning("could not set the SCHED_BATCH policy: %s", exc)
