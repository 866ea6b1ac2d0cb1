"""tools/bench_litgpt_cli.py without LitGPT (its venv is not there in CI): for a tiny shape, the `litgpt pretrain`
command line, the model config it hands LitGPT (train.py's model: same dimensions, layers, heads, vocabulary,
sequence and parameter count), the windows it writes (train.py's own, in train.py's order) and the reading of
LitGPT's CSV log."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from disttrain_core.config import compose
from disttrain_core.data.token_file import token_loader
from disttrain_core.data.tokenizer import ByteTokenizer
from disttrain_core.models import build_model

from ..conftest import REPO

WARMUP, STEPS = 5, 5


@pytest.fixture
def tool(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import bench_litgpt_cli

    return bench_litgpt_cli


def litgpt_parameters(c: dict) -> int:
    """LitGPT's ``GPT`` parameter count for a Llama ``Config`` (untied embeddings, no biases, RMSNorm weights)."""
    keys = ("n_embd", "padded_vocab_size", "n_head", "n_query_groups", "head_size", "intermediate_size")
    d, v, heads, groups, hs, ffn = (c[k] for k in keys)
    block = 2 * d + d * (heads + 2 * groups) * hs + heads * hs * d + 3 * d * ffn
    return 2 * v * d + c["n_layer"] * block + d


def test_pretrain_command_and_its_inputs_describe_the_train_py_run(tool, tmp_path):
    TINY, MICRO = tool.TINY_SHAPE, tool.TINY_MICRO  # litgpt_shape=tiny
    assert (TINY["dim"], TINY["n_layers"], TINY["n_heads"], TINY["n_kv_heads"], TINY["ffn_dim"], MICRO) == (
        64,
        2,
        4,
        2,
        96,
        2,
    )
    cfg, extra, data, windows = tool.litgpt_setup(tmp_path, "32", STEPS, WARMUP, shape=TINY, micro=MICRO)
    paths = tool.write_inputs(tmp_path, cfg, windows)

    given = yaml.safe_load(paths["config"].read_text())  # what `--config` hands LitGPT
    config = given["model_config"]
    assert given["model_name"] == config["name"] and set(given) == {"model_name", "model_config"}
    llm = cfg.model.llm
    assert (config["n_embd"], config["n_layer"], config["n_head"], config["n_query_groups"]) == (64, 2, 4, 2)
    assert (config["intermediate_size"], config["head_size"], config["block_size"]) == (96, 16, 32)
    assert config["vocab_size"] == config["padded_vocab_size"] == llm.vocab_size == 384
    assert (config["norm_eps"], config["rope_base"]) == (llm.norm_eps, int(llm.rope_theta))
    model = build_model(cfg.model, ByteTokenizer())  # on the meta device
    assert litgpt_parameters(config) == sum(p.numel() for p in model.parameters())

    rows = np.load(paths["windows"])  # one window a row, in the order train.py's data=tokens loader yields them
    loader = token_loader(cfg, MICRO, 1, None)
    expected = [
        np.concatenate([b.tokens.numpy(), b.labels[:, -1:].numpy()], axis=1)
        for _ in range(10)
        for b in loader.next_step()
    ]
    assert rows.dtype == np.int32 and rows.shape == ((WARMUP + STEPS) * MICRO, TINY["seq_len"] + 1)
    np.testing.assert_array_equal(rows, np.concatenate(expected))

    command = tool.pretrain_command(Path("/venv/bin/litgpt"), cfg, paths, tmp_path / "out", workers=0)
    assert command[:2] == ["/venv/bin/litgpt", "pretrain"]
    flags = dict(zip(command[2::2], command[3::2], strict=True))
    assert flags["--config"] == str(paths["config"])
    assert (flags["--data"], flags["--data.num_workers"]) == ("LitData", "0")
    assert flags["--data.data_path"] == str(paths["chunks"])
    assert flags["--train.micro_batch_size"] == flags["--train.global_batch_size"] == str(MICRO)
    # `pretrain` runs max_tokens // (micro_batch * block_size) iterations: the warm-up and timed steps, no more
    assert int(flags["--train.max_tokens"]) // (MICRO * TINY["seq_len"]) == WARMUP + STEPS
    assert flags["--train.log_interval"] == str(cfg.trainer.log_every_n_steps) == "5"
    assert flags["--train.max_norm"] == str(cfg.optim.grad_clip)
    # train.py's schedule: linear warm-up, then cosine down to lr * min_lr_ratio
    assert flags["--train.lr_warmup_steps"] == str(cfg.optim.warmup_steps)
    assert float(flags["--train.min_lr"]) == pytest.approx(cfg.optim.lr * cfg.optim.min_lr_ratio)
    optimizer = json.loads(flags["--optimizer"])
    assert optimizer["class_path"] == "torch.optim.AdamW"
    assert optimizer["init_args"] == {
        "lr": cfg.optim.lr,
        "weight_decay": cfg.optim.weight_decay,
        "betas": list(cfg.optim.betas),
        "eps": cfg.optim.eps,
    }
    assert (flags["--precision"], flags["--devices"], flags["--logger_name"]) == ("32-true", "1", "csv")
    assert flags["--out_dir"] == str(tmp_path / "out") and flags["--eval.final_validation"] == "false"
    cfg.trainer.precision = "bf16-mixed"
    assert "bf16-mixed" in tool.pretrain_command(Path("litgpt"), cfg, paths, tmp_path, workers=0)

    # train.py's command composes to the same model and batch
    run_dir = tmp_path / "run"
    train = tool.train_command(tool._overrides("llama_tiny", "32", run_dir, WARMUP + STEPS) + [*extra, *data], run_dir)
    assert train[1] == str(REPO / "train.py") and train[-1] == f"hydra.run.dir={run_dir}"
    again = compose(train[2:-1])
    assert tool.model_config(again) == config
    assert (again.optim.micro_batch_size, again.trainer.max_steps, again.data.path) == (MICRO, 10, cfg.data.path)


def test_litgpt_throughput_is_read_from_its_csv_log_over_the_timed_steps(tool, tmp_path):
    log = tmp_path / "logs" / "csv" / "version_0" / "metrics.csv"
    log.parent.mkdir(parents=True)
    # the columns LitGPT's CSVLogger writes; Fabric writes its step index (iter - 1) over the ``step`` column
    header = "batches,device/items_per_sec,epoch,iter,iter_time,lengths,loss,samples,step,time,tokens,val_loss\n"
    rows = [
        "5,,0,5,0.5,320,5.9,10,4,9.0,320,\n",  # the warm-up: compilation included
        "10,,0,10,0.5,640,5.8,20,9,10.0,640,\n",
        "15,610.0,0,15,0.5,960,5.7,30,14,10.5,960,\n",
        ",,,,,,,,15,,,5.6\n",  # a validation row
    ]
    log.write_text(header + "".join(rows))
    rates = tool.litgpt_rates(log, warmup=5)
    assert rates["tokens_per_s"] == pytest.approx((960 - 320) / (10.5 - 9.0))
    assert rates["logged_items_per_sec"] == 610.0 and rates["steps"] == 15
    accumulating = tool.litgpt_rates(log, warmup=1, accumulation=5)  # 5 micro-batches a step: iter 5 is step 1
    assert accumulating["tokens_per_s"] == pytest.approx((960 - 320) / (10.5 - 9.0)) and accumulating["steps"] == 3


def test_settings_it_cannot_time_are_one_line_before_anything_runs(tool):
    with pytest.raises(SystemExit, match="multiples of 5"):
        tool.main(["steps=6", "warmup=2"])
    with pytest.raises(SystemExit, match="litgpt_shape='huge'"):
        tool.main(["litgpt_shape=huge"])
    with pytest.raises(SystemExit, match="use 32 or bf16-mixed"):
        tool.main(["litgpt_precision=16-mixed"])
