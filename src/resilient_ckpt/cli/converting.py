"""``convert``: which conversion a source needs, and the check that comes first.

A conversion makes a new file out of a checkpoint's bytes, and the new file has checksums
of its own (or none): damage carried over is damage nobody can see any more. So the source
is checked first, as ``verify`` checks it: a DCP checkpoint against the sizes and CRC32s its
commit record holds (sizes only where it holds none: a plain ``dcp.save``, whose items the
load then reads back), a memory tier's newest complete step copy by copy, a local
checkpoint by its manifests (its load reads nothing unchecked). A source that fails is
refused with :class:`~resilient_ckpt.errors.VerificationFailedError`, naming what failed;
``ignore_checksums=True`` (the command's ``--ignore-checksums``) converts it anyway and says
so through ``warn``. A ``torch.save`` file records no checksums: only its zip directory is
checked.

A tiered checkpoint's memory tier holds each step's files spread over the rank
directories; its conversion reads the newest step that ``ls`` lists as complete, each data
file from a copy that passed its CRC32, through a directory of links to them (DCP's reader
reads one directory).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

from ..errors import ConfigurationError, CorruptCheckpointError, VerificationFailedError
from ..storage import get_backend
from ..storage.base import is_msc_url
from ..storage.commit import COMMIT_RECORD, RecordCommit
from . import checkpoints, conversion, local_checkpoints, memory_tier

Progress = Callable[[int], None]
Warn = Callable[[str], None]


def convert(
    src: str,
    dst: str,
    progress: Progress | None = None,
    *,
    trusted: bool = False,
    ignore_checksums: bool = False,
    warn: Warn | None = None,
) -> str:
    """Convert ``src`` into ``dst``; returns what was done. ``progress`` gets byte counts of
    the conversion's reads and writes. What is read is loaded safely unless ``trusted`` (a
    local checkpoint only when ``trusted``); a source failing its check is refused unless
    ``ignore_checksums`` (then ``warn`` is told)."""
    if is_msc_url(src) or is_msc_url(dst):
        raise ConfigurationError(
            "convert works on local paths only; for msc:// checkpoints load them with "
            "CachedMetadataFileSystemReader and save where you need"
        )
    if os.path.isdir(src) and checkpoints.is_dcp_dir(src):
        if not RecordCommit(get_backend(src), src).is_committed():
            raise ConfigurationError(f"{src!r} is not committed (no .metadata); nothing to convert")
        _refuse_damage(src, _dcp_problems(src, trusted), ignore_checksums, warn)
        conversion.dcp_to_torch(src, dst, progress, trusted=trusted)
        return "dcp -> torch.save"
    if os.path.isdir(src) and memory_tier.is_memory_root(src):
        return _convert_memory_tier(src, dst, progress, trusted, ignore_checksums, warn)
    from ..local._manifest import parse_name

    if os.path.isfile(src) and parse_name(os.path.basename(src)):
        conversion.save_file(checkpoints.load_file(src, progress, trusted=trusted), dst, progress)
        return "local shard -> torch.save"
    if os.path.isdir(src) and local_checkpoints.is_session_dir(src):
        state = local_checkpoints.load_iteration(src, progress=progress, trusted=trusted)
        conversion.save_file(state, dst, progress)
        return "local checkpoint (newest complete iteration, all ranks) -> torch.save"
    if os.path.isfile(src):
        if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
            raise ConfigurationError(
                f"destination {dst!r} exists and is not an empty directory; a DCP checkpoint "
                "needs a directory of its own"
            )
        problem = checkpoints.torch_file_problem(src)
        if problem is not None:
            raise CorruptCheckpointError(f"{src}: {problem}", path=src)
        conversion.torch_to_dcp(src, dst, progress, trusted=trusted)
        return "torch.save -> dcp"
    if os.path.isdir(src):
        raise checkpoints.not_a_checkpoint(src)
    raise ConfigurationError(f"{src!r} does not exist")


def _dcp_problems(src: str, trusted: bool) -> list[str]:
    """What ``verify`` finds wrong with a committed DCP checkpoint (an unreadable or refused
    commit record is raised as its named error)."""
    from ..async_ckpt.verify import verify_checkpoint

    checkpoints.read_dcp_metadata(src, trusted=trusted)
    try:
        verify_checkpoint(src, trusted=trusted)
    except CorruptCheckpointError as exc:
        lines = str(exc).splitlines()
        return [line.strip() for line in lines[1:]] or lines
    return []


def _refuse_damage(src: str, problems: list[str], ignore: bool, warn: Warn | None) -> None:
    if not problems:
        return
    what = "; ".join(problems)
    if not ignore:
        raise VerificationFailedError(
            f"{src} fails verification ({what}): nothing converted. Pass --ignore-checksums "
            "(ignore_checksums=True) to convert it anyway; the output then holds the damaged "
            "bytes",
            path=src,
        )
    if warn is not None:
        warn(
            f"{src} fails verification ({what}); converting it anyway, as --ignore-checksums "
            "asks: the output holds the damaged bytes"
        )


def _convert_memory_tier(
    src: str,
    dst: str,
    progress: Progress | None,
    trusted: bool,
    ignore_checksums: bool,
    warn: Warn | None,
) -> str:
    step = memory_tier.newest_complete(src, trusted=trusted)
    copies, problems = memory_tier.good_copies(step, checksums=not ignore_checksums)
    _refuse_damage(f"{src} (step {step.step})", problems, ignore_checksums, warn)
    if step.metadata_path is None or set(copies) != set(step.table):
        raise VerificationFailedError(f"{src}: step {step.step} has no copy of some file", path=src)
    with tempfile.TemporaryDirectory(prefix=".resilient_ckpt-convert-") as view:
        os.symlink(os.path.abspath(step.metadata_path), os.path.join(view, COMMIT_RECORD))
        for name, path in copies.items():
            os.symlink(os.path.abspath(path), os.path.join(view, name))
        conversion.dcp_to_torch(view, dst, progress, trusted=trusted)
    return f"memory tier, step {step.step} (the newest complete) -> torch.save"
