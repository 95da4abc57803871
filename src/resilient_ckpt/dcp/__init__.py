"""PyTorch-native face: torch's own checkpoint protocols, on this package's engine.

Most PyTorch-native trainers (torchtitan, Lightning's distributed async checkpoint IO) call
``torch.distributed.checkpoint.async_save`` and pass torch's stagers and writers; they never
call NVRx's API. This package meets them at torch's protocols instead of asking them to
adopt ours:

* :func:`async_save` / :func:`save`: torch's signatures and return types, run by the async
  core (persistent worker, reused staging arenas, plan cache, checksums, verified commit).
  A trainer switches by one import.
* :class:`Stager`: torch's ``AsyncStager``, for torch's own ``dcp.async_save`` (thread or
  process executor): snapshots into reused shared memory that crosses the process
  executor's pipe as a handle, not a copy.
* :class:`FileSystemWriter`: a ``StorageWriter`` for torch's ``dcp.save`` and
  ``dcp.async_save`` that writes this package's files: CRC-32s in the commit record,
  fsync, ``.metadata`` last and atomic.

Decision: the module stands in for ``torch.distributed.checkpoint`` as a whole, so the switch
is one line, ``import resilient_ckpt.dcp as dcp``: every name it does not define (``load``,
``FileSystemReader``, the planners...) is torch's own, looked up there on use.

Decision: a face of its own on the async core's public API (``AsyncCallsQueue``,
``save_state_dict_async_plan`` / ``finalize``, ``FileSystemWriterAsync``), not a mode of the
core: torch's protocols change with torch releases, and the core stays NVRx's contract.
"""

from typing import Any

from ._saver import async_save, close, save
from ._stager import Stager
from ._writer import FileSystemWriter

__all__ = ["FileSystemWriter", "Stager", "async_save", "close", "save"]


def __getattr__(name: str) -> Any:
    """torch's ``torch.distributed.checkpoint`` for every name this module does not define."""
    import torch.distributed.checkpoint as torch_dcp

    try:
        return getattr(torch_dcp, name)
    except AttributeError:
        raise AttributeError(
            f"neither resilient_ckpt.dcp nor torch.distributed.checkpoint has {name!r}"
        ) from None
