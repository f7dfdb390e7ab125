"""``which_config``: which config the fused op would run for a problem, and where that config comes from.

Why: the op picks its config silently at run time (tuning DB or heuristic); a user checking that their own
tuning took effect, or what an H200 would run while on a CPU-only CI machine, needs the answer and its source
without running the op. It asks ``plan.choose.choose_config_match``, the op's own path, so the two cannot disagree.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ..plan.choose import choose_config_match, choose_config_within_budget
from ..plan.config import FLCEConfig
from ..plan.precision import accum_dtype_for
from . import db

#: ``ConfigChoice.source`` values, most specific first.
SOURCES = (*db.MATCH_KINDS, "heuristic")


@dataclass(frozen=True)
class ConfigChoice:
    """The config the op would pick, and why."""

    config: FLCEConfig
    #: One of SOURCES: "user exact", "shipped exact", "nearest bucket", "nearest shape" or "heuristic".
    source: str
    #: The op's own source string ("tuning_db:nearest_tokens(shipped tokens=4096)", "heuristic", ...); with a
    #: memory budget it names a budget-tier entry's tier ("tuning_db:shipped_exact(budget 0.5 GiB)") or says
    #: that the plain pick was fitted ("heuristic, fitted to 0.5 GiB").
    detail: str
    #: What the answer is for: a GPU kind ("h200") or a device type ("cpu").
    target: str
    #: The tuning-DB entry the config was taken from (its ``key``, timings, date ...); None for the heuristic.
    entry: db.Entry | None = None
    #: The memory budget the answer is for (GiB), or None.
    memory_budget_gb: float | None = None
    #: The GPU kind whose entry answered when it is another of ``target``'s family (an H100 reading the H200's
    #: entries: ``tuning_db.GPU_FAMILIES``), else None.
    borrowed_from: str | None = None

    def __str__(self) -> str:
        # The CPU detail already begins with "heuristic"; a DB detail names the entry the answer came from.
        how = self.detail if self.detail.startswith(self.source) else f"{self.source} ({self.detail})"
        budget = "" if self.memory_budget_gb is None else f" within {self.memory_budget_gb:g} GiB"
        lines = [f"{self.target}{budget}: {how}", f"  config: {self.config.to_json()}"]
        e = self.entry
        if e is not None:
            speedup = "" if e.speedup is None else f", {e.speedup:.2f}x over the default"
            tier = "" if e.budget_tier_gb is None else f" budget {e.budget_tier_gb:g} GiB"
            lines.append(f"  entry:  {e.device} V={e.vocab} H={e.hidden} {e.dtype} tokens={e.tokens}{tier}: "
                         f"{e.ms:.3f} ms{speedup}, {e.trials} trials, {e.date or 'undated'}")
        return "\n".join(lines)


def _positive_int(name: str, value: int) -> int:
    """``value`` as an int >= 1; any integer type is taken (numpy's, a 0-dim integer tensor), not a bool."""
    refused = isinstance(value, bool) or (isinstance(value, torch.Tensor) and (value.dtype == torch.bool
                                                                               or value.dim() != 0))
    try:
        number = operator.index(value) if not refused else None
    except TypeError:
        number = None
    if number is None or number < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return number


def is_gpu_kind(text: str) -> bool:
    """Whether ``text`` names a GPU kind ("h200", "NVIDIA H200"): not empty, and not a torch device ("cpu",
    "cuda", "cuda:1", "mps", "meta")."""
    name = text.strip().lower()
    if not name:
        return False
    try:
        torch.device(name)
    except (RuntimeError, ValueError):
        return True
    return False


#: fp64 by the names ``normalize_dtype`` would give the tuned dtypes: the op runs it (the checking dtype), though no
#: entry is ever tuned for it, so its answer is the heuristic's.
_FP64_NAMES = frozenset({"torch.float64", "float64", "fp64", "double", "torch.double"})


def _op_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The torch dtype ``which_config`` answers for: a tuned one (bf16, fp16, fp32) or fp64."""
    if str(dtype).lower() in _FP64_NAMES:
        return torch.float64
    try:
        return db.torch_dtype(db.normalize_dtype(dtype))
    except ValueError:
        raise ValueError(f"dtype={dtype!r} is not one the op runs; use one of bf16, fp16, fp32 (tuned) or fp64 "
                         "(the heuristic's config)") from None


def which_config(
    tokens: int,
    vocab: int,
    hidden: int,
    dtype: torch.dtype | str = torch.bfloat16,
    device: torch.device | str | int | None = None,
    gpu: str | None = None,
    memory_budget_gb: float | None = None,
) -> ConfigChoice:
    """The config the op would run for ``tokens`` x ``hidden`` inputs against a ``vocab`` x ``hidden`` weight,
    and its source: user exact, shipped exact, nearest bucket, nearest shape, or heuristic.

    ``device``: where the op would run (a torch device, "cuda:1", a CUDA index); default the current CUDA
    device, or the CPU without one. ``gpu``: a GPU kind or name ("h200", "NVIDIA H200") to answer for instead,
    which needs no such GPU here (CI asks what an H200 would run). On the CPU the answer is the heuristic: the
    tuning DB holds GPU measurements only. Like the op, it reads ``$FLCE_TUNING_DB`` and the shipped files.
    ``memory_budget_gb``: answer for a call with that budget (``choose_config_within_budget``, the op's path,
    for fwd+bwd with dX and dW and fp32 accumulators): a budget-tier entry, or the plain pick fitted to it.
    """
    tokens, vocab, hidden = (_positive_int(name, value) for name, value in
                             (("tokens", tokens), ("vocab", vocab), ("hidden", hidden)))
    torch_dtype = _op_dtype(dtype)
    if gpu is not None:
        if device is not None:
            raise ValueError(f"give device= or gpu=, not both (device={device!r}, gpu={gpu!r})")
        if not isinstance(gpu, str) or not is_gpu_kind(gpu):
            raise ValueError(f"gpu={gpu!r} must name a GPU kind, e.g. gpu='h200' or gpu='NVIDIA H200' (flce-tune "
                             "--list shows the kinds held); a device such as 'cuda:0' goes to device=")
        target = db.normalize_device_name(gpu)
        dev = torch.device("cuda")  # the GPU heuristic, computed without a GPU
    else:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"which_config: device={device!r}, but this torch sees no CUDA device; ask for a GPU "
                             "kind with gpu= (e.g. gpu='h200'), or pass device='cpu'")
        target = db.device_key(dev) if dev.type == "cuda" else dev.type
    kind = target if gpu else None
    if memory_budget_gb is None:
        config, detail, match = choose_config_match(tokens, vocab, hidden, torch_dtype, dev, gpu=kind)
    else:
        # The op's default accumulators (``plan.precision.accum_dtype_for``): fp64 for fp64 weights, else fp32.
        config, detail, match = choose_config_within_budget(
            tokens, vocab, hidden, torch_dtype, dev, memory_budget_gb, gpu=kind,
            accum_dtype=accum_dtype_for("exact", None, torch_dtype))
    return ConfigChoice(config=config, source="heuristic" if match is None else match.kind, detail=detail,
                        target=target, entry=None if match is None else match.entry,
                        memory_budget_gb=memory_budget_gb, borrowed_from=None if match is None else match.borrowed_from)
