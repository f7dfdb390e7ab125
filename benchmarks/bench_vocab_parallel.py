"""The vocabulary-parallel fused op against PyTorch's tensor-parallel loss, forward + backward, mean reduction,
~6% ignored targets. Every rank holds the same hidden states and targets and 1/world of the lm_head's rows.

Variants:

* ``flce-vp``: ``flce_compile.vocab_parallel_linear_cross_entropy`` on each rank's local shard (group=).
* ``loss_parallel``: the logits as a DTensor sharded over V (``F.linear`` of a replicated input and a Shard(0)
  weight, what ``ColwiseParallel(output_layouts=Shard(-1))`` computes), then ``F.cross_entropy(logits.float(),
  ...)`` under ``torch.distributed.tensor.parallel.loss_parallel()``.
* ``flce-1gpu``: the single-device op with the whole weight, on rank 0 alone (the reference: the target is a
  per-GPU peak of about half of it for flce-vp).

Reports, per variant, the median fwd+bwd time (CUDA events; ``time.perf_counter`` on the CPU) and each rank's
peak memory above its inputs and their gradients (``max_memory_allocated``; the CPU profiler's allocation
records on the CPU), prints a table, and writes JSON (GPU name, versions, world size) to ``--out``.

    torchrun --nproc-per-node 2 benchmarks/bench_vocab_parallel.py                 # 16384 x 4096 x 128256 bf16
    torchrun --nproc-per-node 2 benchmarks/bench_vocab_parallel.py --out benchmarks/results/bench_vp_h200.json
    python benchmarks/bench_vocab_parallel.py --device cpu --shape 64x32x256 --iters 2 --nproc 2   # gloo, CPU

Without torchrun (no RANK in the environment) the script spawns ``--nproc`` processes itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import make_inputs, median_ms, step_peak_bytes, versions  # noqa: E402

VARIANTS = ("flce-vp", "loss_parallel", "flce-1gpu")
GB = 1e9
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _variant(name: str, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, mesh) -> Callable[[], torch.Tensor]:
    """A closure running one forward + backward of ``name`` on fresh leaves; returns the loss (plain tensor)."""
    import flce_compile

    rank, world = dist.get_rank(), dist.get_world_size()
    w_local = w.chunk(world)[rank].contiguous()
    xg = x.detach().clone().requires_grad_()
    if name == "flce-1gpu":
        wg = w.detach().clone().requires_grad_()
    else:
        wg = w_local.detach().clone().requires_grad_()
    leaves = (xg, wg)

    if name == "flce-vp":
        def loss_fn():
            return flce_compile.vocab_parallel_linear_cross_entropy(xg, wg, t, group=mesh.get_group())
    elif name == "loss_parallel":
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.parallel import loss_parallel

        def loss_fn():
            x_dt = DTensor.from_local(xg, mesh, [Replicate()], run_check=False)
            w_dt = DTensor.from_local(wg, mesh, [Shard(0)], run_check=False)
            logits = F.linear(x_dt, w_dt)  # (N, V) sharded over V
            with loss_parallel():
                loss = F.cross_entropy(logits.float(), t, ignore_index=-100)
                loss.backward()
            return loss.to_local()
    else:
        def loss_fn():
            return flce_compile.fused_linear_cross_entropy(xg, wg, t)

    def step() -> torch.Tensor:
        for leaf in leaves:
            leaf.grad = None
        loss = loss_fn()
        if name != "loss_parallel":  # loss_parallel's backward must run inside the context
            loss.backward()
        return loss.detach()

    step.leaves = leaves  # type: ignore[attr-defined]
    return step


def _grad_bytes(leaves) -> int:
    return sum(leaf.grad.numel() * leaf.grad.element_size() for leaf in leaves if leaf.grad is not None)


def _measure(step, device: torch.device, iters: int, warmup: int) -> dict:
    """Median ms of ``step`` and its peak GB above inputs and gradients."""
    for _ in range(warmup):
        loss = step()
    for leaf in step.leaves:
        leaf.grad = None
    out: list[torch.Tensor] = []
    peak = step_peak_bytes(lambda: out.append(step()), device) - _grad_bytes(step.leaves)
    loss = out[0]
    return {"ms": median_ms(step, iters, device.type), "gb": peak / GB, "loss": float(loss)}


def run(rank: int, world: int, args: argparse.Namespace) -> list[dict] | None:
    """Every variant on this rank; rank 0 returns the rows (one per variant, each rank's numbers)."""
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(args.device, (world,))
    n, h, v = (int(s) for s in args.shape.split("x"))
    x, w, t = make_inputs(n, h, v, seed=0, device=str(device), dtype=DTYPES[args.dtype])  # same on every rank
    rows = []
    for name in args.variants:
        result: dict = {}
        if name != "flce-1gpu" or rank == 0:
            try:
                result = _measure(_variant(name, x, w, t, mesh), device, args.iters, args.warmup)
            except torch.OutOfMemoryError:
                result = {"error": "OOM"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, result)
        rows.append({"variant": name, "ranks": per_rank})
    return rows if rank == 0 else None


def environment(args: argparse.Namespace, world: int) -> dict:
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    return {"gpu": gpu, "world_size": world, "shape": args.shape, "dtype": args.dtype, "backend":
            dist.get_backend(), "date": datetime.date.today().isoformat(), **versions()}


def table(env: dict, rows: list[dict]) -> str:
    lines = [f"# bench_vocab_parallel: {env['gpu']} x {env['world_size']}, {env['shape']} {env['dtype']}, "
             f"torch {env['torch']}, {env['date']}", "",
             "fwd+bwd, mean, ~6% ignored. ms = median; GB = per-rank peak above inputs and grads.", "",
             "| variant | " + " | ".join(f"rank {r} ms / GB" for r in range(env["world_size"])) + " | loss |",
             "|---|" + "---|" * env["world_size"] + "---|"]
    for row in rows:
        cells, loss = [], "-"
        for r in row["ranks"]:
            if not r:
                cells.append("-")
            elif "error" in r:
                cells.append(r["error"])
            else:
                cells.append(f"{r['ms']:.1f} / {r['gb']:.3f}")
                loss = f"{r['loss']:.6f}"
        lines.append(f"| {row['variant']} | " + " | ".join(cells) + f" | {loss} |")
    return "\n".join(lines)


def _worker(rank: int, world: int, args: argparse.Namespace) -> None:
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":  # before NCCL sets up its communicator on the current device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        rows = run(rank, world, args)
        if rank == 0:
            env = environment(args, world)
            print(table(env, rows), flush=True)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
                print(f"wrote {args.out}")
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    _worker(rank, world, args)
    # Leave without running C++ static destructors: about one CPU run in five, a spawned rank that used the
    # profiler (cpu_peak_bytes) aborted at interpreter exit with "terminate called without an active
    # exception" after its work was done and reported (a thread still joinable at teardown). An error above
    # still reaches mp.spawn as an exception.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="16384x4096x128256", help="BT x H x V")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="processes to spawn when not run by torchrun")
    parser.add_argument("--out", default=None, help="JSON file to write (e.g. benchmarks/results/bench_vp.json)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA GPU: pass --device cpu for a gloo run on the CPU")
    if "RANK" in os.environ:  # torchrun
        _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.nproc, port, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
