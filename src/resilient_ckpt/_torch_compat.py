"""Every torch name the package uses that torch does not promise to keep, and what differs
between the torch releases it supports (2.4.1, 2.5.1, 2.11, 2.13).

Decision: the rest of the package uses public torch API only. A private name is reached here,
through a small function, with a fallback on public API that is correct where the name is
gone, if slower or less informed; ``tests/unit/test_torch_compat.py`` makes each name
disappear to test its fallback. The private name stays first where it exists rather than a
vendored copy, because a copy would freeze behaviour torch changes on purpose (a DCP file's
byte layout, the names its metadata pickles). Each is looked up once by a
``functools.cache``d loader (tests call ``__wrapped__`` to look again), on first use: the
background worker imports this module and must not pay for DCP or DTensor unless it uses them.

The private names, what each is for, the releases tested and the fallback:

``torch.distributed.checkpoint.filesystem._write_item`` (:func:`write_item`)
    Serialises one DCP item exactly as ``FileSystemWriter`` does, so our files are
    byte-identical to torch's; adapts to its 4, 5 or 6 parameters. Tested: 2.13. Fallback:
    the same steps in public calls (stream transforms, ``torch.save``, a ``WriteResult``).
``torch.distributed.checkpoint.filesystem._StorageInfo`` (:func:`storage_info`)
    An item's (path, offset, length) as DCP metadata pickles it; used by the ``_write_item``
    fallback. Tested: 2.13. Fallback: a dataclass of the same fields (readers use attributes).
``torch.distributed.checkpoint.filesystem._StoragePrefix`` (:func:`storage_prefix`,
:func:`prefix_of`)
    A save plan's ``storage_data`` naming a rank's file prefix, as the inherited
    ``prepare_global_plan`` sets it. Tested: 2.13. Fallback: a dataclass with ``prefix``; any
    value carrying a ``prefix`` string is accepted.
``torch.storage._dtype_to_storage_type_map`` (:func:`storage_type_dtypes`)
    The legacy storage names (``"FloatStorage"``) ``torch.save`` pickles per dtype, read by
    the archive reader of :mod:`~resilient_ckpt.async_ckpt.cached_metadata_filesystem_reader`.
    Tested: 2.13. Fallback: the table written out (torch froze it).
``torch._utils._rebuild_tensor_v2`` (:data:`REBUILD_TENSOR`)
    The call a ``torch.save`` pickle makes per tensor, recognised by name by that archive
    reader. Tested: 2.13. Fallback: a pickle naming anything else is left to torch's
    ``FileSystemReader``.
``torch.distributed._shard.sharded_tensor.ShardedTensor`` (:func:`is_sharded_tensor`)
    Recognises the deprecated type in a state dict; no public path exports it. Tested: 2.13.
    Fallback: nothing is one (a torch without the class cannot make one).
``torch._utils._sparse_tensors_to_validate``, ``torch._utils._validate_loaded_sparse_tensors``
(:func:`pending_sparse_tensors`, :func:`validate_loaded_sparse_tensors`)
    What ``torch.load`` does after unpickling, done after unpickling a staged request: sparse
    rebuilds queue on that process-wide list. Tested: 2.13. Fallback: nothing is queued.
``torch._C._cuda_hasPrimaryContext`` (:func:`cuda_devices_with_context`)
    Which CUDA devices already have a context, without creating one. Tested: 2.13 (CPU builds
    lack it: CI runs the fallback, and the private branch with a stand-in). Fallback: the
    current device only; a copy from another device then waits for that whole device.
``torch.serialization._get_layout``, ``torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING``
(:func:`dcp_metadata_globals`)
    Names a DCP ``.metadata`` pickle asks for besides the public classes (a ``torch.layout``,
    a memory format); :mod:`resilient_ckpt._restricted_pickle` allows exactly these. Tested:
    2.4.1 to 2.13 (files written by each, ``tests/unit/test_restricted_pickle.py``). Fallback:
    a name this torch lacks is not allowed, so a file naming it is refused with a named error.
``DTensor._spec`` (:func:`dtensor_specs`)
    A DTensor's mesh, placements, global shape, stride and dtype in one object, read by the
    structure key of :mod:`resilient_ckpt.async_ckpt._structure` at every save. Tested: 2.13.
    Fallback: the same fields through the public attributes, each a Python-level property.
``torch._C._dynamo.guards.TensorGuards`` (:func:`tensor_guard`)
    ``torch.compile``'s check of its input tensors, in C++: Python type, dispatch keys (which
    hold the device, the layout and the conjugate and negative bits), dtype, device index,
    ``requires_grad``, sizes and strides. The structure check of
    :mod:`resilient_ckpt.async_ckpt._structure` runs it on every tensor at every steady save.
    Used only after a probe at first use shows it tells each of those fields apart; always
    built with both keyword arguments, which its constructor reads unchecked. Tested: 2.13.
    Fallback: None, and the caller reads the same fields from Python.
``DefaultStager._config`` (:func:`default_stager_is_async`)
    Whether a ``torch.distributed.checkpoint.staging.DefaultStager`` stages in the
    background (its ``StagingOptions.use_async_staging``, which decides whether torch's
    ``dcp.async_save`` answers with an ``AsyncSaveResponse``): ``resilient_ckpt.dcp.async_save``
    answers as torch would for the same stager. Tested: 2.13. Fallback: whether it has a
    staging executor (``_staging_executor``), else False (a plain ``Future`` is returned).
``DTensor(local, DTensor._spec, requires_grad=False)`` (:func:`dtensor_around`)
    A DTensor of the same mesh, placements, shape and stride around a staged local shard, the
    shard left where it is (host memory): ``DTensor.from_local`` would move a host shard to
    a CUDA mesh's device, undoing the staging. Used by ``resilient_ckpt.dcp.Stager``. Tested:
    2.13 (CPU meshes; the fallback gives the same DTensor there). Fallback:
    ``DTensor.from_local(..., run_check=False, shape=, stride=)``.
``torch.distributed._tensor`` (``DTensor``, ``Replicate``, ``Shard``, ``distribute_tensor``)
    Torch 2.4's home of DTensor; the public ``torch.distributed.tensor`` is used from 2.5 on.
    Tested: 2.13, which takes the public path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import operator
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import WriteItem
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

__all__ = [
    "DTensor",
    "Replicate",
    "REBUILD_TENSOR",
    "Shard",
    "cuda_devices_with_context",
    "default_stager_is_async",
    "distribute_tensor",
    "dtensor_around",
    "extra_safe_globals",
    "has_stream_transforms",
    "dtensor_specs",
    "is_sharded_tensor",
    "loaded_dtensor",
    "no_dist_kwargs",
    "pending_sparse_tensors",
    "prefix_of",
    "storage_info",
    "storage_prefix",
    "storage_type_dtypes",
    "tensor_guard",
    "unsafe_globals_in",
    "user_safe_globals",
    "validate_loaded_sparse_tensors",
    "write_item",
]


def __getattr__(name: str) -> Any:
    if name not in ("DTensor", "Replicate", "Shard", "distribute_tensor"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    except ImportError:  # torch < 2.5: the same classes under their private module
        from torch.distributed._tensor import (  # type: ignore[no-redef]
            DTensor,
            Replicate,
            Shard,
            distribute_tensor,
        )
    names = {"DTensor": DTensor, "Replicate": Replicate, "Shard": Shard}
    globals().update(names, distribute_tensor=distribute_tensor)
    return globals()[name]


def loaded_dtensor() -> type | None:
    """``DTensor`` if its module is imported, else None (then no DTensor exists): for code
    that must recognise a DTensor without paying for the import."""
    found = globals().get("DTensor")  # resolved by an earlier call: no import statement again
    if found is None and any(
        name in sys.modules for name in ("torch.distributed.tensor", "torch.distributed._tensor")
    ):
        found = __getattr__("DTensor")
    return found


def dtensor_specs(dtensors: Sequence[Any]) -> list[Any]:
    """What each DTensor's plan depends on besides ``requires_grad``: mesh, placements, global
    shape, stride and dtype, comparable with ``==``."""
    return list(map(_dtensor_spec(), dtensors)) if dtensors else []


_PUBLIC_SPEC = operator.attrgetter("device_mesh", "placements", "shape", "dtype")


@functools.cache
def _dtensor_spec() -> Callable[[Any], Any]:
    dtensor = loaded_dtensor()
    if dtensor is not None and hasattr(dtensor, "_spec"):  # called only once DTensors exist
        return operator.attrgetter("_spec")

    def public(obj: Any) -> tuple:
        return (*_PUBLIC_SPEC(obj), obj.stride())

    return public


def tensor_guard(tensors: Sequence[torch.Tensor]) -> Any | None:
    """A check of later tensors against the description of ``tensors``, position by
    position (``guard.check(*later)``); it holds no reference to them. None where torch's
    guard is missing or fails its probe, and for a tensor object met twice, which the guard
    refuses (``torch.compile`` deduplicates its inputs). The guard compares dispatch keys under
    the dispatch state of its construction, so a check under another (``inference_mode``)
    only fails."""
    make = _guard_maker()
    if make is None or len(set(map(id, tensors))) != len(tensors):
        return None
    return make(tensors)


@functools.cache
def _guard_maker() -> Callable[[Sequence[torch.Tensor]], Any] | None:
    try:
        from torch._C._dynamo.guards import TensorGuards
    except Exception:  # no dynamo in this build
        return None

    def make(tensors: Sequence[torch.Tensor]) -> Any:
        return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)

    try:
        base = [torch.zeros(4), torch.zeros(2, 3)]
        guard = make(base)
        changed = [
            [torch.zeros(5), base[1]],  # shape
            [torch.zeros(4, dtype=torch.float64), base[1]],  # dtype
            [torch.zeros(4, dtype=torch.int32), base[1]],  # dtype of the same size
            [torch.zeros(4, requires_grad=True), base[1]],  # requires_grad
            [torch.nn.Parameter(torch.zeros(4), requires_grad=False), base[1]],  # type
            [torch.zeros(4, device="meta"), base[1]],  # device
            [base[0], torch.zeros(3, 2).t()],  # stride
            [torch.zeros(4).to_sparse(), base[1]],  # layout
        ]
        complex_ = torch.zeros(2, dtype=torch.complex64)
        bits = make([complex_])  # the conjugate and negative bits: views of the same bytes
        if (
            guard.check(*base)
            and not any(guard.check(*other) for other in changed)
            and bits.check(complex_)
            and not bits.check(complex_.conj())
            and not bits.check(torch._neg_view(complex_))
        ):
            return make
    except Exception:  # a changed private interface
        pass
    return None


# -- torch releases ---------------------------------------------------------------------------


def has_stream_transforms(storage_data: Any, items: Any) -> bool:
    """Whether any read item's file data went through storage-writer stream transforms
    (torch 2.8 and later record them; earlier releases have none)."""
    return any(
        getattr(storage_data[item.storage_index], "transform_descriptors", None) for item in items
    )


def no_dist_kwargs(dcp_call: Any) -> dict[str, bool]:
    """Keyword arguments making ``dcp.save`` / ``dcp.load`` (``dcp_call``) run in this
    process alone: ``no_dist=True`` where the call takes it (torch 2.6 and later); none
    before, where the call runs alone whenever no default process group is initialised."""
    return {"no_dist": True} if "no_dist" in inspect.signature(dcp_call).parameters else {}


def user_safe_globals() -> dict[str, Any]:
    """The globals the user marked safe for ``weights_only`` loads
    (``torch.serialization.add_safe_globals``, or inside ``safe_globals``), by the
    ``"module.qualname"`` a pickle names them with; read at each call."""
    found: dict[str, Any] = {}
    for entry in torch.serialization.get_safe_globals():
        if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], str):
            found[entry[1]] = entry[0]
        else:
            module = getattr(entry, "__module__", None)
            name = getattr(entry, "__qualname__", None)
            if module and name:
                found[f"{module}.{name}"] = entry
    return found


@contextlib.contextmanager
def extra_safe_globals(allowed: list[Any]) -> Iterator[None]:
    """Allow ``allowed`` (objects, or ``(object, "module.name")`` pairs) in the
    ``weights_only`` loads made inside: ``torch.serialization.safe_globals`` (torch 2.5 and
    later). Torch 2.4 has no such context and allows an object by its own name only: there
    the objects are added for good (they are this package's own harmless classes) and pairs
    are dropped, so a file naming them is refused."""
    if not allowed:
        yield
        return
    scoped = getattr(torch.serialization, "safe_globals", None)
    if scoped is not None:
        with scoped(allowed):
            yield
        return
    torch.serialization.add_safe_globals([g for g in allowed if not isinstance(g, tuple)])
    yield


def unsafe_globals_in(f: IO[bytes]) -> list[str] | None:
    """The globals (``"module.name"``, sorted) in the ``torch.save`` archive ``f`` that a
    ``weights_only`` load would refuse, found without running anything
    (``get_unsafe_globals_in_checkpoint``, torch 2.5+). None where that cannot tell: torch 2.4,
    a legacy (non-zip) file, a damaged one. ``f`` is read from its position, left anywhere."""
    find = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if find is None:
        return None
    try:
        return sorted(str(name) for name in find(f))
    except Exception:  # not an archive, or a damaged one: torch's error says more
        return None


# -- DCP data files ---------------------------------------------------------------------------


def write_item(
    transforms: Any, stream: Any, data: Any, item: WriteItem, storage_key: str
) -> WriteResult:
    """Serialise one DCP item (a CPU tensor holding exactly its bytes, or a ``BytesIO``) at
    the stream's position, as ``FileSystemWriter`` does; where it landed, as a result.
    ``transforms`` is the writer's ``transforms`` attribute (None on releases without one)."""
    return _write_item()(transforms, stream, data, item, storage_key)


@functools.cache
def _write_item() -> Callable[..., WriteResult]:
    try:
        from torch.distributed.checkpoint.filesystem import _write_item as private
    except ImportError:
        return _write_item_public
    params = list(inspect.signature(private).parameters)
    if len(params) >= 6:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        return functools.partial(_call_write_item_6, private, SerializationFormat.TORCH_SAVE)
    if len(params) == 5:
        return private
    return functools.partial(_call_write_item_4, private)


def _call_write_item_6(
    private: Any, fmt: Any, transforms: Any, stream: Any, data: Any, item: Any, key: str
) -> WriteResult:
    return private(transforms, stream, data, item, key, fmt)


def _call_write_item_4(
    private: Any, transforms: Any, stream: Any, data: Any, item: Any, key: str
) -> WriteResult:
    return private(stream, data, item, key)


def _write_item_public(
    transforms: Any, stream: Any, data: Any, item: WriteItem, storage_key: str
) -> WriteResult:
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    offset = stream.tell()
    transform = getattr(transforms, "transform_save_stream", None)
    # torch's transforms wrap the stream so that closing the wrapper leaves it open.
    out, descriptors = transform(item, stream) if transform is not None else (stream, [])
    if item.type == WriteItemType.BYTE_IO:
        out.write(data.getbuffer())
    else:
        torch.save(data, out)
    if out is not stream:
        out.close()
    length = stream.tell() - offset
    return WriteResult(
        index=item.index,
        size_in_bytes=length,
        storage_data=storage_info(storage_key, offset, length, descriptors),
    )


@dataclasses.dataclass
class _StorageInfo:
    """The fallback of torch's ``_StorageInfo``: the same fields, pickled the same way."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Sequence[str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def storage_info(
    relative_path: str, offset: int, length: int, transform_descriptors: Sequence[str] = ()
) -> Any:
    """Where an item lies in a data file, as DCP metadata records it."""
    if transform_descriptors:
        return _storage_info_class()(
            relative_path, offset, length, transform_descriptors=list(transform_descriptors)
        )
    return _storage_info_class()(relative_path, offset, length)


@functools.cache
def _storage_info_class() -> type:
    try:
        from torch.distributed.checkpoint.filesystem import _StorageInfo as private
    except ImportError:
        return _StorageInfo
    return private


@dataclasses.dataclass
class _StoragePrefix:
    """The fallback of torch's ``_StoragePrefix``."""

    prefix: str


def storage_prefix(prefix: str) -> Any:
    """A save plan's ``storage_data`` naming its rank's data files ``<prefix><k>.distcp``."""
    return _storage_prefix_class()(prefix)


def prefix_of(storage_data: Any) -> str | None:
    """The file prefix a final save plan's ``storage_data`` names, or None if it names none
    (the plan did not go through the writer's ``prepare_global_plan``)."""
    cls = _storage_prefix_class()
    if cls is _StoragePrefix:  # torch's class is gone: accept whatever carries a prefix
        prefix = getattr(storage_data, "prefix", None)
        return prefix if isinstance(prefix, str) else None
    return storage_data.prefix if isinstance(storage_data, cls) else None


@functools.cache
def _storage_prefix_class() -> type[Any]:
    try:
        from torch.distributed.checkpoint.filesystem import _StoragePrefix as private
    except ImportError:
        return _StoragePrefix
    return private


def storage_type_dtypes() -> dict[str, torch.dtype]:
    """``"FloatStorage"`` -> ``torch.float32``, ...: the legacy storage names ``torch.save``
    writes for a storage's dtype (from torch's own table; touching the legacy classes
    would warn)."""
    return dict(_storage_type_dtypes())


@functools.cache
def _storage_type_dtypes() -> dict[str, torch.dtype]:
    table = getattr(torch.storage, "_dtype_to_storage_type_map", None)
    pairs = table().items() if table is not None else _LEGACY_STORAGE_NAMES.items()
    return {name: dtype for dtype, name in pairs}


# What a torch.save pickle calls to rebuild each tensor (module, name).
REBUILD_TENSOR = ("torch._utils", "_rebuild_tensor_v2")


# torch's table, frozen by torch (dtypes added later are saved as untyped storage + dtype).
_LEGACY_STORAGE_NAMES = {
    torch.double: "DoubleStorage",
    torch.float: "FloatStorage",
    torch.half: "HalfStorage",
    torch.long: "LongStorage",
    torch.int: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.cdouble: "ComplexDoubleStorage",
    torch.cfloat: "ComplexFloatStorage",
    torch.qint8: "QInt8Storage",
    torch.qint32: "QInt32Storage",
    torch.quint8: "QUInt8Storage",
    torch.quint4x2: "QUInt4x2Storage",
    torch.quint2x4: "QUInt2x4Storage",
}


# -- state dict values ------------------------------------------------------------------------


def is_sharded_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a ``ShardedTensor`` (torch's deprecated sharded type)."""
    cls = _sharded_tensor_class()
    return cls is not None and isinstance(obj, cls)


@functools.cache
def _sharded_tensor_class() -> type | None:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:
        return None
    return ShardedTensor


# -- unpickling staged tensors ----------------------------------------------------------------


def pending_sparse_tensors() -> list[Any]:
    """The process-wide list of sparse tensors rebuilt by unpickling and not validated yet
    (clear it when the unpickling failed: it would keep them alive)."""
    return getattr(torch._utils, "_sparse_tensors_to_validate", [])


def validate_loaded_sparse_tensors() -> None:
    """Validate (and forget) the sparse tensors unpickling rebuilt, as ``torch.load`` does."""
    validate = getattr(torch._utils, "_validate_loaded_sparse_tensors", None)
    if validate is not None:
        validate()


# -- CUDA -------------------------------------------------------------------------------------


def cuda_devices_with_context() -> list[int]:
    """The CUDA devices this process has a context on (the current one at least), found
    without creating one on any other device."""
    current = torch.cuda.current_device()
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is None:
        return [current]
    return sorted({current, *(d for d in range(torch.cuda.device_count()) if has_context(d))})


def dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """The private names a DCP ``.metadata`` pickle may ask for, by (module, name), as far as
    this torch has them (see the module docstring)."""
    import torch.serialization
    from torch.distributed.checkpoint import metadata

    found: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _storage_info_class(),
        (__name__, "_StorageInfo"): _StorageInfo,
    }
    for module, name in (
        (torch.serialization, "_get_layout"),
        (metadata, "_MEM_FORMAT_ENCODING"),
    ):
        if hasattr(module, name):
            found[(module.__name__, name)] = getattr(module, name)
    return found


def default_stager_is_async(stager: Any) -> bool:
    """Whether torch's ``DefaultStager`` ``stager`` stages in the background (its ``stage``
    returns a ``Future``); see the module note."""
    config = getattr(stager, "_config", None)
    if config is not None and isinstance(getattr(config, "use_async_staging", None), bool):
        return bool(config.use_async_staging)
    return getattr(stager, "_staging_executor", None) is not None


def dtensor_around(dtensor: Any, local: torch.Tensor) -> Any:
    """A DTensor like ``dtensor`` (mesh, placements, global shape and stride) whose local
    shard is ``local``, not moved to the mesh's device; see the module note."""
    spec = getattr(dtensor, "_spec", None)
    if spec is not None:
        try:
            return type(dtensor)(local, spec, requires_grad=False)
        except TypeError:  # another constructor: the public path below
            pass
    return type(dtensor).from_local(
        local,
        dtensor.device_mesh,
        dtensor.placements,
        run_check=False,
        shape=dtensor.shape,
        stride=dtensor.stride(),
    )
