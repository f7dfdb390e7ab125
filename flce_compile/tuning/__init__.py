"""Autotuning of the fused op: a search space, an Optuna search, GPU measurement, a JSON tuning database, kept
studies and their plots, and the ``flce-tune`` CLI.

Only the database is imported here (``db``: the writer, with the read side of ``flce_compile.plan.tuning_db``
that the op uses); it needs neither Optuna nor a GPU. Import ``flce_compile.tuning.search`` / ``.measure`` /
``.space`` / ``.studies`` / ``.plots`` explicitly.
"""

from .db import Entry, device_key, invalidate_cache, lookup, normalize_device_name, token_bucket, user_db_path

__all__ = ["Entry", "device_key", "invalidate_cache", "lookup", "normalize_device_name", "token_bucket", "user_db_path"]
