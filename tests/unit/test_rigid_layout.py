"""The rigid layout the planner compares with (planner/baselines.py ``megatron``), pinned to the DistTrain
paper's section 2.1 description of Megatron-LM's multimodal training: the encoder and the generator are extra
pipeline stages (or folded into the first / last LLM stage) with the LLM backbone's TP and the LLM's DP;
a module too small to split is replicated inside its TP group; the projectors go with the encoder and the
generator. Data-skew stragglers (planner/stragglers.py) enter where the images are encoded: the extra encoder
stage, or the first LLM stage's encoder share when folded, of each LLM data-parallel rank, which only sees its
own samples; nothing else in the pipeline varies with the images."""

from disttrain_core.config import compose
from disttrain_core.planner import CostModel, Hardware, LayoutModel, Orchestrator, UnitChoice, workload_of
from disttrain_core.planner.baselines import megatron
from disttrain_core.planner.costs import PlannerSettings
from disttrain_core.planner.stragglers import pipeline_of


def _solver(model="mllm9b", devices=64, batch=256):
    cfg = compose([f"model={model}", "cluster=h100_80g"])
    costs = CostModel(
        workload_of(cfg.model),
        Hardware.from_config(cfg.cluster, "bf16-mixed"),
        PlannerSettings(precision="bf16-mixed", recompute="selective_op"),
    )
    return Orchestrator(LayoutModel(costs, batch, 1, devices))


def test_every_rigid_candidate_shares_the_llm_dp_and_tp():
    solver = _solver()
    seen = []
    evaluate = solver.m.evaluate

    def spy(llm, enc, gen):
        seen.append((llm, enc, gen))
        return evaluate(llm, enc, gen)

    solver.m.evaluate = spy
    plan = megatron(solver)
    assert plan is not None and seen
    folded = separate = 0
    for llm, enc, gen in seen:
        for side in (enc, gen):
            if side.colocated:  # folded into the first (encoder) or last (generator) LLM stage
                folded += 1
                continue
            separate += 1
            # one extra pipeline stage at the LLM's TP and the LLM's data-parallel width (x its CP ranks)
            assert (side.tp, side.pp, side.dp) == (llm.tp, 1, llm.dp * llm.cp), (llm, side)
        assert enc.colocated == gen.colocated  # both folded or both extra stages
    assert folded and separate  # both forms are searched


def test_the_unet_splits_over_a_tp_group_only_where_its_heads_divide():
    """The U-Net splits its transformers over TP (attention heads, GEGLU width), not its convolutions. SD 2.1's
    levels have 5, 10, 20 and 20 heads of 64: on a TP group of 8 (the rigid layout's generator stage, or
    colocated with the LLM) it stays replicated, every rank running all of it (no speedup, the runtime's
    ``unet_splits``); on 5 its transformers split and the convolutions still run whole. The encoder's blocks
    split, its projector (counted with it) is replicated."""
    m = _solver().m
    one, eight = UnitChoice(1, 4, 1), UnitChoice(8, 4, 1)
    unet = m.w.units["generator"]
    assert unet.params_tp > 0 and 0 < unet.flops_not_tp < unet.train_flops
    assert unet.heads == 5 and unet.tp_allowed(5) and not unet.tp_allowed(8)
    unet_1 = m.c.rank_compute("generator", 1, 4.0, 1, 1)
    assert m.c.rank_compute("generator", 8, 4.0, 1, 1) == unet_1  # replicated
    assert m.c.local_params("generator", 8, 1) == m.c.local_params("generator", 1, 1)
    # split: the convolutions' time bounds it from below; its 96 all-reduces of the transformers' activations
    # (3 forward, 3 backward each) are added
    split = m.c.rank_compute("generator", 5, 4.0, 1, 1)
    assert split > unet_1 * unet.flops_not_tp / unet.train_flops and split != unet_1
    assert m.c.local_params("generator", 5, 1) < m.c.local_params("generator", 1, 1)
    encoder = m.w.units["encoder"]
    assert 0 < encoder.flops_not_tp < encoder.train_flops  # the projector, replicated in the TP group
    assert m.stage_time("encoder", eight, 4.0, 1e11) < m.stage_time("encoder", one, 4.0, 1e11)


def test_stragglers_enter_at_the_encoder_of_each_llm_data_parallel_rank():
    """Every rigid candidate, folded or with extra stages, as the straggler model sees it: only the encoder's
    work scales with a rank's images -- the whole extra encoder stage (the first), or the colocated encoder's
    time inside the first LLM stage; the LLM stages' sequences and the generator's one image per sample are
    fixed. The encoder's replicas are the LLM's DP (x CP) ranks, each holding its own rank's samples."""
    solver = _solver()
    evaluations = []
    evaluate = solver.m.evaluate

    def spy(llm, enc, gen):
        result = evaluate(llm, enc, gen)
        if result.feasible:
            evaluations.append(result)
        return result

    solver.m.evaluate = spy
    megatron(solver)
    forms = set()
    for evaluation in evaluations:
        llm, enc = evaluation.choices["llm"], evaluation.choices["encoder"]
        pipeline = pipeline_of(solver.m, evaluation)
        names = [name for name, _ in evaluation.stage_times]
        varying = [i for i, v in enumerate(pipeline.varying) if v > 0]
        assert varying == [0], (names, pipeline.varying)  # the first stage, and only it
        if enc.colocated:
            forms.add("folded")
            assert names[0] == "llm" and pipeline.encoder_dp == llm.dp
            share = solver.m.colocated_time("encoder", llm.tp, solver.m.micro, evaluation.recompute["llm"])
            assert pipeline.varying[0] == share < pipeline.stage_seconds[0]  # the LLM's own share stays fixed
        else:
            forms.add("extra stage")
            assert names[0] == "encoder" and pipeline.varying[0] == pipeline.stage_seconds[0]
            assert pipeline.encoder_dp == llm.dp * llm.cp
        assert pipeline.llm_dp == llm.dp and pipeline.samples_per_slot == solver.m.micro * llm.dp
    assert forms == {"folded", "extra stage"}
