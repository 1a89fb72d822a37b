"""Shared test setup: the tests directory on sys.path, the slowest files collected first, one generated demo
dataset per session, and a frozen garbage-collector heap before each test body (see ``pytest_runtest_call``)."""

import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Collection imports torch, Megatron-Core, Megatron-Bridge and transformers through the test modules: the cyclic
# collector stays off until it is over (as bagel-train does for a rank's start-up, job/startup.py): ~3 CPU s less
# per pytest process.
gc.disable()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """Collection is over (also in the xdist controller, which collects nothing): freeze and collect again."""
    gc.freeze()
    gc.enable()


#: re-freeze once this many modules were imported since the last freeze (a handful of times per session)
_FREEZE_EVERY_N_MODULES = 20
_frozen_at_modules = 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Move the long-lived heap (imported torch / Megatron / Bridge / transformers, session data) out of the
    collector's generations before the test body runs, as the prefetch producer does for itself.

    Every Energon worker forked from this process runs Energon's ``gc_init_worker``, which walks
    ``gc.get_objects()``: ~700k objects once Megatron-Bridge is imported, about 1 s per worker, 3-4 s of start-up
    per loader with 2 workers per group on 2 cores (measured: 25-32 s -> 8.5 s for build + 3 batches). Frozen
    objects are left out of that walk and never collected, which changes nothing for module-level objects; a
    ``gc.collect()`` first, so no garbage of earlier tests is kept. Only when new modules were imported.
    """
    global _frozen_at_modules
    if len(sys.modules) >= _frozen_at_modules + _FREEZE_EVERY_N_MODULES:
        gc.collect()
        gc.freeze()
        _frozen_at_modules = len(sys.modules)
    yield


#: Test files that take minutes (torchrun worlds, the demo job; ``--durations``), slowest first: collected before
#: the rest, so that ``scripts/run.sh test`` (2 processes, ``--dist loadfile --no-loadscope-reorder``) starts them
#: at once and the short files fill the other process around them, instead of one running alone at the end.
_LONG_FILES_FIRST = ("test_topologies.py", "test_elastic_job.py", "test_main_job.py")


#: The compatibility part of the suite (marker ``compat``): what must hold in every supported environment, run
#: by ``.ci/run`` in a second environment at the oldest end of pyproject.toml's ranges (``scripts/run.sh
#: compat``). Node-id prefixes: a whole file, a test, or one parametrisation; the name must exist (a renamed
#: test fails the collection here instead of silently leaving the part). Kept to a few minutes on 2 cores.
COMPAT_PART = (
    # imports, the install itself, the packaging promises
    "tests/test_install.py",
    "tests/test_bridge_path.py::test_cpu_standin_only_for_lora_layers",
    "tests/test_bridge_path.py::test_provider_is_a_real_mimo_provider",
    "tests/test_bridge_path.py::test_dataset_provider_for_pretrain_builds_the_rank_loader",
    # converter: official raw formats -> Energon, read back by Energon
    "tests/test_convert.py::test_t2i_every_row_once_with_exact_bytes",
    "tests/test_convert.py::test_edit_official_rows_only",
    "tests/test_convert.py::test_vlm_every_line_once",
    "tests/test_convert.py::test_energon_reads_back_everything",
    "tests/test_convert.py::test_deterministic_bytes",
    "tests/test_convert.py::test_convert_from_config_and_cli",
    # packer (its golden suite is not version-bound: bridge/models/bagel/data/parity.py)
    "tests/test_packer_golden.py",
    "tests/test_packer_state.py",
    # builder over a converted dataset, with workers and prefetch; same-topology resume; Bridge save / load
    "tests/test_stage_round_trip.py::test_loader_round_trip_through_bridge[nw0-pf0-flex]",
    "tests/test_stage_round_trip.py::test_loader_round_trip_through_bridge[nw2-pf2-flex]",
    "tests/test_prefetch.py::test_demo_resume_with_prefetch_is_exact[nw0-save3]",
    "tests/test_reader.py::test_resume_nw0[7]",
    "tests/test_reader.py::test_resume_and_restore_sample_with_read_workers",
    "tests/test_reader.py::test_state_is_small_and_survives_bridges_restricted_unpickler",
    "tests/test_external.py::test_bridge_save_and_load_resume_exactly",
    "tests/test_external.py::test_demo_resume_through_bridge_is_exact",
    "tests/test_checkpoint.py::test_good_state_file_still_restores",
    # elastic resume (resize, exactly once)
    "tests/test_elastic.py::test_resize_2_4_3_is_exactly_once_and_deterministic",
    # Energon: an untested version selects the public path (the compat environment's Energon is one)
    "tests/test_compact_open.py::test_an_untested_energon_version_selects_the_public_path",
    # the seed contract with real Energon loaders
    "tests/test_seed_contract.py::test_energon_savable_loader_in_stateful_loaders_resumes_exactly[1-0]",
    "tests/test_seed_contract.py::test_energon_savable_loader_in_stateful_loaders_resumes_exactly[1-2]",
    "tests/test_seed_contract.py::test_energon_savable_loader_resumes_through_bridge_save_and_load",
    "tests/test_seed_contract.py::test_mimo_provider_from_train_loader_alone_over_plain_batches",
    "tests/test_seed_contract.py::test_energon_state_of_another_energon_version_is_refused_in_one_line",
    "tests/test_seed_contract.py::test_the_builders_loader_state_holds_no_energon_class",
    # the data watchdog
    "tests/test_watchdog.py::test_a_read_that_never_returns_warns_then_times_out[2-0-elastic]",
    "tests/test_watchdog.py::test_a_slow_but_healthy_source_is_not_cut_off",
)


def _matches(nodeid: str, prefix: str) -> bool:
    """``prefix`` names this node: the file, the test (any parametrisation) or exactly this one."""
    return nodeid == prefix or nodeid.startswith(prefix + "::") or nodeid.startswith(prefix + "[")


def _mark_compat_part(config, items) -> None:
    """Add the ``compat`` marker to the tests ``COMPAT_PART`` names. When whole files were collected, a name
    whose file is among them but that matches no test is a usage error (renamed or removed: update the list).
    Runs before ``-m`` / ``-k`` deselect anything (conftest hooks run before pytest's own)."""
    used = set()
    for item in items:
        for prefix in COMPAT_PART:
            if _matches(item.nodeid, prefix):
                item.add_marker(pytest.mark.compat)
                used.add(prefix)
    if any("::" in str(arg) for arg in config.args):  # a selection of tests: the others are simply not here
        return
    files = {item.nodeid.split("::", 1)[0] for item in items}
    root = Path(str(config.rootpath))
    stale = [p for p in COMPAT_PART if (p not in used and p.split("::", 1)[0] in files)
             or not (root / p.split("::", 1)[0]).is_file()]
    if stale:
        raise pytest.UsageError("tests/conftest.py COMPAT_PART names tests that do not exist (renamed or "
                                "removed? update the list): " + ", ".join(stale))


def _skip_unproven_parity(items) -> None:
    """Tests marked ``parity`` compare our bits with official BAGEL's: outside the versions they were proven
    on (``parity.PROVEN_VERSIONS``) they are skipped with that reason. ``BAGEL_PARITY_ANYWAY=1`` runs them
    (to see whether the bits hold elsewhere)."""
    from bridge.models.bagel.data.parity import parity_note

    note = parity_note()
    if not note or os.environ.get("BAGEL_PARITY_ANYWAY") == "1":
        return
    skip = pytest.mark.skip(reason=note)
    for item in items:
        if item.get_closest_marker("parity") is not None:
            item.add_marker(skip)


def pytest_collection_modifyitems(config, items):
    """Put ``_LONG_FILES_FIRST`` first (the order within a file, and of the other files, is kept: stable
    sort); mark the compatibility part; skip the parity tests outside their proven versions."""
    rank = {name: i for i, name in enumerate(_LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    _mark_compat_part(config, items)
    _skip_unproven_parity(items)


@pytest.fixture(scope="session")
def demo_setup(tmp_path_factory):
    """The embedded demo dataset (all three groups, converted to Energon) and the offline Qwen2 tokenizer."""
    from bridge.models.bagel.data.converter.demo import make_demo_data
    from bridge.models.bagel.data.tokenizer import build_qwen2_tokenizer

    out = tmp_path_factory.mktemp("demo") / "d"
    make_demo_data(str(out), seed=0)
    return out, build_qwen2_tokenizer()


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """The golden reader raw data (tests/fixtures/bagel_readers/raw, official formats) converted to Energon."""
    from bridge.models.bagel.data.converter.convert import convert_edit, convert_t2i, convert_vlm

    raw = Path(__file__).parent / "fixtures" / "bagel_readers" / "raw"
    out = tmp_path_factory.mktemp("golden_converted")
    convert_t2i(str(raw / "t2i"), out, progress=False)
    convert_edit(str(raw / "unified_edit"), str(raw / "parquet_info" / "unified_edit.json"), out, progress=False)
    convert_vlm(str(raw / "vlm" / "vlm_sft.jsonl"), str(raw / "vlm" / "images"), out, progress=False)
    return out


@pytest.fixture(scope="session")
def tokenizer():
    """The offline Qwen2 tokenizer with BAGEL's special tokens added."""
    from bridge.models.bagel.data.tokenizer import add_special_tokens, build_qwen2_tokenizer

    tok, _, _ = add_special_tokens(build_qwen2_tokenizer())
    return tok


@pytest.fixture
def short_tmp_path():
    """A fresh directory directly under /tmp, removed after the test: short enough to be a TMPDIR for worker
    processes (their unix sockets live below it; pytest's own tmp_path, under xdist, can be too long)."""
    path = Path(tempfile.mkdtemp(prefix="bagel-t-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
