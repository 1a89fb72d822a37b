"""Dataset paths that may be object-storage URLs: ``msc://PROFILE/path`` through Energon's ``EPath`` (the
Multi-Storage Client, ``MSC_CONFIG`` naming the profiles), any other string a local path.

The layout and the readers open every dataset file through these few functions: a local path keeps the plain
``os`` / ``open`` / ``np.load(mmap_mode="r")`` path it always had (the same bits, the same cost); a remote one is
read through MSC, once, into memory (``read_bytes``, ``open_binary``: a ``BytesIO``), never memory-mapped. The
shards themselves are read by Energon through ``EPath`` (ranged reads per sample: ``patches.compact``).

Errors of a remote store become one :class:`RemoteStorageError` line naming the URL, the cause (credentials, no such
bucket, a timeout, a missing object, no S3 client) and the remedy (:func:`describe`). Retries are MSC's (the
profile's ``retry`` and the provider's ``connect_timeout`` / ``read_timeout`` / ``retries``), not a loop here.
"""

from __future__ import annotations

import io
import os
import pathlib
from collections.abc import Callable
from typing import IO, TypeVar

import numpy as np

from ..errors import DataReadError

__all__ = ["MSC_PREFIX", "S3_EXTRA", "RemoteStorageError", "absolute", "describe", "is_remote", "isfile",
           "join", "load_npy", "open_binary", "read_bytes", "remote_call", "size"]

#: The URL scheme of Energon's Multi-Storage Client paths.
MSC_PREFIX = "msc://"
#: What installs the S3 client (the Multi-Storage Client's boto3 backend).
S3_EXTRA = "pip install 'bagel-megatron-data[s3]'"
_CONFIG_REMEDY = "check the profile in the file MSC_CONFIG names (or ~/.msc_config.yaml)"

_T = TypeVar("_T")


class RemoteStorageError(DataReadError):
    """An object store refused or failed a read: one line naming the URL, the cause and the remedy."""


def is_remote(path: str | os.PathLike) -> bool:
    """True for an ``msc://`` URL (read through MSC), False for a local path."""
    return str(path).startswith(MSC_PREFIX)


def join(root: str | os.PathLike, *names: str) -> str:
    """``root/name/...``: ``os.path.join`` locally, ``/``-joined for a URL."""
    if is_remote(root):
        return "/".join([str(root).rstrip("/"), *(n.strip("/") for n in names)])
    return os.path.join(os.fspath(root), *names)


def absolute(path: str | os.PathLike) -> str:
    """``os.path.abspath`` of a local path; a URL as it is (less a trailing ``/``)."""
    return str(path).rstrip("/") if is_remote(path) else os.path.abspath(os.fspath(path))


def _cause(exc: BaseException) -> tuple[str, str]:
    """``(cause, remedy)`` of an error MSC / boto3 raised for a remote read."""
    text, name = " ".join(str(exc).split()), type(exc).__name__
    chain = f"{text} {exc.__cause__ or ''} {exc.__context__ or ''}"
    if isinstance(exc, ModuleNotFoundError | ImportError):
        return f"no client for this store ({text})", f"install the S3 client: {S3_EXTRA}"
    if "NoSuchBucket" in chain or "bucket does not exist" in chain.lower():
        return "no such bucket", f"create the bucket or fix the bucket in the profile's base_path ({_CONFIG_REMEDY})"
    if isinstance(exc, PermissionError) or any(k in chain for k in (
            "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "NoCredentialsError",
            "Unable to locate credentials")):
        return f"access refused ({name})", f"fix the credentials of the profile ({_CONFIG_REMEDY})"
    if isinstance(exc, FileNotFoundError):
        return "no such object", "upload the dataset again (every file of its directory), or fix energon_path"
    if any(k in chain for k in ("timeout", "Timeout", "timed out", "EndpointConnectionError", "Could not connect",
                                "ConnectionRefused", "Connection refused", "network")):
        return (f"the store did not answer ({name}, after MSC's retries)",
                "check the endpoint and the network, or raise the profile's read_timeout / retry settings")
    if isinstance(exc, ValueError) and "profile" in chain.lower():
        return f"unknown profile ({text[:120]})", _CONFIG_REMEDY
    return f"{name}: {text[:160]}", "check the store and the profile (the error above says what failed)"


def describe(exc: BaseException, url: str) -> str:
    """One line for an error reading ``url``: ``<url>: <cause>: <remedy>``."""
    return ": ".join((url, *_cause(exc)))


def remote_call(url: str, fn: Callable[[], _T]) -> _T:
    """``fn()``, an MSC operation on ``url``. A missing object stays a FileNotFoundError (the layout's callers name
    a missing file as they do locally), its message :func:`describe`'s line; any other error (a missing bucket
    included) becomes one :class:`RemoteStorageError` line."""
    try:
        return fn()
    except RemoteStorageError:
        raise
    except Exception as exc:
        line = describe(exc, url)
        if isinstance(exc, FileNotFoundError) and _cause(exc)[0] == "no such object":
            raise FileNotFoundError(line) from exc
        raise RemoteStorageError(line, brief=line[:200]) from exc


def _through(path: str, local: Callable[[str], _T], method: str) -> _T:
    """``local(path)`` for a local path; for a URL, its Energon ``EPath``'s ``method()`` through :func:`remote_call`
    (the profile resolved too: a :class:`RemoteStorageError` line when it is unknown or its client not installed)."""
    if not is_remote(path):
        return local(path)
    from megatron.energon.epathlib import EPath

    return remote_call(path, lambda: getattr(EPath(path), method)())


def isfile(path: str) -> bool:
    """Whether the file (object) ``path`` exists."""
    return _through(path, os.path.isfile, "is_file")


def size(path: str) -> int:
    """The size of file ``path`` in bytes (FileNotFoundError / OSError locally)."""
    return _through(path, os.path.getsize, "size")


def read_bytes(path: str) -> bytes:
    """The whole file ``path`` (one read). Locally: what ``open(path, "rb").read()`` raises."""
    return _through(path, lambda p: pathlib.Path(p).read_bytes(), "read_bytes")


def open_binary(path: str) -> IO[bytes]:
    """A readable, seekable binary file of ``path``: the open local file, or the remote object read once into a
    ``BytesIO`` (its size is ``f.seek(0, os.SEEK_END)``)."""
    return io.BytesIO(read_bytes(path)) if is_remote(path) else open(path, "rb")


def load_npy(path: str, *, mmap: bool) -> np.ndarray:
    """``np.load`` of the ``.npy`` file ``path`` (no pickles): memory-mapped when local and ``mmap``; a remote file
    is read once into memory (read-only). Raises what ``np.load`` raises (ValueError, OSError, EOFError)."""
    if not is_remote(path):
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    a = np.load(io.BytesIO(read_bytes(path)), allow_pickle=False)
    a.flags.writeable = False
    return a
