"""BagelExternalLoader: Megatron's external-iterator protocol, exact resume, fingerprints, safe state files."""

from __future__ import annotations

import os
import pickle
import zipfile

import pytest
import torch

from _external_common import (DENSE_CASE, FLEX_CASE, assert_same, demo_loader, golden_loader,
                              single_process_pg_collection)
from bridge.models.bagel.data.external import ResumeMismatchError, energon_state_classes
from bridge.models.bagel.data.state import StateError, check_restricted


# -- protocol ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [0, -3, True, 2.5, None])
def test_length_must_be_a_positive_int(length):
    with pytest.raises(ValueError, match="length must be a positive int"):
        golden_loader(length=length)


def test_is_its_own_iterator_with_length_hint_and_position():
    loader = golden_loader(length=2)
    assert iter(loader) is loader and len(loader) == 2
    batches = [next(loader) for _ in range(3)]  # length is only a hint: iteration is not bounded by it
    assert loader.position == 3
    assert all("packed_text_ids" in b for b in batches)


def test_close_is_idempotent_and_stops_iteration():
    with golden_loader() as loader:
        next(loader)
    loader.close()
    with pytest.raises(RuntimeError, match="after close"):
        next(loader)


def test_fingerprint_must_be_restricted_types():
    from pathlib import Path

    with pytest.raises(StateError, match="pathlib"):
        golden_loader(fingerprint={"root": Path("/data")})


# -- in-memory resume -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [FLEX_CASE, DENSE_CASE])
@pytest.mark.parametrize("save_after", [1, 3, 7])
def test_restore_into_fresh_loader_continues_exactly(case, save_after):
    ref = golden_loader(case)
    for _ in range(save_after):
        next(ref)
    state = ref.save_state()
    check_restricted(state, allow=energon_state_classes())
    expected = [next(ref) for _ in range(10)]
    fresh = golden_loader(case, length=3)  # a different length (train_iters) must not matter
    fresh.restore_state(pickle.loads(pickle.dumps(state)))
    assert fresh.position == save_after
    for i, want in enumerate(expected):
        assert_same(next(fresh), want, f"resumed[{i}]")


def test_save_is_side_effect_free():
    a, b = golden_loader(), golden_loader()
    for i in range(6):
        a.save_state()
        assert_same(next(a), next(b), f"batch{i}")


# -- bad states -------------------------------------------------------------------------------------------


def test_fingerprint_mismatch_names_every_differing_key():
    saved = golden_loader(fingerprint={"seed": 1, "groups": {"t2i": 0.5, "vlm": 0.5}, "dp_size": 8}).save_state()
    other = golden_loader(fingerprint={"seed": 2, "groups": {"t2i": 0.7, "vlm": 0.5}, "dp_size": 8})
    with pytest.raises(ResumeMismatchError) as err:
        other.restore_state(saved)
    msg = str(err.value)
    assert "loader.seed: saved=1 current=2" in msg
    assert "loader.groups.t2i: saved=0.5 current=0.7" in msg
    assert "dp_size" not in msg and "vlm" not in msg
    assert isinstance(err.value, ValueError)
    assert other.position == 0  # nothing was restored


def test_a_refused_restore_is_short_and_says_what_to_do(demo_setup):
    """A state restored under another order or worker count (real readers: Energon's config differs in hundreds
    of keys): the configuration keys are named, the stage keys only counted, and the message gives the remedy."""
    import dataclasses

    from _external_common import demo_config
    from bridge.models.bagel.data.build import build_bagel_train_loader

    out, tok = demo_setup
    base = demo_config(out, 0, True)
    elastic = build_bagel_train_loader(dataclasses.replace(base, order="elastic"), tok, (0, 1), length=10)
    saved = elastic.save_state()
    elastic.close()
    official = dataclasses.replace(base, order="official", num_workers=1)
    cases = {"order": (official, "loader.order: saved='elastic' current='official'", False),
             "workers": (dataclasses.replace(official, num_workers=2), "loader.num_workers: saved=1 current=2", True)}
    for name, (cfg, key, elastic_hint) in cases.items():
        if name == "workers":
            plain = build_bagel_train_loader(official, tok, (0, 1), length=10)
            saved = plain.save_state()
            plain.close()
        loader = build_bagel_train_loader(cfg, tok, (0, 1), length=10)
        try:
            with pytest.raises(ResumeMismatchError) as err:
                loader.restore_state(saved)
        finally:
            loader.close()
        msg = str(err.value)
        assert key in msg, msg
        assert "more: keys of the stages, which follow from these)" in msg and len(msg) < 2500, (name, len(msg))
        assert "restore with the data configuration this state was saved with" in msg
        assert ("only data.order: elastic lets a run change DP size or data.num_workers" in msg) == elastic_hint


def test_a_chain_that_cannot_be_saved_is_said_at_construction(caplog):
    """A hand-wired chain with an upstream that has no state (a plain iterator under the RNG iterator) still
    iterates, but the loader warns when it is built, naming the stage and field, not first at the first
    checkpoint; a savable chain builds without that warning."""
    import logging

    from bridge.models.bagel.data.external import BagelExternalLoader, BagelRNGIterator

    with caplog.at_level(logging.WARNING, logger="bridge.models.bagel.data.pipeline.loader"):
        loader = BagelExternalLoader(BagelRNGIterator(iter([{"x": 1}, {"x": 2}]), 1), length=2)
    [line] = [r.getMessage() for r in caplog.records if "save_state() will raise" in r.getMessage()]
    assert "BagelRNGIterator.source: list_iterator cannot save its state" in line, line
    assert next(loader) == {"x": 1}
    with pytest.raises(StateError, match="list_iterator .* has no state_dict"):
        loader.save_state()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bridge.models.bagel.data.pipeline.loader"):
        golden_loader()
    assert "save_state() will raise" not in caplog.text


def _edit(state, path, value=None, *, drop=False):
    """A deep copy of ``state`` with the entry at ``path`` (keys) replaced (or removed when ``drop``)."""
    import copy

    out = copy.deepcopy(state)
    node = out
    for key in path[:-1]:
        node = node[key]
    if drop:
        del node[path[-1]]
    else:
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value
    return out


_RNG = ("source", "state")                       # BagelRNGIterator's state inside the loader's
_PACKER = (*_RNG, "source", "state")                # BagelPacker's state inside the RNG iterator's


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s: [s], "must be a dict, got list"),
        (lambda s: _edit(s, ("source",), drop=True), r"missing \['source'\]"),
        (lambda s: {**s, "version": 99}, "version 99"),
        (lambda s: {"version": 1, "fingerprint": s["fingerprint"], "position": 0, "packer": {}, "loaders": []},
         "version 1 is not supported"),
        (lambda s: _edit(s, (*_PACKER, "source"), lambda v: v[:2]), "source count differs"),
        (lambda s: {**s, "position": -1}, "position must be"),
        (lambda s: {}, r"not a loader state \(no version, fingerprint, generation, position, source, stateful_loaders; keys: "
                       r"\[\]\): pass what save_state\(\) returned"),
        (lambda s: {"model": 1}, r"not a loader state .*keys: \['model'\]"),
        (lambda s: _edit(s, (*_RNG, "python_rng"), [3, [0], None]), "python_rng"),
        (lambda s: _edit(s, (*_RNG, "source"), drop=True), "'source'"),
        (lambda s: _edit(s, ("source", "stage"), "PrefetchStage"), "belongs to a PrefetchStage"),
    ],
)
def test_malformed_state_raises_a_clear_error(mutate, match):
    state = golden_loader().save_state()
    with pytest.raises(StateError, match=match):
        golden_loader().restore_state(mutate(state))


# -- through Megatron-Bridge's own save/load functions ----------------------------------------------------


@pytest.fixture(scope="module")
def bridge_ckpt():
    from bridge.models.bagel.data._bridge import import_bridge

    api = import_bridge()
    if api.maybe_save_dataloader_state is None:
        pytest.skip(api.checkpointing_error)
    return api, single_process_pg_collection()


def _state_file(root, step):
    return os.path.join(root, f"iter_{step:07d}", "train_dataloader_dprank000.pt")


@pytest.mark.parametrize("case", [FLEX_CASE, DENSE_CASE])
def test_bridge_save_and_load_resume_exactly(bridge_ckpt, tmp_path, case):
    from megatron.core.rerun_state_machine import RerunDataIterator

    api, pgs = bridge_ckpt
    root = str(tmp_path / "energon")
    it = RerunDataIterator(golden_loader(case))
    for _ in range(3):
        next(it)
    api.maybe_save_dataloader_state(None, it, 3, root, pg_collection=pgs)
    assert os.path.isfile(_state_file(root, 3))
    expected = [next(it) for _ in range(10)]
    payload = api.energon_torch_load(_state_file(root, 3))
    assert set(payload) == {"dataloader_state_dict"}
    resumed = RerunDataIterator(golden_loader(case, length=1))
    api.maybe_load_dataloader_state(resumed, 3, root, pg_collection=pgs)
    assert resumed.iterable.position == 3
    for i, want in enumerate(expected):
        assert_same(next(resumed), want, f"resumed[{i}]")


def test_truncated_state_file_fails_clearly(bridge_ckpt, tmp_path):
    from megatron.core.rerun_state_machine import RerunDataIterator

    api, pgs = bridge_ckpt
    root = str(tmp_path / "energon")
    api.maybe_save_dataloader_state(None, RerunDataIterator(golden_loader()), 2, root, pg_collection=pgs)
    path = _state_file(root, 2)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    fresh = RerunDataIterator(golden_loader())
    with pytest.raises(zipfile.BadZipFile):
        api.maybe_load_dataloader_state(fresh, 2, root, pg_collection=pgs)
    assert fresh.iterable.position == 0


class _WritesAFile:
    """A pickle payload that, if ever unpickled by a permissive loader, creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_code_carrying_state_file_is_refused_and_never_runs(bridge_ckpt, tmp_path):
    from megatron.core.rerun_state_machine import RerunDataIterator

    api, pgs = bridge_ckpt
    # the payload is live: a permissive loader would run it
    live = tmp_path / "live.pt"
    torch.save({"dataloader_state_dict": _WritesAFile(str(tmp_path / "proof"))}, live)
    torch.load(live, weights_only=False)
    assert (tmp_path / "proof").exists()

    root = tmp_path / "energon"
    path = _state_file(str(root), 5)
    os.makedirs(os.path.dirname(path))
    marker = tmp_path / "pwned"
    state = golden_loader().save_state()
    state["source"]["state"]["source"]["state"]["evil"] = _WritesAFile(str(marker))
    torch.save({"dataloader_state_dict": state}, path)
    fresh = RerunDataIterator(golden_loader())
    with pytest.raises(pickle.UnpicklingError, match="system"):
        api.maybe_load_dataloader_state(fresh, 5, str(root), pg_collection=pgs)
    assert not marker.exists()
    assert fresh.iterable.position == 0


def test_tampered_fingerprint_in_file_is_refused(bridge_ckpt, tmp_path):
    from megatron.core.rerun_state_machine import RerunDataIterator

    api, pgs = bridge_ckpt
    root = tmp_path / "energon"
    path = _state_file(str(root), 4)
    os.makedirs(os.path.dirname(path))
    state = golden_loader().save_state()
    state["fingerprint"]["loader"]["rank_seed"] = 15
    torch.save({"dataloader_state_dict": state}, path)
    with pytest.raises(ResumeMismatchError, match="loader.rank_seed: saved=15 current=14"):
        api.maybe_load_dataloader_state(RerunDataIterator(golden_loader()), 4, str(root), pg_collection=pgs)


# -- the full stack on the demo dataset (all three groups, real Energon readers) ------------------------------


def _demo_loader(demo_setup, num_workers, use_flex, *, length=100, seed=42):
    out, tok = demo_setup
    return demo_loader(out, tok, num_workers, use_flex, length=length, seed=seed)


# The full grid (saves after 0/1/3/7, workers 0/2, flex/dense, prefetch 0/2) runs in test_stage_round_trip.py.
DEMO_CONFIGS = [
    pytest.param(0, True, (1, 3), id="nw0-flex-save1-3"),
]


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("num_workers, use_flex, save_points", DEMO_CONFIGS)
def test_demo_resume_through_bridge_is_exact(bridge_ckpt, demo_setup, tmp_path, num_workers, use_flex, save_points):
    from megatron.core.rerun_state_machine import RerunDataIterator

    api, pgs = bridge_ckpt
    root = str(tmp_path / "energon")
    n_after = 10
    with _demo_loader(demo_setup, num_workers, use_flex) as loader:
        it = RerunDataIterator(loader)
        stream = []
        for step in range(1, max(save_points) + n_after + 1):
            stream.append(next(it))
            if step in save_points:
                api.maybe_save_dataloader_state(None, it, step, root, pg_collection=pgs)
        buffered = [len(api.energon_torch_load(_state_file(root, s))["dataloader_state_dict"][_RNG[0]][_RNG[1]]
                        ["source"]["state"]["buffer"]) for s in save_points]
    assert set(stream[0]) >= {"packed_text_ids", "sample_lens", "nested_attention_masks" if not use_flex else "split_lens"}
    for step in save_points:
        with _demo_loader(demo_setup, num_workers, use_flex, length=7) as fresh:
            resumed = RerunDataIterator(fresh)
            api.maybe_load_dataloader_state(resumed, step, root, pg_collection=pgs)
            for i in range(n_after):
                assert_same(next(resumed), stream[step + i], f"save@{step} resumed[{i}]")
    if len(save_points) > 1:
        assert any(buffered), "some save point should hold buffered samples (restore_sample path)"


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_demo_resume_refuses_other_seed(bridge_ckpt, demo_setup, tmp_path):
    from megatron.core.rerun_state_machine import RerunDataIterator

    api, pgs = bridge_ckpt
    root = str(tmp_path / "energon")
    with _demo_loader(demo_setup, 0, True) as loader:
        it = RerunDataIterator(loader)
        next(it)
        api.maybe_save_dataloader_state(None, it, 1, root, pg_collection=pgs)
    with _demo_loader(demo_setup, 0, True, seed=43) as other:
        with pytest.raises(ResumeMismatchError, match="loader.seed: saved=42 current=43"):
            api.maybe_load_dataloader_state(RerunDataIterator(other), 1, root, pg_collection=pgs)


def test_stateful_loaders_kept_for_callers_that_pass_them():
    """The seed contract: ``stateful_loaders=`` still works. Sources the chain already owns are saved once (through
    the packer); an extra stateful object is saved and restored alongside the chain."""
    from bridge.models.bagel.data.external import BagelExternalLoader
    from bridge.models.bagel.data.packing import ListGroupSource

    owned = golden_loader()
    assert owned.state_dict()["stateful_loaders"] == []  # its sources are in the packer's state already

    def make():
        inner = golden_loader()
        extra = ListGroupSource([{"text_ids_list": [], "image_tensor_list": []}] * 3, cycle=True, name="extra")
        return BagelExternalLoader(inner.source, length=4, stateful_loaders=[extra], fingerprint={"x": 1}), extra

    loader, extra = make()
    next(loader)
    next(extra), next(extra)
    state = loader.save_state()
    assert [s["stage"] for s in state["stateful_loaders"]] == ["ListGroupSource"]
    expected = next(loader)
    fresh, fresh_extra = make()
    fresh.restore_state(state)
    assert fresh_extra.position == 2
    assert_same(next(fresh), expected)
    with pytest.raises(TypeError, match="stateful_loaders\\[0\\]"):
        BagelExternalLoader(golden_loader().source, length=1, stateful_loaders=[object()])
