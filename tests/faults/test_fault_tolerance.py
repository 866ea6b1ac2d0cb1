"""Per-step fault tolerance on torchft (trainer.fault_tolerance, docs/FAULT_TOLERANCE.md), seven drills on 4
processes:
- 4 replica groups of 1, one SIGKILLed as step 3 begins (after its quorum formed, so the step fails in the others'
  all-reduce) and its replacement withheld 15 s: the job goes on as 3 groups, then back to 4 (elastic);
- 2 groups of 2 (DDP inside each), one process SIGKILLed in step 5's backward;
- parallel=zero1 in 2 groups of 2, one process SIGKILLed as step 5's all-reduce across groups begins
  (before its part is sent, so the other group's all-reduce fails);
- FSDP2 (parallel.shard=zero3) in 2 groups of 2 -- HSDP: sharded inside a group, replicated across groups -- one
  process SIGKILLed as step 5's forward begins;
- ZeRO-2 (parallel.shard=zero2: FSDP2 keeping the gathered weights) on an HSDP mesh inside each of 2 groups of 2
  (parallel.hsdp_replicas=2: 2 replicas x 1 shard), killed in step 5's backward;
- tensor parallelism (megatron_tp2, llama_tiny) in each of 2 groups of 2, one process killed as step 5 begins;
- pipeline parallelism (megatron_pp2, 1F1B, llama_tiny) in each of 2 groups of 2, one stage killed in step 5's
  backward.
The survivors keep their processes, their step never goes back, the failed step commits nowhere until it is taken
again, a replacement joins and receives the state from a healthy group, and the final parameters equal one process
trained on the same global batches (fp32, 1e-5). And a fifth, on 2 groups of 1: the saving group killed while it
writes a checkpoint."""

from __future__ import annotations

import json

import pytest

from disttrain_core.train.checkpoint import latest_checkpoint, read_tensors, step_dir_name

from ..conftest import cli_overrides, read_metrics
from .conftest import Job

pytestmark = pytest.mark.distributed
# the elastic drill needs steps after its replacement's 15 s wait
STEPS = {"elastic": 24, "backward": 12, "zero1": 12, "fsdp2": 12, "zero2": 12, "tp": 12, "pp": 12}
TEXT = "model=llama_tiny"


def _args(shards, run_dir, *extra: str) -> list[str]:
    return [
        *cli_overrides(shards, run_dir),
        "optim.global_batch_size=4",
        "optim.micro_batch_size=1",
        "trainer.dist_timeout_s=30",
        *extra,
    ]


def _one_process(shards, tmp_path_factory, *extra: str):
    reference = tmp_path_factory.mktemp("ft_reference") / "one"
    steps = sorted(STEPS.values())
    args = [f"trainer.max_steps={steps[-1]}", f"trainer.checkpoint.every_n_steps={steps[0]}", "trainer.devices=1"]
    code, out, _ = Job(_args(shards, reference, *args, *extra), reference.parent / "one.log").finish(timeout=120)
    assert code == 0, out[-3000:]
    return reference / "checkpoints"


@pytest.fixture(scope="module")
def one_process(shards, tmp_path_factory):
    """The same steps in one process, a checkpoint at each drill's last step: where every drill must end."""
    return _one_process(shards, tmp_path_factory)


@pytest.fixture(scope="module")
def one_process_text(shards, tmp_path_factory):
    """The same for the text model the TP and PP drills train (megatron presets keep mllm's units apart)."""
    return _one_process(shards, tmp_path_factory, TEXT)


# (drill, replica groups, the fault: its rank is the job rank = group x group size + rank in the group, extra)
DRILLS = [
    # the replacement withheld just past the survivors' recovery (their quorum's 10 s timeout), so that they commit
    # steps alone and it still joins before the end at 0.3-1 s a step (at 15 s, a fast day's survivors finished all
    # 24 steps first and it was never started; at 8 s it joined during their recovery)
    ("elastic", 4, "kill@step:rank=1:step=3", ["trainer.fault_tolerance.replace_delay_s=11"]),
    ("backward", 2, "kill@backward:rank=3:step=5", ["data.num_workers=1"]),  # and decode workers that end with it
    ("zero1", 2, "kill@allreduce:rank=2:step=5", ["parallel=zero1"]),  # AdamW state sharded inside each group
    ("fsdp2", 2, "kill@forward:rank=3:step=5", ["parallel.shard=zero3"]),  # FSDP2 inside, HSDP across groups
    # ZeRO-2 (FSDP2 keeping its gathered weights) on an HSDP mesh of 2 replicas x 1 shard inside each group
    ("zero2", 2, "kill@backward:rank=1:step=5", ["parallel.shard=zero2", "parallel.hsdp_replicas=2"]),
    ("tp", 2, "kill@step:rank=2:step=5", [TEXT, "parallel=megatron_tp2", "parallel.dp=2", "schedule=none"]),
    ("pp", 2, "kill@backward:rank=3:step=5", [TEXT, "parallel=megatron_pp2", "parallel.dp=2", "schedule=1f1b"]),
]


@pytest.mark.parametrize(
    "drill, replicas, fault, extra",
    DRILLS,
    ids=[
        "4 groups of 1, 4-3-4",
        "2 groups of 2, killed in backward",
        "ZeRO-1, 2 groups of 2, killed in all-reduce",
        "FSDP2, 2 groups of 2, killed in forward",
        "ZeRO-2 on HSDP, 2 groups of 2, killed in backward",
        "TP 2 in each of 2 groups, killed at a step's start",
        "PP 2 (1F1B) in each of 2 groups, killed in backward",
    ],
)
def test_a_replica_killed_mid_run_is_replaced_and_the_run_ends_where_one_process_ends(
    drill, replicas, fault, extra, shards, tmp_path, request
):
    steps, killed, killed_at = STEPS[drill], int(fault.split("rank=")[1].split(":")[0]), int(fault.split("=")[-1])
    reference = request.getfixturevalue("one_process_text" if TEXT in extra else "one_process") / step_dir_name(steps)
    run = tmp_path / "ft"
    args = _args(
        shards,
        run,
        f"trainer.max_steps={steps}",
        "trainer.checkpoint.every_n_steps=0",
        "trainer.devices=4",
        "trainer.fault_tolerance.enabled=true",
        f"trainer.fault_tolerance.replicas={replicas}",
        "trainer.fault_tolerance.timeout_s=10",
        *extra,
    )
    code, out, _ = Job(args, tmp_path / "ft.log", fault=fault).finish(timeout=240)
    assert code == 0, out[-3000:]
    assert "Traceback" not in out, "a survived failure (or a group's exit with its decode workers) printed one"
    report = json.loads((run / "fault_tolerance.json").read_text())
    size = 4 // replicas
    dead = str(killed // size)
    failures = [{k: v for k, v in f.items() if k != "time"} for f in report["failures"]]
    assert failures == [{"group": int(dead), "rank": killed % size, "cause": "SIGKILL", "start": 0}]
    groups = report["groups"]
    survivors = [g for g in groups if g != dead]
    for index in survivors:  # the survivors: the same processes from start to end
        assert len(report["pids"][index]) == 1 and report["pids"][index][0][0] == groups[index]["pid"]
        assert groups[index]["start"] == 0
        logged = [m["step"] for m in read_metrics(run / "replicas" / f"r{index}") if "loss" in m]
        # strictly rising to the end (a group left out of one quorum -- slow, or its peer died mid all-reduce --
        # receives the committed state and skips that step's record: never goes back)
        assert logged == sorted(set(logged)) and logged[-1] == steps, f"group {index}'s steps went back: {logged}"
    # the step killed failed in the survivors' all-reduce: none committed it, and each took it again
    assert any(groups[i]["uncommitted_steps"] >= 1 for i in survivors)
    replacement = groups[dead]
    assert replacement["start"] == 1 and len(report["pids"][dead]) == 2
    healed = replacement["healed_at"]
    assert healed and healed[0] >= killed_at - 1, "the replacement must receive a live state"
    assert sum(g["states_sent"] for g in groups.values()) >= 1
    committed = {int(k): v for i in survivors for k, v in groups[i]["groups_per_step"].items()}
    assert committed[steps] == replicas, "the replacement must be back in the last step's quorum"
    if drill == "elastic":  # the replacement withheld: steps committed by the 3 survivors alone, then 4 again
        alone = sorted(s for s, n in committed.items() if n == replicas - 1)
        assert alone and alone[-1] <= healed[0] < steps, f"no step committed by 3 groups before 4 again: {committed}"
    # every group ends at the same step, data position and parameters
    assert {g["step"] for g in groups.values()} == {steps}
    one_data = json.loads((reference / "data_dp00000.json").read_text())
    assert {g["data"]["index"] for g in groups.values()} == {one_data["index"]}, "samples lost or repeated"
    assert len({tuple(g["parameter_fingerprint"]) for g in groups.values()}) == 1
    ours = read_tensors(latest_checkpoint(run / "checkpoints"))
    theirs = read_tensors(reference)
    assert ours.keys() == theirs.keys()
    worst = max((ours[name] - theirs[name]).abs().max().item() for name in ours)
    assert worst < 1e-5, f"parameters differ from one process by {worst:.2e}"


def test_a_group_killed_while_writing_a_checkpoint_leaves_no_partial_checkpoint_as_the_latest(
    shards, tmp_path, one_process
):
    """2 groups of 1; the first group of the quorum (the one that saves) SIGKILLed after writing its part of the
    step-6 checkpoint: the other group waits for the replacement (2 groups: a majority is both), the step-6
    checkpoint never becomes one, the step-12 checkpoint does, and it equals one process (fp32, 1e-5)."""
    steps, run = STEPS["backward"], tmp_path / "ft"
    args = _args(
        shards,
        run,
        f"trainer.max_steps={steps}",
        "trainer.checkpoint.every_n_steps=6",
        "trainer.checkpoint.async_save=false",
        "trainer.devices=2",
        "trainer.fault_tolerance.enabled=true",
        "trainer.fault_tolerance.replicas=2",
        "trainer.fault_tolerance.timeout_s=10",
    )
    code, out, _ = Job(args, tmp_path / "ft.log", fault="kill@save:rank=0:step=6").finish(timeout=240)
    assert code == 0, out[-3000:]
    report = json.loads((run / "fault_tolerance.json").read_text())
    failures = [{k: v for k, v in f.items() if k != "time"} for f in report["failures"]]
    assert failures == [{"group": 0, "rank": 0, "cause": "SIGKILL", "start": 0}]
    assert report["pids"]["1"] == [[report["groups"]["1"]["pid"]]]  # the other group kept its process
    checkpoints = run / "checkpoints"
    assert latest_checkpoint(checkpoints).name == step_dir_name(steps)
    assert not (checkpoints / step_dir_name(6)).exists(), "the checkpoint killed mid-write became one"
    ours, theirs = read_tensors(latest_checkpoint(checkpoints)), read_tensors(one_process / step_dir_name(steps))
    worst = max((ours[name] - theirs[name]).abs().max().item() for name in ours)
    assert worst < 1e-5, f"parameters differ from one process by {worst:.2e}"
