"""What the command-line tool trusts: nothing in a checkpoint, unless the user says so.

The tool is pointed at files of any origin (a download, a shared bucket), and unpickling a
file runs whatever globals it names. So by default every pickle it reads is loaded safely:

* our and DCP's own pickles (a DCP ``.metadata``, a memory tier's commit record) through
  :mod:`resilient_ckpt._restricted_pickle`, which allows exactly the classes those files
  hold;
* user state (a ``torch.save`` file, a DCP checkpoint's non-tensor items) with
  ``torch.load(weights_only=True)``: tensors, containers and plain values, and the classes
  the user allowed with ``torch.serialization.add_safe_globals``;
* a local checkpoint's state in the managers' safe mode (``weights_only=True``: plain
  values, the format's own classes, the globals marked safe; see
  :mod:`.local_checkpoints`). Verifying one needs no unpickling (its checksums are checked
  on the bytes).

``--trust`` (``trusted=True`` in Python) unpickles in full, as ``torch.load(weights_only=
False)`` does. Both are the library's loads (their ``trusted`` flag); the command's own
are the wording of ``--trust`` and the advice to pass it. Every failure becomes a named
error carrying the file and what is wrong with it:
:class:`~resilient_ckpt.errors.UnsafeCheckpointError` for a refused global (named, with how
to allow it), :class:`~resilient_ckpt.errors.CorruptCheckpointError` for a file that is
empty, cut short, garbage or of the wrong kind. The command prints those as one line.
"""

from __future__ import annotations

from typing import IO, Any

from .. import _restricted_pickle

TRUST_HELP = (
    "unpickle the checkpoint's files in full (torch.load(weights_only=False)): a file can "
    "then run any code on this machine, with your rights. Only for files whose origin you "
    "trust; without it, files are loaded safely (tensors, containers, plain values)"
)


def torch_load(f: IO[bytes], *, path: str, trusted: bool) -> Any:
    """``torch.load`` of ``f`` onto the CPU, safely unless ``trusted``: the package's one
    safe load (:func:`resilient_ckpt._restricted_pickle.torch_load`), whose refusals tell the
    command's user about ``--trust``."""
    return _restricted_pickle.torch_load(
        f,
        path=path,
        trusted=trusted,
        trust_advice="pass --trust (trusted=True in Python)",
        map_location="cpu",
    )
