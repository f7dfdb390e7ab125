"""Which code shape makes the CE step faster? (issue #13: the CE step is ~4 DRAM passes of time, 3 are needed)

A stripped CE kernel (mean cross-entropy only: no smoothing, softcap, class weights) with switches, timed on one
chunk against the op's own ``ce_chunk_kernel`` on the same data:

* ``exp2``: logits pre-multiplied by log2(e), exp2 instead of exp (one multiply less an element);
* ``lane``: pass 1 keeps a running max and sum per lane and reduces across the block once per row, instead of
  two block-wide reductions (with barriers) per block; one more exp an element;
* ``evict``: pass 1 loads ask L2 to keep the lines (evict_last), pass 2 loads to drop them (evict_first);
* ``width``: loops run to the padded row width (a multiple of 16 elements: vectorised loads and stores without
  a separate tail loop), masking only the math against V; the padding columns get a gradient of 0;
* ``one_block``: the whole row is one block, loaded once (two DRAM passes), when it fits.

    python benchmarks/ce_kernel_variants.py

Writes benchmarks/results/ce_kernel_variants_<gpu>.{json,md} (and to $OUT when set). CUDA only.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import median_ms, save_results, versions  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LOG2E = 1.4426950408889634


@triton.jit
def _load(ptr, offs, bound, EVICT: tl.constexpr, FIRST: tl.constexpr):
    if EVICT:
        if FIRST:
            return tl.load(ptr + offs, mask=offs < bound, other=0.0, eviction_policy="evict_last")
        return tl.load(ptr + offs, mask=offs < bound, other=0.0, eviction_policy="evict_first")
    return tl.load(ptr + offs, mask=offs < bound, other=0.0)


@triton.jit
def ce_variant_kernel(logits_ptr, stride, target_ptr, loss_ptr, coef, vocab, width,
                      EXP2: tl.constexpr, LANE: tl.constexpr, EVICT: tl.constexpr, ONE_BLOCK: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = logits_ptr + row * stride
    target = tl.load(target_ptr + row)
    ignored = target == -100
    cols = tl.arange(0, BLOCK_V)
    scale = 1.4426950408889634 if EXP2 else 1.0
    if ONE_BLOCK:
        raw = _load(ptr, cols, width, EVICT, True).to(tl.float32) * scale
        z = tl.where(cols < vocab, raw, -float("inf"))
        m = tl.max(z, axis=0)
        e = tl.exp2(z - m) if EXP2 else tl.exp(z - m)
        s = tl.sum(e, axis=0)
        g = e * (coef / s) - tl.where(cols == target, coef, 0.0)
        g = tl.where(ignored, 0.0, g)
        tl.store(ptr + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < width)
        lse = m + tl.log2(s) if EXP2 else m + tl.log(s)
    else:
        if LANE:
            m_vec = tl.full((BLOCK_V,), -float("inf"), tl.float32)
            s_vec = tl.zeros((BLOCK_V,), tl.float32)
            for start in range(0, width, BLOCK_V):
                offs = start + cols
                z = _load(ptr, offs, width, EVICT, True).to(tl.float32) * scale
                z = tl.where(offs < vocab, z, -float("inf"))
                new_m = tl.maximum(m_vec, z)
                safe = tl.where(new_m == -float("inf"), 0.0, new_m)
                if EXP2:
                    s_vec = s_vec * tl.exp2(m_vec - safe) + tl.exp2(z - safe)
                else:
                    s_vec = s_vec * tl.exp(m_vec - safe) + tl.exp(z - safe)
                m_vec = new_m
            m = tl.max(m_vec, axis=0)
            if EXP2:
                s = tl.sum(s_vec * tl.exp2(m_vec - m), axis=0)
            else:
                s = tl.sum(s_vec * tl.exp(m_vec - m), axis=0)
        else:
            m = -float("inf")
            s = 0.0
            for start in range(0, width, BLOCK_V):
                offs = start + cols
                z = _load(ptr, offs, width, EVICT, True).to(tl.float32) * scale
                z = tl.where(offs < vocab, z, -float("inf"))
                new_m = tl.maximum(m, tl.max(z, axis=0))
                if EXP2:
                    s = s * tl.exp2(m - new_m) + tl.sum(tl.exp2(z - new_m), axis=0)
                else:
                    s = s * tl.exp(m - new_m) + tl.sum(tl.exp(z - new_m), axis=0)
                m = new_m
        lse = m + tl.log2(s) if EXP2 else m + tl.log(s)
        for start in range(0, width, BLOCK_V):
            offs = start + cols
            z = _load(ptr, offs, width, EVICT, False).to(tl.float32) * scale
            p = tl.exp2(z - lse) if EXP2 else tl.exp(z - lse)
            g = coef * p - tl.where(offs == target, coef, 0.0)
            g = tl.where(ignored | (offs >= vocab), 0.0, g)
            tl.store(ptr + offs, g.to(logits_ptr.dtype.element_ty), mask=offs < width)
    raw_y = tl.load(ptr + tl.where(ignored, 0, target))  # (already overwritten: timing only)
    loss = (lse / scale - raw_y.to(tl.float32)) * coef
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, loss))


CASES = (("16384x4096x128256", 4096), ("16384x4096x151936", 3072), ("8192x2304x256000", 2048),
         ("4096x768x50257", 4096))
#: (name, exp2, lane, evict, one_block, block_v, num_warps)
VARIANTS = (
    ("plain 4096/8", False, False, False, False, 4096, 8),
    ("plain 8192/16", False, False, False, False, 8192, 16),
    ("exp2 4096/8", True, False, False, False, 4096, 8),
    ("exp2 8192/16", True, False, False, False, 8192, 16),
    ("lane 4096/8", False, True, False, False, 4096, 8),
    ("lane+exp2 4096/8", True, True, False, False, 4096, 8),
    ("lane+exp2 2048/4", True, True, False, False, 2048, 4),
    ("lane+exp2 8192/16", True, True, False, False, 8192, 16),
    ("evict+exp2 4096/8", True, False, True, False, 4096, 8),
    ("evict+lane+exp2 4096/8", True, True, True, False, 4096, 8),
    ("one_block+exp2 /32", True, False, False, True, 0, 32),
)


def run_case(shape: str, rows: int) -> list[dict[str, Any]]:
    from flce_compile.params import LossParams
    from flce_compile.plan.choose import resolve_config
    from flce_compile.plan.layout import padded_row_elements
    from flce_compile.strategies.ce_common import CEStepArgs
    from flce_compile.plan.config import FLCEConfig
    from flce_compile.strategies.ce_triton import ce_step_triton

    n, h, v = (int(s) for s in shape.split("x"))
    dev = torch.device("cuda")
    config, _ = resolve_config(None, n, v, h, torch.bfloat16, dev)
    stride = padded_row_elements(v, 2)
    width = -(-v // 16) * 16
    base = (torch.randn(rows, stride, device=dev) * 2).to(torch.bfloat16)
    buf = base.clone()
    target = torch.randint(0, v, (rows,), device=dev)
    loss = torch.empty(rows, device=dev)
    src = torch.empty(rows, stride, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), 20, "cuda")
    one = torch.ones((), device=dev)
    args = CEStepArgs(logits=buf[:, :v], target=target, ce_weight=None, weight_sum=torch.tensor(float(v), device=dev),
                      ce_scale=one / rows, z_scale=one / rows, loss_out=loss, lse_out=None, lse_in=None,
                      write_grad=True, padded=True)
    out = []

    def record(name: str, step, check) -> None:
        buf.copy_(base)
        step()
        err = check()
        for _ in range(2):
            step()
        ms = median_ms(step, 20, "cuda")
        row = {"shape": shape, "rows": rows, "variant": name, "ms": ms, "copy_ms": copy_ms,
               "passes": 2 * ms / copy_ms, "max_diff_vs_op": err}
        out.append(row)
        print(json.dumps(row), flush=True)

    buf.copy_(base)
    ce_step_triton(args, LossParams(), config)
    reference = buf[:, :v].float().clone()
    record(f"op kernel {config.block_v}/{config.num_warps}/{config.num_stages}",
           lambda: ce_step_triton(args, LossParams(), config), lambda: 0.0)
    for block_v, warps in ((4096, 8), (8192, 16)):
        tile = FLCEConfig(strategy="triton", block_v=block_v, num_warps=warps)
        record(f"op kernel {block_v}/{warps}/1", lambda tile=tile: ce_step_triton(args, LossParams(), tile),
               lambda: (buf[:, :v].float() - reference).abs().max().item())
    for name, exp2, lane, evict, one_block, block_v, warps in VARIANTS:
        if one_block:
            block_v = triton.next_power_of_2(width)
            if block_v > 65536:
                continue

        def step(exp2=exp2, lane=lane, evict=evict, one_block=one_block, block_v=block_v, warps=warps) -> None:
            ce_variant_kernel[(rows,)](buf, stride, target, loss, 1.0 / rows, v, width, EXP2=exp2, LANE=lane,
                                       EVICT=evict, ONE_BLOCK=one_block, BLOCK_V=block_v, num_warps=warps)

        record(name, step, lambda: (buf[:, :v].float() - reference).abs().max().item())
    return out


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("ce_kernel_variants.py needs a CUDA GPU")
    rows = [r for shape, n in CASES for r in run_case(shape, n)]
    env = {**versions(), "date": datetime.date.today().isoformat()}
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    lines = [f"# ce_kernel_variants: {torch.cuda.get_device_name()}, torch {torch.__version__}, {env['date']}", "",
             "One chunk's CE step, bf16, gradient in place; median ms; passes = time in DRAM passes (a copy of the "
             "chunk = 2); diff = max |gradient - the op kernel's|.", "",
             "| shape | rows | variant | ms | passes | diff |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['rows']} | {r['variant']} | {r['ms']:.3f} | {r['passes']:.2f} | "
              f"{r['max_diff_vs_op']:.1e} |" for r in rows]
    md = "\n".join(lines) + "\n"
    print(md)
    save_results(RESULTS, f"ce_kernel_variants_{gpu}", md, {"env": env, "rows": rows})


if __name__ == "__main__":
    main()
