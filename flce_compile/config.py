"""Execution configs of the fused op, and the one place that picks a config when the caller gives none.

A config names a strategy and its parameters. ``choose_config`` is called inside the op at run time with the
real token count, so a varying token count never changes the traced graph; it asks the tuning database first
and falls back to a heuristic.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .layout import vocab_needs_padding
from .log import logger

#: Strategies the op knows. "torch": chunked PyTorch (CPU or GPU, GEMMs and CE in torch ops).
#: "triton": chunked cuBLAS GEMMs with the cross-entropy part in one Triton kernel per chunk (GPU, or CPU
#: under TRITON_INTERPRET=1).
STRATEGIES = ("torch", "triton")
#: How dW is accumulated over chunks. "addmm": one GEMM per chunk that adds into the accumulator
#: (fp32 output from bf16/fp16 operands where torch offers it). "mm_add": a GEMM into a temporary, then an add.
DW_PATHS = ("addmm", "mm_add")


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

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"config.strategy={self.strategy!r} is unknown; use one of {STRATEGIES}")
        if self.dw_path not in DW_PATHS:
            raise ValueError(f"config.dw_path={self.dw_path!r} is unknown; use one of {DW_PATHS}")
        for name in ("chunk_tokens", "block_v", "num_warps", "num_stages", "vocab_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.{name}={value!r} must be a positive int")
        for name in ("block_v", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"config.{name}={value} must be a power of two")
        for name in ("streams", "pad_vocab"):
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
    ``resolve_config``), so ``{"chunk_tokens": 1024}`` keeps the GPU's Triton strategy and tuned tiles.
    None or "" force nothing."""
    if config is None or isinstance(config, FLCEConfig):
        return config.to_dict() if config is not None else None
    if isinstance(config, str):
        if not config:
            return None
        config = _parse_json_config(config)
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be an FLCEConfig, a dict, a JSON object or None, got {type(config).__name__}")
    fields = dict(config)
    FLCEConfig.from_dict({**FLCEConfig().to_dict(), **fields})  # unknown keys and bad values raise here
    return fields or None


def _parse_json_config(text: str) -> Any:
    """``json.loads(text)``, with an error that names the config argument and what it accepts."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"config={text!r} is not valid JSON ({exc}); pass an FLCEConfig, a dict, or a JSON object such as "
            '\'{"chunk_tokens": 1024}\''
        ) from None


def _supports_dtype(config: FLCEConfig, dtype: torch.dtype, forced: Mapping[str, Any] | None) -> FLCEConfig:
    """``config`` for ``dtype``: the Triton kernel computes in fp32, so fp64 runs the "torch" strategy (an
    error when the caller forced "triton")."""
    if dtype != torch.float64 or config.strategy != "triton":
        return config
    if forced and "strategy" in forced:
        raise ValueError(
            'config strategy "triton" does not support float64 inputs (its kernel computes in fp32); use '
            'strategy "torch", or leave the strategy out of the config'
        )
    return dataclasses.replace(config, strategy="torch")


def resolve_config(
    overrides: Mapping[str, Any] | None,
    num_tokens: int,
    vocab: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[FLCEConfig, str]:
    """The config of one call: ``choose_config``'s pick with ``overrides`` laid over it, and its source."""
    if overrides and set(overrides) >= {f.name for f in dataclasses.fields(FLCEConfig)}:
        return _supports_dtype(FLCEConfig.from_dict(overrides), dtype, overrides), "forced"
    chosen, source = choose_config(num_tokens, vocab, hidden, dtype, device)
    if not overrides:
        return _supports_dtype(chosen, dtype, None), source
    config = dataclasses.replace(chosen, **overrides)
    return _supports_dtype(config, dtype, overrides), f"{source}, forced {', '.join(sorted(overrides))}"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def heuristic_config(num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device) -> FLCEConfig:
    """The untuned default.

    Tokens per chunk are sized so one chunk of logits takes about 512 MiB, in multiples of 256 tokens within
    [256, 8192], and no more than the token count needs. Measured on an H200 (benchmarks/results): each
    chunk's dW GEMM re-reads and re-writes the V x H accumulator, so 2048-token chunks at V=128K run 4-8%
    faster than 1024-token ones; the extra 256 MiB is small next to the fp32 accumulator. Memory-bound users
    pass a smaller chunk_tokens, or let flce-tune search under --budget-gb. On the CPU the budget is 64 MiB:
    the PyTorch CE step holds two or three fp32 copies of the chunk besides it.

    On the GPU an odd V (GPT-2's 50257) is padded (``pad_vocab``): at 4096 x 768 x 50257 the aligned GEMMs
    ran 3.2x faster on an H200 (2.26 vs 7.33 ms, benchmarks/results/bench_flce_h200_padvocab.md) for one
    weight copy (77 MB there). The CPU default leaves the weight alone: nothing was measured to gain there.
    """
    itemsize = dtype.itemsize
    on_gpu = device.type == "cuda"
    budget_bytes = (512 if on_gpu else 64) * 2**20
    chunk = budget_bytes // max(1, vocab * itemsize)
    chunk = max(256, min(8192, chunk // 256 * 256))
    chunk = max(1, min(chunk, _round_up(max(1, num_tokens), 256)))
    return FLCEConfig(
        strategy="triton" if on_gpu and dtype != torch.float64 else "torch",  # the kernel computes in fp32
        chunk_tokens=chunk,
        block_v=4096 if on_gpu else 1024,
        num_warps=16 if on_gpu else 4,
        num_stages=1,
        dw_path="addmm",
        streams=False,
        pad_vocab=on_gpu and vocab_needs_padding(vocab, itemsize),
    )


#: choose_config's source for fp64 on a GPU: the tuning DB holds bf16/fp16/fp32 entries only.
FP64_SOURCE = "heuristic (the tuning DB holds no float64 entries)"
#: choose_config's source on the CPU: the tuning DB is measured on GPUs, so a CPU call never reads it.
CPU_SOURCE = "heuristic (the tuning DB holds GPU entries; CPU calls use the heuristic)"


def choose_config(
    num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device
) -> tuple[FLCEConfig, str]:
    """Pick the config for one call and say where it came from ("tuning_db:<source>", "heuristic", or on a
    non-CUDA device ``CPU_SOURCE``: the database holds GPU measurements only)."""
    config, source, _ = choose_config_match(num_tokens, vocab, hidden, dtype, device)
    return config, source


def choose_config_match(
    num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, *, gpu: str | None = None
) -> tuple[FLCEConfig, str, Any]:
    """``choose_config`` plus the tuning-DB match it used (a ``tuning.db.Match``, or None for the heuristic).

    ``gpu`` (a GPU kind such as "h200") looks up that kind's entries instead of ``device``'s own, so
    ``which_config`` can answer for a GPU this machine does not have; ``device`` must then be a CUDA device
    (it picks the GPU heuristic, which needs no GPU).
    """
    if device.type == "cuda" and dtype == torch.float64:
        source = FP64_SOURCE
    elif device.type == "cuda":
        from .tuning.db import find_match  # noqa: PLC0415 - tuning.db imports this module

        match = find_match(vocab=vocab, hidden=hidden, dtype=dtype, tokens=num_tokens,
                           device=device if gpu is None else gpu)
        if match is not None:
            logger.debug("config for V=%d H=%d tokens=%d from %s", vocab, hidden, num_tokens, match.source)
            return match.config, match.source, match
        source = "heuristic"
    else:
        source = CPU_SOURCE if device.type == "cpu" else (
            f"heuristic (the tuning DB holds CUDA GPU entries; {device.type} calls use the heuristic)")
    logger.debug("config for V=%d H=%d tokens=%d from %s", vocab, hidden, num_tokens, source)
    return heuristic_config(num_tokens, vocab, hidden, dtype, device), source, None
