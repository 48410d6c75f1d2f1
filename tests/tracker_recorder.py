"""A `report_to` integration for the tests: it records what the Trainer hands its integrations (`on_log`) into a
JSONL file, one line per log call with the step, as a tracker (wandb, tensorboard, trackio) would receive it.

    python tests/tracker_recorder.py LOG.jsonl train --config tiny.yaml --output runs/x --set report_to=[recorder]

runs `eviback` with the rest of the arguments, with "recorder" registered beside transformers' own integrations
(`INTEGRATION_TO_CALLBACK`, where the Trainer looks `report_to` names up when it is built). It is registered once
the command has configured its logging, as an installed integration is imported: transformers read their
settings (progress bars) when first imported, so importing it earlier would change the run's log."""

from __future__ import annotations

import json
import sys
from typing import Any

NAME = "recorder"


def register(path: str) -> None:
    """Register the recorder integration under :data:`NAME`, appending to `path`."""
    from transformers import TrainerCallback
    from transformers.integrations import integration_utils

    class Recorder(TrainerCallback):
        """Appends each log the Trainer sends its integrations, on the main process, as integrations log
        (`state.is_world_process_zero`)."""

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            if state.is_world_process_zero and logs:
                with open(path, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": state.global_step, "logs": logs}) + "\n")

    integration_utils.INTEGRATION_TO_CALLBACK[NAME] = Recorder


def main(argv: list[str]) -> int:
    from eviback import cli

    configure = cli.configure_logging

    def configure_then_register(level: int) -> None:
        configure(level)
        register(argv[0])

    cli.configure_logging = configure_then_register
    return cli.main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
