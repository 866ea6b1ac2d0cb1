"""Generate the embedded LAION-like webdataset shards (docs/DATA.md).

    python tools/make_shards.py                                   # -> data/synthetic_laion (the default data)
    python tools/make_shards.py out=/tmp/shards data.synthetic.num_shards=64 data.synthetic.samples_per_shard=1000

Distribution parameters are the ``data.synthetic.*`` config keys.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from disttrain_core.config import compose
from disttrain_core.data.synthetic import generate_shards
from disttrain_core.launch.cli import split_tool_args, tool_main


def main(argv: list[str]) -> int:
    options, overrides = split_tool_args(argv, {"out": "", "processes": "2", "force": "false"})
    cfg = compose(overrides)
    out = Path(options["out"] or cfg.data.path)
    if out.exists() and any(out.glob("*.tar")):
        if options["force"] != "true":
            print(f"{out} already holds shards; pass force=true to regenerate")
            return 0
        import shutil

        shutil.rmtree(out)
    started = time.perf_counter()
    shards = generate_shards(cfg.data.synthetic, out, processes=int(options["processes"]))
    synthetic = cfg.data.synthetic
    print(
        f"wrote {len(shards)} shards x {synthetic.samples_per_shard} samples to {out} "
        f"in {time.perf_counter() - started:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
