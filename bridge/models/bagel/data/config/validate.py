"""The one validation pass every entry point goes through: the data config, its files, their cross-checks.

``validate_data(config)`` checks, in one pass and collecting every problem instead of stopping at the first:

1. the data config's own keys (``BagelDataConfig`` and its ``packer`` knobs; ``PackerConfig.problems``), and the
   not-official packer knobs ``packer.strategy`` / ``packer.balance`` / ``packer.cost``
   (:func:`strategy_problems`);
2. the grouped-datasets YAML (``config.groups``: every group, every key; ``grouped_yaml``);
3. the dataset registry (``config.dataset_info``: every entry) and that it registers every group's names;
   steps 2-5 run for the validation split too when ``data.valid`` is set (``valid.groups`` against its registry,
   training's when ``valid.dataset_info`` is null), its problems in the same error, named by its files;
4. what the readers need from each group: a converted ``energon_path`` per dataset, ``image_transform_args``,
   ``num_used_data`` under ``order: official``;
5. the packer budgets against the groups' transforms (``budgets.budget_issues``, cases B3/B4/B6 of
   ``shared/cases``), errors with ``budgets="error"`` (the builder, the job, ``inspect``), reported only with
   ``budgets="report"`` (``bagel-data stats``, which exists to show them);
6. with worker processes (read workers: ``num_workers`` > 0 outside the official order, whose workers are
   emulated in process; or ``prefetch`` > 0), that the temp dir leaves room for the unix sockets through which
   they hand tensors over (``socket_path_problem``).

Each problem names its file and key; all of them are raised together as one ``ConfigError`` (``.problems`` holds the
list). The job, ``bagel-data inspect`` / ``stats``, the providers and ``build_bagel_train_loader`` call this once and
pass the resulting ``ValidatedData`` on, so the YAML is read and the budgets are checked exactly once per process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import tempfile
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from .budgets import BudgetIssue, budget_issues, log_warnings
from .grouped_yaml import (ConfigError, FieldRule, GroupConfig, field_problems, is_int, is_number, is_url,
                           load_grouped_yaml)
from .packer import STRATEGIES, BalanceConfig, CostConfig, PackerConfig
from .registry import DatasetInfoEntry, ResolvedGroup, load_dataset_info, resolve_groups
from .schema import BagelDataConfig, _source

__all__ = ["PACKAGE_NAME", "UNIX_PATH_MAX", "ValidatedData", "key_origin", "package_version", "path_problems",
           "socket_path_problem", "strategy_problems", "unknown_key_problems", "validate_data"]

PACKAGE_NAME = "bagel-megatron-data"


def package_version() -> str:
    """Installed version of this package ("unknown" when run from an uninstalled tree)."""
    try:
        return metadata.version(PACKAGE_NAME)
    except metadata.PackageNotFoundError:
        return "unknown"


@contextlib.contextmanager
def _collected(problems: list[str]) -> Iterator[None]:
    """Add the problems of a ``ConfigError`` raised inside to ``problems`` (raised together at the end)."""
    try:
        yield
    except ConfigError as exc:
        problems.extend(exc.problems)


@dataclass
class ValidatedData:
    """A data config that passed ``validate_data``: the config, its resolved groups and the budget warnings."""

    config: BagelDataConfig
    groups: list[ResolvedGroup]
    warnings: list[BudgetIssue] = field(default_factory=list)
    #: The validation split's resolved groups (``config.valid``), None when ``data.valid`` is not set.
    valid_groups: list[ResolvedGroup] | None = None

    @property
    def has_valid(self) -> bool:
        """Whether ``data.valid`` is set (and passed the validation pass with training)."""
        return self.valid_groups is not None

    def valid_data(self) -> "ValidatedData":
        """The validation stream's ``ValidatedData`` (``BagelDataConfig.valid_config`` with its resolved groups),
        for ``build_bagel_train_loader``: no second validation pass. ``ValueError`` without ``data.valid``."""
        if self.valid_groups is None:
            raise ValueError("valid_data: data.valid is not set")
        return ValidatedData(self.config.valid_config(), self.valid_groups)

    @property
    def group_configs(self) -> list[GroupConfig]:
        return [g.group for g in self.groups]

    def fingerprint(self, special_tokens: Mapping[str, int], dp_rank: int, dp_size: int) -> dict[str, Any]:
        """The configuration's part of a loader's resume fingerprint (``state.fingerprint``): what changes the
        stream besides the stages' own identities (``frame_sampler_args`` when set: video records draw their frames
        with it), for DP rank ``dp_rank`` of ``dp_size``. The packer's knobs are not here: the packer stage's identity
        is their one record (``BagelPacker.identity``, ``PackerConfig.stream_identity``)."""
        config = self.config
        return {
            "package_version": package_version(),
            "order": config.order,
            "seed": config.seed,
            "data_seed": config.effective_data_seed,
            "dp_rank": int(dp_rank),
            "dp_size": int(dp_size),
            "num_workers": config.num_workers,
            "special_tokens": dict(special_tokens),
            "groups": [{"name": g.name, "dataset_names": list(g.dataset_names), "weight": g.weight,
                        "is_mandatory": g.is_mandatory, "num_used_data": g.num_used_data,
                        "shuffle_lines": g.shuffle_lines, "shuffle_seed": g.shuffle_seed if g.shuffle_lines else None,
                        "image_transform_args": g.image_transform_args,
                        "vit_image_transform_args": g.vit_image_transform_args,
                        **({"frame_sampler_args": g.frame_sampler_args} if g.frame_sampler_args else {})}
                       for g in self.group_configs],
            **({"partitions": config.partitions} if config.order == "elastic" else {}),
            **({"truncated_images": "drop"} if config.truncated_images == "drop" else {}),
        }


def _reader_problems(config: BagelDataConfig, resolved: ResolvedGroup, problems: list[str], *,
                     groups_source: str, info_source: str) -> None:
    """What the readers of one group need besides parsed keys (step 4 of the module docstring); messages name
    ``groups_source`` / ``info_source`` (training's files, or the validation split's)."""
    g = resolved.group
    for name, entry in zip(g.dataset_names, resolved.datasets):
        if not isinstance(entry, DatasetInfoEntry) or not entry.energon_path:
            problems.append(f"{info_source}: {g.name}.{name}: no 'energon_path'; convert it first "
                            "(bagel-data convert) and register the converted directory")
        elif not is_url(entry.energon_path) and not os.path.isdir(entry.energon_path):  # a URL: the reader opens it
            problems.append(f"{info_source}: {g.name}.{name}: energon_path {entry.energon_path} does not exist: "
                            "fix energon_path (relative paths are relative to the registry file) or convert the "
                            "dataset there (bagel-data convert)")
    if not g.image_transform_args:
        problems.append(f"{groups_source}: group {g.name!r}: key 'image_transform_args' is required")
    if config.order == "official" and g.num_used_data is None:
        problems.append(f"{groups_source}: group {g.name!r}: order 'official' needs 'num_used_data' "
                        "(the official loader requires it)")


#: The longest unix-socket path Linux binds: ``sockaddr_un.sun_path`` holds 108 bytes, the terminating NUL included.
UNIX_PATH_MAX = 107
#: Where multiprocessing puts the socket a worker process sends a tensor's file descriptor through (torch's
#: default ``file_descriptor`` strategy), below Python's temp dir: ``multiprocessing.util.get_temp_dir()``
#: (``pymp-`` + 8 characters), then ``connection.arbitrary_address("AF_UNIX")`` (``listener-`` + 8 characters).
_MP_SOCKET = "/pymp-XXXXXXXX/listener-XXXXXXXX"
#: torch_shm_manager's socket, below torch's temp dir, for the ``file_system`` strategy the prefetch producer
#: (and the read workers forked from it) use.
_TORCH_SHM_SOCKET = "/torch-shm-dir-XXXXXX/manager.sock"
#: The variables torch_shm_manager takes its temp dir from, first set first (else ``/tmp``); Python's
#: ``tempfile`` reads TMPDIR, TEMP, TMP.
_TORCH_TEMP_ENV = ("TMPDIR", "TMP", "TEMP", "TEMPDIR")


def socket_path_problem(temp_dir: str | None = None, *, workers: bool = True, prefetch: bool = False) -> str | None:
    """Why worker processes could not hand tensors over under ``temp_dir`` (default: the temp dirs Python and
    torch use), or None.

    A read worker returns each sample's tensors by sending their file descriptors over a unix socket in
    ``<temp dir>/pymp-…/``; under ``prefetch`` they go through torch_shm_manager's socket in
    ``<temp dir>/torch-shm-dir-…/``. Where that path is longer than ``UNIX_PATH_MAX`` bytes the bind fails:
    inside a worker's queue thread, which only prints it, so the sample never arrives and the reader waits until
    its watchdog's time-out, which cannot name the cause. Cluster schedulers often set a long per-job
    ``TMPDIR``. ``workers``: read workers read (their socket is checked); ``prefetch``: the producer runs.
    """
    checks = []
    if workers:
        checks.append((tempfile.gettempdir() if temp_dir is None else temp_dir, _MP_SOCKET,
                       "read worker processes pass tensors through unix sockets under it",
                       "num_workers: 0 and prefetch: 0" if prefetch else "num_workers: 0"))
    if prefetch:
        torch_temp = next((os.environ[k] for k in _TORCH_TEMP_ENV if os.environ.get(k)), "/tmp")
        checks.append((torch_temp if temp_dir is None else temp_dir, _TORCH_SHM_SOCKET,
                       "the prefetch producer's tensors go through torch_shm_manager's unix socket under it",
                       "prefetch: 0"))
    for path, below, what, off in checks:
        size = len(os.fsencode(path))
        if size + len(below) > UNIX_PATH_MAX:
            return (f"temp dir {path!r} is {size} bytes long: {what} ({path}{below}, {size + len(below)} bytes; "
                    f"Linux binds at most {UNIX_PATH_MAX}), so no sample would ever arrive; set TMPDIR to a "
                    f"directory of at most {UNIX_PATH_MAX - len(below)} bytes (e.g. /tmp), or use {off}")
    return None


#: What ``strategy_problems`` checks key by key in ``packer.cost`` / ``packer.balance`` (``field_problems``).
_COST_RULES: tuple[FieldRule, ...] = (
    (("hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "ffn_hidden_size"),
     "a positive integer", lambda v: is_int(v) and v > 0),
    (("vit_hidden_size", "vit_num_layers", "vit_ffn_hidden_size"), "a non-negative integer (0 = no ViT cost)",
     lambda v: is_int(v) and v >= 0),
    (("vae_flops_per_token",), "a number >= 0 (0 = not counted)", lambda v: is_number(v) and not v < 0),
)
_BALANCE_RULES: tuple[FieldRule, ...] = (
    (("target_tokens",), "a positive integer or null", lambda v: v is None or (is_int(v) and v > 0)),
    (("lookahead",), "a number of packs >= 1 (3.0 by default)", lambda v: is_number(v) and v >= 1.0),
    (("max_wait",), "a positive integer (packs)", lambda v: is_int(v) and v >= 1),
)


def _cost_problems(cost: CostConfig, where: str) -> list[str]:
    """Every value of ``packer.cost`` the cost model (``packing.cost.CostModel``) cannot work with."""
    out = field_problems(cost, _COST_RULES, f"{where}.")
    if out:
        return out
    for key, divisor in (("hidden_size", "num_attention_heads"), ("num_attention_heads", "num_query_groups")):
        if getattr(cost, key) % getattr(cost, divisor):
            out.append(f"{where}.{key} ({getattr(cost, key)}) must be a multiple of {divisor} "
                       f"({getattr(cost, divisor)})")
    return out


def strategy_problems(packer: PackerConfig, where: str = "packer") -> list[str]:
    """Every problem of the packer's not-official knobs, one message per key (empty when valid):
    ``strategy`` (one of ``STRATEGIES``), ``balance`` and ``cost`` (checked under every strategy: the job's
    straggler telemetry and ``bagel-data stats`` use the cost model too), and under ``strategy: balanced`` the
    look-ahead pool (``max_buffer_size >= 1``) and a target within ``max_num_tokens``. The mandatory samples'
    bound (they must fit ``max_num_tokens`` together) is a budget check (``budgets.budget_issues``)."""
    out: list[str] = []
    if packer.strategy not in STRATEGIES:
        out.append(f"{where}.strategy: must be one of {list(STRATEGIES)}, got {packer.strategy!r}")
    for sub, cls, check in (("balance", BalanceConfig, lambda b, w: field_problems(b, _BALANCE_RULES, f"{w}.")),
                            ("cost", CostConfig, _cost_problems)):
        value = getattr(packer, sub)
        if isinstance(value, cls):
            out += check(value, f"{where}.{sub}")
        else:
            out.append(f"{where}.{sub}: must be a mapping of {cls.__name__} keys, got {value!r:.60}")
    if out or packer.strategy != "balanced" or packer.problems(where):
        return out
    if packer.max_buffer_size < 1:
        out.append(f"{where}.max_buffer_size: strategy 'balanced' packs from a look-ahead buffer of this many "
                   f"samples; it must be at least 1 (50, the default, or more), got {packer.max_buffer_size}")
    return out + packer.over_cap(where, [("balance.target_tokens", packer.balanced_target_tokens,
                                          "no pack could reach it")])


def validate_data(config: BagelDataConfig, *, budgets: str = "error", readers: bool = True,
                  prior_problems: Sequence[str] = ()) -> ValidatedData:
    """Validate ``config`` and every file it names once; raise one ``ConfigError`` listing every problem.

    ``budgets``: ``"error"`` (budget errors are problems; warnings are logged once per process) or ``"report"`` (budget
    issues are returned in ``warnings`` only, none raised or logged). ``readers=False`` skips step 4 (for tools that
    read metadata only). ``prior_problems``: what the caller found in its own keys (the job's ``train.*``:
    ``job.config.validate_job``), reported first in the same error. Returns ``ValidatedData``.
    """
    if budgets not in ("error", "report"):
        raise ValueError(f"validate_data: budgets must be 'error' or 'report', got {budgets!r}")
    problems = list(prior_problems)
    with _collected(problems):
        config.validate()
    problems += strategy_problems(config.packer)
    paths_ok = not any(p.startswith(("groups:", "dataset_info:")) for p in problems)
    resolved, issues, more = _split_problems(config, config.groups, config.dataset_info, config.groups_source,
                                             config.dataset_info_source, paths_ok=paths_ok, readers=readers,
                                             budgets=budgets)
    problems += more
    valid_resolved: list[ResolvedGroup] | None = None
    if config.valid is not None:
        groups, info = config.valid.groups, config.valid.dataset_info  # a null registry: training's
        valid_ok = not any(p.startswith(("valid.", "valid:")) for p in problems) and (info is not None or paths_ok)
        valid_resolved, valid_issues, more = _split_problems(
            config, groups, config.dataset_info if info is None else info, _source(groups, "valid.groups"),
            config.dataset_info_source if info is None else _source(info, "valid.dataset_info"), paths_ok=valid_ok,
            readers=readers, budgets=budgets)
        problems += [f"data.valid: {m}" for m in more]  # beside training's
        issues += valid_issues
    workers = bool(config.num_workers) and config.order != "official"  # the official order's are emulated
    if readers and (workers or config.prefetch):
        problems += filter(None, [socket_path_problem(workers=workers, prefetch=bool(config.prefetch))])
    if problems:
        raise ConfigError.of(problems, header=f"{config.groups_source}: the data configuration has "
                             f"{len(problems)} problem(s)")
    return ValidatedData(config, resolved, issues if budgets == "report" else log_warnings(issues), valid_resolved)


def _split_problems(config: BagelDataConfig, groups_value: Any, info_value: Any, groups_source: str,
                    info_source: str, *, paths_ok: bool, readers: bool, budgets: str
                    ) -> tuple[list[ResolvedGroup], list[BudgetIssue], list[str]]:
    """Steps 2-5 of the module docstring for one split (training's ``groups`` / ``dataset_info``, or
    ``valid.groups`` / its registry): the resolved groups (empty when they could not be resolved), the budget
    issues and the split's problems, each naming ``groups_source`` / ``info_source``."""
    problems: list[str] = []
    groups: list[GroupConfig] | None = None
    info = None
    if paths_ok:
        with _collected(problems):
            groups = load_grouped_yaml(groups_value, source=groups_source)
        with _collected(problems):
            info = load_dataset_info(info_value, source=info_source)
    resolved: list[ResolvedGroup] = []
    if groups is not None and info is not None:
        with _collected(problems):
            resolved = resolve_groups(groups, info, source=info_source)
        if readers:
            for r in resolved:
                _reader_problems(config, r, problems, groups_source=groups_source, info_source=info_source)
    issues: list[BudgetIssue] = []
    if groups is not None and not config.packer.problems() and not strategy_problems(config.packer):
        issues = budget_issues(config.packer, groups, source=groups_source, official=config.order == "official")
        if budgets == "error":
            problems += [f"packer budgets cannot work with these groups: {issue.message}"
                         for issue in issues if issue.level == "error"]
    return resolved, issues, problems


# --------------------------------------------------------------------------------------------------
# Launch-wide checks (``job.config``): unknown keys of every config part, and the config's file paths named
# by the key and the config file that hold them. Separate from ``validate_data``, whose problems they join.


def _nested_schema(hint: Any) -> type | None:
    """The dataclass a field holds (``X`` or ``X | None``), None for a free-form field (``Any``, ``dict``)."""
    if dataclasses.is_dataclass(hint):
        return hint
    inner = [a for a in typing.get_args(hint) if a is not type(None)]
    return inner[0] if len(inner) == 1 and dataclasses.is_dataclass(inner[0]) else None


def unknown_key_problems(schema: type, part: Any, source: str, prefix: str = "") -> tuple[list[str], Any]:
    """Every key of ``part`` (a mapping or OmegaConf node, one config file or one override) that the dataclass
    ``schema`` does not have, nested dataclasses included: ``(messages, part without those keys)``.

    Each message names ``source`` and the dotted key, with the closest known names (``difflib``) when any,
    e.g. ``"job.yaml: key 'data.packer.max_buffer_sise' is not a config key (did you mean 'max_buffer_size'?)"``.
    Free-form fields (``Any``, ``dict``: ``model``, an inline ``dataset_info``) are not looked into. The part
    returned merges cleanly where only unknown keys were wrong, so the launch's other problems are found too.
    """
    from omegaconf import DictConfig, OmegaConf

    data = OmegaConf.to_container(part, resolve=False) if isinstance(part, DictConfig) else part
    if not isinstance(data, dict):
        return [], part
    hints = typing.get_type_hints(schema)
    known = [f.name for f in dataclasses.fields(schema)]
    messages: list[str] = []
    clean: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=2, cutoff=0.6)
            hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
            messages.append(f"{source}: key {dotted!r} is not a config key{hint}")
            continue
        nested = _nested_schema(hints.get(key))
        if nested is not None and isinstance(value, dict):
            more, value = unknown_key_problems(nested, value, source, f"{dotted}.")
            messages += more
        clean[key] = value
    return messages, (OmegaConf.create(clean) if isinstance(part, DictConfig) else clean)


def key_origin(parts: Sequence[Any], names: Sequence[str], dotted: str) -> str | None:
    """The name of the last of ``parts`` (config file, then ``key=value`` overrides) that sets ``dotted``: the one
    whose value is in force; None when none sets it (a default)."""
    from omegaconf import OmegaConf

    return next((name for part, name in reversed(list(zip(parts, names)))
                 if OmegaConf.select(part, dotted, default="\0missing") != "\0missing"), None)


def path_problems(paths: Mapping[str, tuple[Any, str | None]]) -> tuple[list[str], set[str]]:
    """``paths``: config key -> (value, the config file or override that set it). Every string value that is not
    an existing file is one message naming the key and where it was set, each path once (a key whose value
    repeats an earlier key's path is not reported again: ``data.valid.dataset_info`` defaults to training's).
    Returns the messages and the missing paths (whose read errors the caller leaves out: already said)."""
    messages: list[str] = []
    missing: set[str] = set()
    for key, (value, origin) in paths.items():
        if not isinstance(value, str) or value in missing or os.path.isfile(value):
            continue
        missing.add(value)
        where = f" (set in {origin})" if origin else ""
        what = "is a directory, not a file" if os.path.isdir(value) else "does not exist"
        messages.append(f"{key}{where}: {value} {what}")
    return messages, missing
