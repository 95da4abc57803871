"""Object stores through NVIDIA's multi-storage-client (MSC): ``msc://<profile>/<key>`` paths.

MSC maps a *profile* (defined in the YAML/JSON file that ``MSC_CONFIG`` names, or one of
its default locations) to a storage provider: S3 and S3-compatible servers, GCS, Azure, or a
local POSIX directory. This backend turns the :class:`~.base.StorageBackend` calls into MSC
calls; the package is imported on first use, so it is needed only by jobs that use ``msc://``.

Decisions:

* **Commit without rename.** An object store has no rename, but an upload is already
  atomic: the object appears whole when its upload completes, or not at all. So
  ``open_write`` buffers what is written and uploads it when the block exits cleanly
  (nothing is uploaded when it raises). The checkpoint's commit record is written the same
  way, last, by its writer, after every rank reported success; readers treat a prefix
  without it as no checkpoint. ``sync`` has no meaning here: a completed upload is durable.
* **Buffering.** Objects up to ``ObjectStoreOptions.spool_bytes`` are buffered in memory;
  a larger one spills to a temporary file and is uploaded from there, which lets the client
  upload it in parallel parts. Downloads mirror this.
* **Retries** of every call follow :mod:`.retry` (the whole object is re-sent).
* **One client per profile and process**, built from the config on first use and cached
  with the config's location and the process id (a forked child builds its own, as
  network clients must not cross a fork). A profile that cannot be resolved raises
  :class:`~resilient_ckpt.errors.ConfigurationError` saying what to set.
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO, TypeVar

from .._logging import get_logger
from ..config import (
    ObjectStoreOptions,
    RetryPolicy,
    default_object_store_options,
    default_retry_policy,
)
from ..errors import ConfigurationError
from .base import Listing, StorageBackend
from .retry import call_with_retry

logger = get_logger(__name__)

__all__ = ["MscBackend", "parse_msc_url", "storage_client"]

T = TypeVar("T")

MSC_SCHEME = "msc://"
_DEFAULT_CONFIG_LOCATIONS = (
    "~/.msc_config.yaml, ~/.config/msc/config.yaml, /etc/xdg/msc/config.yaml"
)

_clients: dict[tuple[int, str, str | None], Any] = {}
_clients_lock = threading.Lock()


def parse_msc_url(path: str) -> tuple[str, str]:
    """``msc://profile/a/b`` -> ``("profile", "a/b")``; a named error for anything else."""
    if not isinstance(path, str) or not path.startswith(MSC_SCHEME):
        raise ConfigurationError(f"not an msc:// URL: {path!r}; write it as msc://<profile>/<path>")
    profile, _, key = path[len(MSC_SCHEME) :].partition("/")
    if not profile:
        raise ConfigurationError(
            f"{path!r} names no profile; write it as msc://<profile>/<path>, with a profile "
            "defined in your MSC config"
        )
    return profile, key.strip("/")


def _import_msc() -> Any:
    try:
        import multistorageclient
    except ImportError as exc:
        raise ConfigurationError(
            "msc:// paths need the multi-storage-client package: "
            "pip install 'resilient-ckpt[msc]' (or 'multi-storage-client[boto3]')"
        ) from exc
    return multistorageclient


def _explain_profile_error(profile: str, exc: Exception) -> ConfigurationError:
    """Say which of "no config", "no such profile" or "bad config" it is, and what to set."""
    msc = _import_msc()
    env = os.environ.get("MSC_CONFIG")
    if env and not os.path.exists(env):
        return ConfigurationError(
            f"MSC_CONFIG={env!r} does not exist: point MSC_CONFIG at the multi-storage-client "
            f"config file (YAML or JSON) that defines profile {profile!r}"
        )
    try:
        config, found = msc.StorageClientConfig.read_msc_config()
    except ValueError as bad:
        return ConfigurationError(f"invalid MSC config for profile {profile!r}: {bad}")
    if found is None:
        return ConfigurationError(
            f"no multi-storage-client config found for profile {profile!r}: MSC_CONFIG is "
            f"not set and none of {_DEFAULT_CONFIG_LOCATIONS} exists. Set MSC_CONFIG to a "
            f"YAML file with `profiles: {{{profile}: {{storage_provider: ...}}}}`"
        )
    profiles = sorted((config or {}).get("profiles", {}) or {})
    if profile not in profiles:
        return ConfigurationError(
            f"unknown MSC profile {profile!r}: {found} defines {profiles or 'no profiles'}. "
            f"Add a profile named {profile!r} there (or fix the msc://{profile}/... URL, or "
            "point MSC_CONFIG at another file)"
        )
    return ConfigurationError(f"MSC profile {profile!r} in {found} is not usable: {exc}")


def storage_client(profile: str) -> Any:
    """The (cached) MSC ``StorageClient`` of ``profile``; see the module docstring."""
    cache_key = (os.getpid(), profile, os.environ.get("MSC_CONFIG"))
    with _clients_lock:
        client = _clients.get(cache_key)
        if client is not None:
            return client
        msc = _import_msc()
        try:
            config = msc.StorageClientConfig.from_file(profile=profile)
            client = msc.StorageClient(config)
        except (ValueError, KeyError, TypeError) as exc:
            raise _explain_profile_error(profile, exc) from exc
        _clients[cache_key] = client
        return client


class _SpoolWriter:
    """The stream ``open_write`` hands out: memory first, a temporary file past a limit.

    Deliberately has no ``fileno``: there is no local file to fsync or advise.
    """

    def __init__(self, options: ObjectStoreOptions) -> None:
        self._options = options
        self._memory: io.BytesIO | None = io.BytesIO()
        self._file: Any = None
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if not view.contiguous:
            view = memoryview(view.tobytes())
        view = view.cast("B")
        if self._memory is not None and self.size + view.nbytes > self._options.spool_bytes:
            self._spill()
        target = self._memory if self._memory is not None else self._file
        target.write(view)
        self.size += view.nbytes
        return view.nbytes

    def _spill(self) -> None:
        memory, self._memory = self._memory, None
        self._file = tempfile.NamedTemporaryFile(
            prefix=".resilient_ckpt-upload-", dir=self._options.spool_dir, delete=False
        )
        if memory is not None:
            self._file.write(memory.getbuffer())

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def writable(self) -> bool:
        return True

    def upload(self, client: Any, key: str) -> None:
        """One upload attempt of everything written (callable again to retry)."""
        if self._memory is not None:
            self._memory.seek(0)
            client.upload_file(key, self._memory)
        else:
            self._file.flush()
            client.upload_file(key, self._file.name)

    def discard(self) -> None:
        self._memory = None
        if self._file is not None:
            self._file.close()
            try:
                os.unlink(self._file.name)
            except FileNotFoundError:
                pass
            self._file = None


class MscBackend(StorageBackend):
    """:class:`~.base.StorageBackend` over multi-storage-client; paths are ``msc://`` URLs."""

    scheme = "msc"

    def __init__(
        self, *, retry: RetryPolicy | None = None, options: ObjectStoreOptions | None = None
    ) -> None:
        self.retry = retry if retry is not None else default_retry_policy()
        self.options = options if options is not None else default_object_store_options()

    def check(self, path: str) -> None:
        """Parse ``path`` and resolve its profile now, so a bad one fails early and clearly."""
        profile, _ = parse_msc_url(path)
        storage_client(profile)

    def _call(self, operation: str, path: str, fn: Callable[[Any, str], T]) -> T:
        profile, key = parse_msc_url(path)
        client = storage_client(profile)
        return call_with_retry(
            lambda: fn(client, key), policy=self.retry, operation=operation, key=path
        )

    # -- writing ------------------------------------------------------------------------------

    def makedirs(self, path: str) -> None:
        parse_msc_url(path)  # prefixes need no creating; objects create their own

    @contextmanager
    def open_write(self, path: str, *, sync: bool = True) -> Iterator[BinaryIO]:
        spool = _SpoolWriter(self.options)
        try:
            yield spool  # type: ignore[misc]  # a write-only stream, enough for our writers
            self._call("upload", path, spool.upload)
        finally:
            spool.discard()

    def delete(self, path: str, *, recursive: bool = False, sync: bool = False) -> None:
        # ``sync`` needs nothing here: a completed delete request is durable.
        info = self._info(path)
        if info is None:
            return
        if info.type != "directory":
            try:
                self._call("delete", path, lambda client, key: client.delete(key))
            except FileNotFoundError:
                pass
            return
        if not recursive:
            raise IsADirectoryError(f"{path} is a prefix with objects below it; pass recursive")
        keys = self._call("list", path, _list_recursive)
        if keys:
            self._call("delete", path, lambda client, _: client.delete_many(keys))
        self._call("delete", path, _remove_empty_directories)

    # -- reading ------------------------------------------------------------------------------

    @contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        buffer = self.download(path)
        try:
            yield buffer
        finally:
            buffer.close()

    def download(self, path: str) -> BinaryIO:
        """The whole object at ``path`` in a readable, seekable buffer (the caller closes it)."""
        return self._call("download", path, self._download)

    def version(self, path: str) -> tuple[Any, ...]:
        """What identifies the object's current content: size, ETag, modification time."""
        info = self._call("stat", path, lambda client, key: client.info(key))
        return (info.content_length, info.etag, str(info.last_modified))

    def _download(self, client: Any, key: str) -> BinaryIO:
        info = client.info(key)
        if info.type == "directory":
            raise IsADirectoryError(f"{key!r} is a prefix (directory), not an object")
        if info.content_length <= self.options.spool_bytes:
            memory = io.BytesIO()
            client.download_file(key, memory, info)
            memory.seek(0)
            return memory
        fd, local = tempfile.mkstemp(prefix=".resilient_ckpt-download-", dir=self.options.spool_dir)
        os.close(fd)
        try:
            client.download_file(key, local, info)
            return open(local, "rb")  # closed by open_read
        finally:
            os.unlink(local)  # the open file stays readable; nothing is left behind

    def scan(self, path: str) -> Listing:
        entries = self._call("list", path, _list_level)
        listing = Listing()
        for name, is_dir, size in entries:
            if is_dir:
                listing.dirs.append(name)
            else:
                listing.files[name] = size
        listing.dirs.sort()
        return listing

    def _info(self, path: str) -> Any | None:
        try:
            return self._call("stat", path, lambda client, key: client.info(key))
        except FileNotFoundError:
            return None

    def exists(self, path: str) -> bool:
        return self._info(path) is not None

    def is_dir(self, path: str) -> bool:
        info = self._info(path)
        return info is not None and info.type == "directory"

    def size(self, path: str) -> int:
        info = self._info(path)
        if info is None or info.type == "directory":
            raise FileNotFoundError(f"no object at {path}")
        return int(info.content_length)


def _prefix(key: str) -> str:
    return f"{key}/" if key else ""


def _list_level(client: Any, key: str) -> list[tuple[str, bool, int]]:
    """(name, is_dir, size) of the entries one level below ``key`` (one listing request)."""
    prefix = _prefix(key)
    out = []
    for obj in client.list(prefix, include_directories=True):
        name = obj.key[len(prefix) :] if obj.key.startswith(prefix) else obj.key
        name = name.strip("/")
        if not name or "/" in name:
            continue
        out.append((name, obj.type == "directory", int(obj.content_length or 0)))
    return out


def _remove_empty_directories(client: Any, key: str) -> None:
    """A POSIX provider keeps the directories of deleted files; object stores have none."""
    local = client.get_posix_path(key) if key else None
    if local and os.path.isdir(local):
        for root, _dirs, _files in os.walk(local, topdown=False):
            try:
                os.rmdir(root)
            except OSError:  # not empty: something was written meanwhile; leave it
                pass


def _list_recursive(client: Any, key: str) -> list[str]:
    return [obj.key for obj in client.list(_prefix(key)) if obj.type != "directory"]
