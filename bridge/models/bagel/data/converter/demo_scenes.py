"""Procedural scenes for the demo dataset: coloured shapes on gradients, rendered with PIL and described in words.

Everything is driven by a seeded ``numpy.random.Generator`` passed in by the caller (no global RNG), so the
same seed gives the same scenes, captions, instructions and encoded bytes.
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 70), "blue": (40, 80, 220), "yellow": (240, 210, 40),
    "orange": (245, 140, 30), "purple": (140, 60, 180), "pink": (240, 120, 180), "cyan": (40, 200, 210),
    "white": (245, 245, 245), "black": (20, 20, 20), "gray": (128, 128, 128), "brown": (130, 80, 40),
}
KINDS = ("circle", "square", "triangle", "diamond")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


@dataclass
class Shape:
    kind: str
    colour: str
    cx: float  # centre, as a fraction of the width/height
    cy: float
    size: float  # radius as a fraction of the short edge

    def describe(self) -> str:
        return f"{self.colour} {self.kind}"


@dataclass
class Scene:
    width: int
    height: int
    bg: tuple[str, str]  # gradient from bg[0] to bg[1] (equal: solid)
    direction: str  # "horizontal" | "vertical" | "diagonal"
    shapes: list[Shape] = field(default_factory=list)
    transparent_bg: bool = False

    def background_words(self) -> str:
        if self.transparent_bg:
            return "a transparent background"
        if self.bg[0] == self.bg[1]:
            return f"a plain {self.bg[0]} background"
        return f"a {self.direction} {self.bg[0]}-to-{self.bg[1]} gradient"


def pick(rng: np.random.Generator, seq, exclude=()) -> str:
    options = [x for x in seq if x not in exclude]
    return options[int(rng.integers(len(options)))]


def random_size(rng: np.random.Generator, lo: int = 96, hi: int = 640) -> tuple[int, int]:
    """A varied size: long edge in [lo, hi], aspect ratio from 1:1 up to about 3:1 either way."""
    long_edge = int(rng.integers(lo, hi + 1))
    ratio = float(rng.choice([1.0, 4 / 3, 3 / 2, 16 / 9, 2.0, 3.0]))
    short = max(lo // 2, int(round(long_edge / ratio)))
    return (long_edge, short) if rng.random() < 0.5 else (short, long_edge)


def random_shape(rng: np.random.Generator, avoid_colours=()) -> Shape:
    return Shape(pick(rng, KINDS), pick(rng, COLOURS, avoid_colours), float(rng.uniform(0.2, 0.8)),
                 float(rng.uniform(0.2, 0.8)), float(rng.uniform(0.08, 0.22)))


def random_scene(rng: np.random.Generator, size: tuple[int, int] | None = None, max_shapes: int = 3,
                 transparent: bool = False) -> Scene:
    w, h = size or random_size(rng)
    c1 = pick(rng, COLOURS)
    c2 = c1 if rng.random() < 0.25 else pick(rng, COLOURS, (c1,))
    scene = Scene(w, h, (c1, c2), pick(rng, ("horizontal", "vertical", "diagonal")), transparent_bg=transparent)
    for _ in range(int(rng.integers(1, max_shapes + 1))):
        scene.shapes.append(random_shape(rng, avoid_colours=(c1, c2) + tuple(s.colour for s in scene.shapes)))
    return scene


def render(scene: Scene) -> Image.Image:
    """Draw the scene: RGBA (transparent background) or RGB."""
    w, h = scene.width, scene.height
    if scene.transparent_bg:
        img = Image.new("RGBA", (w, h), (0, 0, 0, 0))
    else:
        a, b = np.array(COLOURS[scene.bg[0]], np.float32), np.array(COLOURS[scene.bg[1]], np.float32)
        xs, ys = np.linspace(0, 1, w, dtype=np.float32), np.linspace(0, 1, h, dtype=np.float32)
        t = {"horizontal": np.broadcast_to(xs[None, :], (h, w)), "vertical": np.broadcast_to(ys[:, None], (h, w)),
             "diagonal": (xs[None, :] + ys[:, None]) / 2}[scene.direction]
        px = a[None, None, :] * (1 - t[..., None]) + b[None, None, :] * t[..., None]
        img = Image.fromarray(np.round(px).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for s in scene.shapes:
        cx, cy, r = s.cx * w, s.cy * h, max(3.0, s.size * min(w, h))
        fill = COLOURS[s.colour] + ((255,) if img.mode == "RGBA" else ())
        box = [cx - r, cy - r, cx + r, cy + r]
        if s.kind == "circle":
            draw.ellipse(box, fill=fill)
        elif s.kind == "square":
            draw.rectangle(box, fill=fill)
        elif s.kind == "triangle":
            draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)
        else:
            draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
    return img


def encode(img: Image.Image, fmt: str) -> bytes:
    """Encode deterministically (fixed settings, no metadata)."""
    buf = io.BytesIO()
    if fmt == "JPEG":
        img.convert("RGB").save(buf, "JPEG", quality=88)
    else:
        img.save(buf, "PNG", compress_level=6)
    return buf.getvalue()


def position_words(s: Shape) -> str:
    horiz = "left" if s.cx < 0.4 else "right" if s.cx > 0.6 else "centre"
    vert = "top" if s.cy < 0.4 else "bottom" if s.cy > 0.6 else "middle"
    return "in the centre" if (horiz, vert) == ("centre", "middle") else f"in the {vert} {horiz}".replace(
        "middle left", "left middle").replace("middle right", "right middle")


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def captions(rng: np.random.Generator, scene: Scene) -> dict[str, str]:
    """1-3 alternative captions describing the scene (the official t2i ``captions`` JSON object)."""
    things = [f"{article(s.colour)} {s.describe()}" for s in scene.shapes]
    listed = things[0] if len(things) == 1 else ", ".join(things[:-1]) + " and " + things[-1]
    caps = {
        "caption": f"{listed.capitalize()} on {scene.background_words()}.",
        "detailed": " ".join(f"{article(s.colour).capitalize()} {s.describe()} {position_words(s)}."
                             for s in scene.shapes) + f" The background is {scene.background_words()}.",
        "short": f"{len(scene.shapes)} shape{'s' if len(scene.shapes) > 1 else ''}: "
                 + ", ".join(s.describe() for s in scene.shapes),
    }
    keys = list(caps)
    n = int(rng.integers(1, 4))
    chosen = [keys[0]] + ([keys[i] for i in sorted(rng.choice([1, 2], size=n - 1, replace=False))] if n > 1 else [])
    return {k: caps[k] for k in chosen}


def edit_step(rng: np.random.Generator, scene: Scene) -> tuple[Scene, list[str]]:
    """Apply one random edit (move / recolour / add / remove / background); return the new scene and 1-3 phrasings."""
    new = copy.deepcopy(scene)
    ops = ["move", "recolour", "add", "background"] + (["remove"] if len(new.shapes) > 1 else [])
    op = pick(rng, ops)
    if op == "move":
        s = new.shapes[int(rng.integers(len(new.shapes)))]
        d = pick(rng, DIRECTIONS)
        dx, dy = DIRECTIONS[d]
        s.cx, s.cy = float(np.clip(s.cx + 0.25 * dx, 0.1, 0.9)), float(np.clip(s.cy + 0.25 * dy, 0.1, 0.9))
        phr = [f"move the {s.describe()} {d}", f"shift the {s.kind} a bit to the {d}" if d in ("left", "right")
               else f"push the {s.kind} {d}wards", f"Drag the {s.describe()} {d}."]
    elif op == "recolour":
        s = new.shapes[int(rng.integers(len(new.shapes)))]
        old = s.describe()
        s.colour = pick(rng, COLOURS, (s.colour, *new.bg))
        phr = [f"make the {old} {s.colour}", f"recolour the {old} to {s.colour}", f"Paint the {s.kind} {s.colour}."]
    elif op == "add":
        s = random_shape(rng, avoid_colours=new.bg)
        new.shapes.append(s)
        a = article(s.colour)
        phr = [f"add {a} {s.describe()} {position_words(s)}", f"put {a} {s.describe()} into the picture",
               f"Insert {a} {s.colour} {s.kind}."]
    elif op == "remove":
        s = new.shapes.pop(int(rng.integers(len(new.shapes))))
        phr = [f"remove the {s.describe()}", f"delete the {s.kind}", f"Take the {s.describe()} away."]
    else:
        c = pick(rng, COLOURS, (*new.bg, *(s.colour for s in new.shapes)))
        new.bg, new.transparent_bg = (c, c), False
        phr = [f"make the background plain {c}", f"replace the background with solid {c}",
               f"Use {article(c)} {c} backdrop."]
    n = int(rng.integers(1, 4))
    return new, [phr[i] for i in sorted(rng.choice(3, size=n, replace=False))]
