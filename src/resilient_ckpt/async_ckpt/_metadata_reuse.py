"""Publishing a prepared ``.metadata`` instead of rebuilding it (NVRx's metadata reuse).

A job whose checkpoint structure does not change can keep the complete metadata of one save
(``save_state_dict_async_finalize(..., create_metadata_path=...)`` returns it and stores it)
and hand it to later finalizes (``reuse_metadata_obj=``), which publish it as the commit
record. That is only correct while every item still lands at the byte range the prepared
metadata records. Tensors are stored raw, so their ranges depend only on shape and dtype;
a non-tensor item is pickled and its length can change with its value (an optimizer's
integer ``step`` growing past a pickle size band), shifting it and every item after it in
its file. Publishing stale metadata would make a later load read the wrong bytes.

Decision: every rank compares the write results of this save with the prepared metadata
(:func:`find_layout_mismatch`, local, both directions) and the finalize's one cross-rank
exchange carries the verdict; a mismatch on any rank fails the save on every rank, naming
the item, and no ``.metadata`` is written. Alternatives: trusting the caller (NVRx's first
version: silent corruption on drift), or rebuilding the metadata every time (the cost the
reuse avoids).
"""

from __future__ import annotations

import pickle
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper

from ..errors import CheckpointingException, ConfigurationError
from ..storage.commit import write_atomically


class StaleMetadataError(CheckpointingException):
    """The prepared metadata no longer describes the bytes this save wrote."""


def find_layout_mismatch(
    write_results: list[WriteResult], prepared: Metadata
) -> tuple[str, str] | None:
    """``(fqn, detail)`` of the first difference between what this rank wrote and the
    prepared metadata, or None when this rank's part of the layout matches.

    Forward: every written item must be in the prepared metadata at the same
    ``(relative_path, offset, length)``. Reverse: every item the prepared metadata places
    in a file this rank wrote must have been written now (an item removed at the end of a
    file, or moved to another rank, shifts nothing this rank wrote). Items in files of
    other ranks are theirs to check.
    """
    expected_by_index = prepared.storage_data or {}
    written = set()
    own_files = set()
    for result in write_results:
        actual = result.storage_data
        written.add(result.index)
        own_files.add(actual.relative_path)
        expected = expected_by_index.get(result.index)
        if expected is None:
            return str(result.index.fqn), (
                "written by this save but absent from the prepared metadata (the checkpoint "
                "structure changed)"
            )
        want = (expected.relative_path, expected.offset, expected.length)
        got = (actual.relative_path, actual.offset, actual.length)
        if want != got:
            return str(result.index.fqn), (
                f"prepared (file, offset, length) = {want}, written = {got}: a non-tensor "
                "item's pickled size changed, or an item before it in the file did"
            )
    for index, info in expected_by_index.items():
        if info.relative_path in own_files and index not in written:
            return str(index.fqn), (
                f"in the prepared metadata at {info.relative_path} (offset {info.offset}, "
                f"length {info.length}) but not written by this save (removed or moved to "
                "another rank)"
            )
    return None


def check_reuse_arguments(reuse_metadata_obj: Any, create_metadata_path: Any) -> None:
    if reuse_metadata_obj is not None and create_metadata_path is not None:
        raise ConfigurationError(
            "save_state_dict_async_finalize: reuse_metadata_obj and create_metadata_path "
            "exclude each other (creating needs the full metadata that reuse skips)"
        )
    if reuse_metadata_obj is not None and not isinstance(reuse_metadata_obj, Metadata):
        raise ConfigurationError(
            "reuse_metadata_obj must be the torch.distributed.checkpoint Metadata of an "
            f"earlier save, got {type(reuse_metadata_obj).__name__}"
        )


def stale_error(rank: int, mismatch: tuple[str, str]) -> StaleMetadataError:
    fqn, detail = mismatch
    return StaleMetadataError(
        f"rank {rank}: the prepared metadata is stale for item {fqn!r}: {detail}. "
        "Nothing was committed; create the metadata again (create_metadata_path) or "
        "finalize without reuse_metadata_obj"
    )


def share_created_metadata(writer: Any, dist_wrapper: _DistWrapper, path: str) -> Metadata:
    """After a full finalize: the complete metadata, read back by the coordinator, given
    to every rank, and stored at ``path`` (atomically) for later jobs."""
    metadata = writer.read_metadata() if dist_wrapper.is_coordinator else None
    metadata = dist_wrapper.broadcast_object(metadata)
    if dist_wrapper.is_coordinator:
        write_atomically(path, lambda f: pickle.dump(metadata, f))
    return metadata
