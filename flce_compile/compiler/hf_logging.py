"""Keep a Hugging Face model's lm_head and loss in one Dynamo graph where transformers logs a warning at the loss.

transformers' ``PreTrainedModel.loss_function`` calls ``logger.warning_once`` (the logger of
``transformers.modeling_utils``) on every call of a model whose class names no loss type: GPT-2's
``GPT2LMHeadModel`` and the other ``*LMHeadModel`` classes. Dynamo breaks the graph at any call of a logger's
method, and this one falls between the lm_head and the loss: the head's graph returns the logits and the loss's
graph takes them as an input, so there is nothing to fuse, and the model would have to be changed
(``model.loss_type = "ForCausalLM"``) to fuse it. Dynamo turns a logger method listed in its
``ignore_logging_functions`` (``ignore_logger_methods`` in older torch) into a no-op in the code it traces, with no
break. ``keep_loss_in_graph`` lists that one logger's ``warning_once``: the head and the loss then share a graph
and are fused. What it changes for the process: compiled code no longer prints that logger's once-only warnings
(an eager call still does), under any backend, since Dynamo's setting is global. Not in a torch whose compile
metrics cannot then write Dynamo's config (torch 2.11 puts that set into the JSON it logs for every compile, and
would log an error each time): there the break stands, and the backend's warning and ``explain`` name the fix.

The backend lists it when its module is imported, once transformers is (``torch.compile(model, backend="flce")``
imports the backend then, after the model exists), on each graph it compiles (for a transformers imported later:
frames traced from then on), and ``explain`` before it traces. Nothing here imports transformers.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from torch._dynamo import config as dynamo_config
from torch._dynamo import utils as dynamo_utils

from ..log import logger

#: The logger that warns at the loss (``PreTrainedModel.loss_function``), named after its module.
HF_LOGGER = "transformers.modeling_utils"


def _ignored_logging_functions() -> set | None:
    """Dynamo's set of logger methods it treats as no-ops; None in a torch without one."""
    for name in ("ignore_logging_functions", "ignore_logger_methods"):  # the newer name first (2.13 aliases them)
        functions = getattr(dynamo_config, name, None)
        if isinstance(functions, set):
            return functions
    return None


def _metrics_log_serializes() -> bool:
    """Whether Dynamo's compile metrics can still write its config as JSON. Torch 2.11 writes the set of ignored
    logging functions into it (2.13 leaves it out), and a method there makes every compile log an error."""
    write = getattr(dynamo_utils, "_get_dynamo_config_for_logging", None)
    if write is None:  # another torch: nothing of the kind to break
        return True
    try:
        write()
    except TypeError:
        return False
    return True


def loss_warning_method() -> Any | None:
    """The bound ``warning_once`` of transformers' ``modeling_utils`` logger once transformers is imported (which
    gives every logger ``warning_once``); else None. The logger is found by name, as transformers names it: the
    package loads ``modeling_utils`` lazily, often after this runs, and gets the same logger then."""
    if "transformers" not in sys.modules:
        return None
    return getattr(logging.getLogger(HF_LOGGER), "warning_once", None)


def keep_loss_in_graph() -> bool:
    """List transformers' loss warning among the logger methods Dynamo ignores (see the module docstring), once;
    whether it is listed now."""
    method = loss_warning_method()
    if method is None:
        return False
    functions = _ignored_logging_functions()
    if functions is None:
        return False
    if method in functions:
        return True
    functions.add(method)
    if not _metrics_log_serializes():
        functions.discard(method)
        logger.debug("flce: not listing transformers' loss warning among Dynamo's ignored logging functions: this "
                     "torch's compile metrics cannot serialize a listed method (torch 2.11 logs an error on every "
                     "compile then); a model with no loss_type keeps its graph break")
        return False
    logger.info(
        "flce: Dynamo now ignores the warning_once of logger %r in traced code, so that the graph does not break between "
        "a Hugging Face lm_head and its loss (transformers warns there for a model with no loss_type, GPT-2's); "
        "compiled code no longer prints that logger's once-only warnings. To undo it: "
        "torch._dynamo.config.ignore_logger_methods.discard(logging.getLogger(%r).warning_once)", HF_LOGGER, HF_LOGGER)
    return True
