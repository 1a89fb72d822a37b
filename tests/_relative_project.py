"""A job whose every path is relative: ``root/project/{configs/job.yaml, data/groups.yaml, data/dataset_info.yaml}``
over the session's demo dataset (tests of the path rule, and jobs launched from another directory)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def project(demo_setup, root: Path, *, groups_edit=None, info_edit=None) -> Path:
    """``root/project/{configs/job.yaml, data/groups.yaml, data/dataset_info.yaml}``, every path relative:
    the job YAML names ``../data/...``, the registry's ``energon_path`` entries are relative to ``data/``."""
    out, _ = demo_setup
    data_dir, cfg_dir = root / "project" / "data", root / "project" / "configs"
    data_dir.mkdir(parents=True)
    cfg_dir.mkdir(parents=True)
    info = yaml.safe_load((out / "dataset_info.yaml").read_text())
    for entries in info.values():
        for entry in entries.values():
            entry["energon_path"] = os.path.relpath(entry["energon_path"], data_dir)
    groups = yaml.safe_load((out / "groups.yaml").read_text())
    if groups_edit:
        groups_edit(groups)
    if info_edit:
        info_edit(info)
    (data_dir / "groups.yaml").write_text(yaml.safe_dump(groups, sort_keys=False))
    (data_dir / "dataset_info.yaml").write_text(yaml.safe_dump(info, sort_keys=False))
    job = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    job["demo_data"] = None
    job["data"].update(groups="../data/groups.yaml", dataset_info="../data/dataset_info.yaml", prefetch=0)
    (cfg_dir / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    return cfg_dir / "job.yaml"
