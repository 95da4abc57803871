"""Write ``torch-<version>.metadata``: the ``.metadata`` of a small checkpoint saved by
``torch.distributed.checkpoint.save`` of the torch this runs with.

These files let ``tests/unit/test_restricted_pickle.py`` check that the restricted unpickler
reads what every supported torch release writes (2.4 to 2.13), with only the torch the
tests run. The state holds what changes the pickle: tensors of several dtypes (bfloat16
among them), a channels_last tensor, a nested dict, non-tensor values. Only ``.metadata``
is kept (a few KiB); the data files are not needed. Run it once per torch release, each in
its own virtual environment, from anywhere::

    python3 -m venv /tmp/venv-t24
    /tmp/venv-t24/bin/pip install torch==2.4.1 numpy
    /tmp/venv-t24/bin/python tests/unit/data/dcp_metadata/make.py

It needs torch only (not this package), and overwrites the file of its release.
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp

HERE = os.path.dirname(os.path.abspath(__file__))


def state() -> dict:
    torch.manual_seed(0)
    return {
        "weight": torch.randn(4, 3),
        "bf16": torch.randn(2, 5).to(torch.bfloat16),
        "half": torch.zeros(3, dtype=torch.float16),
        "ints": torch.arange(6, dtype=torch.int64),
        "mask": torch.tensor([True, False]),
        "conv": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "optim": {"step": 12, "state": {"exp_avg": torch.ones(4, 3)}, "lr": 0.5},
        "name": "fixture",
    }


def main() -> None:
    release = torch.__version__.split("+")[0]
    work = tempfile.mkdtemp()
    try:
        # A relative checkpoint id, so the file does not record this machine's paths.
        os.chdir(work)
        # torch 2.4 and 2.5 have no no_dist: without a process group they save alone anyway.
        no_dist = "no_dist" in inspect.signature(dcp.save).parameters
        kwargs = {"no_dist": True} if no_dist else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state(), checkpoint_id="ckpt", **kwargs)
        target = os.path.join(HERE, f"torch-{release}.metadata")
        shutil.copyfile(os.path.join(work, "ckpt", ".metadata"), target)
        print(f"wrote {target} ({os.path.getsize(target)} bytes)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
