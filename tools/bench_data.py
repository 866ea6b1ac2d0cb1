"""The data producer at scale: what each trainer rank receives per step (docs/DATA.md, docs/performance/data.md).

(a) Measured on loopback: one producer (the process ``train.py`` starts: ``workers`` decode workers, the embedded
LAION-like data, mllm_tiny's samples with rows of ``seq_len`` tokens and images of ``image_size`` px) serving ``dp x
pp`` trainer ranks -- threads of this process, each a real ``ProducerLoader`` on its own TCP connection -- laid out
as an LLM unit of ``dp`` replicas and ``pp`` stages with the encoder in its first stage and the generator in its
last (parallel/stages.py: the first stage reads token ids and images, the last labels, token ids and generation
targets, the ones between nothing). Every rank checks what it got: its rows' keys are its replica's block of each
slot, and the first stages' blocks, replica after replica, are the same global batch, sample for sample, as a whole-
batch run's. For ``data.producer.per_rank`` true and false: bytes per rank per step (mean and max over ranks;
against the rank's own samples' tensor bytes), steps/s and samples/s delivered to the ranks, and the producer
process's peak resident memory.

(c) A pool of producers (``data.producer.count``): 1, 2 and 4 producer processes serving ``pool_dp`` replicas, each
producer planning every sample and decoding its share. Decoding is made to cost ``decode_ms`` a sample by a sleep
(this machine has 2 cores: a sleep is what 4 producers on 4 hosts would do in parallel, whatever the cores here),
so samples/s measures how the pool divides the decoding, and what planning every sample in every producer costs
on top. The replicas check that every pool size delivers the same batches.

(b) Predicted for the paper's scale: the planner's layout for mllm72b on 1,172 H100s with the OBELICS workload
preset (planner/presets.py: 2.5 images of 448 px per sample), each rank receiving its block's fields (the same
rule as (a)) against every rank receiving the whole global batch; no network is simulated, bytes only.

    python tools/bench_data.py                                    # about a minute here
    python tools/bench_data.py ranks=8,32 dp=4,8 steps=2 predict=false format=json
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from disttrain_core.config import REPO_ROOT
from disttrain_core.launch.cli import tool_main, tool_options

OPTIONS = {
    "ranks": "8,64,256",  # trainer ranks (threads), each configuration ...
    "dp": "4,16,64",  # ... with this many data-parallel replicas (ranks / dp pipeline stages each)
    "micro": "1",  # samples per replica per slot
    "slots": "2",  # microbatch slots per step
    "steps": "3",
    "workers": "1",  # the producer's decode workers
    "seq_len": "2048",  # mllm_tiny's rows and images, enlarged towards a real sample (256 and 32 px by default)
    "image_size": "64",
    "producers": "1,2,4",  # (c) pool sizes, each producer decoding at decode_ms a sample (a sleep) ...
    "pool_dp": "8",  # ... for this many replicas (one rank each) of pool_micro samples per slot
    "pool_micro": "2",
    "pool_steps": "4",
    "decode_ms": "20",
    "predict": "true",
    "format": "table",
    "out": str(REPO_ROOT / "docs" / "results" / "bench_data.json"),
}


def stage_fields(stage: int, stages: int) -> tuple[str, ...]:
    """What a rank of an LLM unit (encoder in its first stage, generator in its last) reads: the runtime's rule."""
    from disttrain_core.parallel.stages import llm_stage_fields

    return llm_stage_fields(stage == 0, stage == stages - 1, encoder=True, generator=True, sends_queries=False)


def _shards() -> Path:
    from disttrain_core.config import SyntheticDataConfig
    from disttrain_core.data.synthetic import generate_shards

    out = REPO_ROOT / "outputs" / "bench_data" / "shards"
    if not any(out.glob("*.tar")):
        generate_shards(SyntheticDataConfig(num_shards=4, samples_per_shard=256, image_side_max=256), out, 1)
    return out


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(dp: int, pp: int, options: dict, per_rank: bool) -> dict:
    """One producer, ``dp * pp`` ranks on loopback, ``steps`` steps."""
    from omegaconf import OmegaConf

    from disttrain_core.config import compose
    from disttrain_core.data.producer import (
        Layout,
        ProducerLoader,
        job_identity,
        start_local_producer,
        stop_local_producer,
    )
    from disttrain_core.data.transport import load_key, new_key

    micro, slots, steps = int(options["micro"]), int(options["slots"]), int(options["steps"])
    cfg = compose(
        [
            f"data.path={_shards()}",
            "data.generate_if_missing=false",
            f"data.producer.workers={options['workers']}",
            f"paths.output_dir={REPO_ROOT / 'outputs' / 'bench_data'}",
            f"model.seq_len={options['seq_len']}",
            f"model.encoder.image_size={options['image_size']}",
        ]
    )
    key = new_key()
    process, address = start_local_producer(cfg, OmegaConf.to_container(cfg, resolve=True), key)
    per = dp * micro
    layout = Layout(slots, per, dp, pp, dp * pp, tuple(sorted(job_identity(cfg).items())))
    ranks = [(replica, stage) for replica in range(dp) for stage in range(pp)]
    received = [[0] * steps for _ in ranks]
    own = [[0] * steps for _ in ranks]
    keys: list[list[list[str]]] = [[[] for _ in range(steps)] for _ in ranks]
    errors: list[str] = []

    def rank(index: int, replica: int, stage: int) -> None:
        try:
            block = range(replica * micro, (replica + 1) * micro)
            want = {"block": block, "fields": stage_fields(stage, pp)} if per_rank else {}
            loader = ProducerLoader(address, load_key(key), layout, {}, 120.0, 1 << 30, **want)
            wanted = stage_fields(stage, pp)  # what the rank reads
            for step in range(steps):
                got = loader.next_step()
                if not per_rank:
                    got = [slot.select(block) for slot in got]
                received[index][step] = loader.bytes_received
                own[index][step] = sum(
                    getattr(s, f).numel() * getattr(s, f).element_size() for s in got for f in wanted
                )
                keys[index][step] = [k for s in got for k in s.keys]
            loader.close()
        except Exception as error:  # reported, not raised in a thread
            errors.append(f"rank {index}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=rank, args=(i, r, s)) for i, (r, s) in enumerate(ranks)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    peak = _peak_rss_mb(process.pid)
    stop_local_producer(process)
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    first = [i for i, (_, s) in enumerate(ranks) if s == 0]
    batches = []
    for step in range(steps):  # replica blocks of each slot, slot after slot: the global batch
        per_replica = [keys[i][step] for i in first]
        batch = [per_replica[r][k * micro + j] for k in range(slots) for r in range(dp) for j in range(micro)]
        if len(set(batch)) != slots * per:
            raise RuntimeError(f"step {step + 1}: the ranks' blocks repeat or miss samples")
        for i, (replica, _) in enumerate(ranks):  # every stage of a replica has the replica's rows
            if keys[i][step] != per_replica[replica]:
                raise RuntimeError(f"step {step + 1}: rank {i} got other samples than its replica's first stage")
        batches.append(batch)
    flat = [b for row in received for b in row[1:]] or [b for row in received for b in row]  # step 1 warms up
    samples = steps * slots * per
    return {
        "ranks": dp * pp,
        "dp": dp,
        "pp": pp,
        "per_rank": per_rank,
        "global_batch": slots * per,
        "bytes_per_rank_per_step_mean": sum(flat) / len(flat),
        "bytes_per_rank_per_step_max": max(flat),
        "own_bytes_per_rank_per_step_mean": sum(sum(r) for r in own) / (len(own) * steps),
        "bytes_per_step_all_ranks": sum(sum(r) for r in received) / steps,
        "first_stage_bytes_over_own": max(received[i][s] / max(1, own[i][s]) for i in first for s in range(steps)),
        "steps_per_s": steps / seconds,
        "samples_per_s": samples / seconds,
        "producer_peak_rss_mb": peak,
        "batches": batches,
    }


def _slow_producer(container: dict, key: str, decode_s: float, ready) -> None:
    """A producer process whose decoding costs ``decode_s`` a sample more (a sleep)."""
    from disttrain_core.config import typed_config
    from disttrain_core.data.producer import run_server
    from disttrain_core.data.samples import SampleEncoder
    from disttrain_core.data.transport import load_key

    finish = SampleEncoder.finish

    def slow(self, planned):
        time.sleep(decode_s)
        return finish(self, planned)

    SampleEncoder.finish = slow  # type: ignore[method-assign]
    run_server(typed_config(container), load_key(key), "127.0.0.1:0", ready)


def measure_pool(count: int, options: dict) -> dict:
    """``count`` producers, ``pool_dp`` replicas of one rank each (threads), ``pool_steps`` steps; the first is
    left out of the rate (start-up)."""
    import multiprocessing as mp

    from omegaconf import OmegaConf

    from disttrain_core.config import compose
    from disttrain_core.data.producer import Layout, job_identity
    from disttrain_core.data.producer_client import ProducerPool, pool_connections
    from disttrain_core.data.transport import load_key, new_key

    dp, micro, steps = int(options["pool_dp"]), int(options["pool_micro"]), int(options["pool_steps"])
    cfg = compose(
        [
            f"data.path={_shards()}",
            "data.generate_if_missing=false",
            "data.producer.workers=0",
            f"paths.output_dir={REPO_ROOT / 'outputs' / 'bench_data'}",
        ]
    )
    container, key = OmegaConf.to_container(cfg, resolve=True), new_key()
    ctx = mp.get_context("spawn")
    ready = ctx.SimpleQueue()
    processes = [
        ctx.Process(target=_slow_producer, args=(container, key, float(options["decode_ms"]) / 1e3, ready))
        for _ in range(count)
    ]
    for process in processes:
        process.start()
    try:
        addresses = [ready.get() for _ in processes]
        layout = Layout(2, dp * micro, dp, 1, dp, tuple(sorted(job_identity(cfg).items())))
        blocks = [range(r * micro, (r + 1) * micro) for r in range(dp)]
        keys: list[list[list[str]]] = [[] for _ in blocks]
        times: list[float] = []

        def rank(r: int) -> None:
            conns = pool_connections(count, layout, blocks[r], [(b, 1) for b in blocks])
            loader = ProducerPool(addresses, load_key(key), layout, {}, 120.0, 1 << 30, conns)
            for _ in range(steps):
                keys[r].append([k for slot in loader.next_step() for k in slot.keys])
                if r == 0:
                    times.append(time.perf_counter())
            loader.close()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(dp)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        peak = max(_peak_rss_mb(p.pid) for p in processes)
    finally:
        for process in processes:
            process.kill()
            process.join()
    if any(len(k) != steps for k in keys):
        raise RuntimeError(f"{count} producers: a replica did not receive every step")
    seconds = times[-1] - times[0]
    return {
        "producers": count,
        "replicas": dp,
        "global_batch": 2 * dp * micro,
        "decode_ms_per_sample": float(options["decode_ms"]),
        "samples_per_s": (steps - 1) * 2 * dp * micro / seconds,
        "producer_peak_rss_mb": peak,
        "batches": [[k[step] for k in keys] for step in range(steps)],
    }


def predict() -> dict:
    """Bytes per rank per step for the planner's 1,172-GPU mllm72b plan on the OBELICS preset."""
    from disttrain_core.config import compose
    from disttrain_core.planner import make_plan
    from disttrain_core.planner.presets import PRESETS
    from disttrain_core.planner.report import plan_dict

    preset = PRESETS["obelics_448"]
    cfg = compose(["model=mllm72b", "cluster=h100_80g", "cluster.num_gpus=1172", *preset.overrides()])
    plan = plan_dict(make_plan(cfg, progress=lambda *_: None, allow_ep=True))
    m = cfg.model
    from disttrain_core.parallel.stages import GeneratorStage, encoder_stage_fields, llm_stage_fields

    size = {  # bytes per sample of each Batch field
        "tokens": m.seq_len * 8,  # int64
        "labels": m.seq_len * 8,
        "images": preset.images_per_sample * preset.tiles * 3 * preset.encoder_px**2,  # uint8 pixels
        "image_counts": 8,
    }
    if m.generator is not None:
        side = m.gen_image_size // m.latent_downsample
        size.update(
            gen_images=3 * m.gen_image_size**2, gen_noise=m.generator.in_channels * side * side * 4, gen_timesteps=8
        )
        size["gen_weight"] = 4
    whole = sum(size.values())
    batch = plan["global_batch"]
    summary = batch * 4 + plan["microbatches"] * 20  # StepSummary: an int32 image count a sample, 20 bytes a slot
    units, roles = plan["units"], []
    separate = {name for name, u in units.items() if not u.get("colocated")}
    generator = m.generator is not None
    for name in separate:
        u = units[name]
        dp, pp, tp, cp = u["dp"], u["pp"], u["tp"], u.get("cp", 1)
        for stage in range(pp):  # the runtime's rule of which fields each stage reads (parallel/stages.py)
            if name == "encoder":
                fields = encoder_stage_fields(stage == 0)
            elif name == "generator":
                fields = GeneratorStage.batch_fields
            else:
                first, last = stage == 0, stage == pp - 1
                holds_generator = generator and "generator" not in separate
                fields = llm_stage_fields(
                    first,
                    last,
                    m.encoder is not None and "encoder" not in separate,
                    holds_generator,
                    generator and not holds_generator,
                )
            per_rank = batch / dp * sum(size[f] for f in fields) + summary
            roles.append({"unit": name, "stage": stage, "ranks": dp * tp * cp, "bytes_per_rank": per_rank})
    ranks = sum(r["ranks"] for r in roles)
    total = sum(r["ranks"] * r["bytes_per_rank"] for r in roles)
    return {
        "model": "mllm72b",
        "preset": preset.name,
        "gpus": plan["gpus_used"],
        "global_batch": batch,
        "units": {k: {f: v[f] for f in ("dp", "tp", "pp") if f in v} for k, v in units.items()},
        "bytes_per_sample_whole": whole,
        "whole_batch_bytes_per_rank": batch * whole,
        "whole_batch_bytes_per_step": ranks * batch * whole,
        "per_rank_roles": roles,
        "per_rank_bytes_per_step": total,
        "per_rank_max_bytes_per_rank": max(r["bytes_per_rank"] for r in roles),
        "reduction": ranks * batch * whole / total,
    }


def main(argv: list[str]) -> int:
    options = tool_options(argv, OPTIONS)
    ranks = [int(r) for r in options["ranks"].split(",")]
    dps = [int(d) for d in options["dp"].split(",")]
    if len(ranks) != len(dps) or any(r % d for r, d in zip(ranks, dps, strict=True)):
        from disttrain_core.validation import ConfigError

        raise ConfigError(f"ranks={options['ranks']} dp={options['dp']}: give as many of each, each dp dividing ranks")
    measured = []
    for count, dp in zip(ranks, dps, strict=True):
        pair = [measure(dp, count // dp, options, per_rank) for per_rank in (True, False)]
        if pair[0].pop("batches") != pair[1].pop("batches"):
            raise RuntimeError(f"{count} ranks: per-rank delivery served other samples than the whole batches")
        measured += pair
        shares, whole = pair[0]["bytes_per_rank_per_step_mean"], pair[1]["bytes_per_rank_per_step_mean"]
        print(
            f"{count} ranks (dp {dp} x pp {count // dp}): per rank {shares / 1e3:,.1f} kB against "
            f"{whole / 1e3:,.1f} kB whole "
            f"({pair[1]['bytes_per_step_all_ranks'] / pair[0]['bytes_per_step_all_ranks']:.1f}x less in all); "
            f"{pair[0]['samples_per_s']:,.0f} against {pair[1]['samples_per_s']:,.0f} samples/s",
            file=sys.stderr,
        )
    pool = [measure_pool(int(count), options) for count in options["producers"].split(",") if count]
    if any(run.pop("batches") != pool[0]["batches"] for run in pool[1:]):
        raise RuntimeError("pools of different sizes delivered different batches")
    if pool:
        pool[0].pop("batches")
    for run in pool:
        run["speedup"] = run["samples_per_s"] / pool[0]["samples_per_s"]
        print(
            f"{run['producers']} producer(s), decoding {run['decode_ms_per_sample']:.0f} ms a sample: "
            f"{run['samples_per_s']:,.0f} samples/s ({run['speedup']:.2f}x one producer)",
            file=sys.stderr,
        )
    result = {"options": options, "measured": measured, "pool": pool}
    if options["predict"] == "true":
        result["predicted"] = predict()
    out = Path(options["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if options["format"] == "json":
        print(json.dumps(result, indent=1))
    elif "predicted" in result:
        p = result["predicted"]
        print(
            f"predicted, {p['model']} on {p['gpus']} GPUs ({p['preset']}, global batch {p['global_batch']}): "
            f"{p['whole_batch_bytes_per_rank'] / 1e9:,.2f} GB per rank per step whole, at most "
            f"{p['per_rank_max_bytes_per_rank'] / 1e6:,.1f} MB per rank on shares; "
            f"{p['whole_batch_bytes_per_step'] / 1e12:,.2f} TB against {p['per_rank_bytes_per_step'] / 1e9:,.2f} GB "
            f"per step in all ({p['reduction']:,.0f}x less)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(tool_main(main, sys.argv[1:]))
