"""Cooker cores on tiny hand-made crude samples: exact plans / texts / shapes / tokens / choices, every drop reason."""

from __future__ import annotations

import io
import json
import random

import pytest
import torch
from PIL import Image

from bridge.models.bagel.data.energon.cooking.common import DROP_REASONS, Draws, ReplayError, cook_with
from bridge.models.bagel.data.energon.cooking.groups import (
    CORES, make_cook_context,
)
from bridge.models.bagel.data.energon.cooking.sample import PLAN_KEYS, BagelSample
from bridge.models.bagel.data.tokenizer import add_special_tokens, build_qwen2_tokenizer
from bridge.models.bagel.data.transforms import ImageTransform, pil_img2rgb

# small transforms keep tensors tiny: 40x30 -> 48x32 (VAE), -> 42x28 (ViT)
VAE = dict(max_image_size=64, min_image_size=32, image_stride=16)
VIT = dict(max_image_size=56, min_image_size=28, image_stride=14)
SRC = {"file": "x/part.parquet", "file_index": 0, "row_group": 1, "row": 2, "file_row": 7}


def T(t, cfg, loss):
    return {"type": t, "enable_cfg": cfg, "loss": loss, "special_token_loss": 0, "special_token_label": None}


@pytest.fixture(scope="module")
def tok():
    return add_special_tokens(build_qwen2_tokenizer())[0]


def png(w=40, h=30, mode="RGB", color=(200, 30, 60)):
    buf = io.BytesIO()
    Image.new(mode, (w, h), color if mode != "L" else 90).save(buf, format="PNG")
    return buf.getvalue()


def crude(meta: dict, images: dict[int, bytes] | None = None, key="00000000") -> dict:
    c = {"__key__": key, "__restore_key__": ("Webdataset", key), "meta.json": json.dumps(meta).encode()}
    for i, b in (images or {}).items():
        c[f"img{i}"] = b
    return c


def cook(group, tok, c, replay=None, rng=None, **targs):
    ctx = make_cook_context(group, tok, **(targs or {"image_transform_args": VAE, "vit_image_transform_args": VIT}))
    draws = Draws(replay=replay) if replay is not None else Draws(rng=rng or random.Random(0))
    return cook_with(CORES[group], c, ctx, draws, worker_id=3)


def expected_tensor(data: bytes, args=VAE, img_num=1):
    return ImageTransform(**args)(pil_img2rgb(Image.open(io.BytesIO(data))), img_num=img_num)


# ---------------------------------------------------------------------------------------------- Draws
def test_draws_match_random_choice_and_replay():
    seq = ["a", "b", "c", "d", "e"]
    ref, d = random.Random(7), Draws(rng=random.Random(7))
    for n in (5, 1, 3, 5):
        assert d.choice_index(n) == seq[:n].index(ref.choice(seq[:n]))
    assert d.random() == ref.random()
    assert d.finish() == tuple(d.record) and len(d.record) == 5
    with pytest.raises(IndexError):
        d.choice_index(0)  # like random.choice([]): raises, nothing recorded
    assert len(d.record) == 5
    r = Draws(replay=(2, 0.25))
    assert r.choice_index(3) == 2 and r.random() == 0.25 and r.finish() == (2, 0.25)
    with pytest.raises(ReplayError, match="out of range"):
        Draws(replay=(4,)).choice_index(3)
    with pytest.raises(ReplayError, match="more than"):
        Draws(replay=()).random()
    with pytest.raises(ReplayError, match="expected a float"):
        Draws(replay=(1,)).random()
    with pytest.raises(ReplayError, match="used 0 of"):
        Draws(replay=(1,)).finish()


# ------------------------------------------------------------------------------------------------ t2i
def t2i_meta(captions):
    return {"group": "t2i_pretrain", "source": SRC, "captions": captions, "image_null": False}


def test_t2i_sample(tok):
    img = png(40, 30)
    s = cook("t2i_pretrain", tok, crude(t2i_meta(json.dumps({"a": "a red box", "b": "two words"})), {0: img}),
             replay=(1,), image_transform_args=VAE)
    assert isinstance(s, BagelSample) and s.drop_reason is None
    assert s.sequence_plan == [T("text", 1, 0), T("vae_image", 0, 1)]
    assert all(tuple(it) == PLAN_KEYS for it in s.sequence_plan)
    assert s.text_ids_list == [tok.encode("two words")]
    (t,) = s.image_tensor_list
    assert t.dtype == torch.float32 and tuple(t.shape) == (3, 32, 48)  # 40x30 -> scale 32/30 -> 43x32 -> 48x32
    assert torch.equal(t, expected_tensor(img))
    assert s.num_tokens == 2 * 3 + len(tok.encode("two words"))
    assert s.rng_choices == (1,)
    assert s.data_indexes == {"data_indexes": [0, 1, 2], "worker_id": 3, "dataset_name": "t2i_pretrain"}
    assert s.source == SRC and s.restore_key == (("Webdataset", "00000000"), (1,))


def test_t2i_draws_once_over_captions_and_none_without(tok):
    rng, ref = random.Random(11), random.Random(11)
    caps = {"x": "one", "y": "two", "z": ""}
    s = cook("t2i_pretrain", tok, crude(t2i_meta(json.dumps(caps)), {0: png()}), rng=rng, image_transform_args=VAE)
    pick = ref.choice([tok.encode(v) for v in caps.values()])
    assert s.text_ids_list == [pick] and rng.getstate() == ref.getstate()
    empty = cook("t2i_pretrain", tok, crude(t2i_meta("{}"), {0: png()}), rng=rng, image_transform_args=VAE)
    assert empty.text_ids_list == [[220]] and empty.rng_choices == () and rng.getstate() == ref.getstate()
    assert empty.num_tokens == 6 + 1


@pytest.mark.parametrize("captions,images,reason", [
    ('{"a": "x"}', {}, "missing_image"),
    ('{"a": "x"}', {0: b""}, "image_decode_error"),
    ('{"a": "x"}', {0: b"not an image"}, "image_decode_error"),
    (None, {0: None}, "bad_captions_json"),
    ('{"a": "x', {0: None}, "bad_captions_json"),
    ('["a"]', {0: None}, "bad_captions_json"),
    ('{"a": 3}', {0: None}, "bad_captions_json"),
])
def test_t2i_drops(tok, captions, images, reason):
    imgs = {i: (png() if b is None else b) for i, b in images.items()}
    rng = random.Random(0)
    before = rng.getstate()
    s = cook("t2i_pretrain", tok, crude(t2i_meta(captions), imgs), rng=rng, image_transform_args=VAE)
    assert s.drop_reason == reason and s.drop_reason in DROP_REASONS
    assert "x/part.parquet row group 1 row 2" in s.drop_detail
    assert s.rng_choices == () and rng.getstate() == before  # t2i fails before its only draw
    assert s.image_tensor_list == [] and s.num_tokens == 0


def test_bad_meta(tok):
    c = crude(t2i_meta("{}"), {0: png()})
    del c["meta.json"]
    assert cook("t2i_pretrain", tok, c, image_transform_args=VAE).drop_reason == "bad_meta"
    c = crude({"group": "vlm_sft", "source": {"file": "f", "line": 0}})
    assert cook("t2i_pretrain", tok, c, image_transform_args=VAE).drop_reason == "bad_meta"
    c = crude(t2i_meta("{}"))
    c["meta.json"] = b"{oops"
    assert cook("t2i_pretrain", tok, c, image_transform_args=VAE).drop_reason == "bad_meta"


# ----------------------------------------------------------------------------------------------- edit
def edit_meta(n, instr, null=()):
    return {"group": "unified_edit", "source": SRC, "instruction_list": instr, "num_images": n,
            "null_images": list(null)}


def edit_images(n, broken=(), null=()):
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (9, 9, 9)]
    return {i: (b"junk" if i in broken else png(40, 30, color=colors[i])) for i in range(n) if i not in null}


def test_edit_stepwise_two_steps(tok):
    imgs = edit_images(3)
    # start=0, end=0+1+1=2, u=0.7 (stepwise), step 1 takes "b", step 2 takes "c"
    s = cook("unified_edit", tok, crude(edit_meta(3, [["a", "b"], ["c"]]), imgs), replay=(0, 1, 0.7, 1, 0))
    assert s.drop_reason is None
    assert s.sequence_plan == [T("vae_image", 1, 0), T("vit_image", 1, 0),
                               T("text", 1, 0), T("vae_image", 0, 1), T("vae_image", 1, 0), T("vit_image", 1, 0),
                               T("text", 1, 0), T("vae_image", 0, 1)]
    assert s.text_ids_list == [tok.encode("b"), tok.encode("c")]
    vae = [expected_tensor(imgs[i]) for i in range(3)]
    vit = [expected_tensor(imgs[i], VIT) for i in range(3)]
    want = [vae[0], vit[0], vae[1], vae[1], vit[1], vae[2]]
    assert len(s.image_tensor_list) == 6 and all(torch.equal(a, b) for a, b in zip(s.image_tensor_list, want))
    assert tuple(vit[0].shape) == (3, 28, 42) and tuple(vae[0].shape) == (3, 32, 48)
    assert s.image_tensor_list[2] is not s.image_tensor_list[3]  # the clean VAE copy is its own tensor
    assert s.num_tokens == 4 * 6 + 2 * 6 + len(tok.encode("b")) + len(tok.encode("c"))
    assert s.rng_choices == (0, 1, 0.7, 1, 0)


def test_edit_concat_and_last_image_pullback(tok):
    imgs = edit_images(4)
    s = cook("unified_edit", tok, crude(edit_meta(4, [["a", "b"], ["c."], ["d"]]), imgs), replay=(0, 1, 0.2, 1, 0))
    assert s.sequence_plan == [T("vae_image", 1, 0), T("vit_image", 1, 0), T("text", 1, 0), T("vae_image", 0, 1)]
    assert s.text_ids_list == [tok.encode("b. c..")]  # "b. " + "c.. " rstripped
    assert torch.equal(s.image_tensor_list[2], expected_tensor(imgs[2]))
    # n=3, end drawn 2 == n-1 -> pulled back to 1: one instruction, target image 1; the broken image 2 is never read
    imgs3 = edit_images(3, broken=(2,))
    s = cook("unified_edit", tok, crude(edit_meta(3, [["a", "b"], ["c"]]), imgs3), replay=(0, 1, 0.2, 0))
    assert s.drop_reason is None and s.text_ids_list == [tok.encode("a.")]
    assert torch.equal(s.image_tensor_list[2], expected_tensor(imgs3[1]))


def test_edit_draw_order_matches_global_random(tok):
    """With a generator, the draws are exactly: choice, choice, [random], instruction choices."""
    imgs = edit_images(4)
    for seed in range(12):
        rng, ref = random.Random(seed), random.Random(seed)
        s = cook("unified_edit", tok, crude(edit_meta(4, [["a", "b"], ["c", "d", "e"], ["f"]]), imgs), rng=rng)
        start = ref.choice(range(3))
        end = ref.choice(range(start + 1, min(start + 3, 4)))
        exp = [start, end - start - 1]
        if end - start > 1:
            exp.append(ref.random())
        assert list(s.rng_choices[:len(exp)]) == exp
        assert s.drop_reason is None and len(s.rng_choices) in (len(exp) + end - start, len(exp) + end - start - 1)


def _replay_of(n, start, end, concat, steps):
    """The recorded draws of an edit outcome: start, end index, [u], one alternative index per instruction."""
    u = [0.2 if concat else 0.7] if end - start > 1 else []
    return (start, end - start - 1, *u, *[0] * steps)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_edit_outcomes_are_the_cookers_layouts(tok, n):
    """Every (start, end, variant) ``config.outcomes.edit_draws`` lists, cooked with those draws, gives the layout
    ``edit_outcomes`` predicts: the same plan item types and losses, image tokens and estimate (same draws => same
    layout); the probabilities are the official draw's."""
    from bridge.models.bagel.data.config.outcomes import Text, edit_draws, edit_outcomes

    instr = [["go", "turn it blue now"], ["zoom out"], ["rotate the thing"]][:n - 1]
    imgs = edit_images(n)
    vae = [expected_tensor(imgs[i]).shape[1] * expected_tensor(imgs[i]).shape[2] // 16 ** 2 for i in range(n)]
    vit = [expected_tensor(imgs[i], VIT).shape[1] * expected_tensor(imgs[i], VIT).shape[2] // 14 ** 2
           for i in range(n)]
    draws = edit_draws(n)
    assert sum(p for p, *_ in draws) == pytest.approx(1.0)
    first = lambda st: Text(*[len(tok.encode(instr[st][0]))] * 3)  # noqa: E731 - alternative 0 is replayed
    joined = lambda steps: Text(*[len(tok.encode("".join(instr[st][0] + ". " for st in steps).rstrip()))] * 3)  # noqa: E731
    for (p, start, end, concat), out in zip(draws, edit_outcomes(vae, vit, first, joined)):
        steps = end - (end == n - 1) - start if concat else end - start  # instructions drawn (pull-back)
        s = cook("unified_edit", tok, crude(edit_meta(n, instr), imgs), replay=_replay_of(n, start, end, concat, steps))
        assert s.drop_reason is None and out.probability == p
        assert [(t["type"], t["loss"]) for t in s.sequence_plan] == [(i.type, i.loss) for i in out.items]
        images = [i.tokens for i in out.items if i.type != "text"]
        assert [x.shape[1] * x.shape[2] // (14 if t["type"] == "vit_image" else 16) ** 2
                for x, t in zip(s.image_tensor_list, [t for t in s.sequence_plan if t["type"] != "text"])] == images
        assert out.lo == out.hi == s.num_tokens + 2 * len(s.sequence_plan)


@pytest.mark.parametrize("n,instr,broken,null,replay,reason,choices", [
    (1, [], (), (), None, "too_few_images", ()),
    (2, None, (), (), (0, 0), "bad_instructions", (0, 0)),
    (3, [["a"]], (), (), (0, 1, 0.9, 0), "bad_instructions", (0, 1, 0.9, 0)),  # list too short for step 2
    (2, [[]], (), (), (0, 0), "empty_alternatives", (0, 0)),
    (2, [["a"]], (), (0,), (0, 0), "missing_image", (0, 0)),
    (2, [["a"]], (0,), (), (0, 0), "image_decode_error", (0, 0)),
    (3, [["a"], ["b"]], (1,), (), (0, 1, 0.9, 0), "image_decode_error", (0, 1, 0.9, 0)),
    (2, [[5]], (), (), (0, 0, 0), "bad_instructions", (0, 0, 0)),
])
def test_edit_drops(tok, n, instr, broken, null, replay, reason, choices):
    imgs = edit_images(n, broken=broken, null=null)
    s = cook("unified_edit", tok, crude(edit_meta(n, instr, null), imgs), replay=replay or ())
    assert s.drop_reason == reason and s.rng_choices == choices
    assert s.sequence_plan == [] and s.image_tensor_list == [] and s.num_tokens == 0


# ------------------------------------------------------------------------------------------------ vlm
def vlm_meta(rec, errors=None, raw=None):
    line = raw if raw is not None else json.dumps(rec) + "\n"
    return {"group": "vlm_sft", "source": {"file": "v.jsonl", "line": 4}, "raw_line": line, "image_dir": "img",
            "image_names": None, "image_errors": errors or {}}


VLM_T = dict(max_image_size=56, min_image_size=28, image_stride=14, max_pixels=3000)


def test_vlm_sample_budget_split_and_extra_images(tok):
    rec = {"image": ["a.png", "b.png"], "conversations": [
        {"from": "system", "value": "ignored"},
        {"from": "human", "value": "  <image> what is this?<image><image>"},
        {"from": "gpt", "value": "A box."},
        {"from": "human", "value": "\tmore  "},
        {"from": "gpt", "value": "No."}]}
    imgs = {0: png(50, 40), 1: png(30, 30, "L")}
    s = cook("vlm_sft", tok, crude(vlm_meta(rec), imgs), replay=(), image_transform_args=VLM_T)
    assert s.drop_reason is None and s.rng_choices == ()
    assert s.sequence_plan == [T("vit_image", 0, 0), T("text", 0, 0), T("vit_image", 0, 0),
                               T("text", 0, 1), T("text", 0, 0), T("text", 0, 1)]
    assert s.text_ids_list == [tok.encode(x) for x in ("what is this?", "A box.", "\tmore  ", "No.")]
    want = [expected_tensor(imgs[i], VLM_T, img_num=2) for i in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(s.image_tensor_list, want))
    # budget 3000/2 = 1500 pixels: 50x40 -> 56x42 (2352 px) -> x0.638 -> 36x27 -> snapped 42x28; 30x30 -> 28x28
    assert [tuple(t.shape) for t in s.image_tensor_list] == [(3, 28, 42), (3, 28, 28)]
    assert s.num_tokens == 6 + 4 + sum(len(x) for x in s.text_ids_list)
    one = dict(rec, image="a.png")  # alone, the same image keeps the whole budget: 56x42
    s1 = cook("vlm_sft", tok, crude(vlm_meta(one), {0: imgs[0]}), replay=(), image_transform_args=VLM_T)
    assert [tuple(t.shape) for t in s1.image_tensor_list] == [(3, 42, 56)]
    assert s.data_indexes == {"data_indexes": [4], "worker_id": 3, "dataset_name": "vlm_sft"}


def test_vlm_more_images_than_placeholders_and_none(tok):
    rec = {"image": "a.png", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    s = cook("vlm_sft", tok, crude(vlm_meta(rec), {0: png()}), replay=(), image_transform_args=VLM_T)
    assert [p["type"] for p in s.sequence_plan] == ["text", "text"] and len(s.image_tensor_list) == 1
    assert s.num_tokens == 6 + len(tok.encode("hi")) + len(tok.encode("yo"))  # 40x30 -> 42x28: 3x2 patches
    rec = {"conversations": [{"from": "human", "value": "<image> x"}, {"from": "gpt", "value": "y"}]}
    s = cook("vlm_sft", tok, crude(vlm_meta(rec)), replay=(), image_transform_args=VLM_T)
    assert [p["type"] for p in s.sequence_plan] == ["text", "text"] and s.image_tensor_list == []


@pytest.mark.parametrize("rec,raw,errors,images,reason", [
    (None, "{not json\n", None, {}, "bad_json"),
    (None, "   \t\n", None, {}, "bad_json"),
    ([1, 2], None, None, {}, "bad_record"),
    ({"image": "a.png"}, None, None, {0: None}, "bad_record"),
    ({"image": [3], "conversations": []}, None, {"0": "TypeError: expected str"}, {}, "bad_record"),
    ({"video": "v.mp4", "conversations": []}, None, {"video": "FileNotFoundError: [Errno 2] No such file"}, {},
     "missing_video"),
    ({"video": "v.mp4", "conversations": []}, None, None, {0: b"\0"}, "no_frame_sampler"),  # no frame_sampler_args
    ({"image": ["a.png", "b.png"], "conversations": []}, None,
     {"1": "FileNotFoundError: [Errno 2] No such file or directory: 'img/b.png'"}, {0: None}, "missing_image"),
    ({"image": "a.png", "conversations": []}, None, None, {0: b""}, "image_decode_error"),
    ({"image": "a.png", "conversations": [{"from": "human", "value": "<image>x"}, {"from": "gpt", "value": ""}]},
     None, None, {0: None}, "no_loss_item"),
    ({"conversations": [{"from": "human", "value": "a"}]}, None, None, {}, "no_loss_item"),
])
def test_vlm_drops(tok, rec, raw, errors, images, reason):
    imgs = {i: (png() if b is None else b) for i, b in images.items()}
    s = cook("vlm_sft", tok, crude(vlm_meta(rec, errors, raw), imgs), replay=(), image_transform_args=VLM_T)
    assert s.drop_reason == reason and "v.jsonl line 4" in s.drop_detail


# -------------------------------------------------------------------------------- context factory
def test_cook_context_factory(tok):
    ctx = make_cook_context("unified_edit", tok, VAE, VIT)
    assert ctx.group == "unified_edit" and ctx.vit_transform is not None
    with pytest.raises(ValueError, match="vit_image_transform_args"):
        make_cook_context("unified_edit", tok, VAE)
    with pytest.raises(ValueError, match="unknown BAGEL group"):
        make_cook_context("video", tok, VAE)


def test_replayed_choices_draw_nothing(tok):
    ctx = make_cook_context("t2i_pretrain", tok, VAE)
    c = crude(t2i_meta(json.dumps({"a": "one", "b": "two"})), {0: png()})
    before = random.getstate()
    s = cook_with(CORES["t2i_pretrain"], c, ctx, Draws(replay=(0,)), 0)
    assert random.getstate() == before
    assert s.text_ids_list == [tok.encode("one")] and s.data_indexes["worker_id"] == 0
    with pytest.raises(ReplayError):
        cook_with(CORES["t2i_pretrain"], c, ctx, Draws(replay=(0, 1)), 0)
