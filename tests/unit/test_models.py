"""Model zoo: published parameter counts, deterministic init, FLOP accounting."""

import json

import pytest
import torch

from disttrain_core.config import compose
from disttrain_core.data.tokenizer import ByteTokenizer
from disttrain_core.models import build_model, materialize, parameter_table
from disttrain_core.models.common import init_weights
from disttrain_core.models.flops import module_flops

from ..conftest import REPO, run_script

# Published sizes (1% tolerance required by the issue; pinned here to the exact counts).
PUBLISHED = {
    "vit_h14": 632e6,  # OpenCLIP ViT-H/14 image tower with its 1024-d projection
    "llama3_8b": 8.03e9,
    "llama2_13b": 13.0e9,
    "llama3_70b": 70.6e9,
    "sd21_unet": 866e6,
    "qwen2_5_7b": 7.61e9,  # model cards' figures; the issue asks 0.5% of the 405B's
    "qwen3_8b": 8.2e9,
    "mistral_7b": 7.24e9,
    "llama3_405b": 405.9e9,
}


def _params(model_name: str) -> dict[str, int]:
    return parameter_table(build_model(compose([f"model={model_name}"]).model, ByteTokenizer(), device="meta"))


@pytest.mark.parametrize(
    "model_name, module, published",
    [
        ("mllm9b", "encoder", "vit_h14"),
        ("mllm9b", "llm", "llama3_8b"),
        ("mllm15b", "llm", "llama2_13b"),
        ("mllm72b", "llm", "llama3_70b"),
        ("mllm72b", "generator", "sd21_unet"),
        ("llama3_8b", "llm", "llama3_8b"),
        ("llama3_70b", "llm", "llama3_70b"),
        ("qwen2_5_7b", "llm", "qwen2_5_7b"),
        ("qwen3_8b", "llm", "qwen3_8b"),
        ("mistral_7b", "llm", "mistral_7b"),
        ("llama3_405b", "llm", "llama3_405b"),
    ],
)
def test_parameter_counts_match_published_within_one_percent(model_name, module, published):
    count = _params(model_name)[module]
    assert abs(count / PUBLISHED[published] - 1) < (0.005 if published == "llama3_405b" else 0.01), (model_name, count)


def test_exact_counts_are_pinned():
    table = _params("mllm72b")
    assert table["encoder"] == 632_076_800
    assert table["llm"] == 70_553_706_496
    assert table["generator"] == 865_910_724  # diffusers' SD 2.1 UNet2DConditionModel count


def test_model_info_json_answers_for_mllm72b():
    out = run_script(REPO / "tools/model_info.py", ["model=mllm72b", "format=json"], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    info = json.loads(out.stdout)
    assert info["modules"]["llm"]["params"] == 70_553_706_496
    assert info["total_params"] == sum(m["params"] for m in info["modules"].values())
    assert set(info["modules"]) == {"encoder", "encoder_projector", "llm", "generator_projector", "generator"}
    assert all(m["flops_per_sample"] > 0 for m in info["modules"].values())


def test_llm_flops_match_the_analytic_formula():
    """6 * (params - embedding) * tokens + 12 * layers * dim * seq^2 (attention, full), per sequence."""
    cfg = compose(["model=llama3_8b", "model.seq_len=2048"]).model
    flops = module_flops(cfg)["llm"].train
    llm = cfg.llm
    params = _params("llama3_8b")["llm"] - llm.vocab_size * llm.dim
    expected = 6 * params * cfg.seq_len + 12 * llm.n_layers * llm.dim * cfg.seq_len**2
    assert flops == pytest.approx(expected, rel=1e-3)


def test_document_flops_count_attention_inside_each_document():
    from omegaconf import OmegaConf

    from disttrain_core.models.flops import document_flops, llm_flop_terms

    cfg = compose(["model=llama_tiny", "model.seq_len=1024"]).model
    terms = llm_flop_terms(cfg)
    exact = {n: module_flops(OmegaConf.merge(cfg, {"seq_len": n}))["llm"].train for n in (1024, 512, 96)}
    for n, flops in exact.items():  # exact at the two fitted lengths and at a third one
        assert document_flops(terms, [n]) == pytest.approx(flops, rel=1e-9)
    # four documents of 256 packed in one row: four times one document, less than a dense row of 1,024
    four = document_flops(terms, [256] * 4)
    assert four == pytest.approx(4 * document_flops(terms, [256])) and four < exact[1024]


def test_frozen_encoder_costs_forward_only():
    trained = module_flops(compose([]).model)["encoder"]
    frozen = module_flops(compose(["model.freeze.encoder=true", "model.freeze.encoder_projector=true"]).model)
    assert frozen["encoder"].train == frozen["encoder"].forward
    assert trained.train > 2.5 * trained.forward


@pytest.mark.parametrize("model", ["llama_moe_tiny", "any2any_video_tiny"])
@pytest.mark.parametrize("frozen", [(), ("llm", "encoder", "audio_encoder", "video_encoder")])
def test_towers_counted_block_by_block_equal_the_whole_module_count(model, frozen):
    """models/flops.py counts a stack of identical blocks once per distinct block: the same FLOPs, forward and
    training, as the whole module run under the counter (the LLM with MoE layers; the ViT, audio and video
    towers; trained and frozen, with and without a gradient reaching their input); and _compute uses it."""
    from omegaconf import OmegaConf

    from disttrain_core.models import flops
    from disttrain_core.models.audio import AudioEncoder, audio_frames
    from disttrain_core.models.llama import Llama
    from disttrain_core.models.video import VideoTower
    from disttrain_core.models.vit import VisionTransformer

    cfg = OmegaConf.to_object(compose([f"model={model}", *(f"model.freeze.{name}=true" for name in frozen)]).model)
    counted = flops._compute(cfg)
    upstream = any(flops._trainable(cfg)[name] for name in flops.FEEDS["llm"])

    class Whole(torch.nn.Module):  # the LLM as training runs it after the embedding: blocks, final norm, head
        def __init__(self, llm):
            super().__init__()
            self.llm = llm

        def forward(self, h):
            return self.llm.logits(self.llm.final_norm(self.llm.run_layers(h)))

        def pieces(self, inputs, trainable):
            head = lambda h: self.llm.logits(self.llm.final_norm(h))  # noqa: E731
            return flops._count_stack(self, None, self.llm.layers.values(), head, inputs, trainable, (self.llm.rope,))

    with torch.device("meta"):
        towers = {"llm": (Whole(Llama(cfg.llm, cfg.seq_len)), torch.empty(1, cfg.seq_len, cfg.llm.dim), upstream)}
        if cfg.encoder is not None:
            size = cfg.encoder.image_size
            images = torch.empty(1, 3, size, size, dtype=torch.uint8)
            towers["encoder"] = (VisionTransformer(cfg.encoder), images, False)
        if cfg.audio_encoder is not None:
            mels = torch.empty(1, cfg.audio_encoder.n_mels, audio_frames(cfg.audio_encoder))
            towers["audio_encoder"] = (AudioEncoder(cfg.audio_encoder), mels, False)
        if cfg.video_encoder is not None:
            video = cfg.video_encoder
            groups = torch.empty(1, video.temporal_merge, 3, video.image_size, video.image_size, dtype=torch.uint8)
            towers["video_encoder"] = (VideoTower(video), groups, False)  # its frames through the ViT, then a mean
        assert len(towers) == (1 if model == "llama_moe_tiny" else 4)
        for name, (module, x, in_training) in towers.items():
            trained = name not in frozen
            for input_grad in (False, True) if x.is_floating_point() else (False,):
                inputs = (torch.empty(x.shape, dtype=x.dtype, requires_grad=input_grad),)
                whole = flops._count(module, inputs, trained)
                if name == "llm":
                    pieces = module.pieces(inputs, trained)
                else:  # the video tower's frames go through the ViT one by one
                    frames = inputs[0].flatten(0, 1) if x.dim() == 5 else inputs[0]
                    pieces = flops._count_tower(module, (frames,), trained)
                assert (pieces.forward, pieces.train) == (whole.forward, whole.train), (name, trained, input_grad)
                assert (whole.train > whole.forward) == (trained or input_grad), (name, trained, input_grad)
                if input_grad == in_training:
                    assert (counted[name].forward, counted[name].train) == (whole.forward, whole.train), name


def test_submodule_init_matches_full_model_init():
    cfg = compose([]).model
    full = build_model(cfg, ByteTokenizer(), device="cpu")
    init_weights(full, seed=3)
    alone = build_model(cfg, ByteTokenizer(), device="cpu").llm
    init_weights(alone, seed=3, prefix="llm")
    for (name, a), (_, b) in zip(full.llm.named_parameters(), alone.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_tiny_model_forward_backward_gives_finite_losses_and_grads():
    cfg = compose([]).model
    model = build_model(cfg, ByteTokenizer())
    materialize(model, "cpu", seed=0, std=cfg.init_std)
    tok = ByteTokenizer()
    patches = (cfg.encoder.image_size // cfg.encoder.patch_size) ** 2
    row = [tok.bos_id] + [65] * 10 + [tok.gen_id] * cfg.gen_tokens + [tok.image_id] * patches + [66, tok.eos_id]
    row += [tok.pad_id] * (cfg.seq_len - len(row))
    tokens = torch.tensor([row, row])
    labels = torch.where(tokens < 256, tokens, torch.full_like(tokens, -100)).roll(-1, 1)
    from disttrain_core.data.batch import Batch

    side = cfg.gen_image_size // cfg.latent_downsample
    batch = Batch(
        tokens=tokens,
        labels=labels,
        images=torch.randint(0, 255, (2, 3, 32, 32), dtype=torch.uint8),
        image_counts=torch.tensor([1, 1]),
        gen_images=torch.randint(0, 255, (2, 3, 32, 32), dtype=torch.uint8),
        gen_weight=torch.tensor([1.0, 0.0]),
        gen_noise=torch.randn(2, 4, side, side),
        gen_timesteps=torch.tensor([10, 900]),
    )
    out = model(batch)
    loss = out["lm_loss_sum"] / out["lm_tokens"] + out["gen_loss_sum"] / out["gen_samples"]
    loss.backward()
    assert torch.isfinite(loss)
    assert out["gen_samples"] == 1.0
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name


def test_a_microbatch_without_images_trains():
    """Text-only samples happen (5% of the embedded data); a microbatch of them has zero images."""
    cfg = compose([]).model
    model = build_model(cfg, ByteTokenizer())
    materialize(model, "cpu", seed=0, std=cfg.init_std)
    tok = ByteTokenizer()
    row = [tok.bos_id] + [65] * 10 + [tok.gen_id] * cfg.gen_tokens + [tok.eos_id]
    tokens = torch.tensor([row + [tok.pad_id] * (cfg.seq_len - len(row))])
    from disttrain_core.data.batch import Batch

    side = cfg.gen_image_size // cfg.latent_downsample
    batch = Batch(
        tokens=tokens,
        labels=tokens.roll(-1, 1),
        images=torch.zeros(0, 3, 32, 32, dtype=torch.uint8),
        image_counts=torch.tensor([0]),
        gen_images=torch.zeros(1, 3, 32, 32, dtype=torch.uint8),
        gen_weight=torch.tensor([0.0]),
        gen_noise=torch.randn(1, 4, side, side),
        gen_timesteps=torch.tensor([3]),
    )
    out = model(batch)
    (out["lm_loss_sum"] + out["gen_loss_sum"]).backward()
    assert model.encoder.patch_embed.weight.grad is not None
    assert float(model.encoder.patch_embed.weight.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("shape", [(5,), (17,), (1000,), (37, 11), (128, 7), (7, 128), (4, 3, 3, 3), (33, 17, 2)])
def test_chunked_init_of_a_block_equals_the_same_block_of_the_whole_draw(shape):
    """Shard before materialize draws a weight in chunks and keeps one block: exactly today's values."""
    from disttrain_core.models.common import _seeded_normal, _seeded_normal_into

    shape = torch.Size(shape)
    whole = _seeded_normal(shape, 0.02, seed=123)
    for dim, size in enumerate(shape):
        for parts in (1, 2, 3, 4):
            if size % parts:
                continue
            for index in range(parts):
                offset = [0] * len(shape)
                offset[dim] = index * size // parts
                block = torch.empty(*shape[:dim], size // parts, *shape[dim + 1 :])
                _seeded_normal_into(block, shape, tuple(offset), 0.02, seed=123)
                assert torch.equal(block, whole.narrow(dim, offset[dim], size // parts)), (dim, parts, index)
