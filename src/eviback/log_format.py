"""The log format of the command line and of the processes it starts (training workers, experiment runs)."""

from __future__ import annotations

import logging


def configure_logging(level: int) -> None:
    """The command line's log format (also used by the child processes it starts)."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
