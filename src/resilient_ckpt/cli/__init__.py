"""``resilient-ckpt``: list, verify, inspect and convert checkpoints; run the demo and benchmarks.

Every verb prints a table for people and, with ``--json`` (before or after the verb), one
JSON document on stdout for programs. Long work (``verify``, ``ls --verify``, ``convert``)
shows a progress bar on stderr when stderr is a terminal (``--no-progress`` hides it; it is
never shown with ``--json``). Exit status: 0 on success, 1 when a checkpoint fails
verification or a run fails, 2 when a file cannot be read at all (empty, cut short, garbage,
of the wrong kind, refused as unsafe) or on bad usage; errors are one line naming the file,
``--debug`` adds the traceback. Nothing read runs code from a checkpoint: pickles are loaded
safely (DCP metadata by an allow-list, user state with ``weights_only=True``, local
checkpoints' state not at all) unless ``--trust`` says the files' origin is trusted (see
``_trust``). The verbs work on DCP checkpoint directories
(ours and plain ``dcp.save`` ones), local per-rank checkpoints (``LocalCheckpointManager``'s
root or a session directory), the memory tier of a tiered checkpoint (its durable tier is
plain DCP; ``ls`` and ``verify`` take both roots at once) and ``torch.save`` files.

The package is a face of the library (nothing in the library imports it):

* ``command``: argument parsing and the verbs; ``main`` is the console script.
* ``checkpoints``: what a checkpoint on disk is (DCP directory, local checkpoint session,
  ``torch.save`` file), found, verified, inspected and converted through the storage backend
  of its path; ``local_checkpoints`` and ``memory_tier`` hold the local-checkpoint and
  tiered-memory halves of that.
* ``conversion``: format conversions that report bytes as they move.
* ``bench`` and ``bench_plot``: running the benchmarks and drawing their figures.
"""

from .command import build_parser, main

__all__ = ["build_parser", "main"]
