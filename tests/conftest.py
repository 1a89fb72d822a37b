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
