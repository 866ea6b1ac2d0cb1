"""LLaVA in two stages from Hugging Face parts (recipes/llava_two_stage*.yaml, reduced): a random CLIPVisionModel and a
random LlamaForCausalLM written in Hugging Face's layout; stage 1 trains the projector alone on caption pairs (the
tower and the LLM stay the imported tensors); stage 2 starts from stage 1's weights (trainer.checkpoint.initial_load,
checked tensor for tensor) and tunes the projector and the LLM on LLaVA-format conversations; then
tools/evaluate.py and tools/generate.py read its checkpoint."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image

from disttrain_core.config import compose
from disttrain_core.models.hf import pretrained_state
from disttrain_core.train.checkpoint import latest_checkpoint, read_tensors

from ..conftest import REPO, cli_overrides, read_metrics, run_script, run_train, write_tar

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")
SMALL = ["optim.global_batch_size=4", "optim.micro_batch_size=2", "trainer.checkpoint.async_save=false"]


def _hf_parts(root):
    """Random Hugging Face checkpoints with llava_tiny's shapes (conf/model/llava_tiny.yaml)."""
    torch.manual_seed(7)
    clip = transformers.CLIPVisionConfig(
        image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, hidden_act="quick_gelu", layer_norm_eps=1e-5,
    )  # fmt: skip
    transformers.CLIPVisionModel(clip).save_pretrained(root / "clip", safe_serialization=True)
    llama = transformers.LlamaConfig(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=352,
        vocab_size=384, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
    )  # fmt: skip
    transformers.LlamaForCausalLM(llama).save_pretrained(root / "llama", safe_serialization=True)
    return f"model.init_from={{llm: {root / 'llama'}, encoder: {root / 'clip'}}}"


def _conversation_shards(out):
    """2 shards x 8 LLaVA-format samples, each an image and a two-round conversation about it."""
    out.mkdir()
    for shard in range(2):
        samples = []
        for i in range(8):
            colour = (40 * i % 256, 200 - 20 * i, 30 * shard)
            buffer = io.BytesIO()
            Image.new("RGB", (48, 40), colour).save(buffer, format="JPEG")
            record = {
                "conversations": [
                    {"from": "human", "value": "<image>\nWhat colour is this picture?"},
                    {"from": "gpt", "value": f"It is the colour {colour}."},
                    {"from": "human", "value": "Is it dark?"},
                    {"from": "gpt", "value": "Yes, quite dark." if sum(colour) < 300 else "No, it is bright."},
                ]
            }
            samples.append((f"s{shard}_{i:03d}", {"json": json.dumps(record).encode(), "jpg": buffer.getvalue()}))
        write_tar(out / f"shard-{shard:05d}.tar", samples)
    return out


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return read_tensors(latest_checkpoint(run_dir / "checkpoints"))


def test_llava_two_stages_from_hugging_face_parts(shards, tmp_path):
    init_from = _hf_parts(tmp_path / "hf")
    stage1 = tmp_path / "stage1"
    result = run_train(
        ["recipe=llava_two_stage", init_from, *cli_overrides(shards, stage1), *SMALL, "trainer.max_steps=3"]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first = _weights(stage1)
    imported = pretrained_state(compose(["model=llava_tiny", init_from]).model)
    frozen = [name for name in imported if name.startswith(("llm.", "encoder."))]
    assert frozen and all(torch.equal(first[name], imported[name]) for name in frozen)  # stage 1 kept them

    conversations = _conversation_shards(tmp_path / "conversations")
    held_out = _conversation_shards(tmp_path / "val")  # the same conversations, as a split of their own
    data = [f"data.path={conversations}", f"data.val.path={held_out}", "data.generate_if_missing=false"]
    data += ["data.num_workers=0"]
    stage2 = ["recipe=llava_two_stage_sft", f"trainer.checkpoint.initial_load={stage1}", *SMALL, *data]
    probe = tmp_path / "probe"  # one step with the projector frozen: it must still be stage 1's
    overrides = [o for o in cli_overrides(shards, probe) if not o.startswith("data.")]
    result = run_train([*stage2, *overrides, "trainer.max_steps=1", "model.freeze.encoder_projector=true"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trainer.checkpoint.initial_load: model weights from" in result.stderr + result.stdout
    projector = [name for name in first if name.startswith("encoder_projector.")]
    assert projector and all(torch.equal(_weights(probe)[name], first[name]) for name in projector)
    assert any(not torch.equal(first[name], imported.get(name, first[name] * 0)) for name in projector)

    tuned = tmp_path / "stage2"
    overrides = [o for o in cli_overrides(shards, tuned) if not o.startswith("data.")]
    result = run_train([*stage2, *overrides, "trainer.max_steps=3"])
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(tuned) if "loss" in m]
    assert len(losses) == 3 and all(0 < loss < 20 for loss in losses)
    assert not torch.equal(_weights(tuned)["llm.output.weight"], first["llm.output.weight"])  # the LLM learns now

    evaluated = run_script(REPO / "tools" / "evaluate.py", [f"path={tuned}", "trainer.val_batches=1"], timeout=240)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "val/loss" in evaluated.stdout.splitlines()[-1]
    generated = run_script(REPO / "tools" / "generate.py", [f"path={tuned}", "prompt=USER: Is it dark?"], timeout=240)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert json.loads(generated.stdout.splitlines()[-1])["prompt"] == "USER: Is it dark?"
