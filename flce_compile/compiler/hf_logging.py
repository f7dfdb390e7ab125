"""Keep a Hugging Face model's lm_head and loss in one Dynamo graph where transformers logs a warning at the loss.

transformers' ``PreTrainedModel.loss_function`` calls ``logger.warning_once`` (the logger of
``transformers.modeling_utils``; it prints once, but is called every time) for a model whose class names no loss
type: GPT-2's ``GPT2LMHeadModel``, and CTRL's, OpenAI GPT's and the like. Dynamo breaks the graph at any call of a
logger's method, and this one falls between the lm_head and the loss: the head's graph returns the logits and the
loss's graph takes them as an input, so there is nothing to fuse, and the model would have to be changed
(``model.loss_type = "ForCausalLM"``) to fuse it. Dynamo turns a logger method listed in its
``ignore_logging_functions`` (``ignore_logger_methods``, its older name) into a no-op in the code it traces, with no
break. ``keep_loss_in_graph`` lists that one logger's ``warning_once``: the head and the loss then share a graph and
are fused. What that changes: code Dynamo traces no longer prints that logger's once-only warnings (an eager call
still does), under any backend.

Dynamo's settings are per thread (torch 2.13 keeps each in a context variable), so the listing is made in the
thread that compiles: when the backend is imported, before each frame Dynamo compiles (a compile-start callback,
which also covers a transformers imported after the backend; kept across ``torch._dynamo.reset()``, which clears
Dynamo's callbacks: ``dynamo_callbacks``), on each graph the backend compiles, and in ``explain``. Nothing here
imports transformers. ``FLCE_IGNORE_HF_LOSS_WARNING=0`` turns it off (then set the model's loss type).

What is listed is ``ListedWarning``: equal to the bound method (so Dynamo's ``method in ignore_set`` finds it) and a
string to whatever writes Dynamo's config out. Torch 2.11 puts the set into the JSON it logs for every compile (2.13
leaves it out), and a method there made each compile log an error; so nothing was listed there before this, and
GPT-2 as transformers builds it kept its break (5.73 GB against 1.54 at 16384 tokens on an H200). A torch whose
metrics cannot write even the string is still left unlisted (``breaks_compile_metrics``), where the break stands
and the backend's warning and ``explain`` name the fix.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch
from torch._dynamo import config as dynamo_config
from torch._dynamo import utils as dynamo_utils

from ..log import logger
from . import dynamo_callbacks

#: The logger that warns at the loss (``PreTrainedModel.loss_function``), named after its module.
HF_LOGGER = "transformers.modeling_utils"
#: "0" turns the listing off (read at each listing).
ENV_VAR = "FLCE_IGNORE_HF_LOSS_WARNING"

_announced = False  # the INFO note, once a process
_metrics_refuse = False  # this torch's compile metrics cannot write the listed warning (``breaks_compile_metrics``)


def enabled() -> bool:
    """Whether the listing is on (``FLCE_IGNORE_HF_LOSS_WARNING``, default on)."""
    return os.environ.get(ENV_VAR, "1") != "0"


def _ignored_logging_functions() -> set | None:
    """This thread's set of logger methods Dynamo treats as no-ops; None in a torch without one."""
    for name in ("ignore_logging_functions", "ignore_logger_methods"):  # the newer name first (2.13 aliases them)
        functions = getattr(dynamo_config, name, None)
        if isinstance(functions, set):
            return functions
    return None


class ListedWarning(str):
    """transformers' loss warning as listed in Dynamo's ignored logging functions: hashed as the bound method and
    equal to it, so Dynamo's membership test finds it; a ``str`` (its logger and method name) to the compile
    metrics' JSON. Copied, it is itself (Dynamo deep-copies its config to log it); pickled (``save_config``), it
    comes back as a ``ListedWarning`` of the same method, so a config saved and loaded again still lists it."""

    method: Any

    def __new__(cls, method: Any) -> "ListedWarning":
        listed = super().__new__(cls, f"{HF_LOGGER}.{getattr(method, '__name__', 'warning_once')}")
        listed.method = method
        return listed

    def __hash__(self) -> int:
        return hash(self.method)

    def __eq__(self, other: object) -> bool:
        return other is self or self.method == other

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __copy__(self) -> "ListedWarning":
        return self

    def __deepcopy__(self, memo: dict) -> "ListedWarning":
        return self

    def __getnewargs__(self) -> tuple:  # (pickle rebuilds it from the method, not from its text)
        return (self.method,)


def _metrics_json_ok() -> bool:
    """Whether Dynamo's compile metrics can write its config as JSON (the function it calls for every compile)."""
    write = getattr(dynamo_utils, "_get_dynamo_config_for_logging", None)
    if write is None:  # another torch: nothing of the kind to break
        return True
    try:
        write()
    except TypeError:
        return False
    return True


def breaks_compile_metrics(functions: set, method: Any) -> bool:
    """Whether listing ``method`` (as ``ListedWarning``) in ``functions`` would make the compile metrics fail to
    write the config where they wrote it before (as torch 2.11's did with the method itself listed). Leaves
    ``functions`` as it found it. A yes is this torch's and kept: the compile-start callback asks on every compile,
    and the writer serializes the whole config each time."""
    global _metrics_refuse
    if _metrics_refuse:
        return True
    if method in functions or not _metrics_json_ok():  # already listed, or failing for a reason of its own
        return False
    functions.add(ListedWarning(method))
    try:
        _metrics_refuse = not _metrics_json_ok()
    finally:
        functions.discard(method)
    if _metrics_refuse:
        logger.debug("flce: not listing transformers' loss warning among Dynamo's ignored logging functions: this "
                     "torch's compile metrics cannot write it (they would log an error on every compile); a model "
                     "with no loss_type keeps its graph break")
    return _metrics_refuse


def loss_warning_method() -> Any | None:
    """The bound ``warning_once`` of transformers' ``modeling_utils`` logger once transformers is imported (which
    gives every logger ``warning_once``); else None. The logger is found by name, as transformers names it: the
    package loads ``modeling_utils`` lazily, often after this runs, and gets the same logger then."""
    if "transformers" not in sys.modules:
        return None
    return getattr(logging.getLogger(HF_LOGGER), "warning_once", None)


def _listable() -> tuple[set, Any] | None:
    """(this thread's set of ignored logging functions, the loss warning) when the listing is on, transformers is
    imported and this torch's compile metrics allow it; else None."""
    if not enabled():
        return None
    method, functions = loss_warning_method(), _ignored_logging_functions()
    if method is None or functions is None or breaks_compile_metrics(functions, method):
        return None
    return functions, method


def can_list() -> bool:
    """Whether ``keep_loss_in_graph`` lists the warning in this thread (or has). Lists nothing."""
    return _listable() is not None


def keep_loss_in_graph() -> bool:
    """List transformers' loss warning among the logger methods Dynamo ignores in this thread (see the module
    docstring), and make sure the compile-start callback that lists it in any compiling thread is registered;
    whether it is listed in this thread now."""
    if not enabled():
        return False
    dynamo_callbacks.keep(start=_on_compile_start)
    listable = _listable()
    if listable is None:
        return False
    functions, method = listable
    if method in functions:
        return True
    functions.add(ListedWarning(method))
    global _announced
    if not _announced:
        _announced = True
        logger.info("flce: Dynamo now ignores the warning_once of logger %r in traced code, so that the graph does "
                    "not break between a Hugging Face lm_head and its loss (transformers warns there for a model "
                    "with no loss_type, GPT-2's); traced code no longer prints that logger's once-only warnings. "
                    "%s=0 turns this off.", HF_LOGGER, ENV_VAR)
    return True


@torch.compiler.disable
def _on_compile_start(_args: Any) -> None:
    """Dynamo's compile-start callback: list the warning in the compiling thread before it traces the frame.

    Never traced: a compile can start inside code Dynamo runs (AOT's backward, compiled at its first run, under
    a compiled function's ``loss.backward()``), and Dynamo would compile this frame there, waiting on the lock its
    callbacks hold (a hang)."""
    try:
        keep_loss_in_graph()
    except Exception as exc:  # noqa: BLE001 - a compile must never fail here
        logger.debug("flce: could not list transformers' loss warning: %r", exc)
