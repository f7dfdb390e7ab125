"""bench_e2e.py's training step under DDP and FSDP2: the Llama-3.2-1B-shaped HF model (bf16, gradient
checkpointing, batch 1, S tokens per rank), one process per GPU, in the loop most people write
(``loss = model(input_ids=ids, labels=ids).loss; loss.backward()``; no optimizer step, as in bench_e2e.py).

Modes, wrapped as users wrap them:
- ddp:   ``DistributedDataParallel(model)``; compiled variants compile the wrapper,
         ``torch.compile(DDP(model), backend="flce")`` (Dynamo's DDPOptimizer splits the graph by bucket).
- fsdp2: ``fully_shard`` on every decoder layer and on the root; compiled variants compile the whole model
         afterwards, ``torch.compile(model, backend="flce")``.

Variants (bench_e2e.py's, built by its code): flce (``backend="flce"``, no options) and liger-flce (eager +
Liger's fused linear cross-entropy, patched into the HF model before it is wrapped) by default; flce-drop
(``flce.logits="drop"``), eager and inductor on request. ``--mask`` is bench_e2e.py's, with its default ``both``:
every variant as users run it (``as-is``), then the compiled ones again with the bench-only mask patch
(``patched``: compiled models get eager's mask-free SDPA call; see bench_e2e.allow_causal_skip_under_compile).

Each (mode, mask, variant) runs in fresh processes started by this script (torch.multiprocessing, one per rank:
spawned on CUDA with NCCL, forked on the CPU with gloo; no torchrun), so peaks, Dynamo's caches and Liger's
in-place patch never carry over from one row to the next. Per row, from every rank and then the max over ranks:
the median step time after warm-up (synchronize + perf_counter, ranks lined up by a collective before each step)
and torch.cuda.max_memory_allocated over the timed steps. Also each rank's first-step loss (rank r's tokens are the
same in every row, and rank 0's are bench_e2e.py's, so rank 0's loss compares with bench_e2e.py's single-GPU rows)
and its largest difference from the reference row's (eager when run, else the first row that ran); for flce rows,
how many loss sites the pass fused (rank 0's log); Dynamo's graph and graph-break counts.

On two GPUs; every rank's numbers go to benchmarks/results/e2e-dist-<time>.{json,md} (and to $OUT when set):

    python benchmarks/bench_e2e_distributed.py                      # ddp, fsdp2: flce (as-is, patched), liger-flce
    python benchmarks/bench_e2e_distributed.py --variants flce-drop eager   # ddp, fsdp2: flce-drop (x 2), eager

On the CPU (what tests/test_bench_e2e_distributed.py runs; fp32, gloo):

    python benchmarks/bench_e2e_distributed.py --device cpu --layers 2 --hidden 32 --vocab 128 --seq 16 \\
        --warmup 1 --steps 1 --variants eager flce --mask as-is --flce-inner aot_eager
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import logging
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_e2e  # noqa: E402
from benchmarks._common import versions  # noqa: E402

MODES = ("ddp", "fsdp2")
VARIANTS = ("flce", "flce-drop", "liger-flce", "eager", "inductor")
DEFAULT_VARIANTS = ("flce", "liger-flce")  # both modes, both mask modes: one command under 10 minutes
RESULTS = Path(__file__).resolve().parent / "results"
#: DDP rebuilds its gradient buckets in the second step (in the order the gradients arrived), holding the old
#: and the new buckets for a while: on two H200s that step peaked 2.4 GB (flce) and 1.4 GB (Liger) above the
#: steady steps. Peaks are taken after it.
DDP_MIN_WARMUP = 2
EXIT_GRACE_S = 30.0  # how long ranks that have written their numbers get to exit before they are ended


def rank_ids(rank: int, seq: int, vocab: int) -> torch.Tensor:
    """Rank ``rank``'s tokens (1, seq), the same in every row; rank 0's are bench_e2e.py's for that seq."""
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq + 1_000_003 * rank))


def wrap(mode: str, model, device: torch.device):
    """The HF model as users wrap it for ``mode``; returns the module to call (and to compile)."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)  # the root: embedding, final norm and the (tied) lm_head
        return model
    raise ValueError(f"unknown mode {mode!r}; use one of {MODES}")


class _SiteLog(logging.Handler):
    """Collects the flce pass's verdict on each loss site (``flce: loss X -> path`` or ``... not fused: why``),
    so a row shows that the pass fused the site under DDP / FSDP2, not only that the step ran."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.sites: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("flce: loss "):
            self.sites.append(message)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _status(exc: BaseException) -> str:
    """A row status for an exception: OOM, bench_e2e's 'unavailable: ...', or the error's first line."""
    text = str(exc)
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text.lower():
        return "OOM"
    if text.startswith("unavailable"):
        return text
    first = text.splitlines()[0] if text else ""
    return f"error: {type(exc).__name__}: {first[:200]}"


def _worker(rank: int, world: int, port: int, spec: dict, out_dir: str) -> None:
    """One rank of one row: build, wrap, compile, ``warmup + steps`` steps; writes rank<r>.json to out_dir.

    A failed rank writes its status and exits non-zero at once: its peers may be blocked in a collective it
    will never join, and the launcher ends them when it sees the exit."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A rank still running near the row's timeout prints every thread's stack to stderr before the launcher
    # ends it: a hung collective or lock then shows where it hangs.
    faulthandler.dump_traceback_later(max(1.0, spec["timeout"] - 5), exit=False)
    # Ranks share the host's cores: one full-width intra-op pool per rank would oversubscribe them (the model's
    # CPU initialisation, and every CPU op on --device cpu).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    out: dict = {"rank": rank, "status": "ok"}
    try:
        if spec["device"] == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            out["device_name"] = torch.cuda.get_device_name(device)
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device,
                                    timeout=datetime.timedelta(seconds=spec["timeout"]))
            dtype = torch.bfloat16
        else:
            device = torch.device("cpu")
            out["device_name"] = platform.processor() or platform.machine()
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=spec["timeout"]))
            dtype = torch.float32  # the CPU run checks losses at fp32 tolerance
        if spec["mask"] == "patched":
            bench_e2e.allow_causal_skip_under_compile()
        model = bench_e2e.build_model(device, dtype, vocab=spec["vocab"], hidden=spec["hidden"],
                                      layers=spec["layers"])
        variant = spec["variant"]
        site_log = _SiteLog()
        flce_logger = logging.getLogger("flce_compile")
        flce_logger.addHandler(site_log)
        flce_logger.setLevel(logging.INFO)
        if variant in bench_e2e.LIGER_VARIANTS:
            bench_e2e.apply_liger(variant, model)  # on the HF model, before DDP / FSDP2 wrap it
        torch._dynamo.reset()
        step_fn = bench_e2e.compile_variant(variant, wrap(spec["mode"], model, device), spec["flce_inner"])
        ids = rank_ids(rank, spec["seq"], spec["vocab"]).to(device)
        line_up = torch.zeros(1, device=device)
        times = []
        for i in range(spec["warmup"] + spec["steps"]):
            model.zero_grad(set_to_none=True)
            if i == spec["warmup"] and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)  # the timed steps only, as bench_e2e.py measures
            dist.all_reduce(line_up)  # every rank starts the step together: the max over ranks is one step
            _sync(device)
            start = time.perf_counter()
            loss = step_fn(input_ids=ids, labels=ids).loss
            loss.backward()
            loss = loss.detach()
            _sync(device)
            elapsed = time.perf_counter() - start
            if i == 0:
                out.update(first_loss=float(loss), first_step_s=elapsed)  # the first step includes the compile
            if i >= spec["warmup"]:
                times.append(elapsed * 1e3)
        from torch._dynamo.utils import counters

        out.update(last_loss=float(loss), step_ms_all=times, step_ms=statistics.median(times),
                   flce_sites=site_log.sites,
                   # Graphs and graph breaks: under FSDP2 Dynamo breaks at FSDP's hooks, and how the layers are
                   # split (or recompiled) bears on compile time and on what runs compiled at all.
                   dynamo={"graphs": counters["stats"]["unique_graphs"],
                           "graph_breaks": sum(counters["graph_break"].values()),
                           "break_reasons": [reason[:300] for reason in counters["graph_break"]][:20]})
        if device.type == "cuda":
            out.update(peak_gb=torch.cuda.max_memory_allocated(device) / 1e9,
                       reserved_gb=torch.cuda.max_memory_reserved(device) / 1e9)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes the row's status
        out.update(status=_status(exc), traceback=traceback.format_exc()[-4000:])
        _write_json(Path(out_dir) / f"rank{rank}.json", out)
        _leave(3)  # no clean-up: a collective a peer waits in would block it
    _write_json(Path(out_dir) / f"rank{rank}.json", out)
    # Every collective of the row has completed on every rank (each step ends with the last one done), so a
    # rank can leave without tearing down the process group; doing so has once hung forked CPU ranks after
    # their numbers were written (an exit-time hang costs a whole row's timeout).
    _leave(0)


def _leave(code: int) -> None:
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)  # the launcher never reads half a file


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: dict, world: int, timeout_s: float, start_method: str = "spawn") -> dict:
    """Run one row in ``world`` fresh processes; return the row: the spec, each rank's numbers and the
    aggregates (status, step ms and peak GB as the max over ranks, rank 0's first-step loss)."""
    import torch.multiprocessing as mp

    row = {k: spec[k] for k in ("mode", "mask", "variant", "seq")}
    with tempfile.TemporaryDirectory(prefix="e2e-dist-") as tmp:
        ctx = mp.start_processes(_worker, args=(world, _free_port(), spec, tmp), nprocs=world, join=False,
                                 start_method=start_method)
        deadline = time.monotonic() + timeout_s
        launch_error = None
        try:
            while not ctx.join(timeout=2):
                written = all((Path(tmp) / f"rank{r}.json").exists() for r in range(world))
                if written:  # the numbers are in: only the exits are left
                    deadline = min(deadline, time.monotonic() + EXIT_GRACE_S)
                if time.monotonic() > deadline:
                    launch_error = (f"ranks ended {EXIT_GRACE_S:.0f} s after writing their numbers" if written
                                    else f"timeout: no result within {timeout_s:.0f} s")
                    for proc in ctx.processes:  # ours: started above
                        if proc.is_alive():
                            proc.kill()
                        proc.join()
                    break
        except Exception as exc:  # noqa: BLE001 - a rank exited non-zero; join has ended the others
            launch_error = f"error: {str(exc).splitlines()[0][:200]}"
        ranks = []
        for rank in range(world):
            path = Path(tmp) / f"rank{rank}.json"
            ranks.append(json.loads(path.read_text()) if path.exists() else {"rank": rank, "status": "no result"})
    row["ranks"] = ranks
    failures = [r["status"] for r in ranks if r["status"] not in ("ok", "no result")]
    if failures:
        row["status"] = failures[0]  # the rank's own account beats the launcher's
    elif any(r["status"] == "no result" for r in ranks):
        row["status"] = launch_error or "no result"
    else:
        row["status"] = "ok"
        if launch_error:
            row["launch_note"] = launch_error  # every rank's numbers are in; the row stands
    if row["status"] == "ok":
        row.update(step_ms=max(r["step_ms"] for r in ranks), first_step_s=max(r["first_step_s"] for r in ranks),
                   loss=ranks[0]["first_loss"], losses=[r["first_loss"] for r in ranks])
        row.update(flce_sites=ranks[0]["flce_sites"], dynamo=ranks[0]["dynamo"])
        if all("peak_gb" in r for r in ranks):
            row.update(peak_gb=max(r["peak_gb"] for r in ranks), reserved_gb=max(r["reserved_gb"] for r in ranks))
    return row


def plan_runs(modes: list[str], variants: list[str], mask: str) -> list[tuple[str, str, str]]:
    """(mode, variant, mask mode) in run order: per mode, bench_e2e.py's order (as-is rows first, then the
    compiled variants with the mask patch, Liger last)."""
    return [(mode, variant, m) for mode in modes for variant, _, m in bench_e2e.plan_runs(variants, [0], mask)]


def loss_reference(rows: list[dict]) -> dict | None:
    """The row every first-step loss is compared with: eager when it ran (any mode), else the first row that
    ran."""
    ok = [r for r in rows if r["status"] == "ok"]
    return next((r for r in ok if r["variant"] == "eager"), ok[0] if ok else None)


def add_loss_deltas(rows: list[dict]) -> None:
    """Each ok row's largest |first-step loss - the reference's| over ranks (rank r against rank r)."""
    ref = loss_reference(rows)
    for r in rows:
        if ref is not None and r["status"] == "ok":
            r["loss_ref"] = f"{ref['mode']} {ref['mask']} {ref['variant']}"
            r["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))


def table(rows: list[dict], world: int) -> str:
    """Markdown: one line per row, max over ranks; the loss column is rank 0's first step."""
    ref = loss_reference(rows)
    ref_name = f"{ref['mode']} {ref['mask']} {ref['variant']}" if ref else "none"
    out = [f"{world} ranks; step ms: median over the timed steps, max over ranks; peak GB: "
           "torch.cuda.max_memory_allocated, max over ranks; loss: rank 0's first step; "
           f"|dloss|: max over ranks against {ref_name}",
           "mask: " + "; ".join(f"{k} = {v}" for k, v in bench_e2e.MASK_MODES.items()), "",
           "| mode | mask | variant | status | peak GB | step ms | first step s | loss | max abs dloss | fused | "
           "graphs / breaks |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in rows:
        out.append(f"| {r['mode']} | {r['mask']} | {r['variant']} | {r['status']} | {r.get('peak_gb', nan):.2f} | "
                   f"{r.get('step_ms', nan):.1f} | {r.get('first_step_s', nan):.1f} | {r.get('loss', nan):.5f} | "
                   f"{r.get('max_abs_loss_diff', nan):.2e} | {fused_sites(r)} | {graphs(r)} |")
    return "\n".join(out) + "\n"


def fused_sites(row: dict) -> str:
    """'fused/sites' of the flce pass on rank 0 (the same graphs on every rank); empty for the other variants."""
    if row["variant"] not in bench_e2e.FLCE_OPTIONS or row["status"] != "ok":
        return ""
    sites = row["flce_sites"]
    return f"{sum(' -> ' in s for s in sites)}/{len(sites)}"


def graphs(row: dict) -> str:
    """'graphs / graph breaks' Dynamo counted on rank 0; empty for rows that Dynamo never saw."""
    dyn = row.get("dynamo")
    return f"{dyn['graphs']} / {dyn['graph_breaks']}" if dyn and dyn["graphs"] else ""


def environment(device: str, world: int, rows: list[dict]) -> dict:
    """GPU (as rank 0 of the first row saw it), versions, world size. The launcher itself never touches CUDA:
    a context there would sit on GPU 0 beside rank 0."""
    import transformers

    names = [r["ranks"][0].get("device_name") for r in rows if r["ranks"] and r["ranks"][0].get("device_name")]
    env = {"device": device, "gpu" if device == "cuda" else "cpu": names[0] if names else None, "world": world,
           **versions(), "transformers": transformers.__version__, "cuda": torch.version.cuda}
    if device == "cuda":
        nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return env


def write(prefix: Path, env: dict, args: dict, rows: list[dict], world: int) -> None:
    """<prefix>.json (env, arguments, rows with every rank's numbers) and <prefix>.md; a copy under $OUT when set
    (the GPU machine's way back)."""
    header = (f"# e2e training step under DDP / FSDP2, Llama-3.2-1B shape family (V {args['vocab']}, "
              f"H {args['hidden']}, {args['layers']} layers), batch 1 x S {args['seq']} per rank, "
              "gradient checkpointing")
    text = f"{header}\n\n{', '.join(f'{k} {v}' for k, v in env.items())}\n\n{table(rows, world)}"
    data = json.dumps({"env": env, "args": args, "rows": rows}, indent=2)
    targets = [prefix] + ([Path(os.environ["OUT"]) / prefix.name] if os.environ.get("OUT") else [])
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.with_name(target.name + ".json").write_text(data)
        target.with_name(target.name + ".md").write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    parser.add_argument("--mask", choices=["as-is", "patched", "both"], default="both",
                        help="bench_e2e.py's: as-is, patched (bench-only mask patch), both (default)")
    parser.add_argument("--seq", type=int, default=16384, help="tokens per rank (batch 1)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--warmup", type=int, default=DDP_MIN_WARMUP,
                        help=f"untimed steps first (>= {DDP_MIN_WARMUP} with ddp on CUDA: see DDP_MIN_WARMUP)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU; 2 on the CPU)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--flce-inner", default=None,
                        help="the flce variants' inner compiler (default: theirs, Inductor); the CPU test uses "
                             "aot_eager, since Inductor's C++ build takes minutes on a small CPU")
    parser.add_argument("--start-method", choices=["spawn", "fork"], default=None,
                        help="how ranks start (default: spawn on CUDA, which a forked child cannot initialise "
                             "safely; fork on the CPU, where it saves each rank re-importing torch and "
                             "transformers)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one row may take, compile included, before its processes are ended")
    parser.add_argument("--out", type=Path, default=None,
                        help="path prefix of the .json / .md (default: benchmarks/results/e2e-dist-<time>)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and "ddp" in args.modes and args.warmup < DDP_MIN_WARMUP:
        parser.error(f"--warmup {args.warmup}: DDP rebuilds its gradient buckets during step 2, briefly holding "
                     f"old and new ones; use --warmup >= {DDP_MIN_WARMUP} so the peak is a steady step's")
    if args.device == "cuda":
        import torch.distributed as dist

        # Counted without creating a CUDA context here (ranks create their own).
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise SystemExit("--device cuda needs CUDA GPUs and NCCL (use --device cpu for gloo)")
        world = args.nproc or torch.cuda.device_count()
        if world > torch.cuda.device_count():
            raise SystemExit(f"--nproc {world}: only {torch.cuda.device_count()} GPUs")
    else:
        world = args.nproc or 2
    start_method = args.start_method or ("spawn" if args.device == "cuda" else "fork")
    if start_method == "fork":
        import transformers.models.llama.modeling_llama  # noqa: F401  (imported once, here, for every rank)

        import flce_compile.compiler  # noqa: F401
    prefix = args.out or RESULTS / f"e2e-dist-{time.strftime('%Y%m%d-%H%M%S')}"
    shape = {"seq": args.seq, "layers": args.layers, "hidden": args.hidden, "vocab": args.vocab}
    record = {**shape, "modes": args.modes, "variants": args.variants, "mask": args.mask, "warmup": args.warmup,
              "steps": args.steps, "nproc": world, "flce_inner": args.flce_inner, "start_method": start_method}
    rows: list[dict] = []
    env: dict = {}
    for mode, variant, mask in plan_runs(args.modes, args.variants, args.mask):
        spec = {**shape, "mode": mode, "variant": variant, "mask": mask, "device": args.device,
                "flce_inner": args.flce_inner,
                "warmup": args.warmup, "steps": args.steps, "timeout": args.timeout}
        started = time.perf_counter()
        row = launch(spec, world, args.timeout, start_method)
        row["wall_s"] = time.perf_counter() - started  # processes, model build and compile included
        rows.append(row)
        add_loss_deltas(rows)
        print(json.dumps({k: v for k, v in row.items() if k != "ranks"}), flush=True)
        env = environment(args.device, world, rows)
        write(prefix, env, record, rows, world)  # after every row: a run cut short keeps what it measured
    print(f"\n{', '.join(f'{k} {v}' for k, v in env.items())}\n")
    print(table(rows, world))
    print(f"written: {prefix}.json, {prefix}.md")


if __name__ == "__main__":
    main()
