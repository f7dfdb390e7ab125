"""Parsing and validation of the ``flce.*`` options of the ``flce`` Dynamo backend.

``torch.compile(model, backend="flce", options={...})`` hands the whole options dict to the backend. Keys that
start with ``flce.`` belong to this package; every other key (and ``mode=``) belongs to the inner compiler and is
passed through untouched, so the inner compiler sees exactly what it would have seen without us.
"""

from __future__ import annotations

import difflib
import math

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..plan.config import config_overrides
from ..plan.precision import check_precision

PREFIX = "flce."
#: Our option keys and what they mean (used in error messages, so keep the text short).
VALID_KEYS: dict[str, str] = {
    "flce.inner": 'inner compiler: "inductor" (default), "aot_eager", "eager", any registered backend name, or a callable',
    "flce.logits": '"keep" (default: logits outputs stay exact, computed when first read), "materialize" '
                   '(computed in the forward) or "drop" (logits outputs become None)',
    "flce.config": "force config fields for every fused site (FLCEConfig, or a dict / JSON string of some fields)",
    "flce.enabled": "False runs the inner compiler alone",
    "flce.precision": '"exact" (default: errors no larger than eager\'s), "compact" (accumulators in the weight '
                      'dtype) or "precise" (fp32 logits into the CE step: dX/dW errors below eager\'s)',
    "flce.memory_budget_gb": "the most each fused site may use above its inputs and gradients (GiB), or None",
    "flce.causal_masks": "True (default): SDPA calls given a causal mask the graph builds from constants run with "
                         "is_causal=True (flash attention); False leaves attention as traced",
    "flce.inner_failure": '"traced" (default: a graph with a fused site that the inner compiler fails on with an '
                          'error torch.compile answers with a graph break runs as traced, its loss fused) or "dynamo" '
                          '(left to torch.compile: the head and its loss run uncompiled and unfused)',
    "flce.checkpoint_side_effects": '"once" (default: a side effect in a checkpointed forward, as transformers '
                                    '5.25\'s layer hook has, runs in the forward only, so the model stays one '
                                    'graph) or "replay" (Dynamo\'s default: the graph breaks at such a checkpoint)',
}
# The choices of each option that has some, its default first.
LOGITS_MODES = ("keep", "materialize", "drop")
INNER_FAILURE_MODES = ("traced", "dynamo")
CHECKPOINT_SIDE_EFFECT_MODES = ("once", "replay")  # see checkpoint_side_effects


@dataclass(frozen=True)
class FLCEOptions:
    """Validated ``flce.*`` options."""

    inner: str | Callable[..., Any] = "inductor"
    logits: str = "keep"
    config: dict[str, Any] | None = None  # forced FLCEConfig fields; the rest is chosen at run time
    enabled: bool = True
    precision: str = "exact"
    memory_budget_gb: float | None = None
    causal_masks: bool = True  # see causal_mask.drop_causal_masks
    inner_failure: str = "traced"  # see inner.compile_graph
    checkpoint_side_effects: str = "once"  # see checkpoint_side_effects

    @property
    def inner_name(self) -> str:
        if isinstance(self.inner, str):
            return self.inner
        return getattr(self.inner, "__name__", type(self.inner).__name__)


def split_options(options: Mapping[str, Any] | None) -> tuple[FLCEOptions, dict[str, Any]]:
    """Split a ``torch.compile`` options dict into (our validated options, the inner compiler's options).

    Raises ValueError/TypeError naming the offending key and the accepted values.
    """
    if options is None:
        return FLCEOptions(), {}
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a dict, got {type(options).__name__}")
    ours: dict[str, Any] = {}
    inner: dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(key, str) and key.startswith(PREFIX):
            if key not in VALID_KEYS:
                raise ValueError(f"unknown option {key!r} for backend 'flce'{_did_you_mean(key)}; the flce options "
                                 f"are {', '.join(VALID_KEYS)} (the README's options table says what each does)")
            ours[key[len(PREFIX):]] = value
        else:
            inner[key] = value
    validated = _validate(ours)
    _check_unprefixed(inner, validated)
    return validated, inner


#: Inner compilers whose options cannot hold one of ours (Inductor's are its config's names; the other two take
#: none and would ignore a misspelt key without a word).
_BUILTIN_INNER = ("inductor", "aot_eager", "eager")


def _check_unprefixed(inner_options: Mapping[str, Any], opts: FLCEOptions) -> None:
    """Refuse a key meant for us that would go to the inner compiler instead: one of our options without the
    ``flce.`` prefix (``"logits"``), or with the prefix in another case (``"FLCE.logits"``). Inductor would say
    only that it does not know the key, and aot_eager and eager ignore it: the option would be lost. For another
    inner compiler a bare name of ours may be its own option, so it passes."""
    for key in inner_options:
        if not isinstance(key, str):
            continue
        if key.lower().startswith(PREFIX):
            raise ValueError(f"option {key!r}: flce options are spelt in lower case{_did_you_mean(key.lower())}")
        if PREFIX + key in VALID_KEYS and opts.inner in _BUILTIN_INNER:
            raise ValueError(f"option {key!r} would go to the inner compiler ({opts.inner_name}), which does not "
                             f"take it; flce options carry the prefix: {PREFIX + key!r}")


def _did_you_mean(key: str) -> str:
    """``" (did you mean 'flce.x'?)"`` for the valid key closest to ``key`` (compared without the prefix, which
    every key shares), or ""."""
    names = [k[len(PREFIX):] for k in VALID_KEYS]
    close = difflib.get_close_matches(key[len(PREFIX):] if key.startswith(PREFIX) else key, names, n=1)
    return f" (did you mean {PREFIX + close[0]!r}?)" if close else ""


def _validate(raw: dict[str, Any]) -> FLCEOptions:
    inner = raw.get("inner", "inductor")
    if isinstance(inner, str):
        if inner == "flce":
            raise ValueError("options['flce.inner']='flce' would recurse; use 'inductor', 'aot_eager' or 'eager'")
        _check_backend_name(inner)
    elif not callable(inner):
        raise TypeError(f"options['flce.inner'] must be a backend name or a callable, got {type(inner).__name__}")

    logits = _one_of(raw, "logits", LOGITS_MODES)

    try:
        config = config_overrides(raw.get("config"))
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"options['flce.config'] is not a valid FLCEConfig: {exc}") from exc

    enabled, causal_masks = raw.get("enabled", True), raw.get("causal_masks", True)
    for key, flag in (("enabled", enabled), ("causal_masks", causal_masks)):
        if not isinstance(flag, bool):
            raise TypeError(f"options['flce.{key}'] must be True or False, got {flag!r}")
    inner_failure = _one_of(raw, "inner_failure", INNER_FAILURE_MODES)
    side_effects = _one_of(raw, "checkpoint_side_effects", CHECKPOINT_SIDE_EFFECT_MODES)
    precision = check_precision(raw.get("precision", "exact"), "options['flce.precision']")
    budget = raw.get("memory_budget_gb")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not math.isfinite(budget) or budget <= 0):
        raise ValueError(f"options['flce.memory_budget_gb']={budget!r} must be a positive number of GiB, or None")
    return FLCEOptions(inner=inner, logits=logits, config=config, enabled=enabled, precision=precision,
                       memory_budget_gb=float(budget) if budget is not None else None,
                       causal_masks=causal_masks, inner_failure=inner_failure, checkpoint_side_effects=side_effects)


def _one_of(raw: dict[str, Any], key: str, modes: tuple[str, ...]) -> str:
    """``raw[key]`` (default ``modes[0]``), which must be one of ``modes``."""
    value = raw.get(key, modes[0])
    if value not in modes:
        raise ValueError(f"options['flce.{key}']={value!r} is not valid; use one of {modes}")
    return value


def _check_backend_name(name: str) -> None:
    from torch._dynamo.backends.registry import list_backends

    known = list_backends(exclude_tags=())
    if name not in known:
        # torch's test-only backends are registered too: not worth offering
        usable = sorted(b for b in known if b != "flce" and "TESTING" not in b.upper())
        close = difflib.get_close_matches(name, usable, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"options['flce.inner']={name!r} is not a registered torch.compile backend; {hint}use one of {usable}, "
            "or pass a compiler function"
        )
