"""How the fused op runs: the config type, the strategy registry, the choice of a call's config (tuning DB read
side, then heuristic), row layout and the memory bound. The op and the tuner both stand on this layer; it
imports neither of them.

Modules: ``registry`` (the strategies), ``config`` (``FLCEConfig``, forced fields), ``layout`` (row padding),
``tuning_db`` (reading the tuning database), ``choose`` (the choice), ``memory`` (the sympy peak bound).
"""

from .choose import choose_config, heuristic_config, resolve_config
from .config import FLCEConfig, config_overrides
from .memory import peak_bytes, peak_bytes_expr
from .registry import Strategy, names

__all__ = ["FLCEConfig", "Strategy", "choose_config", "config_overrides", "heuristic_config", "names", "peak_bytes",
           "peak_bytes_expr", "resolve_config"]
