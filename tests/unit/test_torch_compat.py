"""Each private torch name the package uses, and the public-API fallback ``_torch_compat``
takes where torch drops it: the fallback gives what the private name gives.

The private names imported here are the reference the fallbacks and the public
replacements are checked against (tests may name them; the library may not, outside
``_torch_compat``).
"""

from __future__ import annotations

import io
import pickle
import traceback
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resilient_ckpt import _rank_errors, _torch_compat

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


def _state() -> dict:
    return {
        "w": torch.arange(300, dtype=torch.float32).reshape(10, 30),
        "b": torch.ones(7, dtype=torch.bfloat16),
        "view": torch.arange(100.0)[10:30],
        "nested": {"m": torch.full((5,), 2.0), "lst": [torch.zeros(3, dtype=torch.int64), 4]},
        "step": 7,
        "name": "model",
    }


# -- state dict values ------------------------------------------------------------------------


def test_flattened_state_dict_is_torch_flattening() -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from resilient_ckpt.async_ckpt._planning import _flattened

    state = _state()
    flat = _flattened(state)
    expected, _ = flatten_state_dict(state)
    assert list(flat) == list(expected)
    assert all(flat[k] is expected[k] for k in expected)


def test_item_sizes_use_public_itemsize() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.complex64, torch.bool, torch.int8):
        assert dtype.itemsize == torch._utils._element_size(dtype)


# -- failures -----------------------------------------------------------------------------


def _failed() -> BaseException:
    try:
        raise RuntimeError("disk on fire")
    except RuntimeError as exc:
        return exc


def test_failure_pairs_match_torch() -> None:
    from torch.distributed.checkpoint.api import _is_wrapped_exception, _wrap_exception

    exc = _failed()
    ours, theirs = _rank_errors._wrap_exception(exc), _wrap_exception(exc)
    assert ours[0] is theirs[0]
    assert [(f.filename, f.lineno, f.name) for f in ours[1]] == [
        (f.filename, f.lineno, f.name) for f in theirs[1]
    ]
    pickle.dumps(ours)
    samples = [ours, theirs, (exc, []), (exc,), [exc, traceback.StackSummary()], None, (1, 2)]
    assert [_rank_errors.is_wrapped_failure(s) for s in samples] == [
        _is_wrapped_exception(s) for s in samples
    ]


# -- the command line's whole-checkpoint load -------------------------------------------------


def test_cli_load_dcp_matches_torch_dcp_to_torch_save(tmp_path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from resilient_ckpt.cli.conversion import load_dcp

    state = _state()
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), **_torch_compat.no_dist_kwargs(dcp.save))
    dcp_to_torch_save(str(tmp_path / "ckpt"), str(tmp_path / "ref.pt"))
    expected = torch.load(str(tmp_path / "ref.pt"), weights_only=False)
    seen: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the single-process load warns no one
        loaded = load_dcp(str(tmp_path / "ckpt"), seen.append)
    assert sum(seen) > 0
    buffer_a, buffer_b = io.BytesIO(), io.BytesIO()
    torch.save(loaded, buffer_a)
    torch.save(expected, buffer_b)
    assert buffer_a.getvalue() == buffer_b.getvalue()
