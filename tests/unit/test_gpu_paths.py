"""The CUDA/NCCL defects of issue 36 that a CPU can show, each pinned by a test that fails on the old code: a
second device stands in as the meta device where the defect is a device mismatch."""

import pytest
import torch

from disttrain_core.config import OptimConfig, compose, typed_config

from ..conftest import run_train

META = torch.device("meta")


def test_a_rank_with_only_frozen_parameters_keeps_its_optimizer_tensors_on_the_engines_device():
    """parallel=disagg2 with the encoder frozen: the encoder rank's ZeRO-1 buffers and gradient norm live on
    the engine's device (they join NCCL collectives), not on the CPU fallback of an empty parameter list."""
    from disttrain_core.parallel.fsdp import ShardedOptimizer
    from disttrain_core.parallel.zero import ZeroOneOptimizer

    zero = ZeroOneOptimizer([], OptimConfig(), None, 1, 0, tp=1, device=META)
    assert {m.device for flat in zero.flats.values() for m in flat.masters} == {META}
    assert zero.grad_norm_squared().device == META
    sharded = ShardedOptimizer([], OptimConfig(), copies=1, device=META)  # no trainable tensor: one empty group
    assert sharded.grad_norm_squared().device == META
    sharded.step()


def test_the_memory_report_counts_the_training_devices_allocator_only():
    from disttrain_core.train.memory_report import running_peak

    mib = 2**20
    events = [(1, 256 * mib, "cpu"), (2, 256 * mib, "cuda"), (3, -256 * mib, "cuda"), (4, -256 * mib, "cpu")]
    assert running_peak(events, "cuda") == (256 * mib, 0)  # 512 MiB when both allocators were summed


def test_mfu_peak_is_the_datasheet_of_the_math_the_step_runs():
    from disttrain_core.train.perf import datasheet_peak, peak_flops_per_device, peak_source, step_math

    assert step_math("bf16-mixed", "cuda") == "bf16"
    assert step_math("32", "cuda", tf32=True) == "tf32" and step_math("32", "cuda", tf32=False) == "fp32"
    assert step_math("32", "cpu") == "fp32"
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert datasheet_peak("NVIDIA H100 PCIe", "tf32") == 378.0e12
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    # fp32 with TF32 on a GPU preset: the TF32 peak, not the plain fp32 one MFU could pass 100% against
    assert peak_flops_per_device("32", torch.device("cuda"), 989e12, 67e12, 494.7e12, tf32=True) == 494.7e12
    local = compose(["cluster=local_cpu"]).cluster
    assert peak_source("bf16", "NVIDIA H100 80GB HBM3", local) is None  # the default cluster on an H100
    line = peak_source("bf16", "NVIDIA RTX 9999", local)
    assert "'NVIDIA RTX 9999'" in line and "cluster.peak_flops_bf16=" in line and "\n" not in line


def test_bf16_on_a_cpu_without_native_kernels_is_named_in_one_line(monkeypatch):
    from disttrain_core.train.perf import cpu_bf16_line

    assert cpu_bf16_line("32") is None
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert cpu_bf16_line("bf16-mixed") is None
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    line = cpu_bf16_line("bf16-mixed")
    assert "trainer.precision=bf16-mixed" in line and "trainer.precision=32" in line and "\n" not in line


def test_measured_links_replace_the_presets_only_where_they_are_the_clusters():
    from disttrain_core.planner import with_measured_links
    from disttrain_core.planner.costs import Hardware
    from disttrain_core.planner.profiler import Profile

    h100 = Hardware.from_config(compose(["cluster=h100_80g"]).cluster, "bf16-mixed")
    loopback = Profile(key="k", world=2, threads=1, precision="32", allreduce_bw=2e9, p2p_bw=1e9, latency_s=1e-4)
    assert with_measured_links(h100, loopback, "cuda", 16) == h100  # CPU tensors over gloo: not NVLink
    nccl = Profile(**{**loopback.__dict__, "link_backend": "nccl", "allreduce_bw": 400e9})
    measured = with_measured_links(h100, nccl, "cuda", 16)
    assert measured.intra_bw == 400e9 and measured.inter_bw == h100.inter_bw and measured.latency_s == h100.latency_s
    cpu = Hardware.from_config(compose(["cluster=local_cpu"]).cluster, "32", peak_flops=1e11)
    assert with_measured_links(cpu, loopback, "cpu", 2).intra_bw == 2e9  # loopback is the CPU cluster's link


def test_the_host_sync_checker_flags_an_index_kept_on_the_host():
    from disttrain_core.train.host_sync import HostSyncError, HostSyncGuard

    guard = HostSyncGuard("error", torch.device("cpu"))
    weights = torch.empty(8, 4, device=META)
    with pytest.raises(HostSyncError, match="takes a host tensor with meta tensors"):
        with guard.check(True):
            weights.index_select(0, torch.tensor([1, 2]))
    with guard.check(True):  # the index on the parameters' device, and a 0-d host scalar: nothing to flag
        weights.index_select(0, torch.tensor([1, 2], device=META)) * torch.tensor(2.0)


def test_logged_counts_wait_for_their_reduction_on_ranks_that_compute_no_loss():
    from disttrain_core.train.engine import GlobalCounts

    class Work:
        waited = 0

        def wait(self):
            Work.waited += 1

    counts = GlobalCounts(torch.ones(4), Work())
    assert counts.reduced() is counts.values and Work.waited == 1
    counts.reduced()
    assert Work.waited == 1  # once


def test_weights_drawn_on_the_device_are_the_same_for_every_shard():
    """The CUDA materialization path (per-block device generators, forced here on the CPU): any shard of a
    tensor holds the values the whole tensor has there, so every layout starts from the same weights."""
    from disttrain_core.models import common

    shape = torch.Size([37, 24])
    whole = torch.empty(shape)
    previous, common.DEVICE_BLOCK_VALUES = common.DEVICE_BLOCK_VALUES, 100  # several blocks
    try:
        common._seeded_normal_into(whole, shape, (0, 0), 0.02, 7, on_device=True)
        shard = torch.empty(13, 8)
        common._seeded_normal_into(shard, shape, (10, 16), 0.02, 7, on_device=True)
    finally:
        common.DEVICE_BLOCK_VALUES = previous
    assert torch.equal(shard, whole[10:23, 16:24]) and 0.015 < whole.std().item() < 0.025


def test_cuda_launch_variables_are_named_for_the_launcher_to_set_before_any_context():
    from disttrain_core.launch.worker import cuda_environment

    cfg = typed_config(compose(["parallel.comm.tp_overlap=true", "trainer.deterministic=true"]))
    env = cuda_environment(cfg, "cuda")
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert cuda_environment(cfg, "cpu") == {}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer.accelerator=cuda", "trainer.threads_per_rank=1", "trainer.straggler.ranks=[0]"],
            "on CUDA it would delay the launches, not the device",
        ),
    ],
)
def test_gpu_settings_that_would_be_ignored_fail_in_one_line(overrides, message, tmp_path):
    result = run_train([*overrides, f"hydra.run.dir={tmp_path}"], timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr[-2000:]
