"""The one validation pass every entry point goes through: the data config, its files, their cross-checks.

``validate_data(config)`` checks, in one pass and collecting every problem instead of stopping at the first:

1. the data config's own keys (``BagelDataConfig`` and its ``packer`` knobs; ``PackerConfig.problems``);
2. the grouped-datasets YAML (``config.groups``: every group, every key; ``grouped_yaml``);
3. the dataset registry (``config.dataset_info``: every entry) and that it registers every group's names;
4. what the readers need from each group: a converted ``energon_path`` per dataset, ``image_transform_args``,
   ``num_used_data`` under ``order: official``;
5. the packer budgets against the groups' transforms (``budgets.budget_issues``, cases B3/B4/B6 of
   ``shared/cases``), errors with ``budgets="error"`` (the builder, the job, ``inspect``), reported only with
   ``budgets="report"`` (``bagel-data stats``, which exists to show them);
6. with worker processes (Energon workers: ``num_workers`` > 0 outside the official order, whose workers are
   emulated in process; or ``prefetch`` > 0), that the temp dir leaves room for the unix sockets through which
   they hand tensors over (``socket_path_problem``).

Each problem names its file and key; all of them are raised together as one ``ConfigError`` (``.problems``
holds the list). The job, ``bagel-data inspect`` / ``stats``, the providers and ``build_bagel_train_loader``
call this once and pass the resulting ``ValidatedData`` on, so the YAML is read and the budgets are checked
exactly once per process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from .budgets import BudgetIssue, budget_issues, log_warnings
from .schema import (BagelDataConfig, ConfigError, DatasetInfoEntry, ResolvedGroup, load_dataset_info,
                     load_grouped_yaml, resolve_groups)
from .grouped_yaml import GroupConfig

__all__ = ["PACKAGE_NAME", "UNIX_PATH_MAX", "ValidatedData", "package_version", "socket_path_problem", "validate_data"]

PACKAGE_NAME = "bagel-megatron-data"


def package_version() -> str:
    """Installed version of this package ("unknown" when run from an uninstalled tree)."""
    try:
        return metadata.version(PACKAGE_NAME)
    except metadata.PackageNotFoundError:
        return "unknown"


logger = logging.getLogger(__name__)

class _Problems:
    """Collects the messages of ``ConfigError``s raised inside ``check()`` blocks, to raise them together."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        try:
            yield
        except ConfigError as exc:
            self.messages.extend(getattr(exc, "problems", None) or [str(exc)])

    def add(self, message: str) -> None:
        self.messages.append(message)

    def raise_if_any(self, source: str) -> None:
        if self.messages:
            raise ConfigError.of(self.messages, header=f"{source}: the data configuration has "
                                 f"{len(self.messages)} problem(s)")


@dataclass
class ValidatedData:
    """A data config that passed ``validate_data``: the config, its resolved groups and the budget warnings."""

    config: BagelDataConfig
    groups: list[ResolvedGroup]
    warnings: list[BudgetIssue] = field(default_factory=list)

    @property
    def group_configs(self) -> list[GroupConfig]:
        return [g.group for g in self.groups]

    def fingerprint(self, special_tokens: Mapping[str, int], dp_rank: int, dp_size: int) -> dict[str, Any]:
        """The configuration's part of a loader's resume fingerprint (``state.fingerprint``): what changes the
        stream besides the stages' own identities (``frame_sampler_args`` does not: no videos), for DP rank
        ``dp_rank`` of ``dp_size``."""
        config = self.config
        return {
            "package_version": package_version(),
            "order": config.order,
            "seed": config.seed,
            "data_seed": config.effective_data_seed,
            "dp_rank": int(dp_rank),
            "dp_size": int(dp_size),
            "num_workers": config.num_workers,
            "packer": dataclasses.asdict(config.packer),
            "special_tokens": dict(special_tokens),
            "groups": [{"name": r.group.name, "dataset_names": list(r.group.dataset_names), "weight": r.group.weight,
                        "is_mandatory": r.group.is_mandatory, "num_used_data": r.group.num_used_data,
                        "shuffle_lines": r.group.shuffle_lines,
                        "shuffle_seed": r.group.shuffle_seed if r.group.shuffle_lines else None,
                        "image_transform_args": r.group.image_transform_args,
                        "vit_image_transform_args": r.group.vit_image_transform_args} for r in self.groups],
            **({"partitions": config.partitions} if config.order == "elastic" else {}),
        }


def _reader_problems(config: BagelDataConfig, resolved: ResolvedGroup, problems: _Problems) -> None:
    """What the readers of one group need besides parsed keys (step 4 of the module docstring)."""
    g = resolved.group
    for name, entry in zip(g.dataset_names, resolved.datasets):
        if not isinstance(entry, DatasetInfoEntry) or not entry.energon_path:
            problems.add(f"{config.dataset_info}: {g.name}.{name}: no 'energon_path'; convert it first "
                         "(bagel-data convert) and register the converted directory")
    if not g.image_transform_args:
        problems.add(f"{config.groups}: group {g.name!r}: key 'image_transform_args' is required")
    if config.order == "official" and g.num_used_data is None:
        problems.add(f"{config.groups}: group {g.name!r}: order 'official' needs 'num_used_data' "
                     "(the official loader requires it)")


#: The longest unix-socket path Linux binds: ``sockaddr_un.sun_path`` holds 108 bytes, the terminating NUL included.
UNIX_PATH_MAX = 107
#: Where multiprocessing puts the socket a worker process sends a tensor's file descriptor through (torch's
#: default ``file_descriptor`` strategy), below Python's temp dir: ``multiprocessing.util.get_temp_dir()``
#: (``pymp-`` + 8 characters), then ``connection.arbitrary_address("AF_UNIX")`` (``listener-`` + 8 characters).
_MP_SOCKET = "/pymp-XXXXXXXX/listener-XXXXXXXX"
#: torch_shm_manager's socket, below torch's temp dir, for the ``file_system`` strategy the prefetch producer
#: (and the Energon workers forked from it) use.
_TORCH_SHM_SOCKET = "/torch-shm-dir-XXXXXX/manager.sock"
#: The variables torch_shm_manager takes its temp dir from, first set first (else ``/tmp``); Python's
#: ``tempfile`` reads TMPDIR, TEMP, TMP.
_TORCH_TEMP_ENV = ("TMPDIR", "TMP", "TEMP", "TEMPDIR")


def _torch_temp_dir() -> str:
    return next((os.environ[k] for k in _TORCH_TEMP_ENV if os.environ.get(k)), "/tmp")


def socket_path_problem(temp_dir: str | None = None, *, workers: bool = True, prefetch: bool = False) -> str | None:
    """Why worker processes could not hand tensors over under ``temp_dir`` (default: the temp dirs Python and
    torch use), or None.

    An Energon worker returns each sample's tensors by sending their file descriptors over a unix socket in
    ``<temp dir>/pymp-…/``; under ``prefetch`` they go through torch_shm_manager's socket in
    ``<temp dir>/torch-shm-dir-…/``. Where that path is longer than ``UNIX_PATH_MAX`` bytes the bind fails:
    inside a worker's queue thread, which only prints it, so the sample never arrives and the reader waits until
    its watchdog's time-out, which cannot name the cause. Cluster schedulers often set a long per-job
    ``TMPDIR``. ``workers``: Energon workers read (their socket is checked); ``prefetch``: the producer runs.
    """
    checks = []
    if workers:
        checks.append((tempfile.gettempdir() if temp_dir is None else temp_dir, _MP_SOCKET,
                       "Energon worker processes pass tensors through unix sockets under it",
                       "num_workers: 0 and prefetch: 0" if prefetch else "num_workers: 0"))
    if prefetch:
        checks.append((_torch_temp_dir() if temp_dir is None else temp_dir, _TORCH_SHM_SOCKET,
                       "the prefetch producer's tensors go through torch_shm_manager's unix socket under it",
                       "prefetch: 0"))
    for path, below, what, off in checks:
        size = len(os.fsencode(path))
        if size + len(below) > UNIX_PATH_MAX:
            return (f"temp dir {path!r} is {size} bytes long: {what} ({path}{below}, {size + len(below)} bytes; "
                    f"Linux binds at most {UNIX_PATH_MAX}), so no sample would ever arrive; set TMPDIR to a "
                    f"directory of at most {UNIX_PATH_MAX - len(below)} bytes (e.g. /tmp), or use {off}")
    return None


def validate_data(config: BagelDataConfig, *, budgets: str = "error", readers: bool = True) -> ValidatedData:
    """Validate ``config`` and every file it names once; raise one ``ConfigError`` listing every problem.

    ``budgets``: ``"error"`` (budget errors are problems; warnings are logged once per process) or
    ``"report"`` (budget issues are returned in ``warnings`` only, none raised or logged). ``readers=False``
    skips step 4 (for tools that read metadata only). Returns ``ValidatedData``.
    """
    if budgets not in ("error", "report"):
        raise ValueError(f"validate_data: budgets must be 'error' or 'report', got {budgets!r}")
    problems = _Problems()
    with problems.check():
        config.validate()
    groups: list[GroupConfig] | None = None
    info = None
    with problems.check():
        groups = load_grouped_yaml(config.groups)
    with problems.check():
        info = load_dataset_info(config.dataset_info)
    resolved: list[ResolvedGroup] = []
    if groups is not None and info is not None:
        with problems.check():
            resolved = resolve_groups(groups, info, source=str(config.dataset_info))
        if readers:
            for r in resolved:
                _reader_problems(config, r, problems)
    issues: list[BudgetIssue] = []
    if groups is not None and not config.packer.problems():
        issues = budget_issues(config.packer, groups, source=str(config.groups), official=config.order == "official")
        if budgets == "error":
            for issue in issues:
                if issue.level == "error":
                    problems.add(f"packer budgets cannot work with these groups: {issue.message}")
    workers = bool(config.num_workers) and config.order != "official"  # the official order's are emulated
    if readers and (workers or config.prefetch):
        problem = socket_path_problem(workers=workers, prefetch=bool(config.prefetch))
        if problem:
            problems.add(problem)
    problems.raise_if_any(str(config.groups))
    if budgets == "report":
        return ValidatedData(config, resolved, issues)
    return ValidatedData(config, resolved, log_warnings(issues))
