"""End-to-end training step of a Llama-3.2-1B-shaped HF model (or, with ``--model gpt2``, GPT-2 small, whose class
names no loss type; with ``--model qwen3moe``, a mixture-of-experts model of Qwen3-30B-A3B's layers; with
``--model bart``, BART-large, whose fp32 ``final_logits_bias`` promotes the logits under autocast), in the loop
most people write (``loss = model(input_ids=ids, labels=ids).loss; loss.backward()``), bf16 weights, or fp32
weights under bf16 autocast with ``--autocast``. GPU only.

Default variants: eager, inductor (``torch.compile(model)``), flce (``torch.compile(model, backend="flce")`` with
no options: the logits the model returns are kept, computed when first read, which this loop never does),
flce-drop (``options={"flce.logits": "drop"}``) and liger-flce (eager + Liger's fused linear cross-entropy
only). Also available: aot_eager, dynamo-eager (``backend="eager"``), flce-materialize (the logits computed in
the forward), flce-aot_eager / flce-eager (drop, with that inner compiler), flce-drop-chunk1024,
flce-inner-dynamo (a graph Inductor fails on left to torch.compile, ``flce.inner_failure="dynamo"``),
flce-replay (checkpointed side effects left to Dynamo's default, ``flce.checkpoint_side_effects="replay"``: with
transformers 5.25 the model then compiles in pieces, as under Inductor alone) and liger
(Liger's default patch, which also swaps RMSNorm, SwiGLU and RoPE).

``--mask`` (default ``both``): first the rows as users run them, with the installed transformers and nothing
patched; then the compiled variants again with the bench-only mask patch (``allow_causal_skip_under_compile``),
which gives compiled models eager's mask-free SDPA call. Eager and Liger rows do not go through Dynamo, so the
patch changes nothing for them and they run once.

    python benchmarks/bench_e2e.py                      # S = 16384 and 65536, default variants, both mask modes
    python benchmarks/bench_e2e.py --seq 16384 --variants inductor flce --mask patched
    python benchmarks/bench_e2e.py --model gpt2 --seq 16384 --variants eager inductor flce --mask as-is
    python benchmarks/bench_e2e.py --model qwen3moe --autocast --seq 16384 --variants eager inductor flce --mask as-is
    python benchmarks/bench_e2e.py --model bart --autocast --seq 8192 --variants eager inductor flce --mask as-is
    python benchmarks/bench_e2e.py --objective log-probs --seq 16384 --variants eager inductor flce --mask as-is

Prints a table (peak GB, median step ms after warm-up, the loss, and each flce row's time and peak relative to
the same inner compiler without the pass) and writes JSON + markdown under benchmarks/results/ (and $OUT).

Note: in torch 2.11 (the H200 results) Dynamo's ``backend="eager"`` runs ``torch.utils.checkpoint`` regions
without checkpointing (pytorch/pytorch#160773; torch 2.13 checkpoints them), so dynamo-eager and flce-eager
keep every layer's activations there: compare flce-eager with dynamo-eager, not with eager.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

VARIANTS = ("eager", "inductor", "flce", "flce-drop", "liger-flce", "dynamo-eager", "aot_eager", "liger",
            "flce-materialize", "flce-aot_eager", "flce-eager", "flce-drop-chunk1024", "flce-inner-dynamo",
            "flce-replay")
DEFAULT_VARIANTS = ("eager", "inductor", "flce", "flce-drop", "liger-flce")
#: Variants that do not go through Dynamo: the mask patch cannot change them.
UNCOMPILED = ("eager", "liger-flce", "liger")
#: Liger variants, run last and in this order: each patches the model in place. "liger-flce" swaps only the
#: loss for Liger's fused linear cross-entropy (the like-for-like comparison with our pass); "liger" is Liger's
#: default patch, which also swaps RMSNorm, SwiGLU and RoPE for its own kernels.
LIGER_VARIANTS = {"liger-flce": {"rope": False, "rms_norm": False, "swiglu": False}, "liger": {}}
#: Each flce variant and the same inner compiler without the pass.
BASELINES = {"flce": "inductor", "flce-drop": "inductor", "flce-aot_eager": "aot_eager", "flce-eager": "dynamo-eager",
             "flce-drop-chunk1024": "inductor", "flce-materialize": "inductor", "flce-inner-dynamo": "inductor",
             "flce-replay": "inductor"}
#: The options of each flce variant (None: none at all, as users call it).
FLCE_OPTIONS = {
    "flce": None,
    "flce-drop": {"flce.logits": "drop"},
    "flce-materialize": {"flce.logits": "materialize"},
    "flce-aot_eager": {"flce.logits": "drop", "flce.inner": "aot_eager"},
    "flce-eager": {"flce.logits": "drop", "flce.inner": "eager"},
    "flce-drop-chunk1024": {"flce.logits": "drop", "flce.config": {"chunk_tokens": 1024}},
    "flce-inner-dynamo": {"flce.inner_failure": "dynamo"},
    "flce-replay": {"flce.checkpoint_side_effects": "replay"},
}
PRECISIONS = {False: "bf16", True: "fp32 weights under bf16 autocast"}
MASK_MODES = {"as-is": "as users run it: installed transformers, nothing patched",
              "patched": "bench-only mask patch: compiled models get eager's mask-free SDPA call"}
RESULTS = Path(__file__).resolve().parent / "results"


def llama_config(vocab: int = 128256, hidden: int = 2048, layers: int = 16):
    """Llama-3.2-1B's config (the defaults), or the same shape family at other sizes: MLP 4 x hidden, 64-wide
    heads, 4 query heads per KV head (bench_e2e_distributed.py and its CPU test shrink the model this way)."""
    import transformers

    heads = max(1, hidden // 64)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=True,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


#: The models ``--model`` picks, as the result files name them.
MODELS = {"llama": "Llama-3.2-1B shape",
          "gpt2": "GPT-2 small (124M, V = 50257), its loss type unset as transformers builds it",
          "qwen3moe": "Qwen3-30B-A3B's layer shape, 4 layers and 32 experts (1.3B, V = 151936)",
          "bart": "BART-large's shape (12 + 12 layers, hidden 1024, V = 50265, final_logits_bias), encoder and decoder "
                  "both given the sequence"}


def qwen3moe_config(layers: int = 4, experts: int = 32):
    """Qwen3-30B-A3B's shape (hidden 2048, 32 query / 4 KV heads of 128, 8 of the experts per token, expert MLP
    768, V = 151936, untied head), at ``layers`` layers of ``experts`` experts: a mixture-of-experts model whose
    logits outweigh one layer's activations, as in the full model."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=experts, num_experts_per_tok=8, max_position_embeddings=131072, tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def bart_config(positions: int = 1024, layers: int = 12):
    """BART-large's shape (hidden 1024, 16 heads, MLP 4096, V = 50265, tied head) with ``layers`` encoder and
    decoder layers and ``positions`` learned positions, dropout off (steps compare across variants)."""
    import transformers

    cfg = transformers.BartConfig(
        vocab_size=50265, d_model=1024, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=16,
        decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, max_position_embeddings=positions,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(device: str = "cuda", dtype: torch.dtype = torch.bfloat16, family: str = "llama",
                positions: int = 1024, **shape):
    """The benchmark's model in training mode: seeded initialisation on the CPU (the same weights on every
    device and in every process), no KV cache, non-reentrant gradient checkpointing per decoder layer.
    ``shape``: llama_config's vocab / hidden / layers (qwen3moe_config's layers / experts, bart_config's layers).
    ``family`` "gpt2": GPT-2 small with ``positions`` learned positions (the longest sequence it is run at) and
    dropout off, otherwise as transformers builds it; "bart": BART-large's shape with as many positions, its
    final_logits_bias random."""
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        # dropout off, as for BART (GPT2Config's defaults are 0.1: each variant drew its own masks, and the loss
        # read by a variant's place in the run order, 10.9734 second and 10.9793 third, a review found)
        config = transformers.GPT2Config(n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config).to(device, dtype)
    elif family == "llama":
        model = transformers.LlamaForCausalLM(llama_config(**shape)).to(device, dtype)
    elif family == "qwen3moe":
        model = transformers.Qwen3MoeForCausalLM(qwen3moe_config(**shape)).to(device, dtype)
    elif family == "bart":
        model = transformers.BartForConditionalGeneration(bart_config(positions, **shape)).to(device, dtype)
        with torch.no_grad():  # zeros when built: random, so that it counts
            model.final_logits_bias.normal_()
    else:
        raise ValueError(f"family={family!r} is unknown; use one of {sorted(MODELS)}")
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def allow_causal_skip_under_compile() -> None:
    """Let compiled HF models call SDPA with ``is_causal=True`` and no mask, as eager runs do.

    Under Dynamo, transformers 5 (5.17 on the H200, 5.24 on CI) cannot check data-dependently that the
    position ids hold one unpacked sequence, nor (5.17) that an absent padding mask is absent, so every
    compiled variant builds an S x S mask and SDPA cannot use its flash kernel; eager and Liger-patched runs
    skip the mask. backend="flce" drops that mask itself when it proves it causal (``compiler/causal_mask.py``);
    Inductor alone does not. This benchmark feeds one unpadded, unpacked sequence,
    so it tells transformers so, and the compiled variants get eager's attention.
    """
    import transformers.masking_utils as masking_utils

    original = masking_utils._ignore_causal_mask_sdpa
    if getattr(original, "_bench_patched", False):
        return

    def ignore_mask_when_unpadded(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        if padding_mask is None and local_attention_size is None and q_length == kv_length:
            return True
        return original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)

    ignore_mask_when_unpadded._bench_patched = True
    masking_utils._ignore_causal_mask_sdpa = ignore_mask_when_unpadded
    masking_utils.find_packed_sequence_indices = lambda position_ids: None  # one sequence per row, never packed


def apply_liger(variant: str, model) -> None:
    """Liger's patch of a Liger variant, in place on the HF model (before any DDP / FSDP wrapper), once per
    variant; raise RuntimeError('unavailable: ...') without liger-kernel."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as exc:
        raise RuntimeError(f"unavailable: liger_kernel not importable ({exc})") from exc
    # main() runs the Liger variants last, so the others see the unpatched model; prepare() runs again for
    # every sequence length.
    applied = model.__dict__.setdefault("_bench_liger_applied", set())
    if variant not in applied:
        _apply_liger_kernel_to_instance(model=model, **LIGER_VARIANTS[variant])
        applied.add(variant)


def compile_variant(variant: str, module, flce_inner: str | None = None):
    """``module`` (the HF model, or its DDP / FSDP2 wrapper) as the variant runs it: as it is (eager, Liger,
    whose patch apply_liger has made), or ``torch.compile``d with the variant's backend and options.
    ``flce_inner`` overrides the flce variants' inner compiler (CPU tests skip Inductor's C++ build with it)."""
    if variant == "eager" or variant in LIGER_VARIANTS:
        return module
    if variant in ("inductor", "aot_eager", "dynamo-eager"):
        return torch.compile(module, backend=variant.removeprefix("dynamo-"))
    if variant in FLCE_OPTIONS:
        import flce_compile.compiler  # noqa: F401  (registers backend="flce" when not installed)

        options = FLCE_OPTIONS[variant]
        if flce_inner is not None:
            options = {**(options or {}), "flce.inner": flce_inner}
        return (torch.compile(module, backend="flce", options=options) if options
                else torch.compile(module, backend="flce"))
    raise ValueError(f"unknown variant {variant!r}; use one of {VARIANTS}")


#: What a step differentiates: the model's own loss (``loss = model(input_ids=ids, labels=ids).loss``), or a
#: policy-gradient objective written by hand, as DPO, PPO and GRPO code does: each token's log-prob picked with
#: ``gather`` from a log_softmax of the returned logits, weighted by a per-token advantage; the compiled variants
#: compile that function (the model inside it), as a user compiling their step would.
OBJECTIVES = ("loss", "log-probs")


def log_prob_objective(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """The "log-probs" objective of ``model``: -mean(advantage * log p(token)), the advantages fixed per shape."""
    advantages: dict[tuple, torch.Tensor] = {}

    def objective(ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids).logits[:, :-1]
        picked = torch.gather(logits.float().log_softmax(-1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        weights = advantages.setdefault(tuple(picked.shape), torch.randn(
            picked.shape, generator=torch.Generator().manual_seed(0)).to(picked.device))
        return -(picked * weights).mean()

    return objective


def prepare(variant: str, model, objective: str = "loss"):
    """A callable (input_ids) -> loss for one variant, or raise RuntimeError('unavailable: ...')."""
    torch._dynamo.reset()
    if objective == "log-probs":
        if variant in LIGER_VARIANTS:
            raise RuntimeError("unavailable: Liger patches the model's loss, which this objective does not use")
        return compile_variant(variant, log_prob_objective(model))
    if variant in LIGER_VARIANTS:
        apply_liger(variant, model)
    fn = compile_variant(variant, model)
    return lambda ids: fn(input_ids=ids, labels=ids).loss


def run_one(variant: str, model, seq: int, steps: int, warmup: int, mask: str, autocast: bool = False,
            objective: str = "loss") -> dict:
    """One variant's row: the first step's time (with the compile), then the median (and range) of ``steps`` step
    times and the peak memory after ``warmup`` steps: the absolute peak, and ``base_gb``, what was allocated before
    the timed steps (the weights; gradients are set to None before each step), so that peak - base is the step's
    own memory; ``autocast``: each step under bf16 autocast (the model's weights fp32)."""
    row: dict = {"variant": variant, "seq": seq, "mask": mask}
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq)).cuda()
    try:
        step_fn = prepare(variant, model, objective)
        times = []
        for i in range(warmup + steps):
            model.zero_grad(set_to_none=True)
            if i == warmup:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                row["base_gb"] = torch.cuda.memory_allocated() / 1e9  # weights (and optimizer-free state)
            start = time.perf_counter()
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                loss = step_fn(ids)
            loss.backward()
            torch.cuda.synchronize()
            if i == 0:
                row["first_step_s"] = time.perf_counter() - start  # includes the compile
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
        row.update(status="ok", loss=float(loss), step_ms=statistics.median(times), steps=len(times),
                   step_ms_range=[min(times), max(times)], peak_gb=torch.cuda.max_memory_allocated() / 1e9)
    except torch.cuda.OutOfMemoryError:
        row.update(status="OOM")
    except RuntimeError as exc:
        if "out of memory" in str(exc).lower():
            row.update(status="OOM")
        elif str(exc).startswith("unavailable"):
            row.update(status=str(exc))
        else:
            row.update(status=f"error: {str(exc).splitlines()[0][:200]}")
    finally:
        model.zero_grad(set_to_none=True)
        step_fn = None  # noqa: F841
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    return row


def plan_runs(variants: list[str], seqs: list[int], mask: str) -> list[tuple[str, int, str]]:
    """(variant, seq, mask mode) in run order: rows as users run them first; compiled variants again with the
    mask patch (applied once, after every as-is row); Liger variants last (they patch the model in place)."""
    modes = ["as-is", "patched"] if mask == "both" else [mask]
    plain = [v for v in variants if v not in LIGER_VARIANTS]
    runs = []
    for mode in modes:
        for variant in plain:
            if mode == "patched" and variant in UNCOMPILED and "as-is" in modes:
                continue  # nothing to patch: the as-is row stands for both
            runs += [(variant, seq, mode) for seq in seqs]
    runs += [(v, seq, modes[0]) for v in LIGER_VARIANTS if v in variants for seq in seqs]
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    parser.add_argument("--mask", choices=["as-is", "patched", "both"], default="both",
                        help="as-is: installed transformers, nothing patched; patched: the bench-only mask patch "
                             "(see allow_causal_skip_under_compile); both (default): as-is rows first")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row (median and range reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama", help="the model (default llama)")
    parser.add_argument("--autocast", action="store_true",
                        help="fp32 weights, each step under bf16 autocast (default: bf16 weights, no autocast)")
    parser.add_argument("--objective", choices=OBJECTIVES, default="loss",
                        help="loss (default): the model's own loss; log-probs: per-token log-probs picked with "
                             "gather and weighted, as policy-gradient code writes it (see OBJECTIVES)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:  # (the first step compiles: it is never timed)
        parser.error(f"--steps and --warmup must be >= 1, got {args.steps} and {args.warmup}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_e2e.py needs a CUDA GPU")

    import transformers

    env = {
        "model": MODELS[args.model], "precision": PRECISIONS[args.autocast], "objective": args.objective,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
    }
    try:
        from importlib.metadata import version

        env["liger_kernel"] = version("liger_kernel")
    except Exception:  # noqa: BLE001 - optional
        pass
    stem = f"e2e-{time.strftime('%Y%m%d-%H%M%S')}{args.tag}"
    model = build_model(dtype=torch.float32 if args.autocast else torch.bfloat16, family=args.model,
                        positions=max(args.seq))
    rows = []
    for variant, seq, mask in plan_runs(args.variants, args.seq, args.mask):
        if mask == "patched":
            allow_causal_skip_under_compile()  # idempotent; after every as-is row
        row = run_one(variant, model, seq, args.steps, args.warmup, mask, args.autocast, args.objective)
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write(stem, env, rows)  # after every row: a run cut short by a time limit keeps what it measured
    print(_table(rows))


def _write(stem: str, env: dict, rows: list[dict]) -> None:
    """JSON + markdown under benchmarks/results/ and, when set, $OUT (the GPU machine's way back)."""
    header = f"# e2e training step, {env['model']}, {env['precision']}, batch 1, gradient checkpointing"
    text = f"{header}\n\n{', '.join(f'{k} {v}' for k, v in env.items())}\n\n{_table(rows)}"
    for folder in filter(None, [RESULTS, os.environ.get("OUT")]):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{stem}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2))
        (Path(folder) / f"{stem}.md").write_text(text)


def _table(rows: list[dict]) -> str:
    """Markdown tables, one per mask mode (as users run it first); flce rows also show step time and peak
    relative to their inner compiler alone, in the same mode."""
    by_key = {(r["variant"], r["seq"], r.get("mask", "as-is")): r for r in rows}
    out = []
    for mode, title in MASK_MODES.items():
        mode_rows = [r for r in rows if r.get("mask", "as-is") == mode]
        if not mode_rows:
            continue
        out += [f"{mode}: {title}", "",
                "| seq | variant | status | peak GB | step's own GB | step ms (range) | loss "
                "| vs same inner w/o pass (time, peak) |",
                "|---|---|---|---|---|---|---|---|"]
        for r in sorted(mode_rows, key=lambda r: r["seq"]):
            base = by_key.get((BASELINES.get(r["variant"]), r["seq"], mode))
            vs = ""
            if base is not None and r["status"] == "ok" and base["status"] == "ok":
                vs = (f"{r['step_ms'] / base['step_ms']:.2f}x, {r['peak_gb'] / base['peak_gb']:.2f}x "
                      f"(vs {base['variant']})")
            own = r["peak_gb"] - r["base_gb"] if "base_gb" in r and "peak_gb" in r else float("nan")
            spread = f" ({r['step_ms_range'][0]:.0f}-{r['step_ms_range'][1]:.0f})" if "step_ms_range" in r else ""
            out.append(f"| {r['seq']} | {r['variant']} | {r['status']} | {r.get('peak_gb', float('nan')):.2f} | "
                       f"{own:.2f} | {r.get('step_ms', float('nan')):.0f}{spread} | {r.get('loss', float('nan')):.4f} "
                       f"| {vs} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    main()
