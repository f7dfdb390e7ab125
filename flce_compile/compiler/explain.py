"""``explain(model, *args, **kwargs)``: which lm_head/loss sites would ``backend="flce"`` fuse, and why not.

It captures the model's Dynamo graphs with ``torch._dynamo.explain`` (which runs the model once and resets
Dynamo's caches, like any ``torch._dynamo.explain`` call), analyzes every graph without rewriting it, and reports
one entry per loss site plus one per lm_head that a graph break separated from its loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ..log import logger
from .patterns import hint_int, match_linear, meta_value
from .rewrite import SiteResult, analyze


@dataclass
class SiteReport:
    """One loss site (or a lone lm_head) as ``explain`` sees it."""

    graph: int
    loss: str
    fused: bool
    path: str  # "fused" | "kept_logits" | "unchanged"
    reason: str | None
    strategy: str | None
    tokens: int | None
    vocab: int | None
    hidden: int | None
    softcap: float | None = None
    logit_scale: float = 1.0
    logits_escape: bool = False
    est_saved_bytes: int = 0
    kept_logits_bytes: int = 0

    def __str__(self) -> str:
        head = f"[graph {self.graph}] {self.loss}: "
        if not self.fused:
            return head + f"NOT fused - {self.reason}"
        extra = []
        if self.softcap is not None:
            extra.append(f"softcap={self.softcap:g}")
        if self.logit_scale != 1.0:
            extra.append(f"logit_scale={self.logit_scale:g}")
        text = (
            f"fused ({self.path}, strategy={self.strategy}) tokens~{self.tokens} V={self.vocab} H={self.hidden}"
            + (" " + " ".join(extra) if extra else "")
            + f", est. memory saved {self.est_saved_bytes / 2**30:.3f} GiB"
        )
        if self.path == "kept_logits":
            text += (
                f"; logits are returned so ~{self.kept_logits_bytes / 2**30:.3f} GiB stay"
                " (options={'flce.logits': 'drop'} frees them)"
            )
        return head + text


class ExplainReport(list):
    """A list of :class:`SiteReport` that prints as a table (``print(flce_compile.explain(...))``)."""

    graph_count: int = 0
    graph_breaks: list[str]

    def __str__(self) -> str:
        lines = [f"flce explain: {self.graph_count} graph(s), {len(self.graph_breaks)} graph break(s), "
                 f"{sum(r.fused for r in self)} of {len(self)} site(s) fused"]
        lines += ["  " + str(r) for r in self]
        lines += [f"  graph break: {b}" for b in self.graph_breaks]
        return "\n".join(lines)

    __repr__ = __str__


def _strategy(res: SiteResult) -> str | None:
    if res.path == "kept_logits":
        return "chunked-ce-over-kept-logits"
    if res.path != "fused":
        return None
    from ..config import choose_config

    try:
        cfg, source = choose_config(res.tokens or 1, res.site.vocab, res.site.hidden, res.logits_dtype, res.device)
        return f"{cfg.strategy} ({source})"
    except Exception as exc:  # noqa: BLE001 - reporting only
        return f"unknown ({exc!r})"


def _saved_bytes(res: SiteResult) -> int:
    """Unfused training keeps logits + fp32 upcast + fp32 log-softmax + fp32 grad + grad in the logits dtype;
    the fused op keeps none of them, the kept-logits path keeps logits and their grad."""
    if not res.fused or res.tokens is None or res.site.vocab is None:
        return 0
    n = res.tokens * res.site.vocab
    s = res.logits_dtype.itemsize
    unfused = n * (s + (4 if s != 4 else 0) + 4 + 4 + (s if s != 4 else 0))
    remaining = res.kept_logits_bytes if res.path == "kept_logits" else 0
    return max(0, unfused - remaining)


def report_graph(gm: fx.GraphModule, index: int = 0, logits: str = "keep") -> list[SiteReport]:
    """Site reports for one Dynamo graph (no rewrite)."""
    reports: list[SiteReport] = []
    results = analyze(gm, logits)
    linked = set()
    for res in results:
        site = res.site
        if site.linear is not None:
            linked.add(site.linear.node)
        plan = res.plan
        reports.append(SiteReport(
            graph=index, loss=f"{site.loss_node.name} ({site.loss.form if site.loss else site.loss_node.target})",
            fused=res.fused, path=res.path, reason=res.reason, strategy=_strategy(res), tokens=res.tokens,
            vocab=site.vocab, hidden=site.hidden, softcap=plan.softcap if plan else None,
            logit_scale=plan.logit_scale if plan else 1.0, logits_escape=bool(site.linear and site.escapes()),
            est_saved_bytes=_saved_bytes(res), kept_logits_bytes=res.kept_logits_bytes,
        ))
    # lm_heads whose loss is in another graph: a linear with a large output returned by the graph.
    for node in gm.graph.nodes:
        if node in linked or node.op not in ("call_function", "call_module"):
            continue
        lin = match_linear(gm, node)
        if lin is None or not any(u.op == "output" for u in node.users):
            continue
        out, x = meta_value(node), meta_value(lin.input)
        if not isinstance(out, torch.Tensor) or out.dim() < 2 or not isinstance(out.shape[-1], int):
            continue
        if out.shape[-1] < 2 * (x.shape[-1] if isinstance(x, torch.Tensor) else 0):
            continue  # not vocab-sized
        reports.append(SiteReport(
            graph=index, loss=f"{node.name} (lm_head-like {lin.form}, output returned by the graph)", fused=False,
            path="unchanged", strategy=None, tokens=hint_int(out.numel() // out.shape[-1]), vocab=out.shape[-1],
            hidden=None, reason="no loss in this graph consumes it; if a cross_entropy follows after a graph "
            "break, nothing can be fused (remove the break between lm_head and the loss)",
        ))
    return reports


def explain(model: nn.Module | Any, *args: Any, **kwargs: Any) -> ExplainReport:
    """Run ``model(*args, **kwargs)`` under Dynamo and report every lm_head/cross-entropy site.

    Returns an :class:`ExplainReport` (a list of :class:`SiteReport`) that prints as a table; it is also
    logged at INFO on the ``flce_compile`` logger.
    """
    out = torch._dynamo.explain(model)(*args, **kwargs)
    report = ExplainReport()
    report.graph_count = out.graph_count
    report.graph_breaks = [_break_text(b) for b in out.break_reasons]
    for i, gm in enumerate(out.graphs):
        report.extend(report_graph(gm, i))
    torch._dynamo.reset()  # explain's captured frames should not linger in the code cache
    logger.info("%s", report)
    return report


def _break_text(reason: Any) -> str:
    where = ""
    stack = getattr(reason, "user_stack", None)
    if stack:
        frame = stack[-1]
        where = f" at {frame.filename}:{frame.lineno}"
    return f"{getattr(reason, 'reason', reason)}".strip().splitlines()[0] + where
