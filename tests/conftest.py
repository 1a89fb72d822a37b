"""Shared test setup: the tests directory on sys.path, and one generated demo dataset per session."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


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
