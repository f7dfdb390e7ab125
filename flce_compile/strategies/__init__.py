"""Execution strategies of the fused op: the chunk loop and the CE step implementations it can use."""

from .chunked import ForwardResult, GradRequest, Operands, fused_backward_per_token, fused_forward

__all__ = ["ForwardResult", "GradRequest", "Operands", "fused_forward", "fused_backward_per_token"]
