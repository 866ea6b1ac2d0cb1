"""Small files of the kinds the cookbook's data=hf commands read, written where their paths point."""

from __future__ import annotations

import gzip
import io
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image


def hf_files(path: str, root: Path) -> str:
    """The command's ``/data/...`` pattern under ``root``, a brace range cut to two names and a glob matched by
    two files, with small files of the kind it names written there: C4's jsonl.gz rows (text, timestamp, url), or
    a LAION-style parquet (JPEG bytes in ``jpg``, ``caption``, ``url``, as img2dataset writes)."""
    from braceexpand import braceexpand

    local = re.sub(r"\{(\d+)\.\.\d+\}", lambda m: f"{{{m[1]}..{int(m[1]) + 1:0{len(m[1])}d}}}", path)
    local = local.replace("/data/", f"{root}/data/", 1)
    names = [n.replace("*", f"{i:05d}") for n in braceexpand(local) for i in range(2 if "*" in n else 1)]
    for f, name in enumerate(names):
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        rows = [(f * 16 + i, f"row {f * 16 + i}: a red square on a blue field, seen from above") for i in range(16)]
        if name.endswith(".json.gz"):
            with gzip.open(name, "wt") as out:
                for k, text in rows:
                    out.write(json.dumps({"text": text, "timestamp": "2019-04-25", "url": f"x/{k}"}) + "\n")
        else:
            pq.write_table(pa.table({"jpg": [_jpeg(k) for k, _ in rows], "caption": [t for _, t in rows]}), name)
    return local


def _jpeg(shade: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (48, 32), (shade * 7 % 256, 40, 200)).save(out, "JPEG")
    return out.getvalue()
