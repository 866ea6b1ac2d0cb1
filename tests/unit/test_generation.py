"""Generation (models/generation.py, models/image_sampling.py): the KV cache against recomputing the prefix, its
time per token against position, top-p sampling, the DDIM/DDPM sampler against a denoiser whose optimum is
known, and the pixel latents' decoder."""

import time

import pytest
import torch

from disttrain_core.config import REPO_ROOT as REPO
from disttrain_core.data.tokenizer import ByteTokenizer
from disttrain_core.models import build_model, materialize
from disttrain_core.models.generation import KVCache, Sampling, _uncached_last, generate
from disttrain_core.models.image_sampling import (
    decode_pixel_latents,
    generate_images,
    image_grid,
    sample_latents,
    timesteps_for,
)
from disttrain_core.models.latents import PixelLatentEncoder

TOKENIZER = ByteTokenizer()


def model_of(compose_cfg, name: str, *overrides: str, std: float = 0.2):
    """A model with weights large enough that its next-token choices are far from ties."""
    cfg = compose_cfg(f"model={name}", *overrides)
    model = build_model(cfg.model, TOKENIZER, device="meta")
    materialize(model, "cpu", seed=0, std=std)
    return model.eval()


def prompt(text: str, rows: int = 2) -> torch.Tensor:
    return torch.tensor([[TOKENIZER.bos_id, *TOKENIZER.encode(text)]] * rows)


def test_cached_generation_equals_recomputing_the_prefix(compose_cfg):
    llm = model_of(compose_cfg, "llama_tiny").llm
    start = prompt("a photo of a red")
    cached = generate(llm, start, 48, cache=True)
    uncached = generate(llm, start, 48, cache=False)
    assert cached.shape == (2, start.shape[1] + 48)
    assert torch.equal(cached, uncached)
    assert len(set(cached[0, start.shape[1] :].tolist())) > 3  # not one token repeated: a real check
    # the states themselves, a prefill then a chunk of 4 new positions (the masked path) and single positions
    with torch.no_grad():
        kv = KVCache(llm, 64)
        kv.forward(llm, cached[:, :10])
        chunk = kv.forward(llm, cached[:, 10:14])
        assert (chunk - _uncached_last(llm, cached[:, :14])).abs().max() < 1e-5
        for stop in range(15, 20):
            one = kv.forward(llm, cached[:, stop - 1 : stop])
            assert (one - _uncached_last(llm, cached[:, :stop])).abs().max() < 1e-5


def test_the_cache_keeps_time_per_token_flat_from_64_to_512(compose_cfg):
    """The acceptance figure, on this CPU: the time of a new token at position 512 over that at 64 (with the
    cache the work per token is one position through the blocks; without it the whole prefix). The two positions
    are timed alternately on one filled cache (rewound before each token), 64 times each, and the fastest of each
    compared: timing 64 first and 512 later let a burst of load from the other test workers land on one side only
    (a CI run read 1.74 on the fastest of 32 consecutive tokens each; a median once read 1.79)."""
    llm = model_of(compose_cfg, "llama_tiny").llm
    kv = KVCache(llm, 560)
    token = torch.tensor([[65]])
    times = {64: [], 512: []}
    with torch.no_grad():
        kv.forward(llm, torch.full((1, 520), 65))

        def timed(position: int) -> float:  # one token written at ``position``, attending to all before it
            kv.position = position
            for layer in kv.layers:
                layer.length = position
            started = time.perf_counter()
            kv.forward(llm, token)
            return time.perf_counter() - started

        for _ in range(64):
            for position in times:
                times[position].append(timed(position))
    ratio = min(times[512]) / min(times[64])
    assert ratio <= 1.5, (ratio, min(times[64]), min(times[512]))


def test_sampling_greedy_top_p_and_seeds():
    logits = torch.tensor([[0.0, 3.0, 2.5, -1.0, 1.0]]).repeat(4000, 1)
    assert Sampling().choose(logits, None).unique().tolist() == [1]
    generator = torch.Generator().manual_seed(0)
    # top_p 0.5: token 1 alone holds 0.52 of the probability at temperature 1 -> always chosen
    assert Sampling(1.0, 0.5).choose(logits, generator).unique().tolist() == [1]
    # top_p 0.9: the nucleus is tokens 1, 2 and 4 (0.52 + 0.32 + 0.07 >= 0.9), never 0 or 3
    drawn = Sampling(1.0, 0.9).choose(logits, generator)
    assert set(drawn.unique().tolist()) == {1, 2, 4}
    first = Sampling(0.7, 1.0).choose(logits, torch.Generator().manual_seed(3))
    again = Sampling(0.7, 1.0).choose(logits, torch.Generator().manual_seed(3))
    assert torch.equal(first, again) and len(first.unique()) == 5
    with pytest.raises(ValueError, match="top_p=0"):
        Sampling(1.0, 0.0).check()


def test_generation_stops_at_eos_per_row(compose_cfg):
    llm = model_of(compose_cfg, "llama_tiny").llm
    start = prompt("x", rows=1)
    free = generate(llm, start, 12)
    eos = int(free[0, start.shape[1] + 2])  # pretend the third new token is the end of text
    stopped = generate(llm, start, 12, eos_id=eos)
    assert stopped.shape[1] == start.shape[1] + 3 and int(stopped[0, -1]) == eos


def test_the_sampler_draws_the_data_distribution_given_the_optimal_denoiser():
    """Data x0 ~ N(mu, s^2) per element: the optimal noise prediction at x_t is known in closed form, so the
    sampler alone decides whether the samples come out with the data's mean and spread. Both samplers replace
    x0 by its posterior mean at each step, which narrows the spread at coarse steps: DDIM (eta 0) converges to
    the data's spread as the steps grow (measured: std 0.202, 0.274, 0.293, 0.299 at 10, 50, 200, 1000 steps);
    DDPM (eta 1) over all 1000 timesteps comes within 3%."""
    from disttrain_core.config.model import UNetConfig
    from disttrain_core.models.unet import DiffusionGenerator

    cfg = UNetConfig(block_out_channels=[8], cross_attention_blocks=[False], norm_groups=4, head_dim=8)
    schedule = DiffusionGenerator(cfg).alphas_cumprod
    mu, s = 0.5, 0.3

    def optimal(x, t):
        ab = schedule[t].view(-1, 1, 1, 1).double()
        return (1 - ab).sqrt() * (x.double() - ab.sqrt() * mu) / (ab * s**2 + 1 - ab)

    shape = (16, 4, 16, 16)
    spreads = [sample_latents(optimal, schedule, shape, steps, 0.0, seed=0).std().item() for steps in (10, 50, 200)]
    assert spreads == sorted(spreads) and spreads[0] < 0.9 * s
    ddim = sample_latents(optimal, schedule, shape, 1000, 0.0, seed=0)
    assert abs(ddim.mean().item() - mu) < 0.02 and abs(ddim.std().item() - s) / s < 0.01
    ddpm = sample_latents(optimal, schedule, shape, 1000, 1.0, seed=0)
    assert abs(ddpm.mean().item() - mu) < 0.01 and abs(ddpm.std().item() - s) / s < 0.03
    assert timesteps_for(4, 1000) == [999, 666, 333, 0]


def test_pixel_latents_decode_to_their_pooled_image():
    encoder = PixelLatentEncoder(channels=4, downsample=4)
    images = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8)
    decoded = decode_pixel_latents(encoder, encoder(images))
    pooled = torch.nn.functional.avg_pool2d(images.float(), 4)
    expected = pooled.repeat_interleave(4, dim=2).repeat_interleave(4, dim=3)
    assert decoded.dtype == torch.uint8 and decoded.shape == images.shape
    assert (decoded.float() - expected).abs().max() <= 1.0  # rounding to uint8


def test_images_from_the_generator_and_the_grid(compose_cfg):
    model = model_of(compose_cfg, "mllm_tiny")
    captions = ["photo of a red circle on white", "drawing of a blue square"]
    images = generate_images(model, TOKENIZER, captions, steps=5, seed=1)
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.uint8
    assert torch.equal(images, generate_images(model, TOKENIZER, captions, steps=5, seed=1))
    # the same noise (one caption at a time, one seed), another caption: the LLM's <gen> states condition it
    alone = [generate_images(model, TOKENIZER, [c], steps=5, seed=1)[0] for c in captions]
    assert torch.equal(alone[0], images[0]) and not torch.equal(alone[1], images[0])
    grid = image_grid(images, columns=2)
    assert grid.shape == (2 + 32 + 2, 2 + 2 * (32 + 2), 3)
    with pytest.raises(ValueError, match="has no generator"):
        generate_images(model_of(compose_cfg, "llama_tiny"), TOKENIZER, captions)


def test_the_benchmark_writes_its_medians(tmp_path):
    import json
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    from bench_generate import main

    out = tmp_path / "bench.json"
    assert main(["positions=96", "uncached_to=96", f"out={out}"]) == 0
    result = json.loads(out.read_text())
    assert set(result["cache"]["median_seconds_per_token"]) == {"64"}  # 512 needs positions >= 528
    assert result["no_cache"]["median_seconds_per_token"]["64"] > 0
