"""Timestamps of a decode step's stages, to find where a token's time goes (``bench/wan.py --trace``).

Silent unless the ``swarmgate.step_trace`` logger is at DEBUG (``SWARMGATE_TRACE_STEPS=1`` in a process's
environment, or ``enable()``): then each stage is one record ``STAGE SESSION POSITION WALLCLOCK``, keyed by the
node's session id and the step's position, so the gateway's and every node's records of one hop line up (the
processes share a clock on one machine). Off, a mark costs one level check.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger("swarmgate.step_trace")
ENV = "SWARMGATE_TRACE_STEPS"


def enable() -> None:
    logger.setLevel(logging.DEBUG)


def enable_from_env() -> None:
    if os.environ.get(ENV, "") not in ("", "0"):
        enable()


def mark(stage: str, session_id: str, position: int) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s %s %d %.6f", stage, session_id, position, time.time())
