"""One root log handler per process, on stderr (stdout is reserved for what a command prints for scripts)."""

from __future__ import annotations

import logging
import os

from hivemind.utils.logging import use_hivemind_log_handler

from shared import step_trace


def configure_logging(level: str | None = None) -> None:
    logging.basicConfig(
        level=(level or os.environ.get("SWARMGATE_LOG_LEVEL", "INFO")).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # hivemind installs its own handler by default; send its records through ours instead.
    use_hivemind_log_handler("in_root_logger")
    step_trace.enable_from_env()
