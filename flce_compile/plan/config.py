"""The execution config of the fused op (``FLCEConfig``) and the fields a caller forces (``config_overrides``).

A config names a registered strategy (``registry``) and its parameters. Which config a call runs is decided in
``choose``; this module only says what a valid config is.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from . import registry

#: Forced config fields as sorted (name, value) pairs: hashable, so choices made from them can be memoised.
Forced = tuple[tuple[str, Any], ...]

#: How dW is accumulated over chunks. "addmm": one GEMM per chunk that adds into the accumulator
#: (fp32 output from bf16/fp16 operands where torch offers it), the last chunk's GEMM finishing dW where the kernel
#: runs (``strategies.dw_final``: sm_90+ GPUs); "addmm_round": the same, with cuBLAS for the last chunk too and
#: the fp32 sums then rounded by a copy; "mm_add": a GEMM into a temporary, then an add.
DW_PATHS = ("addmm", "addmm_round", "mm_add")
#: 1024 threads, the most a GPU thread block holds.
MAX_NUM_WARPS = 32


@dataclass(frozen=True)
class FLCEConfig:
    """How the fused op runs: strategy, tokens per chunk and the CE kernel's launch parameters."""

    strategy: str = "torch"
    chunk_tokens: int = 1024
    block_v: int = 4096
    num_warps: int = 8
    num_stages: int = 1
    dw_path: str = "addmm"
    streams: bool = False
    #: Zero-pad the weight to the padded logits row (a multiple of 128 bytes) so every GEMM dimension is
    #: aligned; only changes anything when V is not already such a multiple (GPT-2's 50257). The tuner tries it.
    pad_vocab: bool = False
    #: Vocabulary rows per block of the "recompute" strategy's backward (its fp32 dW block is vocab_block x H).
    vocab_block: int = 4096
    #: The logits GEMM writes fp32 (bf16/fp16 operands, fp32 accumulation: the same tensor-core work) and the CE
    #: step reads them unrounded, writing the logit gradient into a buffer of its own in the compute dtype:
    #: what ``precision="precise"`` runs (see ``plan.precision``). A no-op for fp32/fp64 inputs. Never tuned:
    #: it is part of the precision the user chose, not of the speed.
    fp32_logits: bool = False
    #: The CE kernel's pass 1 lane-wise (``kernels.ce_chunk._lane_pass``: a running max and sum per thread, combined
    #: once a row, so its loop holds no barrier) instead of block-wise. Part of the CE tile: ``flce-tune
    #: --retune-ce-tiles`` times every tile both ways and keeps the faster (on an H100, 2026-12-07, lane-wise ran
    #: GPT-2's 4096 x 50257 chunk 9% faster at its best tile, and lost or tied at the H = 4096 shapes).
    lane_pass: bool = False

    def __post_init__(self) -> None:
        if not registry.is_registered(self.strategy):
            raise ValueError(f"config.strategy={self.strategy!r} is unknown; use one of {registry.names()}")
        if self.dw_path not in DW_PATHS:
            raise ValueError(f"config.dw_path={self.dw_path!r} is unknown; use one of {DW_PATHS}")
        for name in ("chunk_tokens", "block_v", "num_warps", "num_stages", "vocab_block"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.{name}={value!r} must be a positive int")
            if type(value) is not int:  # a NumPy int, say: a plain one in keys, JSON and the op's schema
                object.__setattr__(self, name, int(value))
        for name in ("block_v", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"config.{name}={value} must be a power of two")
        if self.num_warps > MAX_NUM_WARPS:  # the launch would fail with Triton's "out of resource: threads"
            raise ValueError(f"config.num_warps={self.num_warps} must be at most {MAX_NUM_WARPS} (a GPU thread block "
                             f"holds at most {32 * MAX_NUM_WARPS} threads)")
        for name in ("streams", "pad_vocab", "fp32_logits", "lane_pass"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"config.{name}={getattr(self, name)!r} must be True or False")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FLCEConfig":
        """Build a config from a mapping; unknown keys are an error that lists the valid ones."""
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - valid
        if unknown:
            raise ValueError(f"config has unknown keys {sorted(unknown)}; valid keys are {sorted(valid)}")
        return cls(**dict(data))


def config_overrides(config: "FLCEConfig | Mapping[str, Any] | str | None") -> dict[str, Any] | None:
    """The config fields a caller forces, validated now: every field of an ``FLCEConfig``, or just the keys of a
    dict / JSON object. Fields left out come from the tuning DB or the heuristic at run time (see
    ``choose.resolve_config``), so ``{"chunk_tokens": 1024}`` keeps the GPU's Triton strategy and tuned tiles.
    None or "" force nothing."""
    if config is None or isinstance(config, FLCEConfig):
        return config.to_dict() if config is not None else None
    if isinstance(config, str):
        return dict(forced_fields(config)) or None
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be an FLCEConfig, a dict, a JSON object or None, got {type(config).__name__}")
    fields = dict(config)
    full = FLCEConfig.from_dict({**FLCEConfig().to_dict(), **fields})  # unknown keys and bad values raise here
    return {name: getattr(full, name) for name in fields} or None  # (as the config holds them: plain ints)


@functools.lru_cache(maxsize=256)
def forced_fields(text: str) -> Forced:
    """The fields a JSON config string forces (the op's ``config`` argument), validated, as ``Forced``; "" forces
    none. Memoised: the op parses its argument on every call."""
    if not text:
        return ()
    return tuple(sorted((config_overrides(_parse_json_config(text)) or {}).items()))


def _parse_json_config(text: str) -> Any:
    """``json.loads(text)``, with an error that names the config argument and what it accepts."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"config={text!r} is not valid JSON ({exc}); pass an FLCEConfig, a dict, or a JSON object such as "
            '\'{"chunk_tokens": 1024}\''
        ) from None


