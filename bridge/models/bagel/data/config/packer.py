"""The packer knobs (``data.packer.*``): ``PackerConfig`` (the one place their defaults live), its cost model
(``CostConfig``) and balanced-loop settings (``BalanceConfig``), the strategies and which knobs are budgets.

Plain dataclasses checked by ``PackerConfig.validate``; ``schema.BagelDataConfig`` holds one under ``packer``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .grouped_yaml import ConfigError, FieldRule, field_problems, is_int, is_number

__all__ = ["OFFICIAL_NON_PACKER_KEYS", "PACKER_BUDGET_KEYS", "STRATEGIES", "BalanceConfig", "CostConfig",
           "PackerConfig"]

logger = logging.getLogger(__name__)

#: Values ``PackerConfig.strategy`` accepts: the official greedy loop (default, bit-exact) or the cost-balanced
#: loop (``packing.balance``).
STRATEGIES: tuple[str, ...] = ("official", "balanced")
#: The packer *budgets*: the ``data.packer.*`` knobs that only decide how the samples read are packed (how many
#: tokens a pack aims at / may hold, which sample is too long, how many samples wait in the overflow buffer or the
#: balanced pool), never which samples are read nor in which order. With ``data.resume_budget_change: true`` they
#: may change across a resume under ``data.order: elastic`` (docs/resume.md): the packer's waiting samples go back
#: to the readers. Everything else (dropout probabilities, image geometry, ``lossless``, ``strategy``, ``use_flex``
#: ...) changes the samples or the loop and stays part of the resume fingerprint.
PACKER_BUDGET_KEYS: tuple[str, ...] = ("expected_num_tokens", "max_num_tokens", "max_num_tokens_per_sample",
                                       "prefer_buffer_before", "max_buffer_size", "balance.target_tokens",
                                       "balance.lookahead", "balance.max_wait")
#: Keys of the official ``PackedDataset(data_config, **packed_dataset_args)`` call that are not packer knobs
#: (the dataset's place in the world and its resume status): pass as ``PackerConfig.from_mapping(ignore=...)``
#: when reading an official config.
OFFICIAL_NON_PACKER_KEYS: tuple[str, ...] = ("grouped_datasets", "data_status", "local_rank", "num_workers",
                                             "world_size")

#: What ``PackerConfig.problems`` checks key by key (``grouped_yaml.field_problems``).
_PACKER_RULES: tuple[FieldRule, ...] = (
    (("expected_num_tokens", "max_num_tokens_per_sample", "max_num_tokens", "prefer_buffer_before",
      "vae_image_downsample", "max_latent_size", "vit_patch_size", "max_num_patch_per_side", "max_consecutive_drops"),
     "a positive integer", lambda v: is_int(v) and v > 0),
    (("max_buffer_size",), "a non-negative integer", lambda v: is_int(v) and v >= 0),
    (("interpolate_pos", "use_flex", "lossless"), "a bool", lambda v: isinstance(v, bool)),
    (("text_cond_dropout_prob", "vit_cond_dropout_prob", "vae_cond_dropout_prob"), "a probability in [0, 1]",
     lambda v: is_number(v) and 0.0 <= v <= 1.0),
)
#: The risky packer budgets already warned about in this process (``PackerConfig.validate``).
_WARNED: set[tuple[int, int, int]] = set()


@dataclass
class CostConfig:
    """The model whose compute one pack costs (``packing.cost.CostModel``; ``data.packer.cost.*``).

    Defaults: BAGEL-7B, i.e. Qwen2-7B with SigLIP-so400m/14 cut to 26 layers as BAGEL runs it; the FLOPs these give
    are derived in ``packing/cost.py``.
    """

    hidden_size: int = 3584           # the LLM (Qwen2-7B)
    num_layers: int = 28
    num_attention_heads: int = 28
    num_query_groups: int = 4         # KV heads
    ffn_hidden_size: int = 18944
    vit_hidden_size: int = 1152       # the ViT (SigLIP-so400m/14, 26 layers)
    vit_num_layers: int = 26
    vit_ffn_hidden_size: int = 4304
    #: FLOPs of the (frozen, forward-only) VAE encoder per latent token, 0 = not counted (not derived here: measure
    #: it for your VAE and image sizes).
    vae_flops_per_token: float = 0.0


@dataclass
class BalanceConfig:
    """Knobs of ``packer.strategy: balanced`` (``packing.balance``; ``data.packer.balance.*``).

    ``target_tokens``: the mean real tokens a balanced pack aims at; every pack's cost target is this many tokens at the
    stream's mean cost per token (None = ``(expected_num_tokens + max_num_tokens) / 2``). ``lookahead``: packs' worth of
    cost the look-ahead buffer is refilled to before each pack (at most ``max_buffer_size`` samples). ``max_wait``:
    packs after which a waiting sample is packed whenever the token cap allows, even past the cost target.
    """

    target_tokens: int | None = None
    lookahead: float = 3.0
    max_wait: int = 8


@dataclass
class PackerConfig:
    """Every BagelPacker knob with the official defaults (``DataConfig`` + ``PackedDataset``).

    The one place these knobs and their defaults live: ``BagelPacker`` and its ``PackLayout`` take this object.
    """

    #: The budgets; tokens are packed sequence positions.
    expected_num_tokens: int = 32768        # tokens: soft target, a pack is yielded once its length reaches it
    max_num_tokens_per_sample: int = 16384  # tokens: a sample estimated above it is dropped (overlength)
    max_num_tokens: int = 36864             # tokens: hard cap of a pack (with use_flex also its padded length)
    prefer_buffer_before: int = 16384       # tokens: while a pack is shorter, buffered samples go first
    max_buffer_size: int = 50               # samples the overflow buffer holds
    #: Interpolated instead of extrapolated latent position ids; flex split metadata instead of dense masks.
    interpolate_pos: bool = False
    use_flex: bool = False
    #: CFG dropout probabilities of the conditioning text / ViT / VAE items.
    text_cond_dropout_prob: float = 0.1
    vit_cond_dropout_prob: float = 0.4
    vae_cond_dropout_prob: float = 0.1
    #: Image geometry, checked against the groups' transforms (``budgets``).
    vae_image_downsample: int = 16          # px per VAE latent (the VAE stride)
    max_latent_size: int = 32               # latents per side of the latent position table
    vit_patch_size: int = 14                # px per ViT patch
    max_num_patch_per_side: int = 70        # patches per side of the ViT position table
    #: Not an official knob: a group whose samples are dropped as over-length this many times in a row, with
    #: none packed, raises ``DataStallError`` (the official loop would spin forever).
    max_consecutive_drops: int = 100
    #: Not an official knob (default off = the official loop): keep the sample an official flush discards
    #: (``flush_drop`` / ``flush_drop_buffered``) for the next pack, and never let mandatory samples overflow
    #: ``max_num_tokens`` (``packing.step``; docs/packing_ledger.md).
    lossless: bool = False
    #: Not an official knob: ``official`` (the official loop, default) or ``balanced`` (every pack close to one
    #: common compute target, so no data-parallel rank waits for another; ``packing.balance``, docs/packing.md).
    strategy: str = "official"
    #: ``strategy: balanced`` only: its target and waiting bound.
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    #: The model's dimensions for the compute estimate of a pack (the balanced strategy, the job's straggler
    #: telemetry and ``bagel-data stats``; ``packing.cost``). Never changes an official pack.
    cost: CostConfig = field(default_factory=CostConfig)

    def stream_identity(self) -> dict[str, Any]:
        """The knobs that decide the batch stream, for resume fingerprints: the official knobs, and under
        ``strategy: balanced`` also ``strategy: {name, balance, cost}`` (so a fingerprint difference names the
        strategy in every line). Under ``official`` the three keys only feed telemetry and are left out, so states
        saved before they existed still resume."""
        out = dataclasses.asdict(self)
        balance, cost = out.pop("balance"), out.pop("cost")
        del out["strategy"]
        if self.strategy != "official":
            out["strategy"] = {"name": self.strategy, "balance": balance, "cost": cost}
        return out

    @property
    def balanced_target_tokens(self) -> int:
        """``balance.target_tokens``, or ``(expected_num_tokens + max_num_tokens) // 2`` when it is null."""
        t = self.balance.target_tokens
        return int(t) if t is not None else (self.expected_num_tokens + self.max_num_tokens) // 2

    def problems(self, where: str = "packer") -> list[str]:
        """Every value the packer cannot work with, one message per key (empty when valid)."""
        out = field_problems(self, _PACKER_RULES, f"{where}.")
        if out:  # the cross-checks below need valid numbers
            return out
        if self.prefer_buffer_before >= self.max_num_tokens:
            out.append(f"{where}.prefer_buffer_before ({self.prefer_buffer_before}) must be smaller than "
                       f"max_num_tokens ({self.max_num_tokens})")
        return out + self.over_cap(where, (
            ("expected_num_tokens", self.expected_num_tokens, "packs could never reach the target"),
            ("max_num_tokens_per_sample", self.max_num_tokens_per_sample, "such samples could never be packed")))

    def over_cap(self, where: str, checks: Iterable[tuple[str, int, str]]) -> list[str]:
        """One message per ``(key, value, consequence)`` of ``checks`` whose value exceeds ``max_num_tokens``."""
        return [f"{where}.{key} ({value}) exceeds max_num_tokens ({self.max_num_tokens}): {why}"
                for key, value, why in checks if value > self.max_num_tokens]

    def validate(self, where: str = "packer") -> None:
        """Raise one ConfigError naming every invalid key (``problems``); warn about a risky combination."""
        problems = self.problems(where)
        if problems:
            raise ConfigError.of(problems, header=f"{where}: {len(problems)} invalid packer knobs")
        risky = (self.prefer_buffer_before, self.max_num_tokens_per_sample, self.max_num_tokens)
        if self.prefer_buffer_before + self.max_num_tokens_per_sample > self.max_num_tokens and risky not in _WARNED:
            _WARNED.add(risky)  # once per process (every validation pass and stage would repeat it)
            logger.warning("%s: prefer_buffer_before + max_num_tokens_per_sample > max_num_tokens: a buffered "
                           "sample can overflow a pack and is then discarded by the official flush", where)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every packer knob name (the keys ``from_mapping`` accepts)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, ignore: Sequence[str] = (),
                     where: str = "packer") -> "PackerConfig":
        """The knobs in ``values``, defaults for the rest; validated.

        A key that is neither a knob (``keys()``) nor named in ``ignore`` is a ``ConfigError`` (a misspelt
        knob would otherwise silently keep its default). Pass the official ``DataConfig`` /
        ``PackedDataset`` keys that are not packer knobs in ``ignore`` when reading an official config.
        """
        names = set(cls.keys())
        unknown = sorted(str(k) for k in values if k not in names and k not in ignore)
        if unknown:
            raise ConfigError(f"{where}: unknown packer key(s) {unknown} (known: {sorted(names)})")
        kw = {k: v for k, v in values.items() if k in names}
        for sub, sub_cls in (("balance", BalanceConfig), ("cost", CostConfig)):
            if isinstance(kw.get(sub), Mapping):
                sub_names = {f.name for f in dataclasses.fields(sub_cls)}
                bad = sorted(str(k) for k in kw[sub] if k not in sub_names)
                if bad:
                    raise ConfigError(f"{where}.{sub}: unknown key(s) {bad} (known: {sorted(sub_names)})")
                kw[sub] = sub_cls(**kw[sub])
        cfg = cls(**kw)
        cfg.validate(where)
        return cfg
