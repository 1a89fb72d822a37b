"""The official grouped-datasets YAML (``data/configs/example.yaml`` format, spec bagel_packer.md §3.1).

Parsed without mutating the input; every per-group key is checked against ``GROUP_KEYS`` and any other key
is a ``ConfigError`` naming the file, group and key. ``config`` re-exports everything public here.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import yaml

from ..transforms import ImageTransform
from ..yaml_errors import yaml_problem

__all__ = ["ConfigError", "GROUP_KEYS", "GroupConfig", "KNOWN_GROUPS", "field_problems", "is_int", "is_number",
           "load_grouped_yaml", "is_url", "read_mapping", "resolve_path"]

#: Group names with a reader (the official ``DATASET_REGISTRY`` keys).
KNOWN_GROUPS: tuple[str, ...] = ("t2i_pretrain", "unified_edit", "vlm_sft")

_TRANSFORM_KEYS = frozenset(
    ("max_image_size", "min_image_size", "image_stride", "max_pixels", "image_mean", "image_std"))
#: Every per-group key of the official grouped YAML (spec bagel_packer.md §3.1); anything else is refused.
GROUP_KEYS: tuple[str, ...] = ("dataset_names", "weight", "is_mandatory", "image_transform_args",
                               "vit_image_transform_args", "frame_sampler_args", "num_used_data", "resume_data_status",
                               "shuffle_lines", "shuffle_seed")
#: Keys only the vlm_sft class accepts (the official t2i / edit constructors raise TypeError on them).
_VLM_ONLY_KEYS = ("frame_sampler_args", "shuffle_lines", "shuffle_seed")
_FRAME_SAMPLER_KEYS = frozenset(("max_num_frames", "min_num_frames"))


class ConfigError(ValueError):
    """A configuration file or value is invalid; the message names the file and key.

    ``problems`` lists every problem found by one validation pass (one entry, the message, when raised
    for a single problem); ``ConfigError.of`` builds one error from several.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = list(problems) if problems else [message]

    @classmethod
    def of(cls, problems: list[str], *, header: str) -> "ConfigError":
        """One error holding every problem (a single one is raised as it is, without the header)."""
        if len(problems) == 1:
            return cls(problems[0])
        return cls(header + ":\n  - " + "\n  - ".join(problems), problems)


@dataclass
class GroupConfig:
    """One top-level group of the grouped YAML (every key of ``GROUP_KEYS``; any other key is a ConfigError).

    ``num_used_data`` is the official per-dataset selection (t2i / edit: that many parquet files, the
    listing repeated when larger than the file count; vlm: the first n lines after the optional
    ``shuffle_lines`` shuffle with ``random.Random(shuffle_seed)``); None = every converted sample once.
    ``frame_sampler_args`` (``max_num_frames`` / ``min_num_frames``) samples the frames of vlm ``video`` records
    (``energon.cooking.video``). ``resume_data_status`` must be true (every group resumes exactly).
    """

    name: str
    dataset_names: list[str]
    weight: float = 0.0
    is_mandatory: bool = False
    image_transform_args: dict[str, Any] | None = None
    vit_image_transform_args: dict[str, Any] | None = None
    frame_sampler_args: dict[str, Any] | None = None
    num_used_data: list[int] | None = None
    resume_data_status: bool = True
    shuffle_lines: bool = False
    shuffle_seed: int = 0

    def transform(self) -> ImageTransform | None:
        """The group's ``ImageTransform`` (the official ``transform`` kwarg), or None."""
        return ImageTransform(**self.image_transform_args) if self.image_transform_args else None

    def vit_transform(self) -> ImageTransform | None:
        """The group's ViT ``ImageTransform`` (edit groups), or None."""
        return ImageTransform(**self.vit_image_transform_args) if self.vit_image_transform_args else None


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: A rule of ``field_problems``: the keys it checks, what their values must be (message text), the test they pass.
FieldRule = tuple[tuple[str, ...], str, Callable[[Any], bool]]


def field_problems(obj: Any, rules: Iterable[FieldRule], prefix: str = "") -> list[str]:
    """``"<prefix><key>: must be <what>, got <value!r>"`` for every key of ``rules`` whose value (the attribute of
    ``obj``) fails the rule's test, in rule and key order."""
    return [f"{prefix}{key}: must be {what}, got {getattr(obj, key)!r}"
            for keys, what, ok in rules for key in keys if not ok(getattr(obj, key))]


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (YAML would silently keep the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(f"duplicate key {key!r} (line {key_node.start_mark.line + 1})")
        seen.add(key)
    return loader.construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def is_url(value: Any) -> bool:
    """Whether ``value`` is a URL (``scheme://...``, e.g. an object-storage ``msc://PROFILE/path``), not a path."""
    return isinstance(value, str) and "://" in value and value.split("://", 1)[0].isalpha()


def resolve_path(value: Any, base_dir: str | os.PathLike | None) -> Any:
    """``value`` resolved against ``base_dir`` when it is a relative path string (``~`` expanded); anything
    else (an absolute path, a URL, None, a mapping, an OmegaConf ``???`` / ``${...}``) as it is.

    The rule of every path a config file holds: relative to the directory of the file that holds it, so a
    job behaves the same from any working directory (Slurm, ``torchrun`` launched elsewhere). Paths typed on
    the command line (``key=value`` overrides) stay relative to the working directory, as a shell user expects.
    """
    if base_dir is None or not isinstance(value, str) or not value or value == "???" or "${" in value \
            or is_url(value):
        return value
    value = os.path.expanduser(value)
    return value if os.path.isabs(value) else os.path.normpath(os.path.join(os.fspath(base_dir), value))


def read_mapping(path_or_dict: str | os.PathLike | Mapping, source: str) -> tuple[dict, str]:
    """Deep copy of a mapping, or the parsed YAML/JSON file; returns (data, source name)."""
    if isinstance(path_or_dict, Mapping):
        return copy.deepcopy(dict(path_or_dict)), source
    path = Path(path_or_dict)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc}") from exc
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=_StrictLoader)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {yaml_problem(exc)}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    return data, source


def _transform_args(args: Any, where: str, problems: list[str]) -> dict | None:
    """``args`` when they are valid ``ImageTransform`` arguments, else None (a problem added when not None)."""
    if args is None:
        return None
    if not isinstance(args, dict):
        problems.append(f"{where}: must be a mapping of ImageTransform arguments, got {type(args).__name__}")
    elif unknown := sorted(set(args) - _TRANSFORM_KEYS):
        problems.append(f"{where}: unknown ImageTransform argument(s) {unknown} (known: {sorted(_TRANSFORM_KEYS)})")
    else:
        try:
            ImageTransform(**args)
            return args
        except (TypeError, ValueError) as exc:
            problems.append(f"{where}: {exc}")
    return None


def _parse_group(name: str, raw: Any, src: str) -> GroupConfig:
    """One group, every key checked: a ``ConfigError`` listing every problem of the group (``.problems``)."""
    where = f"{src}: group {name!r}"
    if name not in KNOWN_GROUPS:
        raise ConfigError(f"{where}: unknown group (known groups: {', '.join(KNOWN_GROUPS)})")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(raw).__name__}")
    raw = dict(raw)
    problems: list[str] = []
    names = raw.pop("dataset_names", None)
    if names is None:
        problems.append(f"{where}: missing required key 'dataset_names'")
    elif not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        problems.append(f"{where}: key 'dataset_names' must be a non-empty list of names, got {names!r}")
        names = None
    weight = raw.pop("weight", 0.0)
    if not is_number(weight) or weight < 0:
        problems.append(f"{where}: key 'weight' must be a non-negative number, got {weight!r}")
    for key in [k for k in raw if k not in GROUP_KEYS]:
        problems.append(f"{where}: key {key!r} is not an official grouped-YAML key this loader supports "
                        f"(known: {', '.join(GROUP_KEYS)})")
        raw.pop(key)
    problems += [f"{where}: key {key!r} applies only to vlm_sft (the official {name} class rejects it)"
                 for key in _VLM_ONLY_KEYS if name != "vlm_sft" and key in raw]
    flags = {}
    for key, default in (("is_mandatory", False), ("resume_data_status", True), ("shuffle_lines", False)):
        flags[key] = raw.pop(key, default)
        if not isinstance(flags[key], bool):
            problems.append(f"{where}: key {key!r} must be of type bool (true/false), got {flags[key]!r}")
    if flags["resume_data_status"] is False:
        problems.append(f"{where}: key 'resume_data_status': false is not supported (official: the group restarts "
                        "from its first unit after a resume); this loader always resumes every group exactly")
    shuffle_seed = raw.pop("shuffle_seed", 0)
    if not is_int(shuffle_seed):
        problems.append(f"{where}: key 'shuffle_seed' must be of type int, got {shuffle_seed!r}")
    image_args, vit_args = (_transform_args(raw.pop(key, None), f"{where}: key {key!r}", problems)
                            for key in ("image_transform_args", "vit_image_transform_args"))
    frame_args = raw.pop("frame_sampler_args", None)
    if frame_args is not None:
        if not isinstance(frame_args, dict):
            problems.append(f"{where}: key 'frame_sampler_args' must be a mapping, got {type(frame_args).__name__}")
        elif set(frame_args) - _FRAME_SAMPLER_KEYS or not all(is_int(v) and v > 0 for v in frame_args.values()):
            problems.append(f"{where}: key 'frame_sampler_args' takes positive integers "
                            f"{sorted(_FRAME_SAMPLER_KEYS)}, got {frame_args!r}")
    num_used = raw.pop("num_used_data", None)
    if num_used is not None:
        if not isinstance(num_used, list) or not all(is_int(n) and n >= 0 for n in num_used):
            problems.append(f"{where}: key 'num_used_data' must be a list of non-negative integers, got {num_used!r}")
        elif names is not None and len(num_used) != len(names):
            problems.append(f"{where}: key 'num_used_data' has {len(num_used)} entries but 'dataset_names' has "
                            f"{len(names)}")
        elif not any(num_used):
            problems.append(f"{where}: key 'num_used_data' selects no data ({num_used!r})")
    assert not raw, raw  # every key was checked against GROUP_KEYS above
    if problems:
        raise ConfigError.of(problems, header=f"{where}: {len(problems)} problems")
    return GroupConfig(name=name, dataset_names=names, weight=float(weight), image_transform_args=image_args,
                       vit_image_transform_args=vit_args, frame_sampler_args=frame_args, num_used_data=num_used,
                       shuffle_seed=shuffle_seed, **flags)


def load_grouped_yaml(path_or_dict: str | os.PathLike | Mapping, *, source: str = "<dict>") -> list[GroupConfig]:
    """Parse the official grouped-datasets YAML (top-level keys = groups, in order); input is not mutated."""
    data, src = read_mapping(path_or_dict, source)
    if not data:
        raise ConfigError(f"{src}: no groups defined")
    groups, problems = [], []
    for name, raw in data.items():
        try:
            groups.append(_parse_group(name, raw, src))
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError.of(problems, header=f"{src}: {len(problems)} groups are invalid")
    total = sum(g.weight for g in groups)
    if total <= 0:
        raise ConfigError(f"{src}: the group weights sum to {total}; at least one 'weight' must be positive")
    return groups
