"""The search space of the fused op's execution configs, and the rules that prune illegal ones before they run.

Why its own module: the space decides which parameters each strategy actually reads (its registry entry's
``params``: a "torch" config has no CE kernel, so sampling block_v or num_warps for it would only waste trials),
which values are legal for a problem (a chunk larger than the token count is pruned, and so is what the
strategy's ``check`` rejects, such as a kernel block larger than the vocab), and which configs would exceed the
memory budget according to the op's own memory bound. Nothing here touches a
GPU or Optuna's study; ``search`` drives it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from ..log import logger
from ..plan import registry
from ..plan.config import FLCEConfig
from ..plan.layout import vocab_needs_padding
from ..plan.memory import peak_bytes

#: The FLCEConfig fields a strategy may read (``Strategy.params``). Those a strategy does not read are not
#: sampled for it and are set to the base config's values, so two configs that run identically compare equal.
TUNABLE_FIELDS = tuple(f.name for f in dataclasses.fields(FLCEConfig) if f.name != "strategy")


def _pow2_range(low: int, high: int) -> tuple[int, ...]:
    out, v = [], low
    while v <= high:
        out.append(v)
        v *= 2
    return tuple(out)


_warned_memory_model = False


def predicted_peak_bytes(
    config: FLCEConfig, tokens: int, vocab: int, hidden: int, dtype: torch.dtype,
    accum_dtype: torch.dtype = torch.float32,
) -> int | None:
    """The op's memory bound (``flce_compile.plan.memory.peak_bytes``, sympy-derived: bytes above the inputs and the
    returned loss/gradients) for fwd+bwd with dX and dW, or None when evaluating the model fails (then only the
    measured peak is checked)."""
    global _warned_memory_model
    try:
        return int(peak_bytes(config, tokens, vocab, hidden, dtype, accum_dtype, need_dw=True))
    except Exception as exc:  # noqa: BLE001 - a bug in the model must not stop tuning
        if not _warned_memory_model:
            logger.warning("flce_compile.plan.memory.peak_bytes failed (%s: %s); checking measured peaks only",
                           type(exc).__name__, exc)
            _warned_memory_model = True
        return None


def _same_dw_path(path: str) -> str:
    """The dw_path that runs as ``path`` where the last chunk's GEMM cannot finish dW: "addmm" for "addmm_round"."""
    return "addmm" if path == "addmm_round" else path


@dataclass(frozen=True)
class SearchSpace:
    """Candidate values per parameter for one problem (tokens, V, H, dtype), plus pruning.

    ``base`` supplies the fields a strategy does not read. ``budget_bytes`` (if set) prunes configs whose
    predicted peak exceeds it. Value tuples can be narrowed for quick searches or tests.
    """

    tokens: int
    vocab: int
    hidden: int
    dtype: torch.dtype = torch.bfloat16
    accum_dtype: torch.dtype = torch.float32
    strategies: tuple[str, ...] = field(default_factory=registry.names)  # every registered strategy
    # Powers of two and the steps half-way between them: 1536-token chunks can fit a budget 2048 misses.
    chunk_tokens: tuple[int, ...] = tuple(sorted(set(_pow2_range(128, 32768)) | {3 * p // 2 for p in _pow2_range(256, 16384)}))
    block_v: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    vocab_block: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)  # the recompute strategy's backward blocks
    num_warps: tuple[int, ...] = (4, 8, 16, 32)
    num_stages: tuple[int, ...] = (1, 2, 3)
    dw_path: tuple[str, ...] = ("addmm", "addmm_round", "mm_add")
    streams: tuple[bool, ...] = (False, True)
    pad_vocab: tuple[bool, ...] = (False, True)  # only sampled where V needs padding (see ``choices``)
    base: FLCEConfig = FLCEConfig()
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("tokens", "vocab", "hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SearchSpace.{name}={value!r} must be a positive int")
        unknown = set(self.strategies) - set(registry.names())
        if unknown or not self.strategies:
            raise ValueError(
                f"SearchSpace.strategies={self.strategies!r}: use a non-empty subset of {registry.names()}")
        for name in ("chunk_tokens", "block_v", "vocab_block", "num_warps", "num_stages", "dw_path", "streams",
                     "pad_vocab"):
            if not getattr(self, name):
                raise ValueError(f"SearchSpace.{name} is empty; give at least one candidate value")
        if not self.legal_chunks():
            raise ValueError(
                f"SearchSpace.chunk_tokens={self.chunk_tokens} has no value <= {registry.next_pow2(self.tokens)} "
                f"(tokens={self.tokens}); add smaller chunk sizes"
            )

    # -- candidate values ------------------------------------------------------------------------------
    def legal_chunks(self) -> tuple[int, ...]:
        """Chunk sizes not larger than the token count rounded up to a power of two."""
        limit = registry.next_pow2(self.tokens)
        return tuple(sorted({c for c in self.chunk_tokens if c <= limit}))

    def choices(self, name: str) -> tuple[Any, ...]:
        """The candidate values Optuna samples for ``name`` (deduplicated, in a stable order)."""
        if name == "strategy":
            return tuple(dict.fromkeys(self.strategies))
        if name == "chunk_tokens":
            return self.legal_chunks()
        if name == "pad_vocab" and not self.vocab_needs_padding():
            return (False,)  # padding is a no-op for this V: sampling it would only duplicate trials
        if name == "dw_path" and not self.dw_finish_possible():
            return tuple(dict.fromkeys(_same_dw_path(v) for v in self.dw_path))
        values = getattr(self, name)
        if name in ("dw_path", "streams", "pad_vocab"):
            return tuple(dict.fromkeys(values))
        return tuple(sorted(set(values)))

    def vocab_needs_padding(self) -> bool:
        """Whether ``pad_vocab`` changes anything for this problem's V (see ``layout.vocab_needs_padding``)."""
        return vocab_needs_padding(self.vocab, self.dtype.itemsize)

    def including(self, configs: Iterable[FLCEConfig | None]) -> "SearchSpace":
        """This space widened so each given config is expressible (Optuna needs enqueued values among the
        choices). Configs of a strategy outside the space are left out; illegal values stay prunable."""
        changes: dict[str, tuple[Any, ...]] = {}
        for config in configs:
            if config is None or config.strategy not in self.strategies:
                continue
            for name in registry.get(config.strategy).params:
                current = changes.get(name, getattr(self, name))
                value = getattr(config, name)
                if value not in current:
                    changes[name] = tuple(current) + (value,)
        return dataclasses.replace(self, **changes) if changes else self

    # -- configs <-> Optuna params ---------------------------------------------------------------------
    def dw_finish_possible(self) -> bool:
        """Whether dw_path "addmm" can differ from "addmm_round" for this problem: only bf16 calls that sum dW in
        fp32 finish it in the last chunk's GEMM (``strategies.dw_final``; fp16 sums are fitted into its range first,
        fp32 and fp64 take cuBLAS, bf16 sums need no rounding), so elsewhere the two run identically."""
        return self.dtype == torch.bfloat16 and self.accum_dtype == torch.float32

    def canonical(self, config: FLCEConfig) -> FLCEConfig:
        """The config with the fields its strategy ignores set to the base config's values."""
        used = registry.get(config.strategy).params
        values = config.to_dict()
        for name in TUNABLE_FIELDS:
            if name not in used:
                values[name] = getattr(self.base, name)
        if not self.vocab_needs_padding():
            values["pad_vocab"] = False  # runs identically either way
        if "block_v" not in used:
            values["lane_pass"] = False  # no CE kernel; with one, the CE tile re-pick chooses it (not sampled)
        if not self.dw_finish_possible():
            values["dw_path"] = _same_dw_path(values["dw_path"])  # likewise
        return FLCEConfig(**values)

    def to_params(self, config: FLCEConfig) -> dict[str, Any]:
        """Optuna parameters that reproduce ``config`` (for ``study.enqueue_trial``)."""
        params: dict[str, Any] = {"strategy": config.strategy}
        for name in registry.get(config.strategy).params:
            params[f"{config.strategy}.{name}"] = getattr(config, name)
        return params

    def suggest(self, trial: Any) -> FLCEConfig:
        """Sample a config from an Optuna trial. Parameters are named per strategy ("triton.block_v"), so a
        strategy's parameters are only sampled when that strategy is (a conditional space for TPE)."""
        strategy = trial.suggest_categorical("strategy", self.choices("strategy"))
        values = self.base.to_dict()
        values["strategy"] = strategy
        for name in registry.get(strategy).params:
            values[name] = trial.suggest_categorical(f"{strategy}.{name}", self.choices(name))
        return self.canonical(FLCEConfig(**values))

    def run_key(self, config: FLCEConfig) -> FLCEConfig:
        """A key shared by configs that run identically for this problem: every chunk of at least ``tokens``
        runs as one chunk of all tokens (with 1.5x steps, tokens=3000 admits both 3072 and 4096), so the search
        measures only one of them and answers the other from its cache."""
        if config.chunk_tokens <= self.tokens:
            return config
        return dataclasses.replace(config, chunk_tokens=self.tokens)

    # -- pruning ---------------------------------------------------------------------------------------
    def check(self, config: FLCEConfig) -> str | None:
        """Why ``config`` must not run for this problem, or None if it may. Memory is not checked here (see
        ``predicted_bytes``) because the memory model may be slow or missing."""
        if config.strategy not in self.strategies:
            return f"strategy {config.strategy!r} is not in this search ({self.strategies})"
        if config.chunk_tokens > registry.next_pow2(self.tokens):
            return f"chunk_tokens={config.chunk_tokens} > tokens={self.tokens}"
        return registry.get(config.strategy).check(config, self.vocab)

    def predicted_bytes(self, config: FLCEConfig) -> int | None:
        """The op's memory bound for this config, or None if unknown."""
        return predicted_peak_bytes(config, self.tokens, self.vocab, self.hidden, self.dtype, self.accum_dtype)

    def over_budget(self, config: FLCEConfig) -> str | None:
        """A reason if the predicted peak exceeds ``budget_bytes``, else None."""
        if self.budget_bytes is None:
            return None
        predicted = self.predicted_bytes(config)
        if predicted is not None and predicted > self.budget_bytes:
            return f"memory bound {predicted / 2**30:.2f} GiB > budget {self.budget_bytes / 2**30:.2f} GiB"
        return None

    def within_budget(self) -> "SearchSpace":
        """This space less what cannot fit ``budget_bytes``: the strategies none of whose configs fit, and the
        chunk_tokens and vocab_block values that fit with none, so a tight budget leaves a small space whose
        proposals are mostly measured rather than pruned (at 16384 x 4096 x 128256 bf16 and 0.5 GiB only
        "recompute" remains). The bound never shrinks as chunk_tokens or vocab_block grow or as streams,
        dw_path "mm_add" or pad_vocab are switched on, so a value that fails with the leanest choices of every
        other field fails with all. Unchanged without a budget or a memory model; an error names the budget and
        the least any config needs when nothing fits."""
        if self.budget_bytes is None:
            return self
        kept: list[str] = []
        chunks: set[int] = set()
        blocks: set[int] = set()
        least: tuple[int, FLCEConfig] | None = None
        for name in self.strategies:
            lean = self._leanest(name)
            needed = self.predicted_bytes(lean)
            if needed is None:
                return self  # no memory model: only measured peaks are checked
            if needed > self.budget_bytes:
                least = min(least or (needed, lean), (needed, lean), key=lambda pair: pair[0])
                continue
            kept.append(name)
            params = registry.get(name).params
            if "chunk_tokens" in params:
                chunks |= {c for c in self.legal_chunks() if self._fits(dataclasses.replace(lean, chunk_tokens=c))}
            if "vocab_block" in params:
                blocks |= {b for b in self.choices("vocab_block")
                           if self._fits(dataclasses.replace(lean, vocab_block=b))}
        if not kept:
            assert least is not None
            hint = "" if "recompute" in self.strategies else " or search the \"recompute\" strategy too"
            raise ValueError(
                f"memory budget {self.budget_bytes / 2**30:.3g} GiB: no config of strategies {self.strategies} fits "
                f"{self.tokens} tokens x V={self.vocab} x H={self.hidden}; the least any needs is "
                f"{least[0] / 2**30:.3g} GiB ({least[1].strategy}, chunk_tokens={least[1].chunk_tokens}); raise the "
                f"budget (--budget-gb){hint}")
        changes: dict[str, Any] = {"strategies": tuple(kept), "chunk_tokens": tuple(sorted(chunks))}
        if blocks:
            changes["vocab_block"] = tuple(sorted(blocks))
        narrowed = dataclasses.replace(self, **changes)
        logger.debug("memory budget %.3g GiB leaves strategies %s, chunk_tokens %s, vocab_block %s",
                     self.budget_bytes / 2**30, narrowed.strategies, narrowed.chunk_tokens, narrowed.vocab_block)
        return narrowed

    def least_predicted_bytes(self) -> int | None:
        """The least memory bound of any config in this space (the leanest config of each strategy), or None
        without a memory model: a budget below it leaves nothing to search."""
        bounds = [self.predicted_bytes(self._leanest(name)) for name in self.strategies]
        return None if any(b is None for b in bounds) else min(b for b in bounds if b is not None)

    def fit_default(self, config: FLCEConfig) -> FLCEConfig:
        """The config the op would run for this problem under ``budget_bytes`` without a tuned entry for it: the
        first of ``plan.choose.budget_candidates(config)`` (``config``, then it with halved chunks, then
        "recompute") that is in this search and fits by the predicted bound. A budget study measures its
        winner against this default, so a budget-tier entry is never slower than what the op ran before it.
        ``config`` itself without a budget, without a memory model, or when no candidate fits."""
        from ..plan.choose import budget_candidates  # noqa: PLC0415 - plan.choose imports the tuning DB

        if self.budget_bytes is None:
            return config
        for candidate in budget_candidates(config, self.dtype):
            if candidate.strategy not in self.strategies:
                continue
            predicted = self.predicted_bytes(candidate)
            if predicted is None:
                return config
            if predicted <= self.budget_bytes:
                return self.canonical(candidate)
        return config

    def _leanest(self, strategy: str) -> FLCEConfig:
        """The config of ``strategy`` with the least memory bound in this space: the smallest legal chunk and
        vocabulary block, no streams, dw_path "addmm" and no padding where those are choices."""
        def least(name: str, order: tuple[Any, ...]) -> Any:
            choices = self.choices(name)
            return next((v for v in order if v in choices), choices[0])

        return self.canonical(dataclasses.replace(
            self.base, strategy=strategy, chunk_tokens=min(self.legal_chunks()),
            vocab_block=min(self.choices("vocab_block")), streams=least("streams", (False,)),
            dw_path=least("dw_path", ("addmm",)), pad_vocab=least("pad_vocab", (False,))))

    def _fits(self, config: FLCEConfig) -> bool:
        """Whether the predicted bound of ``config`` is within ``budget_bytes`` (True without a model)."""
        predicted = self.predicted_bytes(config)
        return predicted is None or self.budget_bytes is None or predicted <= self.budget_bytes

    def neighbours(self, config: FLCEConfig) -> list[FLCEConfig]:
        """A few configs next to ``config`` worth measuring early when the trial budget is small, most promising
        first: the padding switch where V needs it, larger chunks (fewer, larger GEMMs are the usual win over
        the memory-conservative default), the streams switch, a larger then a smaller CE block."""
        legal = self.legal_chunks()
        blocks = self.choices("block_v") if "block_v" in registry.get(config.strategy).params else ()
        out: list[FLCEConfig] = []
        if len(self.choices("pad_vocab")) > 1:
            out.append(dataclasses.replace(config, pad_vocab=not config.pad_vocab))  # aligned GEMMs for odd V
        out += [dataclasses.replace(config, chunk_tokens=config.chunk_tokens * f) for f in (2, 4)]
        if len(self.choices("streams")) > 1:
            out.append(dataclasses.replace(config, streams=not config.streams))
        if blocks and config.block_v * 2 in blocks:
            out.append(dataclasses.replace(config, block_v=config.block_v * 2))
        out.append(dataclasses.replace(config, chunk_tokens=config.chunk_tokens * 8))
        if blocks and config.block_v // 2 in blocks:
            out.append(dataclasses.replace(config, block_v=config.block_v // 2))
        return [c for c in out if c.chunk_tokens in legal and self.check(c) is None]
