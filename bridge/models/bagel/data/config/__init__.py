"""Configuration: everything a job is told, checked once.

* ``schema``: the data config (``BagelDataConfig``, an OmegaConf-structured dataclass, ``structured_merge``), the
  orders;
* ``packer``: the packer knobs (``PackerConfig``, the one place their defaults live);
* ``registry``: the official dataset registry and the groups resolved against it;
* ``loading``: a file's paths and ``key=value`` overrides as config parts (``load_config``);
* ``grouped_yaml``: the official grouped-datasets YAML (``configs/example.yaml`` format).
* ``lengths`` / ``outcomes``: the packer's length rules and what a converted sample can become (its layouts);
* ``budgets``: the config-time budget checks (cases B3/B4/B6), one list of rules.
* ``validate``: ``validate_data``, the one validation pass every entry point goes through.

Everything public is re-exported here (``from bridge.models.bagel.data.config import BagelDataConfig``).
"""

from .grouped_yaml import GROUP_KEYS, KNOWN_GROUPS, ConfigError, GroupConfig, load_grouped_yaml, resolve_path
from .loading import config_parts, load_config
from .packer import OFFICIAL_NON_PACKER_KEYS, PACKER_BUDGET_KEYS, STRATEGIES, BalanceConfig, CostConfig, PackerConfig
from .registry import DatasetInfoEntry, ResolvedGroup, load_dataset_info, resolve_groups
from .schema import (DATA_PATH_KEYS, DEFAULT_PARTITIONS, ORDERS, PREFETCH_STARTS, REMOVED_ORDERS, BagelDataConfig,
                     ValidDataConfig, structured_merge)
from .validate import ValidatedData, validate_data

__all__ = [
    "DATA_PATH_KEYS", "DEFAULT_PARTITIONS", "GROUP_KEYS", "KNOWN_GROUPS", "OFFICIAL_NON_PACKER_KEYS", "ORDERS",
    "PACKER_BUDGET_KEYS", "PREFETCH_STARTS", "REMOVED_ORDERS", "STRATEGIES", "BagelDataConfig", "BalanceConfig",
    "CostConfig", "ConfigError", "DatasetInfoEntry", "GroupConfig", "PackerConfig", "ResolvedGroup", "ValidDataConfig",
    "ValidatedData",
    "config_parts", "load_config", "load_dataset_info", "load_grouped_yaml", "resolve_groups", "resolve_path",
    "structured_merge", "validate_data",
]
