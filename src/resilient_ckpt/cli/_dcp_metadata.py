"""A DCP checkpoint's commit record, read safely: the one thing both the catalogue
(:mod:`.checkpoints`) and the conversions (:mod:`.conversion`) need from each other.

Kept below both so that imports run one way (``checkpoints`` -> ``conversion`` -> here):
the catalogue converts and verifies by loading, a conversion starts from the metadata.
"""

from __future__ import annotations

from typing import Any

from .. import _restricted_pickle
from ..storage import get_backend
from ..storage.commit import RecordCommit


def read_dcp_metadata(path: str, *, trusted: bool = False) -> Any:
    """The unpickled ``.metadata`` of the DCP checkpoint at ``path`` (any backend), read by
    the restricted unpickler unless ``trusted``; a damaged or refused file is a named error."""
    from torch.distributed.checkpoint.metadata import Metadata

    backend = get_backend(path)
    record = RecordCommit(backend, path).record_path
    with backend.open_read(record) as f:
        return _restricted_pickle.load(f, path=record, expect=Metadata, trusted=trusted)
