"""Official BAGEL image/utility semantics: worked examples, hand-computed layouts and golden tensors."""

from __future__ import annotations

import importlib.util
import io
import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageFile, PngImagePlugin

from bridge.models.bagel.data.transforms import (
    DEFAULT_MAX_PIXELS,
    ImageTransform,
    configure_pil,
    get_flattened_position_ids_extrapolate,
    get_flattened_position_ids_interpolate,
    len2weight,
    patchify,
    pil_img2rgb,
    uint8_to_float,
)

FIXTURES = Path(__file__).parent / "fixtures" / "bagel_readers"

VAE = dict(max_image_size=1024, min_image_size=512, image_stride=16)
VIT = dict(max_image_size=518, min_image_size=224, image_stride=14)
VLM = dict(max_image_size=980, min_image_size=378, image_stride=14, max_pixels=2_007_040)


@pytest.fixture
def pil_globals():
    """configure_pil() for the test, PIL's previous globals restored afterwards."""
    saved = (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES, PngImagePlugin.MAX_TEXT_CHUNK)
    configure_pil()
    yield
    Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES, PngImagePlugin.MAX_TEXT_CHUNK = saved


# --- target size ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "args, wh, img_num, hw",
    [
        (VAE, (640, 480), 1, (512, 688)),      # spec §9.1 example
        (VAE, (16, 48), 1, (1024, 336)),       # short edge first -> [512x1536], then long-edge cap
        (VAE, (2400, 256), 1, (112, 1024)),    # max_pixels area ratio as linear factor, 220.5 -> 220
        (VAE, (200, 1800), 1, (1024, 112)),
        (VAE, (552, 700), 1, (704, 544)),      # 552/16 = 34.5 -> 34 (half to even)
        (VAE, (1024, 576), 1, (576, 1024)),
        (VAE, (200, 100), 1, (512, 1024)),
        (VAE, (500, 300), 1, (512, 848)),
        (VAE, (1600, 200), 1, (128, 1024)),
        (VIT, (40, 30), 1, (224, 294)),
        (VIT, (1600, 200), 1, (70, 518)),
        (VIT, (512, 512), 1, (518, 518)),      # 512/14 = 36.57 -> 37: slight upscale
        (VLM, (1400, 1050), 3, (686, 924)),    # budget split over 3 images, 52.5 -> 52
        (VLM, (1500, 100), 1, (70, 980)),
        (VLM, (12, 30), 1, (952, 378)),        # 67.5 -> 68
        (VLM, (720, 540), 1, (546, 714)),
        (VLM, (270, 480), 4, (672, 378)),
    ],
)
def test_target_size_worked_examples(args, wh, img_num, hw):
    assert ImageTransform(**args).target_size(*wh, img_num=img_num) == hw


def test_image_transform_defaults_and_validation():
    t = ImageTransform(**VAE)
    assert t.stride == 16 and t.max_pixels == DEFAULT_MAX_PIXELS == 1_806_336
    assert ImageTransform(**VAE, image_mean=[0.5] * 3, image_std=(0.5, 0.5, 0.5)).image_mean == 0.5
    with pytest.raises(ValueError, match="image_stride"):
        ImageTransform(1024, 512, 0)
    with pytest.raises(ValueError, match="image_mean"):
        ImageTransform(**VAE, image_mean=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="RGB"):
        t(Image.new("L", (64, 64)))
    with pytest.raises(ValueError, match="positive"):
        t.target_size(0, 10)


def test_call_matches_resize_and_normalize():
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8), "RGB")
    t = ImageTransform(**VIT)
    out = t(img)
    h, w = t.target_size(53, 37)
    ref = np.array(img.resize((w, h), Image.BICUBIC), dtype=np.float32) / np.float32(255)
    ref = ((ref - np.float32(0.5)) / np.float32(0.5)).transpose(2, 0, 1)
    assert out.dtype == torch.float32 and tuple(out.shape) == (3, h, w)
    assert torch.equal(out, torch.from_numpy(np.ascontiguousarray(ref)))
    assert out.min() >= -1 and out.max() <= 1
    u8 = t.to_uint8(img)
    assert u8.dtype == torch.uint8 and u8.is_contiguous() and torch.equal(uint8_to_float(u8), out)


def test_uint8_to_float_extremes():
    u8 = torch.tensor([0, 128, 255], dtype=torch.uint8).view(3, 1, 1)
    out = uint8_to_float(u8)
    assert out.dtype == torch.float32
    assert out[0, 0, 0].item() == -1.0 and out[2, 0, 0].item() == 1.0


# --- patchify / position ids / len2weight --------------------------------------------------------

def test_patchify_layout():
    x = torch.arange(2 * 4 * 6).view(2, 4, 6)   # C=2, H=4, W=6
    p = patchify(x, 2)
    assert tuple(p.shape) == (2 * 3, 2 * 2 * 2)
    # patch (grid row 0, grid col 1): pixels rows 0..1, cols 2..3; (row, col, channel), channel fastest
    expected = [x[c, r, 2 + q].item() for r in range(2) for q in range(2) for c in range(2)]
    assert p[1].tolist() == expected == [2, 26, 3, 27, 8, 32, 9, 33]
    # row-major grid: patch index 3 = grid row 1, col 0 -> top-left pixel (2, 0)
    assert p[3, 0].item() == x[0, 2, 0].item()
    with pytest.raises(ValueError, match="not divisible by patch size 4"):
        patchify(x, 4)


def test_position_ids_extrapolate():
    ids = get_flattened_position_ids_extrapolate(32, 48, 16, 4)
    assert ids.dtype == torch.int64
    assert ids.tolist() == [0, 1, 2, 4, 5, 6]
    # nw > max_side aliases silently (official quirk): 1x5 grid with M=4
    assert get_flattened_position_ids_extrapolate(14, 70, 14, 4).tolist() == [0, 1, 2, 3, 4]
    # partial patches are floored
    assert get_flattened_position_ids_extrapolate(31, 17, 16, 10).tolist() == [0]


def test_position_ids_interpolate():
    # M=4: boundaries [0.25, 0.5, 0.75]; nh=2 -> coords [0, .5] -> buckets [0, 2]; nw=4 -> [0, 1, 2, 3]
    ids = get_flattened_position_ids_interpolate(28, 56, 14, 4)
    assert ids.dtype == torch.int64
    assert ids.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    # nh=8 onto M=4: two rows per bucket (0.25 lands right of the boundary)
    assert get_flattened_position_ids_interpolate(8, 1, 1, 4).tolist() == [0, 0, 4, 4, 8, 8, 12, 12]
    # nh=3: [0, 1/3, 2/3] -> [0, 1, 2]
    assert get_flattened_position_ids_interpolate(3, 1, 1, 4).tolist() == [0, 4, 8]
    # a grid larger than the table stays inside it
    big = get_flattened_position_ids_interpolate(100 * 14, 3 * 14, 14, 70)
    assert big.numel() == 300 and int(big.min()) == 0 and int(big.max()) < 70 * 70


def test_len2weight():
    assert len2weight(0) == 0
    assert len2weight(7, "token") == 1
    assert len2weight(4, "sample") == 0.25
    assert len2weight(4) == 0.5
    assert len2weight(3) == 1 / math.sqrt(3) == 1 / (3 ** 0.5)
    with pytest.raises(ValueError, match="unknown mode"):
        len2weight(3, "bogus")


# --- pil_img2rgb -----------------------------------------------------------------------------------

def test_pil_img2rgb_rgba_composites_on_white():
    arr = np.zeros((1, 3, 4), np.uint8)
    arr[0, :, 0] = 200
    arr[0, :, 3] = [0, 255, 128]
    out = np.array(pil_img2rgb(Image.fromarray(arr, "RGBA")))
    assert out.shape == (1, 3, 3)
    assert out[0, 0].tolist() == [255, 255, 255]      # fully transparent -> white
    assert out[0, 1].tolist() == [200, 0, 0]          # opaque -> unchanged
    assert 200 < out[0, 2, 0] < 255 and 0 < out[0, 2, 1] < 255   # half: blended with white


def test_pil_img2rgb_palette_with_transparency(tmp_path):
    im = Image.new("P", (2, 1))
    im.putpalette([10, 20, 30, 40, 50, 60] + [0] * 762)
    im.putpixel((0, 0), 0)
    im.putpixel((1, 0), 1)
    im.save(tmp_path / "p.png", transparency=0)      # index 0 (falsy!) is transparent
    loaded = Image.open(tmp_path / "p.png")
    assert loaded.info.get("transparency") == 0
    assert np.array(pil_img2rgb(loaded)).tolist() == [[[255, 255, 255], [40, 50, 60]]]


def test_pil_img2rgb_rgb_colour_key(tmp_path):
    im = Image.new("RGB", (2, 1), (1, 2, 3))
    im.putpixel((1, 0), (9, 9, 9))
    im.save(tmp_path / "k.png", transparency=(1, 2, 3))
    assert np.array(pil_img2rgb(Image.open(tmp_path / "k.png"))).tolist() == [[[255, 255, 255], [9, 9, 9]]]


def test_pil_img2rgb_la_is_not_composited():
    la = Image.fromarray(np.array([[[77, 0], [150, 255]]], np.uint8), "LA")
    assert "transparency" not in la.info
    assert np.array(pil_img2rgb(la)).tolist() == [[[77, 77, 77], [150, 150, 150]]]


def test_pil_img2rgb_cmyk_plain_convert():
    cmyk = Image.new("CMYK", (3, 2), (10, 200, 30, 40))
    out = pil_img2rgb(cmyk)
    assert out.mode == "RGB" and np.array_equal(np.array(out), np.array(cmyk.convert("RGB")))


def test_configure_pil(pil_globals):
    assert Image.MAX_IMAGE_PIXELS == 200_000_000
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True
    assert PngImagePlugin.MAX_TEXT_CHUNK == 1024 ** 3


# --- golden: official tensors re-derived from the raw bytes ------------------------------------------

def _load_golden(name: str) -> dict:
    spec = importlib.util.spec_from_file_location("bagel_golden_decode", FIXTURES / "decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load(str(FIXTURES / name))


def _check(expected: torch.Tensor, got: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.float32 and got.shape == expected.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    assert torch.equal(got, expected), f"{what}: values differ"


@pytest.mark.parity
def test_golden_t2i_images(pil_globals):
    case = _load_golden("t2i_pretrain.pt")
    transform = ImageTransform(**VAE)
    assert len(case["samples"]) == 17
    for s in case["samples"]:
        src = s["meta"]["source"]
        table = pq.ParquetFile(FIXTURES / "raw" / src["file"]).read_row_group(src["row_group"])
        raw = table.column("image")[src["row_in_row_group"]].as_py()
        img = pil_img2rgb(Image.open(io.BytesIO(raw)))
        (expected,) = s["image_tensor_list"]
        _check(expected, transform(img), src["case"])


@pytest.mark.parity
def test_golden_vlm_images(pil_globals):
    case = _load_golden("vlm_sft.pt")
    transform = ImageTransform(**VLM)
    n_images = 0
    for s in case["samples"]:
        src = s["meta"]["source"]
        names = json.loads(src["raw_line"]).get("image", [])
        names = [names] if isinstance(names, str) else names
        assert len(names) == len(s["image_tensor_list"]), src["case"]
        for i, (name, expected) in enumerate(zip(names, s["image_tensor_list"])):
            with Image.open(FIXTURES / "raw" / "vlm" / "images" / name) as im:
                img = pil_img2rgb(im)
            _check(expected, transform(img, img_num=len(names)), f"{src['case']} image {i}")
            n_images += 1
    assert n_images == 21
