"""Which Hugging Face model families ``backend="flce"`` fuses, and how close it stays to eager.

For each family: a one-layer random model (fp32, CPU by default), one forward + backward of
``model(input_ids=ids, labels=labels).loss`` run as is and through ``torch.compile(model, backend="flce")`` with the
logits kept (the default) and dropped; ``explain`` says whether the head was fused and what the op absorbed (a
softcap, a logit scale). Reported: the largest absolute difference to eager in the loss, the parameters' gradients
and the kept logits. A family this transformers lacks is listed as such.

    python benchmarks/hf_families.py                       # every family, inner compiler aot_eager
    python benchmarks/hf_families.py llama gemma3 --inner inductor
    python benchmarks/hf_families.py bart --autocast bf16  # fp32 parameters under autocast, as the Trainer's bf16
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
#: A difference to eager past this (fp32, one layer) is not rounding: the family is compiled again with the pass off.
ATTRIBUTE = 1e-4
sys.path.insert(0, str(REPO))  # run as a script: the repository's flce_compile and benchmarks
V, H = 160, 32


class FamilyMissing(LookupError):
    """The installed transformers has no model or config class of this family."""


def builders(vocab: int = V, hidden: int = H) -> dict[str, Callable[[], torch.nn.Module]]:
    """Family name -> a function that builds a tiny random model of it (``FamilyMissing``: this transformers has
    none; any other error is the model's own)."""
    import transformers as t

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    head8 = dict(common, head_dim=8)

    def hf(model: str, config: str, **kw: Any) -> Callable[[], torch.nn.Module]:
        def build() -> torch.nn.Module:
            missing = [name for name in (model, config) if not hasattr(t, name)]
            if missing:
                raise FamilyMissing(f"transformers {t.__version__} has no {', '.join(missing)}")
            return getattr(t, model)(getattr(t, config)(**kw))

        return build

    def with_logits_bias(build: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
        """BART's family adds ``final_logits_bias`` (zeros when built) to its logits: random here, so it counts."""
        def biased() -> torch.nn.Module:
            model = build()
            with torch.no_grad():
                model.final_logits_bias.normal_()
            return model

        return biased

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden)
    mrope = {"type": "mrope", "mrope_section": [1, 1, 2]}  # Qwen2-VL's rotary sections, of head_dim 8
    vision = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=4,
                  image_size=28, patch_size=14)
    return {
        "llama": hf("LlamaForCausalLM", "LlamaConfig", **common),
        "mistral": hf("MistralForCausalLM", "MistralConfig", **common),
        "qwen2": hf("Qwen2ForCausalLM", "Qwen2Config", **common),
        "qwen3": hf("Qwen3ForCausalLM", "Qwen3Config", **head8),
        "phi3": hf("Phi3ForCausalLM", "Phi3Config", **common, pad_token_id=0),
        "gemma": hf("GemmaForCausalLM", "GemmaConfig", **head8),
        "gemma2": hf("Gemma2ForCausalLM", "Gemma2Config", **head8, final_logit_softcapping=5.0,
                     attn_logit_softcapping=None),
        "gemma3": hf("Gemma3ForCausalLM", "Gemma3TextConfig", **head8, final_logit_softcapping=4.0),
        "cohere": hf("CohereForCausalLM", "CohereConfig", **common, logit_scale=0.25),
        "cohere2": hf("Cohere2ForCausalLM", "Cohere2Config", **common, logit_scale=0.5),
        "granite": hf("GraniteForCausalLM", "GraniteConfig", **common, logits_scaling=4.0),
        "granitemoe": hf("GraniteMoeForCausalLM", "GraniteMoeConfig", **common, logits_scaling=2.0,
                         num_local_experts=4, num_experts_per_tok=2),
        "olmo": hf("OlmoForCausalLM", "OlmoConfig", **common),
        "olmo2": hf("Olmo2ForCausalLM", "Olmo2Config", **common),
        "phi": hf("PhiForCausalLM", "PhiConfig", **common),
        "stablelm": hf("StableLmForCausalLM", "StableLmConfig", **common),
        "starcoder2": hf("Starcoder2ForCausalLM", "Starcoder2Config", **common),
        "mixtral_aux": hf("MixtralForCausalLM", "MixtralConfig", **common, num_local_experts=4, num_experts_per_tok=2,
                          output_router_logits=True, router_aux_loss_coef=0.01),
        "qwen2moe": hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **common, **moe,
                       shared_expert_intermediate_size=hidden),
        "qwen3moe_aux": hf("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **head8, **moe, output_router_logits=True),
        "deepseek_v3": hf("DeepseekV3ForCausalLM", "DeepseekV3Config", **{**common, "num_key_value_heads": 4},
                          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden, q_lora_rank=None,
                          kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                          first_k_dense_replace=0, n_group=1, topk_group=1),
        "gpt_oss": hf("GptOssForCausalLM", "GptOssConfig", **head8, num_local_experts=4, num_experts_per_tok=2),
        "nemotron": hf("NemotronForCausalLM", "NemotronConfig", **common),
        "glm": hf("GlmForCausalLM", "GlmConfig", **head8, pad_token_id=0),
        "helium": hf("HeliumForCausalLM", "HeliumConfig", **head8),
        "smollm3": hf("SmolLM3ForCausalLM", "SmolLM3Config", **common, pad_token_id=0),
        "exaone4": hf("Exaone4ForCausalLM", "Exaone4Config", **common),
        "gpt2": hf("GPT2LMHeadModel", "GPT2Config", vocab_size=vocab, n_embd=hidden, n_layer=1, n_head=4,
                   n_positions=64),
        "gptj": hf("GPTJForCausalLM", "GPTJConfig", vocab_size=vocab, n_embd=hidden, n_layer=1, n_head=4,
                   rotary_dim=4),
        "gpt_bigcode": hf("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=vocab, n_embd=hidden, n_layer=1,
                          n_head=4),
        "gpt_neox": hf("GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=vocab, hidden_size=hidden,
                       num_hidden_layers=1, num_attention_heads=4, intermediate_size=2 * hidden),
        "falcon": hf("FalconForCausalLM", "FalconConfig", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1,
                     num_attention_heads=4),
        "bloom": hf("BloomForCausalLM", "BloomConfig", vocab_size=vocab, hidden_size=hidden, n_layer=1, n_head=4),
        "opt": hf("OPTForCausalLM", "OPTConfig", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1,
                  num_attention_heads=4, ffn_dim=2 * hidden, word_embed_proj_dim=hidden),
        "mamba": hf("MambaForCausalLM", "MambaConfig", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1,
                    state_size=4),
        # an encoder-decoder, its decoder's inputs from the labels, a bias added to the logits
        "bart": with_logits_bias(hf("BartForConditionalGeneration", "BartConfig", vocab_size=vocab, d_model=hidden,
                                    encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                                    decoder_attention_heads=4, encoder_ffn_dim=2 * hidden,
                                    decoder_ffn_dim=2 * hidden, max_position_embeddings=64)),
        "t5": hf("T5ForConditionalGeneration", "T5Config", vocab_size=vocab, d_model=hidden, d_kv=8, d_ff=2 * hidden,
                 num_layers=1, num_heads=4, decoder_start_token_id=0),
        # a masked LM: its head is a transform and a decoder with a bias
        "bert_mlm": hf("BertForMaskedLM", "BertConfig", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=4),
        # vision-language models, given text only (a text-only step of a multimodal fine-tune)
        "qwen2_vl": hf("Qwen2VLForConditionalGeneration", "Qwen2VLConfig", text_config=dict(head8, rope_scaling=mrope),
                       vision_config=dict(depth=1, embed_dim=hidden, hidden_size=hidden, num_heads=4)),
        "qwen2_5_vl": hf("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig",
                         text_config=dict(head8, rope_scaling=mrope), vision_config=dict(
                             depth=1, hidden_size=hidden, out_hidden_size=hidden, num_heads=4,
                             intermediate_size=2 * hidden)),
        "qwen3_vl": hf("Qwen3VLForConditionalGeneration", "Qwen3VLConfig",
                       text_config=dict(head8, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]}),
                       vision_config=dict(depth=1, hidden_size=hidden, out_hidden_size=hidden, num_heads=4,
                                          intermediate_size=2 * hidden)),
        "gemma3_vl": hf("Gemma3ForConditionalGeneration", "Gemma3Config", text_config=dict(head8),
                        vision_config=vision, mm_tokens_per_image=4),
        "llava": hf("LlavaForConditionalGeneration", "LlavaConfig", text_config=dict(common, model_type="llama"),
                    vision_config=dict(vision, model_type="clip_vision_model")),
        "paligemma": hf("PaliGemmaForConditionalGeneration", "PaliGemmaConfig",
                        text_config=dict(head8, model_type="gemma"), vision_config=vision),
        "mistral3": hf("Mistral3ForConditionalGeneration", "Mistral3Config",
                       text_config=dict(head8, model_type="mistral"),
                       vision_config=dict(vision, model_type="pixtral", head_dim=8)),
    }


def make_model(name: str) -> torch.nn.Module:
    """Family ``name``'s tiny model, seeded, fp32, dropout off (runs compare exactly; gradients still flow),
    without a KV cache, otherwise as transformers builds it (GPT-2's names no loss type: transformers warns at its
    loss, which the backend keeps in the graph, ``flce_compile.compiler.hf_logging``)."""
    torch.manual_seed(0)
    model = builders()[name]().float()
    model.config.use_cache = False
    return model.eval()


def batch(seq: int = 8, rows: int = 2, vocab: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels (the ids, two positions ignored)."""
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    return ids, labels


def train_step(model: torch.nn.Module, fn: Callable, ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any
               ) -> tuple[Any, dict[str, torch.Tensor]]:
    """``fn(input_ids=ids, labels=labels, **kwargs)``, its loss's backward, and the parameters' gradients."""
    model.zero_grad(set_to_none=True)
    out = fn(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


class _Recorder:
    """An inner compiler that hands the graphs it gets (after the flce pass) to ``inner`` and records those it
    compiled, and how many it failed on. A failed graph with a fused site whose error Dynamo answers with a
    graph break runs as traced (the backend's default ``flce.inner_failure``: transformers 5.17's MoE models with
    fp32 weights under torch 2.11, with Inductor alone failing too); any other failed graph never runs."""

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self.graphs: list[torch.fx.GraphModule] = []
        self.traced: list[torch.fx.GraphModule] = []
        self.failed = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        from torch._dynamo.backends.registry import lookup_backend

        try:
            compiled = lookup_backend(self.inner)(gm, example_inputs, **kwargs)
        except Exception as exc:
            self.failed += 1
            if isinstance(exc, torch._dynamo.exc.exceptions_allowed_to_be_fallback) and any(_fused_ops(gm).values()):
                self.traced.append(gm)
            raise
        self.graphs.append(gm)
        return compiled

    def fused_ops(self) -> dict[str, int]:
        """How many of each fused op the graphs that ran hold, compiled or as traced (what ran, not what
        ``explain`` predicts)."""
        counts = [_fused_ops(gm) for gm in self.graphs + self.traced]
        return {k: sum(c[k] for c in counts) for k in ("fused", "fused_keep")}


def _fused_ops(gm: torch.fx.GraphModule) -> dict[str, int]:
    from flce_compile.compiler.rewrite import flce_fused_loss, flce_fused_loss_keep

    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return {"fused": targets.count(flce_fused_loss), "fused_keep": targets.count(flce_fused_loss_keep)}


#: ``--autocast`` names -> dtypes.
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _autocast(device: str, dtype: torch.dtype | None) -> torch.autocast:
    """Autocast to ``dtype`` on ``device``'s type (off when None)."""
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None)


def check_family(name: str, inner: str, device: str = "cpu", autocast: torch.dtype | None = None) -> dict[str, Any]:
    """One family's row: for each logits mode, what ``explain`` says the pass does with each site (path and
    reason), the fused ops the compiled graphs really hold, whether the returned logits were dropped, and the
    differences to eager (run under autocast to ``autocast`` too, when given)."""
    from flce_compile.compiler.explain import explain

    try:
        model = make_model(name).to(device)
    except FamilyMissing as exc:
        return {"family": name, "status": f"not in this transformers ({exc})"}
    ids, labels = (t.to(device) for t in batch())
    with _autocast(device, autocast):
        ref, ref_grads = train_step(model, model, ids, labels)
    row: dict[str, Any] = {"family": name}
    for logits in ("keep", "drop"):
        with _autocast(device, autocast):
            report = explain(model, input_ids=ids, labels=labels, options={"flce.logits": logits})
        torch._dynamo.reset()
        recorder = _Recorder(inner)
        compiled = torch.compile(model, backend="flce", options={"flce.inner": recorder, "flce.logits": logits})
        with _autocast(device, autocast):
            out, grads = train_step(model, compiled, ids, labels)
        mode: dict[str, Any] = {
            "graphs": report.graph_count, "graph_breaks": report.graph_breaks,
            "sites": [{"path": s.path, "reason": s.reason, "softcap": s.softcap, "logit_scale": s.logit_scale}
                      for s in report],
            "compiled_graphs": len(recorder.graphs), "inner_failures": recorder.failed,
            "traced_graphs": len(recorder.traced),
            "fused_ops": recorder.fused_ops(),
            "logits_dropped": out.logits is None,
        }
        if grads.keys() != ref_grads.keys():
            mode["error"] = f"gradients of {sorted(grads.keys() ^ ref_grads.keys())} differ in presence"
        else:
            mode.update(_differences(out, grads, ref, ref_grads))
        row[logits] = mode
    if max((m.get(k) or 0.0) for m in (row["keep"], row["drop"]) for k in ("loss", "grads", "logits")) > ATTRIBUTE:
        # Past rounding: the same compile with the pass off says whether torch.compile alone differs as much.
        torch._dynamo.reset()
        alone = torch.compile(model, backend="flce", options={"flce.inner": inner, "flce.enabled": False})
        with _autocast(device, autocast):
            out, grads = train_step(model, alone, ids, labels)
        row["pass_off"] = _differences(out, grads, ref, ref_grads)
    row["status"] = "ok"
    return row


def _differences(out: Any, grads: dict[str, torch.Tensor], ref: Any, ref_grads: dict[str, torch.Tensor]
                 ) -> dict[str, float | None]:
    """The largest absolute differences of a step's loss, gradients and returned logits (None when dropped) to the
    model run as is."""
    return {"loss": (out.loss - ref.loss).abs().item(),
            "grads": max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads),
            "logits": (out.logits - ref.logits).abs().max().item() if out.logits is not None else None}


def table(result: dict[str, Any]) -> str:
    """The sweep as a markdown table: one row per family, keep and drop side by side."""
    env = result["env"]
    lines = [f"# hf_families: backend=\"flce\" on tiny Hugging Face models, {env['date']}", "",
             f"torch {env['torch']}, transformers {env['transformers']}, inner compiler {result['inner']}, fp32 "
             f"{'parameters under ' + result['autocast'] + ' autocast ' if result.get('autocast') else ''}on "
             f"{env.get('device', 'cpu')}; one forward + backward of `model(input_ids=ids, labels=labels).loss`, "
             "one-layer random models (causal LMs, encoder-decoders, a masked LM, vision-language models given text "
             "only), 2 x 8 tokens, vocab 160, as is and through `torch.compile(model, "
             "backend=\"flce\")` with `flce.logits` \"keep\" (the default: the returned logits computed when "
             "read, here after backward) and \"drop\". path: what `explain` says the "
             "pass does with each loss site (with its reason when not fused); ops: the fused ops the graphs that ran "
             "hold; graphs: explain's graphs (the inner compiler's compiled ones, its failures, and of those the ones "
             "the backend ran as traced, flce.inner_failure) for keep / drop; "
             "dropped: whether the returned logits were None; differences are the largest absolute ones to the model "
             "run as is.", "",
             "| family | softcap | logit scale | graphs | keep: path | ops | loss | grads | logits | drop: path | ops "
             "| dropped | loss | grads |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def paths(mode: dict) -> str:
        return ", ".join(s["path"] + (f" ({s['reason']})" if s["reason"] else "") for s in mode["sites"]) or "no site"

    def ops(mode: dict) -> str:
        return "+".join(f"{n} {k}" for k, n in mode["fused_ops"].items() if n) or "none"

    def num(mode: dict, key: str) -> str:
        value = mode.get(key)
        return mode["error"] if "error" in mode else "-" if value is None else f"{value:.1e}"

    for row in result["rows"]:
        if row["status"] != "ok":
            lines.append(f"| {row['family']} | {row['status']} |" + " |" * 12)
            continue
        keep, drop = row["keep"], row["drop"]
        sites = keep["sites"]
        graphs = " / ".join(f"{m['graphs']} ({m['compiled_graphs']} compiled"
                            + (f", {m['inner_failures']} failed" if m.get("inner_failures") else "")
                            + (f", {m['traced_graphs']} run as traced" if m.get("traced_graphs") else "")
                            + ")" for m in (keep, drop))
        lines.append(f"| {row['family']} | {', '.join(str(s['softcap']) for s in sites)} | "
                     f"{', '.join(str(s['logit_scale']) for s in sites)} | {graphs} | {paths(keep)} | {ops(keep)} | "
                     f"{num(keep, 'loss')} | {num(keep, 'grads')} | {num(keep, 'logits')} | {paths(drop)} | "
                     f"{ops(drop)} | {'yes' if drop['logits_dropped'] else '**no**'} | {num(drop, 'loss')} | "
                     f"{num(drop, 'grads')} |")
    off = [row for row in result["rows"] if row.get("pass_off")]
    if off:
        lines += ["", f"Differences past {ATTRIBUTE:.0e}, against the same compile with the pass off (`flce.enabled="
                  "False`, the inner compiler alone), to eager:", ""]
        lines += [f"- {row['family']}: loss {row['pass_off']['loss']:.1e}, grads {row['pass_off']['grads']:.1e}, "
                  f"logits {row['pass_off']['logits']:.1e}" for row in off]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", help="family names (default: all of them)")
    parser.add_argument("--inner", default="aot_eager", help="the backend's inner compiler")
    parser.add_argument("--device", default="cpu", help="where the models run (fp32 either way)")
    parser.add_argument("--autocast", choices=sorted(AUTOCAST), help="run eager and compiled steps under autocast "
                        "to this dtype (the parameters stay fp32, as the Trainer's bf16=True runs them)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    import transformers

    import flce_compile.compiler  # noqa: F401  (registers backend="flce" in a source tree)
    from benchmarks._common import save_results, versions

    unknown = set(args.families) - set(builders())
    if unknown:
        raise SystemExit(f"unknown families {sorted(unknown)}; choose from {sorted(builders())}")
    rows = []
    for name in args.families or list(builders()):
        try:
            rows.append(check_family(name, args.inner, args.device, AUTOCAST.get(args.autocast)))
        except Exception as exc:  # noqa: BLE001 - a failing family is a row of the table, not the end of the sweep
            rows.append({"family": name, "status": f"error: {type(exc).__name__}: {str(exc)[:200]}"})
        print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    result = {"env": {"date": datetime.date.today().isoformat(), "transformers": transformers.__version__,
                      "device": device, **versions()}, "inner": args.inner, "autocast": args.autocast, "rows": rows}
    where = ("" if args.device == "cpu" else "_" + args.device.split(":")[0]) + (
        f"_{args.autocast}_autocast" if args.autocast else "")
    save_results(args.out, f"hf_families_{args.inner}{where}{args.tag}", table(result) + "\n", result)
    print(table(result))
    return result


if __name__ == "__main__":
    warnings.filterwarnings("ignore")  # transformers' deprecation notes, once per family, would bury the rows
    logging.getLogger("transformers").setLevel(logging.ERROR)
    main()
