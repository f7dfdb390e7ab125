"""The CE kernel as the GPU would run it, without a GPU: ``ce_chunk_kernel`` compiled for sm_90 (Triton's own ptxas),
over the constexpr combinations the op launches, with each one's registers per thread and spilled bytes.

With ``--against REV`` the kernel of git revision REV (or of a file) is compiled too and each PTX compared with it
(the DWARF sections, which name the source file, left out, and each kernel parameter read by its argument's name:
an argument a launch leaves unused would renumber every later one): a refactor that claims to change nothing on the
GPU can show it on a machine that has none; the exit status is 1 when any PTX differs. A launch that sets a flag
the other kernel does not have is not compared ("new flag"). The register counts are ptxas's for
the compile the GPU would run (checked against an H200's: 127 and 95 at 8192:8 and 16384:16 on padded GPT-2 rows,
Triton 3.6). Registers decide how many programs an SM holds (the registry's per-thread bound,
``plan.registry.MAX_ELEMENTS_PER_THREAD``); a spill means local-memory traffic in a memory-bound kernel.

    python benchmarks/kernel_ptx.py                           # registers and spills, tiles 4096:8 and 16384:32
    python benchmarks/kernel_ptx.py --against HEAD --tiles 4096:8 --layout padded
    python benchmarks/kernel_ptx.py --out benchmarks/results --tag rev4
    python benchmarks/kernel_ptx.py --lane-pass --against HEAD    # pass 1 lane-wise (ce_triton.LANE_PASS)

Prints a table; with ``--out`` writes ``kernel_ptx_sm90_<tag>.{md,json}``. Needs triton with its NVIDIA backend (the
PyPI wheel carries the ptxas Triton assembles with), not a GPU, and a process without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._common import save_results  # noqa: E402
from benchmarks.ce_kernel_tiles import parse_tile  # noqa: E402
from flce_compile.strategies.ce_triton import lanes  # noqa: E402
KERNEL = "flce_compile/kernels/ce_chunk.py"
ARCH = 90

#: The pointer arguments' element types as the op passes them (bf16 logits and gradient, fp64 lse and stats).
POINTERS = {"logits_ptr": "*bf16", "grad_ptr": "*bf16", "target_ptr": "*i64", "ce_weight_ptr": "*fp32",
            "weight_sum_ptr": "*fp32", "ce_scale_ptr": "*fp32", "z_scale_ptr": "*fp32", "loss_ptr": "*fp32",
            "lse_out_ptr": "*fp64", "lse_in_ptr": "*fp64", "target_z_out_ptr": "*fp32", "target_z_in_ptr": "*fp32",
            "top_out_ptr": "*fp64", "top_in_ptr": "*fp64", "stats_ptr": "*fp64", "residual_ptr": "*fp32"}
FLOATS = ("label_smoothing", "softcap", "logit_scale", "z_loss")

#: Row layouts: the kernel's flags and the integer arguments of a representative launch (GPT-2's V padded to
#: 128-byte rows, or unpadded; Llama 3's V). Triton's launcher specializes an integer on its value (a multiple of
#: 16 is marked divisible, 1 becomes a constant), so these values decide the PTX as much as the flags do.
LAYOUTS: dict[str, tuple[dict[str, bool], dict[str, int]]] = {
    "padded": ({"PADDED": True}, {"vocab": 50257, "width": 50272, "stride_row": 50304}),
    "odd V": ({"UNMASKED_BLOCKS": True}, {"vocab": 50257, "width": 50257, "stride_row": 50257}),
    "V % 16 == 0": ({}, {"vocab": 128256, "width": 128256, "stride_row": 128256}),
}
#: The other integer arguments, as a "mean" call over one chunk of 4096 rows launches them.
OTHER_INTS = {"class_offset": 0, "ignore_index": -100, "scale_stride": 0, "stats_stride": 4096, "top_stride": 4096}
CASES = {
    "loss + grad": {"WRITE_LOSS": True, "WRITE_GRAD": True},
    "smoothing + class weights": {"WRITE_LOSS": True, "WRITE_GRAD": True, "HAS_SMOOTHING": True,
                                  "HAS_CE_WEIGHT": True},
    "softcap + scale": {"WRITE_LOSS": True, "WRITE_GRAD": True, "HAS_SOFTCAP": True, "SCALED": True},
    "z-loss + residual": {"WRITE_LOSS": True, "WRITE_GRAD": True, "HAS_Z_LOSS": True, "WRITE_RESIDUAL": True},
    "recompute backward": {"WRITE_GRAD": True, "HAS_LSE_IN": True, "HAS_TARGET_Z_IN": True, "HAS_TOP_IN": True},
    "forward only": {"WRITE_LOSS": True, "WRITE_LSE": True, "WRITE_TARGET_Z": True},
    "recompute forward": {"WRITE_LOSS": True, "WRITE_LSE": True, "WRITE_TARGET_Z": True, "WRITE_TOP": True},
    "vocab-parallel stats": {"WRITE_STATS": True, "WRITE_TOP": True},
}
#: Pointer types a case launches otherwise: the residual comes with the "precise" policy's fp32 logits.
CASE_POINTERS = {"z-loss + residual": {"logits_ptr": "*fp32"}}


def load_kernel(path: Path, name: str) -> Any:
    """``ce_chunk_kernel`` of the file at ``path``, its relative imports resolved in ``flce_compile.kernels``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "flce_compile.kernels"
    spec.loader.exec_module(module)
    return module.ce_chunk_kernel


def kernel_at(rev: str) -> Path:
    """The kernel file of git revision ``rev``, written to a temporary file."""
    shown = subprocess.run(["git", "show", f"{rev}:{KERNEL}"], cwd=REPO, capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"--against {rev!r}: neither a file nor a git revision holding {KERNEL} "
                         f"({shown.stderr.strip()})")
    handle, name = tempfile.mkstemp(suffix="_ce_chunk.py")
    with os.fdopen(handle, "w") as f:
        f.write(shown.stdout)
    return Path(name)


def int_arguments(layout: str, block_v: int) -> dict[str, int]:
    """The integer arguments of a launch in ``layout`` at ``block_v``, as ``ce_step_triton`` passes them."""
    ints = dict(LAYOUTS[layout][1], **OTHER_INTS)
    vocab = ints["vocab"]
    ints.update(grad_stride_row=ints["stride_row"], num_classes=vocab, vocab_full=vocab - vocab % block_v)
    return ints


def compile_for_sm90(kernel: Any, constexprs: dict[str, Any], num_warps: int, ints: dict[str, int],
                     pointers: dict[str, str] | None = None) -> tuple[str, int, int]:
    """(PTX without its debug sections, registers per thread, spill store bytes) of one launch configuration.
    Pointers are 16-byte aligned, as torch allocates them, of ``POINTERS``' types unless ``pointers`` says
    otherwise; ``ints`` are specialized as Triton's launcher does."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    types = {**POINTERS, **(pointers or {})}
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    constants = dict(constexprs)
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            signature[name] = "fp32"
        elif ints[name] == 1:  # the launcher makes a 1 a constant
            signature[name] = "constexpr"
            constants[name] = 1
        else:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", ARCH, 32),
                              options={"num_warps": num_warps, "num_stages": 1})
    ptx = compiled.asm["ptx"]
    code = ptx.split("\t.section\t.debug")[0]
    code = "\n".join(line for line in code.splitlines() if not line.strip().startswith((".loc", ".file", "//")))
    code = _by_parameter_name(code, [name for name in kernel.arg_names if signature[name] != "constexpr"])
    ptxas = get_ptxas(ARCH).path  # the one Triton itself assembles this arch's PTX with
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        report = subprocess.run([ptxas, f"-arch=sm_{ARCH}a", "-v", "-O3", f.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    text = report.stdout + report.stderr
    registers = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = re.search(r"(\d+) bytes spill stores", text)
    return code, registers, int(spills.group(1)) if spills else 0


def _by_parameter_name(code: str, runtime: list[str]) -> str:
    """PTX with each kernel parameter read by its argument's name, not its position, and without the parameter
    declarations: a kernel that gains an argument its launch leaves unused compiles to the same code, whose
    parameters after the new one would otherwise all be renumbered (parameters past the arguments are Triton's
    own scratch pointers)."""
    def name(match: re.Match) -> str:
        index = int(match.group(1))
        return runtime[index] if index < len(runtime) else f"scratch_{index - len(runtime)}"

    lines = [line for line in code.splitlines() if not line.strip().startswith(".param")]
    return re.sub(r"\w+_param_(\d+)", name, "\n".join(lines))


def launches(names: list[str], layouts: list[str] | None = None,
             cases: list[str] | None = None) -> Iterator[tuple[str, str, dict[str, bool]]]:
    """(layout, case, constexpr flags) for the combinations asked (default all); flags not named are False."""
    for layout, (layout_flags, _ints) in LAYOUTS.items():
        if layouts and layout not in layouts:
            continue
        for case, case_flags in CASES.items():
            if cases and case not in cases:
                continue
            flags = {name: False for name in names}
            flags.update(layout_flags)
            flags.update(case_flags)
            yield layout, case, flags


def run(tiles: list[tuple[int, int]], against: str | None, layouts: list[str] | None = None,
        cases: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per (layout, case, tile): registers, spill bytes and, with ``against`` (a kernel file or a git
    revision), whether its PTX is the same."""
    ours = load_kernel(REPO / KERNEL, "ce_chunk_here")
    theirs = None
    if against is not None:
        if Path(against).is_file():
            theirs = load_kernel(Path(against), "ce_chunk_other")
        else:
            path = kernel_at(against)
            try:
                theirs = load_kernel(path, "ce_chunk_" + re.sub(r"\W", "_", against))
            finally:
                path.unlink()
    sizes = ("BLOCK_V", "LANES")  # the tile's, set per tile as ``ce_step_triton`` sets them
    names = [ours.arg_names[i] for i in ours.constexprs if ours.arg_names[i] not in sizes]  # the kernel's flags
    rows = []
    for layout, case, flags in launches(names, layouts, cases):
        for block_v, num_warps in tiles:
            constexprs = {**flags, "BLOCK_V": block_v}
            if "LANES" in ours.arg_names:
                constexprs["LANES"] = lanes(block_v, num_warps)
            ints = int_arguments(layout, block_v)
            pointers = CASE_POINTERS.get(case)
            ptx, registers, spills = compile_for_sm90(ours, constexprs, num_warps, ints, pointers)
            row = {"layout": layout, "case": case, "tile": f"{block_v}:{num_warps}", "registers": registers,
                   "spill_bytes": spills}
            if theirs is not None:  # (None: a flag this launch sets that the other kernel does not have)
                known = set(theirs.arg_names)
                row["same_ptx"] = None if any(on and name not in known for name, on in constexprs.items()) else (
                    compile_for_sm90(theirs, {k: v for k, v in constexprs.items() if k in known}, num_warps, ints,
                                     pointers)[0] == ptx)
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], against: str | None) -> str:
    head = ["layout", "case", "tile", "registers", "spill bytes"] + ([f"PTX as {against}"] if against else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["layout"], r["case"], r["tile"], str(r["registers"]), str(r["spill_bytes"])]
        if against:
            cells.append({True: "same", False: "DIFFERENT", None: "new flag"}[r["same_ptx"]])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", type=parse_tile, nargs="+", default=[(4096, 8), (16384, 32)],
                        help="BLOCK_V:NUM_WARPS pairs (default 4096:8 16384:32)")
    parser.add_argument("--against", metavar="REV", help="compare each PTX with the kernel of this git revision "
                        "(or in this file)")
    parser.add_argument("--layout", action="append", choices=list(LAYOUTS), help="only this layout (repeatable)")
    parser.add_argument("--case", action="append", choices=list(CASES), help="only this case (repeatable)")
    parser.add_argument("--out", type=Path, help="write kernel_ptx_sm90_<tag>.{md,json} here")
    parser.add_argument("--tag", default=datetime.date.today().isoformat())
    parser.add_argument("--lane-pass", action="store_true", help="launch pass 1 lane-wise where the op may "
                        "(ce_triton.LANE_PASS on, as benchmarks/ce_lane_pass.py does)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":  # Triton's own library would be the interpreter's
        raise SystemExit("kernel_ptx compiles for the GPU: run it without TRITON_INTERPRET=1")
    import triton

    from flce_compile.strategies import ce_triton
    lane_wise = bool(args.lane_pass)  # forced either way, as the launches' configs may not say
    with ce_triton.lane_pass(lane_wise):
        rows = run(args.tiles, args.against, args.layout, args.case)
    md = (f"# ce_chunk_kernel compiled for sm_{ARCH} (no GPU), triton {triton.__version__}, "
          f"{datetime.date.today().isoformat()}{', pass 1 lane-wise' if lane_wise else ''}\n\n"
          + table(rows, args.against) + "\n")
    print(md)
    if args.out is not None:
        save_results(args.out, f"kernel_ptx_sm{ARCH}_{args.tag}", md,
                     {"triton": triton.__version__, "arch": ARCH, "against": args.against, "rows": rows})
    differs = [r for r in rows if r.get("same_ptx") is False]
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
