"""The strategy registry: a strategy is one module plus one registry entry, and every consumer (config validation,
the chunk loop, the memory bound, the heuristic, the tuner's search space, flce-tune's --strategies) reads it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from flce_compile import fused_linear_cross_entropy
from flce_compile.plan import registry
from flce_compile.plan.config import FLCEConfig
from flce_compile.plan.memory import peak_bytes
from flce_compile.tuning.cli import build_parser
from flce_compile.tuning.space import SearchSpace
from flce_reference import random_inputs, reference_loss

#: A toy strategy: the torch CE step under another name, reading two fields, with a memory term of its own.
TOY = registry.Strategy(
    name="toy",
    summary="the torch step again (a test)",
    params=("chunk_tokens", "dw_path"),
    ce_step="flce_compile.strategies.ce_torch:ce_step_torch",
    fp32_temporaries=lambda softcap: 7,
    check=lambda config, vocab: "no odd chunks" if config.chunk_tokens % 2 else None,
    devices=(),  # never the heuristic's pick
)


@contextlib.contextmanager
def registered(strategy: registry.Strategy) -> Iterator[registry.Strategy]:
    registry.register(strategy)
    try:
        yield strategy
    finally:
        registry.unregister(strategy.name)


def test_a_registered_strategy_reaches_every_consumer():
    x, w, t = random_inputs(n=20, h=8, v=48)
    with registered(TOY):
        # config validation and the chunk loop: the op runs it
        loss = fused_linear_cross_entropy(x, w, t, config={"strategy": "toy", "chunk_tokens": 6})
        torch.testing.assert_close(loss, reference_loss(x, w, t))
        # flce-tune --strategies
        assert build_parser().parse_args(["--vocab", "48", "--hidden", "8", "--strategies", "toy"]).strategies == ["toy"]
        # the search space: sampled, its own fields only, its own legality rule
        space = SearchSpace(tokens=1024, vocab=48, hidden=8)
        assert "toy" in space.choices("strategy")
        config = FLCEConfig(strategy="toy", chunk_tokens=256, block_v=64, dw_path="mm_add")
        assert space.to_params(config) == {"strategy": "toy", "toy.chunk_tokens": 256, "toy.dw_path": "mm_add"}
        assert space.canonical(config).block_v == space.base.block_v
        assert space.check(FLCEConfig(strategy="toy", chunk_tokens=255)) == "no odd chunks"
        assert space.neighbours(config) and all(c.block_v == 64 for c in space.neighbours(config))  # no block moves
        # the memory bound: its term, 7 fp32 chunk-sized buffers (the Triton kernel holds none)
        kernel = FLCEConfig(strategy="triton", chunk_tokens=256)
        toy = FLCEConfig(strategy="toy", chunk_tokens=256)
        assert peak_bytes(toy, 1024, 48, 8, torch.bfloat16) - peak_bytes(kernel, 1024, 48, 8, torch.bfloat16) == (
            7 * 256 * 48 * 4)
        # the heuristic does not pick a strategy that names no device
        assert registry.default_for("cpu", torch.float32).name == "torch"
    with pytest.raises(ValueError, match="unknown"):
        FLCEConfig(strategy="toy")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--vocab", "48", "--hidden", "8", "--strategies", "toy"])


def test_default_strategy_per_device_and_dtype():
    assert registry.default_for("cuda", torch.bfloat16).name == "triton"
    assert registry.default_for("cuda", torch.float64).name == "torch"  # the kernel computes in fp32
    assert registry.default_for("cpu", torch.bfloat16).name == "torch"
    assert registry.default_for("meta", torch.float32).name == "torch"


def test_registry_errors_and_lazy_steps():
    with pytest.raises(ValueError, match="'cuda' is unknown; use one of \\('torch', 'triton'"):
        registry.get("cuda")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.get("torch"))
    assert registry.get("triton").ce_step == "flce_compile.strategies.ce_triton:ce_step_triton"  # a name, not an import
    assert callable(registry.get("torch").step())


def test_the_tuner_never_sets_a_precision_field():
    """fp32_logits is the "precise" policy's, the user's choice: no strategy lists it among the fields the tuner
    samples, and the search space resets it to the base config's value, so a tuned entry never changes the
    numerics a user asked for (as with "compact", whose accumulator dtype the tuner does not sample either)."""
    assert all("fp32_logits" not in registry.get(name).params for name in registry.names())
    space = SearchSpace(tokens=4096, vocab=32000, hidden=1024)
    for name in registry.names():
        assert space.canonical(FLCEConfig(strategy=name, fp32_logits=True)).fp32_logits is False
