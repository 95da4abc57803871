"""Who this process is in the job: its rank and the job's size, from the default group.

One answer everywhere, so a log line, a file name and an error never disagree about who "I"
am: rank 0 of a world of 1 without a process group. :mod:`._dist` hands these out with the
library's collectives; they live here, below it, because the rank prefix of every log line
(:mod:`._logging`) needs them and ``_dist`` itself logs.
"""

from __future__ import annotations

import torch.distributed as dist


def has_process_group() -> bool:
    """True once the default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def is_distributed() -> bool:
    """True when a default process group with more than one rank exists."""
    return has_process_group() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank in the default group; 0 without a process group."""
    return dist.get_rank() if has_process_group() else 0


def world_size() -> int:
    """Ranks in the default group; 1 without a process group."""
    return dist.get_world_size() if has_process_group() else 1
