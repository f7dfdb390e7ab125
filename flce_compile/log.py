"""The package logger: everything flce_compile reports goes through ``logging.getLogger("flce_compile")``."""

import logging

logger = logging.getLogger("flce_compile")
