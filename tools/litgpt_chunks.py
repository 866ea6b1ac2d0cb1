"""Writes token windows as the LitData chunks that `litgpt pretrain --data LitData` streams; runs inside
.venv-litgpt (tools/bench_litgpt_cli.py starts it).

The input is a .npy array [windows, seq_len + 1] of token ids (train.py's own windows). Each window becomes one
item of ``litdata.optimize`` with a ``TokensLoader``, the way LitGPT's own data preparation writes tokenized text,
so the data module's ``TokensLoader(block_size=seq_len + 1)`` reads back exactly one window per block. It then
reads the chunks back through LitData's ``StreamingDataset`` (unshuffled) and checks they hold the same windows in
the same order. Prints one JSON line: the windows and tokens written.

    .venv-litgpt/bin/python tools/litgpt_chunks.py windows.npy chunks/
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch


def rows(path: str):
    """The windows of one .npy file, one int32 tensor each (LitGPT's tokenizer hands ``optimize`` int32 ids)."""
    for row in np.load(path):
        yield torch.from_numpy(np.ascontiguousarray(row, dtype=np.int32))


def main(windows: Path, out: Path) -> dict:
    from litdata import optimize
    from litdata.streaming import StreamingDataset, TokensLoader

    array = np.load(windows, mmap_mode="r")
    if array.ndim != 2:
        raise SystemExit(f"error: {windows} holds a {array.ndim}-D array; give [windows, seq_len + 1] token ids")
    optimize(
        fn=rows,
        inputs=[str(windows)],
        output_dir=str(out),
        num_workers=1,
        chunk_bytes="50MB",
        item_loader=TokensLoader(block_size=array.shape[1]),
    )
    dataset = StreamingDataset(str(out), item_loader=TokensLoader(block_size=array.shape[1]), shuffle=False)
    read = np.stack([np.asarray(dataset[index]) for index in range(len(dataset))])
    if read.shape != array.shape or not np.array_equal(read, array):
        raise SystemExit(f"error: the chunks in {out} read back {read.shape}, not the {array.shape} windows written")
    return {"windows": int(array.shape[0]), "tokens": int(array.size), "block_size": int(array.shape[1])}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]))), flush=True)
