"""The data errors a run can end with, from one base: each names where and what to do, with a short form for the
other ranks' line.

``DataError`` carries ``brief`` (one short line: what the other ranks print, ``job.topology.agree``) and pickles with
it (it crosses the prefetch producer's queue and Energon worker processes). Its kinds:

* ``DataReadError`` — reading a converted dataset failed (the damaged file and its remedy when one is found);
* ``DataTimeoutError`` — a read did not return within ``data.timeout_s`` (group, dataset, shard file, process);
* ``DataStallError`` — a source keeps dropping samples and can never yield one (where, why, what to change).
"""

from __future__ import annotations

__all__ = ["DataError", "DataReadError", "DataStallError", "DataTimeoutError"]


class DataError(RuntimeError):
    """A data problem that ends the run: ``str(e)`` the full message, ``e.brief`` a short form (<= ~200 chars)."""

    def __init__(self, message: str, brief: str = "") -> None:
        super().__init__(message)
        self.brief = brief or message[:160]

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.brief))


class DataReadError(DataError):
    """Reading a converted dataset failed: one line naming the damaged file and the remedy when one is found
    (``energon.layout.damage.diagnose``), else the group, datasets, rank and the cause (shard/key if known)."""


class DataTimeoutError(DataError):
    """A data read did not return within ``data.timeout_s``; names group, dataset, shard file and process."""


class DataStallError(DataError):
    """A source keeps dropping samples and can never yield one: the message names where, why and what to change."""
