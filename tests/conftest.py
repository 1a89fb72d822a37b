"""Shared test setup: the tests directory on sys.path, the slowest files collected first, one generated demo
dataset per session, and a frozen garbage-collector heap before each test body (see ``pytest_runtest_call``)."""

import gc
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

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


def pytest_collection_modifyitems(config, items):
    """Put ``_LONG_FILES_FIRST`` first; the order within a file, and of the other files, is kept (stable sort)."""
    rank = {name: i for i, name in enumerate(_LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


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
