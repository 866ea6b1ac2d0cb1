"""Per-module parameters and training FLOPs per sample of a model config.

    python tools/model_info.py model=mllm72b
    python tools/model_info.py model=mllm72b format=json
    python tools/model_info.py model=mllm_tiny model.seq_len=512

Models are built on the meta device, so this answers in seconds for any size.
"""

from __future__ import annotations

import json
import sys

from disttrain_core.config import compose
from disttrain_core.launch.cli import split_tool_args, tool_main
from disttrain_core.models.info import model_info, model_table


def main(argv: list[str]) -> int:
    options, overrides = split_tool_args(argv, {"format": "table"})
    cfg = compose(overrides)
    if options["format"] == "json":
        print(json.dumps(model_info(cfg.model), indent=1))
    elif options["format"] == "table":
        print(model_table(cfg.model))
    else:
        raise SystemExit(f"error: format={options['format']!r}: use format=table or format=json")
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
