"""The cross-attention resampler projector (model.encoder_projector.kind=resampler, models/projector.py): its
shapes and init, its FLOPs and parameters as the planner counts them, the data path's <img> runs, the broker's
rows per image, and its settings refused in one line. Training with it: tests/distributed/test_resampler.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from disttrain_core.config import compose, image_tokens
from disttrain_core.data.samples import SampleEncoder
from disttrain_core.data.tokenizer import ByteTokenizer
from disttrain_core.launch.cli import PreflightError, check_overrides
from disttrain_core.models import build_model, materialize
from disttrain_core.models.flops import module_flops
from disttrain_core.models.projector import Resampler
from disttrain_core.parallel.plan import tokens_per_item
from disttrain_core.planner import workload_of

QUERIES, HEADS, LAYERS = 6, 4, 2
RESAMPLER = [
    "model.encoder_projector.kind=resampler",
    f"model.encoder_projector.num_queries={QUERIES}",
    f"model.encoder_projector.n_heads={HEADS}",
    f"model.encoder_projector.n_layers={LAYERS}",
]


def _model_cfg(*overrides: str):
    return compose([*RESAMPLER, *overrides]).model


def _built(seed: int = 0, *overrides: str):
    cfg = _model_cfg(*overrides)
    model = build_model(cfg, ByteTokenizer(), device="cpu")
    materialize(model, "cpu", seed=seed, std=cfg.init_std)
    return cfg, model


def _expected_parameters(in_dim: int, dim: int, hidden: int) -> int:
    """The resampler's parameters written out: queries, the context norm, per block two norms, q/k/v/proj (k and
    v from the encoder's width) and the MLP, then the output norm."""
    attention = (dim * dim + dim) * 2 + (in_dim * dim + dim) * 2
    block = 2 * (2 * dim) + attention + (dim * hidden + hidden) + (hidden * dim + dim)
    return QUERIES * dim + 2 * in_dim + LAYERS * block + 2 * dim


def test_the_llm_sees_num_queries_positions_per_image_whatever_the_patch_count():
    cfg, model = _built()
    assert isinstance(model.encoder_projector, Resampler)
    for size in (32, 64):  # 16 and 64 patches
        feats = torch.randn(3, (size // cfg.encoder.patch_size) ** 2, model.encoder.out_dim)
        assert model.encoder_projector(feats).shape == (3, QUERIES, cfg.llm.dim)
    images = torch.randint(0, 255, (3, 3, 32, 32), dtype=torch.uint8)
    assert model.encode_images(images).shape == (3, QUERIES, cfg.llm.dim) == (3, image_tokens(cfg), cfg.llm.dim)
    assert model.encode_images(images[:0]).shape == (0, QUERIES, cfg.llm.dim)  # a microbatch without images


def test_each_query_reads_the_image_and_the_output_depends_on_it():
    """Cross-attention, not a constant: two images give different outputs, and changing one image changes only
    that image's queries."""
    _, model = _built()
    images = torch.randint(0, 255, (2, 3, 32, 32), dtype=torch.uint8)
    out = model.encode_images(images)
    assert not torch.allclose(out[0], out[1])
    changed = images.clone()
    changed[1] = 255 - changed[1]
    again = model.encode_images(changed)
    assert torch.equal(again[0], out[0]) and not torch.allclose(again[1], out[1])


def test_init_is_deterministic_and_the_same_alone_or_in_the_whole_model():
    _, first = _built(seed=3)
    _, second = _built(seed=3)
    _, other = _built(seed=4)
    a, b = dict(first.encoder_projector.named_parameters()), dict(second.encoder_projector.named_parameters())
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not torch.equal(a["queries"], dict(other.encoder_projector.named_parameters())["queries"])
    alone = Resampler(first.encoder.out_dim, first.cfg.llm.dim, first.cfg.encoder_projector)
    materialize(alone, "cpu", seed=3, std=first.cfg.init_std, prefix="encoder_projector")
    assert all(torch.equal(p, a[name]) for name, p in alone.named_parameters())
    assert float(a["queries"].detach().std()) == pytest.approx(first.cfg.init_std, rel=0.3)  # drawn, not left at zero


def test_flops_count_the_cross_attention_matmuls():
    """models/flops.py counts the projector on meta under FlopCounterMode: per image, each block's q and output
    projections (Q x D x D), k and v from the P patches (P x C x D each), the scores and the weighted sum
    (Q x P x D each) and the MLP (2 x Q x D x H); training is three forwards (the encoder below trains)."""
    cfg = _model_cfg()
    patches, width, dim = (32 // 8) ** 2, cfg.encoder.output_dim, cfg.llm.dim
    hidden = 4 * dim
    block = 2 * (2 * QUERIES * dim * dim + 2 * patches * width * dim + 2 * QUERIES * patches * dim)
    block += 2 * 2 * QUERIES * dim * hidden
    counted = module_flops(cfg)["encoder_projector"]
    assert counted.forward == LAYERS * block
    assert counted.train == 3 * counted.forward and counted.unit == "image"


def test_the_planner_counts_the_resampler_in_the_encoder_unit():
    """The encoder unit's parameters are the ViT's plus the resampler's, exactly (the resampler also written out
    by hand); its FLOPs include the resampler's, which TP does not split; it sends num_queries rows of the LLM's
    width per image, and the broker's rows per image are the same number."""
    cfg = compose(RESAMPLER)
    model = build_model(cfg.model, ByteTokenizer(), device="meta")
    resampler = sum(p.numel() for p in model.encoder_projector.parameters())
    dim = cfg.model.llm.dim
    assert resampler == _expected_parameters(model.encoder.out_dim, dim, 4 * dim)
    unit = workload_of(cfg.model).units["encoder"]
    vit = sum(p.numel() for p in model.encoder.parameters())
    assert unit.params_tp + unit.params_rep == vit + resampler
    head = sum(p.numel() for part in (model.encoder.norm_post, model.encoder.proj) for p in part.parameters())
    assert unit.params_last == head + resampler  # on the encoder's last pipeline stage, with the ViT's head
    flops = module_flops(cfg.model)
    assert unit.train_flops == flops["encoder"].train + flops["encoder_projector"].train
    assert unit.flops_not_tp == flops["encoder_projector"].train
    assert unit.boundary_floats == QUERIES * dim
    assert tokens_per_item(cfg)["encoder"] == QUERIES
    mlp = compose([]).model
    assert (
        workload_of(mlp).units["encoder"].boundary_floats == 16 * dim and tokens_per_item(compose([]))["encoder"] == 16
    )


def _jpeg() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 90)).save(out, format="JPEG")
    return out.getvalue()


def test_each_image_is_a_run_of_num_queries_placeholders_and_more_images_fit():
    """The data path sizes each <img> run by the resampler's queries: 6 positions instead of 16 patches, so a
    40-token row (34 after <bos>, <eos> and 4 <gen>; 4 of text between the images) holds all 3 images where the
    MLP's holds 1."""
    tok = ByteTokenizer()
    texts, names = ["ab", None, "c", None, "d", None], [None, "0.jpg", None, "1.jpg", None, "2.jpg"]
    members = {"json": json.dumps({"texts": texts, "images": names}).encode()}
    members.update({name: _jpeg() for name in names if name})
    rows = {}
    for kind, overrides in (("mlp", []), ("resampler", RESAMPLER)):
        model = compose([*overrides, "model.seq_len=40"]).model
        rows[kind] = SampleEncoder(model, tok, seed=0, max_image_pixels=64_000_000).encode("k", members)
    assert rows["mlp"].images.shape[0] == 1 and rows["mlp"].truncated_images == 2
    resampled = rows["resampler"]
    assert resampled.images.shape[0] == 3 and resampled.truncated_images == 0
    positions = np.flatnonzero(resampled.tokens == tok.image_id)
    assert _run_lengths(positions) == [QUERIES] * 3
    assert _run_lengths(np.flatnonzero(rows["mlp"].tokens == tok.image_id)) == [16]


def _run_lengths(positions) -> list[int]:
    """Lengths of the runs of consecutive positions."""
    lengths, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            lengths.append(i - start)
            start = i
    return lengths


KIND = "model.encoder_projector.kind=resampler"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([KIND, "model.encoder_projector.num_queries=0"], "model.encoder_projector.num_queries=0: use a value in [1, "),
        ([KIND, "model.encoder_projector.n_heads=5"], "model.encoder_projector.n_heads=5 does not divide the resampl"),
        ([KIND, "model.encoder_projector.n_heads=0"], "model.encoder_projector.n_heads=0: use 1 or more"),
        ([KIND, "model.encoder_projector.n_layers=0"], "model.encoder_projector.n_layers=0: use a value in [1, "),
        ([KIND, "model.encoder_projector.num_queries=300"], "model.seq_len=256 cannot hold one image (300 resampler"),
        (["model.encoder_projector.kind=perceiver"], "model.encoder_projector.kind='perceiver': allowed values are"),
        (["model.generator_projector.kind=resampler"], "model.generator_projector.kind=resampler: only model.enc"),
    ],
)
def test_bad_resampler_settings_are_refused_in_one_line(overrides, expected):
    with pytest.raises(PreflightError) as error:
        check_overrides(overrides)
    message = str(error.value)
    assert expected in message and "\n" not in message, message


def test_a_resampler_with_more_layers_than_the_mlp_allows_is_accepted():
    """n_layers is the resampler's block count (1 or more); for kind=mlp it stays 1 or 2."""
    check_overrides([*RESAMPLER, "model.encoder_projector.n_layers=3"])
    with pytest.raises(PreflightError, match="n_layers=3: allowed values are 1 and 2"):
        check_overrides(["model.encoder_projector.n_layers=3"])


def test_a_producer_and_trainers_that_disagree_on_the_image_positions_refuse_each_other():
    from disttrain_core.data.producer_protocol import job_identity, job_mismatch

    mlp, resampled = job_identity(compose([])), job_identity(compose(RESAMPLER))
    assert job_mismatch(mlp, mlp) is None and job_mismatch(resampled, resampled) is None
    problem = job_mismatch(mlp, resampled)
    assert (
        "producer has model.encoder_projector.kind=mlp, trainer has model.encoder_projector.kind=resampler" in problem
    )
    other = job_identity(compose([*RESAMPLER[:1], "model.encoder_projector.num_queries=7", *RESAMPLER[2:]]))
    assert "model.encoder_projector.num_queries=6, trainer has model.encoder_projector.num_queries=7" in job_mismatch(
        resampled, other
    )
