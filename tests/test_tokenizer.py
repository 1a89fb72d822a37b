"""Offline Qwen2.5 tokenizer (build, disk cache, memo) and BAGEL's special-token ids."""

from __future__ import annotations

import os
import time

import pytest

from bridge.models.bagel.data import tokenizer as tk
from bridge.models.bagel.data.tokenizer import (
    QWEN2_LEN,
    add_special_tokens,
    build_qwen2_tokenizer,
    load_tokenizer,
)

SPECIAL_IDS = {"bos_token_id": 151644, "eos_token_id": 151645, "start_of_image": 151652, "end_of_image": 151653}
# probe encodings recorded with the official run (golden bagel_readers config["tokenizer"]["probes"])
PROBES = {
    "Hello world": [9707, 1879],
    " ": [220],
    "": [],
    "Soft edges fading into white.": [30531, 12822, 58517, 1119, 4158, 13],
    "Что на картинке? 🌈 naïve": [72819, 24634, 13073, 134341, 52571, 30, 11162, 234, 230, 94880, 586],
    "add rain.. tilt 5 degrees.": [718, 11174, 496, 36200, 220, 20, 12348, 13],
}


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tokcache")


@pytest.fixture(scope="module")
def tok(cache_root):
    return build_qwen2_tokenizer(cache_root)


def test_built_tokenizer_vocab_and_probes(tok):
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert len(tok) == QWEN2_LEN == 151665
    for text, ids in PROBES.items():
        assert tok.encode(text) == ids, text
    assert tok.encode("<|im_start|>hi<|im_end|>") == [151644, 6023, 151645]


def test_add_special_tokens_official_semantics(tok):
    tok2, ids, n_new = add_special_tokens(tok)
    assert tok2 is tok
    assert ids == SPECIAL_IDS
    # transformers 5: special_tokens_map lacks the additional special tokens, so add_tokens gets all 4
    # and reports 4 (as the official function did in the golden run), but nothing is really added
    assert "<|im_start|>" not in str(tok.special_tokens_map)
    assert n_new == 4
    assert len(tok) == QWEN2_LEN
    assert tok.encode("Hello world") == [9707, 1879]


def test_cache_reload_gives_identical_ids(cache_root, tok):
    key_dirs = [p for p in cache_root.iterdir() if not p.name.startswith(".")]
    assert len(key_dirs) == 1 and (key_dirs[0] / "tokenizer.json").is_file()
    assert not [p for p in cache_root.iterdir() if p.name.startswith(".")], "temp dir left behind"
    tk._MEMO.clear()                                   # force a load from disk
    reloaded = build_qwen2_tokenizer(cache_root)  # (its speed is a benchmark matter, not a unit test's)
    assert len(reloaded) == QWEN2_LEN
    for text in [*PROBES, "<|vision_start|><|vision_end|>", "日本語のテキスト\n\ttabs  ", "emoji 👩‍👩‍👧 ok"]:
        assert reloaded.encode(text) == tok.encode(text), text
    assert add_special_tokens(reloaded)[1] == SPECIAL_IDS


def test_snapshot_equals_json_load_and_untrusted_one_is_ignored(cache_root, tok):
    """Issue 13 (time to first batch): the pickled snapshot is what loading tokenizer.json gives."""
    (target,) = [p for p in cache_root.iterdir() if not p.name.startswith(".")]
    snap = target / "tokenizer.pkl"
    snap.unlink(missing_ok=True)
    tk._MEMO.clear()
    from_json = build_qwen2_tokenizer(cache_root)         # no snapshot: JSON load, which writes one
    assert snap.is_file() and (snap.stat().st_mode & 0o777) == 0o644
    tk._MEMO.clear()
    from_snapshot = build_qwen2_tokenizer(cache_root)
    assert type(from_snapshot) is type(from_json) and len(from_snapshot) == QWEN2_LEN
    assert from_snapshot.special_tokens_map == from_json.special_tokens_map
    assert {i: str(t) for i, t in from_snapshot.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in from_json.added_tokens_decoder.items()}
    for text in [*PROBES, "<|vision_start|><|vision_end|>", "emoji 👩‍👩‍👧 ok"]:
        assert from_snapshot.encode(text) == from_json.encode(text) == tok.encode(text), text
    assert add_special_tokens(from_snapshot)[1] == SPECIAL_IDS
    snap.write_bytes(b"not a pickle")
    os.chmod(snap, 0o666)                                   # writable by others: never unpickled
    assert not tk._snapshot_is_trusted(snap)
    tk._MEMO.clear()
    assert build_qwen2_tokenizer(cache_root).encode("Hello world") == [9707, 1879]
    assert (snap.stat().st_mode & 0o777) == 0o644 and snap.read_bytes() != b"not a pickle"  # rewritten


def test_memo_per_process(cache_root):
    t0 = time.perf_counter()
    assert build_qwen2_tokenizer(cache_root) is build_qwen2_tokenizer(cache_root)
    assert time.perf_counter() - t0 < 1.0


def test_concurrent_writer_keeps_existing_cache(cache_root, tok):
    (target,) = [p for p in cache_root.iterdir() if not p.name.startswith(".")]
    before = (target / "tokenizer.json").stat().st_mtime_ns
    tk._save_atomically(tok, target)                   # loses the rename race: must not raise or clobber
    assert (target / "tokenizer.json").stat().st_mtime_ns == before
    assert not [p for p in cache_root.iterdir() if p.name.startswith(".")]


def test_env_var_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("BAGEL_TOKENIZER_CACHE", str(tmp_path / "envcache"))
    assert tk.default_cache_dir() == tmp_path / "envcache"
    monkeypatch.delenv("BAGEL_TOKENIZER_CACHE")
    assert tk.default_cache_dir().parts[-2:] == ("bagel-megatron-data", "qwen2-tokenizer")


def test_load_tokenizer_paths(cache_root, tok, monkeypatch, tmp_path):
    monkeypatch.setenv("BAGEL_TOKENIZER_CACHE", str(cache_root))
    assert load_tokenizer(None).encode("Hello world") == [9707, 1879]
    assert len(load_tokenizer("qwen2-offline")) == QWEN2_LEN
    saved = tmp_path / "saved"
    tok.save_pretrained(str(saved))
    assert load_tokenizer(str(saved)).encode(" ") == [220]
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="Qwen/Qwen2.5-7B"):
        load_tokenizer("Qwen/Qwen2.5-7B")
    empty = tmp_path / "empty"
    os.mkdir(empty)
    with pytest.raises(ValueError, match="could not be loaded"):
        load_tokenizer(str(empty))
