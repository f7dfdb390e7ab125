"""The one place that picks the config of a call: the caller's forced fields over the tuning DB's answer, or
the heuristic's.

``resolve_config`` runs inside the op at run time with the real token count, so a varying token count never
changes a traced graph. It sits on the op's hot path (host-bound at small shapes), so everything it derives
from its arguments is memoised: the DB lookup by the DB itself (re-validated every second), the heuristic and
the overlay of forced fields here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Callable, Collection, Mapping

import torch

from ..log import logger
from . import registry, tuning_db
from .config import FLCEConfig, Forced, forced_fields
from .layout import vocab_needs_padding

#: choose_config's source for fp64 on a GPU: the tuning DB holds bf16/fp16/fp32 entries only.
FP64_SOURCE = "heuristic (the tuning DB holds no float64 entries)"
#: choose_config's source on the CPU: the tuning DB is measured on GPUs, so a CPU call never reads it.
CPU_SOURCE = "heuristic (the tuning DB holds GPU entries; CPU calls use the heuristic)"

_ALL_FIELDS = len(dataclasses.fields(FLCEConfig))


def resolve_config(
    overrides: Mapping[str, Any] | None,
    num_tokens: int,
    vocab: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[FLCEConfig, str]:
    """The config of one call: ``choose_config``'s pick with ``overrides`` (see ``config_overrides``) laid over
    it, and its source."""
    forced = tuple(sorted(overrides.items())) if overrides else ()
    return _resolve(forced, num_tokens, vocab, hidden, dtype, device)


#: The op's resolved configs, by ``_op_config_key``. Bounded: a run whose token count varies call by call adds an
#: entry per count, and dropping them all is cheap (each costs one ``_resolve`` to rebuild).
_OP_CONFIGS: dict[tuple[Any, ...], FLCEConfig] = {}
OP_CONFIG_CACHE_SIZE = 4096


def choice_generations(cuda: bool) -> tuple[int, int | None]:
    """What decides an op's config besides its arguments: the strategy registry's generation and, on CUDA (the
    only device that reads it), the loaded tuning DB's, which changes when a rewritten file is reloaded (None
    when the DB cannot be read: then nothing keyed on it may be memoised). Memos of answers that follow from
    the config key on it (``op_config``, the replay shortcuts)."""
    try:
        db = tuning_db.generation() if cuda else 0
    except Exception:  # noqa: BLE001 - the DB never breaks a call: the lookup itself reports and falls back
        db = None
    return registry.generation(), db


def _op_config_key(config: str, num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[Any, ...]:
    """What decides an op's config: its arguments and ``choice_generations``."""
    return (config, num_tokens, vocab, hidden, dtype, device) + choice_generations(device.type == "cuda")


def runs_unforced(strategy: str) -> bool:
    """Whether the op runs a config of ``strategy`` that a call did not force. A strategy of the "recompute" loop
    forms the gradients in backward, a loop the op fixes at trace time from the forced fields
    (``op.grads_in_backward``), so for a call that forces no strategy a tuning-DB entry of one is answered by
    the heuristic instead (``choose_config_match``). Such configs reach the op forced: from a
    ``memory_budget_gb`` (the whole pick is forced, a plain entry of one too) or a ``config`` naming it."""
    return registry.get(strategy).loop != "recompute"


def op_config(config: str, num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype,
              device: torch.device) -> FLCEConfig:
    """``resolve_config`` for the op's ``config`` argument: the JSON of the forced fields ("" for none).

    Memoised as a whole, by everything that decides it (``_op_config_key``): it runs in every call of the op,
    which is host-bound at small shapes, and the chain of memoised steps it replaces (forced fields, DB lookup,
    heuristic, overlay) cost ~10 us of Python per call on the CPU, one dict lookup ~1 us. Errors (a config
    string that is not JSON, a strategy that cannot run the dtype) are raised every time: they are not cached.
    """
    key = _op_config_key(config, num_tokens, vocab, hidden, dtype, device)
    cached = _OP_CONFIGS.get(key)
    if cached is not None and device.type != "cuda":
        return _runnable(cached, device)  # off the GPU it depends on TRITON_INTERPRET, which the key leaves out
    if cached is None:
        forced = forced_fields(config)
        cached = _resolve(forced, num_tokens, vocab, hidden, dtype, device)[0]
        if "strategy" not in dict(forced) and not runs_unforced(cached.strategy):
            # ``choose_config_match`` answers a DB entry of such a strategy with the heuristic already; this keeps
            # the loop fixed at trace time (``op.grads_in_backward``) whatever the pick's source.
            cached = dataclasses.replace(heuristic_config(num_tokens, vocab, hidden, dtype, device), **dict(forced))
        if key[-1] is None:
            return cached
        if len(_OP_CONFIGS) >= OP_CONFIG_CACHE_SIZE:
            _OP_CONFIGS.clear()
        _OP_CONFIGS[key] = cached
    return cached


def _resolve(forced: Forced, num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype,
             device: torch.device) -> tuple[FLCEConfig, str]:
    if len(forced) == _ALL_FIELDS:
        return _runnable(_overlay(None, forced, dtype, device.type, registry.generation()), device), "forced"
    chosen, source = choose_config(num_tokens, vocab, hidden, dtype, device,
                                   strategy_forced="strategy" in dict(forced))
    config = _runnable(_overlay(chosen, forced, dtype, device.type, registry.generation()), device)
    return config, (f"{source}, forced {', '.join(name for name, _ in forced)}" if forced else source)


def _runnable(config: FLCEConfig, device: torch.device) -> FLCEConfig:
    """``config``, or an error that names its strategy when it cannot run on ``device`` (a Triton kernel off the
    GPU: asked here rather than met as Triton's "0 active drivers" at the launch). Outside ``_overlay``'s cache:
    it reads TRITON_INTERPRET."""
    if registry.get(config.strategy).runs_on(device.type):
        return config
    raise ValueError(
        f'config strategy "{config.strategy}" launches a Triton kernel, which needs a CUDA GPU, and the inputs are '
        f"on {device.type}: use strategy \"torch\" there (the default off the GPU), or set TRITON_INTERPRET=1 "
        "before importing triton to run the kernel in Triton's interpreter (slow; for tests)"
    )


@functools.lru_cache(maxsize=256)
def _overlay(chosen: FLCEConfig | None, forced: Forced, dtype: torch.dtype, device_type: str,
             generation: int) -> FLCEConfig:  # noqa: ARG001 - generation: registry changes miss the cache
    """``chosen`` with the ``forced`` fields laid over it (all of them when ``chosen`` is None), moved to a
    strategy that supports ``dtype`` unless the strategy itself was forced (then an error)."""
    fields = dict(forced)
    config = FLCEConfig.from_dict(fields) if chosen is None else dataclasses.replace(chosen, **fields)
    strategy = registry.get(config.strategy)
    if strategy.supports(dtype):
        return config
    supporting = [s.name for s in map(registry.get, registry.names()) if s.supports(dtype)]
    if "strategy" in fields:
        raise ValueError(
            f'config strategy "{config.strategy}" does not support {str(dtype).replace("torch.", "")} inputs (it '
            f"computes in fp32); use strategy {' or '.join(map(repr, supporting))}, or leave the strategy out of "
            "the config"
        )
    return dataclasses.replace(config, strategy=registry.default_for(device_type, dtype).name)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def heuristic_config(num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device) -> FLCEConfig:
    """The untuned default.

    Tokens per chunk are sized so one chunk of logits takes about 512 MiB, in multiples of 256 tokens within
    [256, 8192], and no more than the token count needs. Measured on an H200 (benchmarks/results): each
    chunk's dW GEMM re-reads and re-writes the V x H accumulator, so 2048-token chunks at V=128K run 4-8%
    faster than 1024-token ones; the extra 256 MiB is small next to the fp32 accumulator. Memory-bound users
    pass a smaller chunk_tokens, or let flce-tune search under --budget-gb. On the CPU the budget is 64 MiB:
    the PyTorch CE step holds up to two fp32 chunk-sized temporaries besides it (none on an fp32 chunk it may
    overwrite, without a softcap).

    The strategy is the registry's default for the device and dtype (``registry.default_for``: "triton" on a
    GPU, "torch" elsewhere and for fp64, whose kernel would compute in fp32).

    On the GPU an odd V (GPT-2's 50257) is padded (``pad_vocab``): at 4096 x 768 x 50257 the aligned GEMMs
    ran 3.2x faster on an H200 (2.26 vs 7.33 ms, benchmarks/results/bench_flce_h200_padvocab.md). Measured again
    per GEMM (``pad_vocab_gemms_NVIDIA_H200.md``): unpadded, the logits GEMM took 6.9x, dX 5.8x and dW 1.6x the
    padded ones' time. Split at the last 128-byte row with the odd rows' GEMMs unpadded, the three took 73 us more
    than padded, and dX's error rose 1.4x; with those rows in a small zero-padded block and dX's two parts summed
    in fp32 (``strategies.padded_tail``, one bf16/fp16 chunk) logits and dX take 20 us more than padded on an
    H100 at 4096 tokens, against the 62 us (and 77 MB) of the whole-weight copy they spare
    (``padded_tail_probe_h100.log``). The CPU default leaves the weight alone: nothing was measured to gain there.
    """
    itemsize = dtype.itemsize
    on_gpu = device.type == "cuda"
    budget_bytes = (512 if on_gpu else 64) * 2**20
    chunk = budget_bytes // max(1, vocab * itemsize)
    chunk = max(256, min(8192, chunk // 256 * 256))
    chunk = max(1, min(chunk, _round_up(max(1, num_tokens), 256)))
    pad = on_gpu and vocab_needs_padding(vocab, itemsize)
    # 8 warps: the CE step alone took 15-18% less time than with 16 at V = 50304-256000 on an H200
    # (benchmarks/results/ce_kernel_tiles_NVIDIA_H200.md). A V below the 4096 block (a byte-level head) takes the
    # block that holds it and no more threads than the block has values, as the kernel's launch rules ask
    # (``registry``): the tuner measures the default only where they pass (it never measured it at V <= 2048).
    block_v = min(4096, max(32, registry.next_pow2(vocab))) if on_gpu else 1024
    warps = min(8, max(1, block_v // 32)) if on_gpu else 4
    return _heuristic(chunk, device.type, dtype, pad, block_v, warps, registry.generation())


@functools.lru_cache(maxsize=256)
def _heuristic(chunk: int, device_type: str, dtype: torch.dtype, pad_vocab: bool, block_v: int, num_warps: int,
               generation: int) -> FLCEConfig:  # noqa: ARG001 - generation: registry changes miss the cache
    return FLCEConfig(
        strategy=registry.default_for(device_type, dtype).name,
        chunk_tokens=chunk,
        block_v=block_v,
        num_warps=num_warps,
        num_stages=1,
        dw_path="addmm",
        streams=False,
        pad_vocab=pad_vocab,
    )


#: fp32 working set of one chunk of the loss over kept logits (rows x V x 4 bytes).
KEPT_CHUNK_BYTES = 64 * 2**20


def kept_logits_config(vocab: int, dtype: torch.dtype, device: torch.device) -> FLCEConfig:
    """The config of the loss over logits that already exist (the compiler's kept-logits path): the
    heuristic's strategy and CE launch parameters for the device and dtype, over chunks of ``KEPT_CHUNK_BYTES``
    of fp32 rows. No GEMM runs there, so nothing is tuned and the chunk only bounds the torch step's fp32
    temporaries."""
    rows = max(1, KEPT_CHUNK_BYTES // (4 * max(1, vocab)))
    return dataclasses.replace(heuristic_config(rows, vocab, 1, dtype, device), chunk_tokens=rows)


def choose_config(
    num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, *,
    memory_budget_gb: float | None = None, accum_dtype: torch.dtype = torch.float32, strategy_forced: bool = False,
) -> tuple[FLCEConfig, str]:
    """Pick the config for one call and say where it came from ("tuning_db:<source>", "heuristic", or on a
    non-CUDA device ``CPU_SOURCE``: the database holds GPU measurements only). With ``memory_budget_gb`` the
    pick is ``choose_config_within_budget``'s (a budget-tier entry, or the plain pick fitted to the budget;
    gradients of input and weight, ``accum_dtype`` accumulators), and the source says which. ``device``: a torch
    device or its name ("cuda:0", "cpu"). ``strategy_forced``: the call's own config sets the strategy, so an
    entry of a strategy the op runs only when forced (``runs_unforced``) may answer the other fields."""
    for name, value, least in (("num_tokens", num_tokens, 0), ("vocab", vocab, 1), ("hidden", hidden, 0)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"choose_config: {name}={value!r} must be an int")
        if value < least:
            raise ValueError(f"choose_config: {name}={value!r} must be >= {least}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"choose_config: dtype={dtype!r} must be a floating-point torch.dtype (torch.bfloat16, "
                        "torch.float16, torch.float32 or torch.float64); which_config also takes names such as 'bf16'")
    device = torch.device(device)
    if memory_budget_gb is None:
        config, source, _ = choose_config_match(num_tokens, vocab, hidden, dtype, device,
                                                strategy_forced=strategy_forced)
        return config, source
    config, source, _ = choose_config_within_budget(num_tokens, vocab, hidden, dtype, device, memory_budget_gb,
                                                    accum_dtype=accum_dtype)
    return config, source


class BudgetError(ValueError):
    """A memory budget that no config fits. The ``flce`` backend lets it through (a site it cannot fuse within
    the budget the user set is an error, as in an eager call), where other errors of a rewrite leave the site
    unfused."""


def budget_bytes(memory_budget_gb: float) -> int:
    """``memory_budget_gb`` (GiB) in bytes; an error names the argument unless it is a positive finite number."""
    if isinstance(memory_budget_gb, bool) or not isinstance(memory_budget_gb, numbers.Real):
        raise TypeError(f"memory_budget_gb={memory_budget_gb!r} must be a number of GiB (or None for no budget), got "
                        f"{type(memory_budget_gb).__name__}")
    # (a finite number whose bytes are not, 1e300 GiB or an int past float's range, is refused too: int() of them
    # raised OverflowError)
    try:
        finite = math.isfinite(float(memory_budget_gb) * 2**30)
    except OverflowError:
        finite = False
    if not finite or memory_budget_gb <= 0:
        raise ValueError(f"memory_budget_gb={memory_budget_gb!r} must be a positive finite number of GiB (or None for "
                         "no budget)")
    return int(memory_budget_gb * 2**30)


def choose_config_within_budget(
    num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, memory_budget_gb: float, *,
    accum_dtype: torch.dtype = torch.float32, need_dx: bool = True, need_dw: bool = True, need_db: bool = False,
    softcap: bool = False, gpu: str | None = None, frozen_columns: int = 0,
) -> tuple[FLCEConfig, str, tuning_db.Match | None]:
    """The config of a call that may use ``memory_budget_gb`` GiB (by the memory bound at ``num_tokens``), its
    source, and the tuning-DB match it came from (None for the heuristic).

    Two candidates. The plain pick (``choose_config_match``: plain entry or heuristic), if its bound fits as it
    is. The tuned low-memory pick: the first budget-tier entry (``tuning_db.find_budget_matches``: tier <= the
    budget; exact bucket, then the nearest; the largest tier first) whose bound fits. The tier entry wins when
    the plain pick does not fit, or when it measured faster than the plain pick at the same bucket (a budget
    that does not bind keeps today's config unless a tier entry is known to beat it: a 100 GiB budget never
    trades a fitting tuned config for a 0.5 GiB tier's recompute). Without a fitting tier entry, the plain
    pick goes through ``fit_budget`` (smaller chunks, then "recompute"), as before tiers existed.
    """
    limit = budget_bytes(memory_budget_gb)

    def bound(config: FLCEConfig) -> int:
        from .memory import peak_bytes  # noqa: PLC0415 - sympy is imported only when a budget is given

        return peak_bytes(config, num_tokens, vocab, hidden, dtype, accum_dtype, need_dw=need_dw, need_db=need_db,
                          softcap=softcap, need_dx=need_dx, frozen_columns=frozen_columns, device=device)

    # the plain pick is forced as a whole (``api._budget_config``): any entry may answer
    plain, source, match = choose_config_match(num_tokens, vocab, hidden, dtype, device, gpu=gpu, strategy_forced=True)
    tuned = _fitting_tier_match(num_tokens, vocab, hidden, dtype, device, memory_budget_gb, gpu,
                                lambda config: bound(config) <= limit)
    if tuned is not None and (bound(plain) > limit or _measured_faster(tuned.entry, plain, match)):
        logger.debug("config for V=%d H=%d tokens=%d within %g GiB from %s", vocab, hidden, num_tokens,
                     memory_budget_gb, tuned.source)
        return tuned.config, tuned.source, tuned
    fitted = fit_budget(plain, num_tokens, vocab, hidden, dtype, accum_dtype, limit, need_dx=need_dx, need_dw=need_dw,
                        need_db=need_db, softcap=softcap, frozen_columns=frozen_columns, device=device)
    return fitted, source if fitted == plain else f"{source}, fitted to {memory_budget_gb:g} GiB", match


def _fitting_tier_match(num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device,
                        memory_budget_gb: float, gpu: str | None,
                        fits: Callable[[FLCEConfig], bool]) -> tuning_db.Match | None:
    """The first budget-tier match whose config ``fits`` (a predicate on the bound); None on a device or dtype
    the tuning DB does not answer for (the CPU, fp64), as in ``choose_config_match``, nor for an empty call."""
    if device.type != "cuda" or dtype == torch.float64 or num_tokens < 1 or hidden < 1:
        return None
    matches = tuning_db.find_budget_matches(vocab=vocab, hidden=hidden, dtype=dtype, tokens=num_tokens,
                                            device=device if gpu is None else gpu, budget_gb=memory_budget_gb)
    return next((m for m in matches if fits(m.config)), None)


def _measured_faster(tier: tuning_db.Entry, plain: FLCEConfig, plain_match: tuning_db.Match | None) -> bool:
    """Whether the tier entry measured faster than the plain pick, by times taken at the same token bucket on the
    same GPU kind: the plain entry's own time, or, for the heuristic, the tier study's time of its default when
    that default is this very config. False when nothing comparable was measured."""
    if plain_match is not None:
        other = plain_match.entry
        return other.key[:5] == tier.key[:5] and plain == other.config and tier.ms < other.ms
    if tier.default_ms is None:
        return False
    try:
        default = FLCEConfig.from_dict({**FLCEConfig().to_dict(), **tier.extra.get("default_config", {})})
    except (TypeError, ValueError):
        return False
    return default == plain and tier.ms < tier.default_ms


def choose_config_match(
    num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device, *, gpu: str | None = None,
    strategy_forced: bool = False,
) -> tuple[FLCEConfig, str, tuning_db.Match | None]:
    """``choose_config`` plus the tuning-DB match it used (None for the heuristic).

    ``gpu`` (a GPU kind such as "h200") looks up that kind's entries instead of ``device``'s own, so
    ``which_config`` can answer for a GPU this machine does not have; ``device`` must then be a CUDA device
    (it picks the GPU heuristic, which needs no GPU). Unless ``strategy_forced``, an entry of a strategy the op
    runs only when forced (``runs_unforced``) is answered by the heuristic, as the op would run it.
    """
    if device.type == "cuda" and dtype == torch.float64:
        source = FP64_SOURCE
    elif device.type == "cuda" and (num_tokens < 1 or hidden < 1):
        source = "heuristic"  # an empty call (no tokens, or H = 0): the DB holds no such shape, nothing to look up
    elif device.type == "cuda":
        match = tuning_db.find_match(vocab=vocab, hidden=hidden, dtype=dtype, tokens=num_tokens,
                                     device=device if gpu is None else gpu)
        if match is not None and (strategy_forced or runs_unforced(match.config.strategy)):
            config = one_chunk_entry_config(match, num_tokens)
            source = match.source if config is match.config else (
                f"{match.source}, one chunk of {config.chunk_tokens} tokens")
            logger.debug("config for V=%d H=%d tokens=%d from %s", vocab, hidden, num_tokens, source)
            return config, source, match
        if match is not None:  # an entry the op would not run unforced (a user DB's, written by hand or before)
            source = (f"heuristic ({match.source} holds a {match.config.strategy!r} config, which the op runs only "
                      "when a memory_budget_gb or config forces it)")
        else:
            source = "heuristic" if gpu is None else _heuristic_for_kind(gpu)
    else:
        source = CPU_SOURCE if device.type == "cpu" else (
            f"heuristic (the tuning DB holds CUDA GPU entries; {device.type} calls use the heuristic)")
    logger.debug("config for V=%d H=%d tokens=%d from %s", vocab, hidden, num_tokens, source)
    return heuristic_config(num_tokens, vocab, hidden, dtype, device), source, None


def _heuristic_for_kind(gpu: str) -> str:
    """The heuristic's source for ``which_config(gpu=...)``, naming the kinds the DB knows when it holds no entry
    for this one (a typo such as "h2OO" was answered as silently as an untuned shape)."""
    kind = tuning_db.device_key(gpu)
    known = sorted({entry.device for entry in tuning_db.load_entries()})
    if tuning_db.kind_is_served(kind, set(known)):  # entries, none for this call
        return "heuristic"
    return f"heuristic (the tuning DB holds no entries for GPU kind {kind!r}; it has {', '.join(known) or 'none'})"


#: ``tuning_db.Match`` kinds whose entry was measured in the call's own token bucket.
EXACT_MATCHES = ("user exact", "shipped exact")


def one_chunk_entry_config(match: tuning_db.Match, num_tokens: int) -> FLCEConfig:
    """``match``'s config for a call of ``num_tokens``, run as one chunk where the entry ran as one chunk but the
    call, in the entry's own token bucket, has more tokens than its chunk.

    An entry measured as a single chunk (its chunk holds all the tokens it was timed with) answers its whole
    token bucket, up to 1.41x the bucket's token count. Taken as stored, a longer call would run a full chunk and
    a short one, and need the fp32 dW accumulator the one-chunk call did without (Gemma's 256000 x 2304,
    8192-token entry: 6.56 GB at 10000 tokens by the memory bound, against 4.20 at 8192). One chunk of all the
    tokens (rounded up to 256) keeps what was measured: no accumulator, logits memory growing with the tokens.
    On an H200 (``bench_flce_NVIDIA_H200_one_chunk.md``, ``_evened.md``) it was faster than the stored chunk and
    than the same chunk count evened out: 55.3 / 56.5 / 55.9 ms at 10000 x 2304 x 256000 (5.12 / 6.55 / 4.98
    GB measured), 59.8 vs 62.2 ms (evened) at 11000 tokens (5.63 / 5.24 GB), 46.6 vs 50.0 ms at 5000 x 8192 x 128256
    (1.28 / 4.86 GB). Exact matches only: a nearest-bucket answer may serve far more tokens than the entry's
    bucket (one chunk of them could take any amount of memory), and a nearest-shape one has its chunk rescaled
    already (``tuning_db``); both run their config as it is.
    """
    config, entry = match.config, match.entry
    chunk = config.chunk_tokens
    if match.kind not in EXACT_MATCHES or config != entry.config or chunk < entry.measured_tokens:
        return config
    if num_tokens <= chunk or tuning_db.token_bucket(num_tokens) != entry.tokens:
        return config
    return dataclasses.replace(config, chunk_tokens=_round_up(num_tokens, 256))


def budget_candidates(config: FLCEConfig, dtype: torch.dtype) -> list[FLCEConfig]:
    """The configs ``fit_budget`` tries, in order: ``config`` itself; then ``config`` with halved chunks (down to
    128 tokens), which keeps its speed longest; then each strategy of the "recompute" loop that runs ``dtype``,
    larger chunks and vocabulary blocks first, which drop the V x H accumulator for one more GEMM; then, where
    ``config`` pads V, the same without the padded weight copy. The tuner walks the same list to find the default
    a budget-tier study measures against."""
    candidates = [config]
    chunk = config.chunk_tokens
    while chunk > 128:
        chunk //= 2
        candidates.append(dataclasses.replace(config, chunk_tokens=chunk))
    recompute = [dataclasses.replace(config, strategy=strategy.name, chunk_tokens=c, vocab_block=b)
                 for strategy in map(registry.get, registry.names()) if strategy.loop == "recompute"
                 and strategy.supports(dtype)
                 for c in (4096, 2048, 1024, 512, 256, 128) for b in (8192, 4096, 2048, 1024, 512)]
    # Last, without pad_vocab: its zero-padded weight copy is the recompute forward's largest buffer (V x H).
    return candidates + recompute + [dataclasses.replace(c, pad_vocab=False) for c in recompute if c.pad_vocab]


def fit_budget(
    config: FLCEConfig,
    num_tokens: int,
    vocab: int,
    hidden: int,
    dtype: torch.dtype,
    accum_dtype: torch.dtype,
    budget_bytes: int,
    *,
    need_dx: bool = True,
    need_dw: bool = True,
    need_db: bool = False,
    softcap: bool = False,
    frozen_columns: int = 0,
    device: torch.device | str = "cuda",
    fixed: Collection[str] = (),
) -> FLCEConfig:
    """The first of ``budget_candidates(config, dtype)`` whose memory bound (``plan.memory.peak_bytes``, on
    ``device``) fits ``budget_bytes``. ``fixed``: fields the caller forced (a ``config=``), which every candidate
    keeps as ``config`` has them: a budget fits the rest around them and never overrides them. An error names the
    budget and the least memory any of them needs when none fits."""
    from .memory import peak_bytes

    def bound(candidate: FLCEConfig) -> int:
        return peak_bytes(candidate, num_tokens, vocab, hidden, dtype, accum_dtype, need_dw=need_dw,
                          need_db=need_db, softcap=softcap, need_dx=need_dx, frozen_columns=frozen_columns,
                          device=device)

    best = None
    for candidate in budget_candidates(config, dtype):
        if any(getattr(candidate, name) != getattr(config, name) for name in fixed):
            continue
        needed = bound(candidate)
        if needed <= budget_bytes:
            return candidate
        best = min(best or (needed, candidate), (needed, candidate), key=lambda pair: pair[0])
    assert best is not None  # ``config`` itself is a candidate, and it keeps every field
    forced = ", ".join(f"{name}={getattr(config, name)!r}" for name in sorted(fixed))
    raise BudgetError(
        f"memory_budget_gb={budget_bytes / 2**30:.5g}: no config "
        + (f"with the forced fields {forced} " if fixed else "")
        + f"fits {num_tokens} tokens x V={vocab} x H={hidden} in it; the least memory any "
        + ("such config " if fixed else "")
        + f"needs is {gib_rounded_up(best[0])} GiB ({best[1].strategy}, chunk_tokens={best[1].chunk_tokens}); raise "
        + ("the budget or force fewer fields" if fixed else "the budget")
    )


def gib_rounded_up(nbytes: int, digits: int = 3) -> str:
    """``nbytes`` in GiB to ``digits`` significant digits, rounded up: a budget of the printed figure fits
    (``budget_bytes`` of it is at least ``nbytes``)."""
    gib = nbytes / 2**30
    if gib <= 0:
        return "0"
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(gib)))
    units = math.ceil(gib * scale - 1e-9)  # (an exact figure must not round up on float noise: checked below)
    while budget_bytes(units / scale) < nbytes:
        units += 1
    return f"{units / scale:.{digits + 1}g}"


def config_within_budget(forced: Mapping[str, Any] | None, memory_budget_gb: float, num_tokens: int,
                         vocab: int, hidden: int, dtype: torch.dtype, device: torch.device,
                         accum_dtype: torch.dtype, **needs: bool) -> tuple[FLCEConfig, str]:
    """The config of a call with the forced fields ``forced`` under ``memory_budget_gb``, and its source. Without
    forced fields the pick may be a tuning-DB entry tuned under a budget (``choose_config_within_budget``);
    forced fields are laid over the plain pick, whose other fields are then fitted (``fit_budget``: the forced
    ones are kept, or the error says they do not fit). ``needs``: need_dx,
    need_dw, need_db, softcap, frozen_columns. A ValueError names the budget when nothing fits (or when it is not
    a positive number). The op (``api``) and ``explain`` both ask this."""
    limit = budget_bytes(memory_budget_gb)
    if not forced:
        config, source, _match = choose_config_within_budget(num_tokens, vocab, hidden, dtype, device,
                                                             memory_budget_gb, accum_dtype=accum_dtype, **needs)
        return config, source
    base, source = resolve_config(forced, num_tokens, vocab, hidden, dtype, device)
    fitted = fit_budget(base, num_tokens, vocab, hidden, dtype, accum_dtype, limit, device=device,
                        fixed=tuple(forced), **needs)
    return fitted, source if fitted == base else f"{source}, fitted to memory_budget_gb={memory_budget_gb:g}"
