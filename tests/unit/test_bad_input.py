"""Bad input: each mistake gives one actionable line before any process starts."""

import pytest

from disttrain_core.launch.cli import PreflightError, check_overrides

from ..conftest import base_overrides, run_train

CASES = [
    # (overrides, text the single error line must contain)
    (["model=foo"], "model=foo is not a known model option"),
    (["recipe=nope"], "recipe=nope is not a known recipe"),
    (["optim.lr=-1"], "optim.lr=-1"),
    (["optim.lr=abc"], "optim.lr=abc"),
    (["trainer.max_stepz=5"], "'max_stepz' is not a key of trainer"),
    (["trainer.devices=1000"], "trainer.devices=1000"),
    (["trainer.cpu_processes_per_core=0"], "trainer.cpu_processes_per_core=0 must be at least 1"),
    (["trainer.accelerator=cuda"], "no CUDA device"),
    (["optim.global_batch_size=10", "optim.micro_batch_size=4"], "optim.global_batch_size=10 is not divisible"),
    (["data.path=/nonexistent/shards"], "data.path='/nonexistent/shards': no .tar shards found"),
    (["data=webdataset", "data.path=???"], "data.path is required"),
    (["trainer.precision=16"], "trainer.precision='16'"),
    (["model.llm.n_heads=5"], "not divisible by model.llm.n_heads=5"),
    (["model.llm.n_kv_heads=3"], "model.llm.n_kv_heads=3"),
    (["trainer.backend=nccl"], "trainer.backend=nccl needs CUDA"),
    (["model.encoder.image_size=30"], "model.encoder.image_size=30"),
    (["model/encoder=vit_huge"], "model/encoder=vit_huge is not a known model/encoder option (conf/model/encoder"),
    (["model/generator=null"], "model/generator=null: drop a module with ~model/generator"),
    (["data=synthetic_any2any"], "audio_fraction=0.5 draws audio clips, but model mllm_tiny has no audio tower"),
    (["parallel=disagg2", "parallel.units.encoder.dp=0"], "parallel.units.encoder: dp=0 tp=1 pp=1 vpp=1; each must be"),
    (["model=llama_tiny", "model/encoder=vit_tiny"], "add model.family=mllm to train one"),
    (["~model/encoder"], "model.family=mllm needs an encoder; choose one (model/encoder=vit_tiny"),
    (["trainer.resume=/no/such/run"], "trainer.resume='/no/such/run'"),
    (["optim.betas=[0.9,1.5]"], "optim.betas"),
    (["trainer.num_nodes=2"], "MASTER_ADDR"),
    (["trainer.devices=8"], "4 shard(s) for 8 data-parallel ranks"),
    (["hparams_search=nope"], "hparams_search=nope"),
    (["optim.lr=1e-3,3e-4"], "Ambiguous value"),
    (["model.seq_len=16"], "model.seq_len=16 cannot hold one image"),
    (["model.loss_chunk=-1"], "model.loss_chunk=-1: use 0 (the head's logits whole) or a number of positions"),
    (["model.document_attention=sparse"], "model.document_attention='sparse': allowed values are auto, dense, varlen"),
    (["model.document_attention=flex"], "model.document_attention=flex trains on CUDA only (torch"),
    (["model.float8=tensorwise"], "model.float8=tensorwise runs FP8 matmuls on NVIDIA GPUs with FP8 tensor cores"),
    (["model.float8=fp4"], "model.float8='fp4': allowed values are none, tensorwise, rowwise"),
    (
        ["model=llama_tiny", "parallel=megatron_tp2", "trainer.devices=2", "schedule=none"]
        + ["parallel.comm.tp_overlap=true", "parallel.sequence_parallel=false"],
        "parallel.comm.tp_overlap=true chunks sequence parallelism, which parallel.sequence_parallel=false turns off",
    ),
    (["parallel.sequence_parallel=maybe"], "parallel.sequence_parallel"),
    (
        ["model=llama_tiny", "parallel=megatron_tp2", "trainer.devices=2", "schedule=none", "trainer.compile=true"]
        + ["parallel.comm.tp_overlap=true"],
        "trainer.compile=true with parallel.comm.tp_overlap=true is not built",
    ),
    (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps=0"),
    (["trainer.val_every_n_steps=-1"], "trainer.val_every_n_steps=-1: use 0 (no validation) or a number of steps"),
    (["trainer.val_batches=0"], "trainer.val_batches=0: evaluate at least 1 global batch"),
    (
        ["trainer.val_every_n_steps=5", "data.val.path=null"],
        "trainer.val_every_n_steps=5 evaluates on held-out data, and data.val names none: set data.val.path",
    ),
    (["trainer.checkpoint.keep_best=true"], "trainer.checkpoint.keep_best=true keeps the checkpoint of the lowest"),
    (["trainer.eval_only=true"], "trainer.eval_only=true evaluates a checkpoint: set trainer.resume="),
    # samples and trackers (issue 40)
    (["logger=[tensorboard,foo]"], "logger=foo is not a known logger option"),
    (
        ["model=llama_tiny", "trainer.samples.images=true"],
        "trainer.samples.images=true: model llama_tiny has no generator to sample images from",
    ),
    (
        ["trainer.sample_every_n_steps=5", "parallel=pp2", "schedule=1f1b", "trainer.devices=2"],
        "trainer.sample_every_n_steps=5: this layout spreads the model over the ranks, so rank 0 samples from the "
        "checkpoint saved at each sampling step; set trainer.checkpoint.every_n_steps=5",
    ),
    (["trainer.samples.top_p=0"], "trainer.samples.top_p=0.0: use a value in (0, 1]"),
    (["trainer.samples.steps=5000"], "trainer.samples.steps=5000: the generator's schedule has 1000 timesteps"),
    (["trainer.samples.sampler=euler"], "trainer.samples.sampler='euler': allowed values are ddim, ddpm"),
    (["logger.wandb_mode=cloud"], "logger.wandb_mode='cloud': allowed values are offline, online"),
    (["-m", "optim.lr=1e-3,-1"], "optim.lr=-1"),
    (["model.llm.vocab_size=100"], "model.llm.vocab_size=100 is smaller"),
    # pipeline layouts and schedules
    (["schedule=1f1b"], "schedule=1f1b needs pipeline stages"),
    (["schedule=pipedream"], "schedule=pipedream is not a known schedule option"),
    (
        ["parallel.mode=megatron", "parallel.pp=3"],
        "encoder dp(1) x tp(1) x pp(1) + llm dp(1) x tp(1) x pp(3) + generator dp(1) x tp(1) x pp(1) = 5 processes "
        "but trainer.devices(1)",
    ),
    (
        ["parallel=pp2", "trainer.devices=2", "schedule=interleaved_1f1b", "schedule.vpp=3"],
        "model.llm.n_layers=4 cannot be split into pipeline size (2) x stages per rank (3)",
    ),
    (
        ["parallel=pp2", "trainer.devices=2", "schedule=interleaved_1f1b", "optim.micro_batch_size=16"],
        "needs the microbatches per step (1) to be a multiple of the pipeline size (2)",
    ),
    (
        ["parallel=pp2", "trainer.devices=2", "schedule=1f1b", "schedule.microbatches=7"],
        "schedule.microbatches=7 disagrees",
    ),
    (["parallel=pp2", "trainer.devices=2", "schedule=zbv", "schedule.vpp=1"], "places 2 stage(s) per rank"),
    (  # found by the slow fuzz: the pipeline check's routing would have listed every sample
        ["parallel=disagg2", "optim.micro_batch_size=2000000", "optim.global_batch_size=2000000"],
        "optim.micro_batch_size=2000000 x llm dp(1) = 2000000 samples per microbatch",
    ),
    (
        ["parallel=pp2", "trainer.devices=2", "schedule=zb_h2", "optim.micro_batch_size=8"],
        "schedule=zb_h2: zb_h2 needs at least 2 x pp - 1 = 3 microbatches per step to fill its warm-up, got 2",
    ),
    (
        ["parallel=pp2", "trainer.devices=2", "schedule=dualpipev", "optim.micro_batch_size=8"],
        "schedule=dualpipev: dualpipev needs at least 2 x pp = 4 microbatches per step, got 2",
    ),
    (
        ["parallel=pp2", "trainer.devices=2", "schedule=breadth_first", "optim.micro_batch_size=16"],
        "breadth_first needs at least pp (2) microbatches per step to fill the loop, got 1",
    ),
    (
        ["parallel=pp2", "trainer.devices=2", "schedule=breadth_first", "schedule.vpp=1"],
        "schedule.vpp=1: breadth_first needs at least 2 virtual stages per rank",
    ),
    # overlapped communication
    (["parallel.comm.bucket_mb=-1"], "parallel.comm.bucket_mb=-1.0"),
    (["parallel.comm.collectives=mpi"], "parallel.comm.collectives='mpi'"),
    # settings that cannot work on the accelerator the run will use (checked before any device is touched)
    (["trainer.accelerator=cuda", "parallel.comm.collectives=ring"], "parallel.comm.collectives=ring drives gloo"),
    (["trainer.backend=nccl", "parallel.comm.collectives=ring"], "use parallel.comm.collectives=auto (or native)"),
    (["trainer.deterministic=maybe"], "trainer.deterministic='maybe': allowed values are auto, true, false and warn"),
    (["trainer.sync_debug=loud"], "trainer.sync_debug='loud': allowed values are off, warn, error"),
    (["parallel.comm.wire_dtype=fp8"], "parallel.comm.wire_dtype='fp8': allowed values are auto, fp32 and bf16"),
    (["parallel=zero1", "parallel.comm.interleave_modes=[overlap,fast]"], "unknown mode(s) ['fast']"),
    (["parallel.comm.interleave_modes=[overlap]"], "this layout trains with DDP"),
    (
        [
            "parallel=pp2",
            "parallel.pp=1",
            "parallel.tp=2",
            "trainer.devices=2",
            "parallel.comm.tp_overlap=true",
            "model.seq_len=255",
        ],
        "tp=2 does not divide model.seq_len=255",
    ),
    # activation recompute
    (["parallel.recompute=sometimes"], "parallel.recompute='sometimes': allowed values are none, full, selective_op"),
    (["parallel.recompute=every_k", "parallel.recompute_every=0"], "parallel.recompute_every=0: use 1 or more"),
    (["parallel=disagg2", "parallel.recompute=full"], "set parallel.units.<encoder|llm|generator>.recompute"),
    (["parallel=disagg2", "parallel.units.generator.recompute=full"], "the generator is colocated with the LLM"),
    (["planner.recompute=selective"], "planner.recompute='selective': allowed values are auto, none, full"),
    # model-state sharding
    (["trainer.memory_report_step=400"], "trainer.memory_report_step=400: use 0 (off) or a step from 1"),
    (["parallel.shard=zero4"], "parallel.shard='zero4': allowed values are none, zero1, zero2, zero3"),
    (["parallel=disagg2", "parallel.units.llm.shard=fsdp"], "parallel.units.llm.shard='fsdp': allowed values"),
    (["parallel=zero1", "parallel.shard=zero3"], "parallel.zero1=true is an alias of parallel.shard=zero1"),
    (["parallel=disagg2", "parallel.shard=zero3"], "set parallel.units.<encoder|llm|generator>.shard"),
    (["parallel=disagg2", "parallel.units.generator.shard=zero3"], "the generator is colocated with the LLM"),
    (["parallel.shard=zero3"], "(and context-parallel) ranks and this unit has 1 per shard group"),
    (
        ["parallel.shard=zero3", "trainer.devices=4", "parallel.hsdp_replicas=3"],
        "hsdp_replicas=3 does not divide the unit's dp=4",
    ),
    (
        ["parallel.shard=zero1", "trainer.devices=2", "parallel.hsdp_replicas=2"],
        "hsdp_replicas=2 needs parallel.shard=zero2",
    ),
    (
        ["parallel=pp2", "parallel.shard=zero3", "schedule=zbv", "trainer.devices=4", "model=llama_tiny"],
        "schedule=zbv runs weight gradients outside FSDP2's backward hooks",
    ),
    (["parallel=megatron_pp2", "parallel.shard=none"], "megatron layouts shard at least zero1"),
    # disaggregated units
    (["parallel=disagg4_enc2", "trainer.devices=3"], "= 4 processes but trainer.devices(3)"),
    (
        ["parallel=disagg4_tp2", "model.llm.n_heads=3", "model.llm.dim=96", "model.llm.n_kv_heads=1"],
        "parallel llm unit: tp=2 does not divide model.llm.n_heads=3",
    ),
    (["parallel=disagg4_tp2", "model.llm.ffn_dim=351"], "tp=2 does not divide model.llm.ffn_dim=351"),
    (
        ["parallel=disagg4_tp2", "model.llm.vocab_size=385"],
        "pad it: model.llm.vocab_size=386",
    ),
    (
        ["parallel=disagg6_enc2_llm3", "optim.micro_batch_size=1", "optim.global_batch_size=3"],
        "which the encoder unit's dp(2) cannot share evenly",
    ),
    (
        ["parallel=disagg4_pp2", "schedule=interleaved_1f1b", "schedule.vpp=1"],
        "interleaved_1f1b needs at least 2 virtual stages",
    ),
    (["parallel=disagg4_pp2", "schedule=zbv", "schedule.vpp=2"], "which a pipeline across units does not support"),
    (
        ["parallel=disagg4_pp2", "schedule=dualpipev", "schedule.vpp=2"],
        "schedule=dualpipev places two stages per rank in a V by rank, which a pipeline across units does not",
    ),
    (
        ["parallel=disagg4_pp2", "parallel.units.llm.vpp=2"],
        "parallel.units.llm.vpp=2: virtual LLM stages run under schedule=interleaved_1f1b with as many per rank",
    ),
    (
        ["parallel=disagg4_pp2", "parallel.units.llm.vpp=3", "schedule=interleaved_1f1b", "schedule.vpp=3"],
        "cannot be split into the LLM's pipeline size (2) x virtual stages (3) = 6 equal stages",
    ),
    (["parallel.mode=bogus"], "parallel.mode='bogus': allowed values are ddp, megatron, manual"),
    (
        ["parallel=disagg4_pp2", "parallel.units.encoder.pp=3", "trainer.devices=6"],
        "parallel encoder unit: pp=3 does not divide model.encoder.n_layers=2",
    ),
    # bounds of single settings (validation/numbers.py), checked before anything divides by them
    (["model.llm.n_heads=0"], "model.llm.n_heads=0: use 1 or more"),
    (["model.llm.norm_eps=0"], "model.llm.norm_eps=0.0: use a small positive number"),
    (["model.llm.rope_theta=-1"], "model.llm.rope_theta=-1.0: use a positive base"),
    (["model.encoder.patch_size=0"], "model.encoder.patch_size=0: use 1 or more"),
    (["model.encoder.output_dim=-1"], "model.encoder.output_dim=-1: use 0 (no output projection) or more"),
    (["model.generator.norm_groups=0"], "model.generator.norm_groups=0: use 1 or more groups that divide"),
    (["model.generator.block_out_channels=[]"], "model.generator.block_out_channels=[]: give one positive"),
    (["model.generator.attention_heads=[0,4]"], "model.generator.attention_heads=[0, 4]: give one positive"),
    (["model.generator.beta_end=1.0"], "model.generator.beta_end=1.0: use a value in (0, 1)"),
    (["model.generator.beta_start=0.5"], "model.generator.beta_start=0.5 is above beta_end=0.012"),
    (["model.latent_downsample=0"], "model.latent_downsample=0: use 1 or more pixels per latent cell"),
    (["model.gen_loss_weight=-1"], "model.gen_loss_weight=-1.0: use 0 (no generation loss) or a positive weight"),
    (["model.reference_micro_batch=0"], "model.reference_micro_batch=0: use 1 or more"),
    (["model.encoder_projector.hidden_dim=-1"], "model.encoder_projector.hidden_dim=-1: use 0"),
    (["optim.eps=0"], "optim.eps=0.0: use a small positive number, e.g. 1e-8"),
    (["optim.lr=nan"], "optim.lr=nan: the learning rate must be positive and finite"),
    (["optim.lr=inf"], "optim.lr=inf: the learning rate must be positive and finite"),
    (["optim.decay_steps=0"], "optim.decay_steps=0: use null (decay over trainer.max_steps) or 1 or more steps"),
    (["optim.min_lr_ratio=1.5"], "optim.min_lr_ratio=1.5: use a value in [0, 1]"),
    (["optim.name=lamb"], "optim.name='lamb': the available optimizers are 'adamw' and 'sgd'"),
    (["trainer.accelerator=tpu"], "trainer.accelerator='tpu': allowed values are auto, cpu, cuda"),
    (["trainer.dist_timeout_s=0"], "trainer.dist_timeout_s=0: use a positive number of seconds"),
    (["trainer.seed=-1"], "trainer.seed=-1: use a value in [0, 4294967295]"),
    (["trainer.checkpoint.keep_last=0"], "trainer.checkpoint.keep_last=0: keep at least 1"),
    (["trainer.checkpoint.every_n_steps=-5"], "trainer.checkpoint.every_n_steps=-5: use 0 (off) or more"),
    (["trainer.exit_after_step=0"], "trainer.exit_after_step=0: use null or a step >= 1"),
    (["trainer.stop_grace_s=0"], "trainer.stop_grace_s=0.0: use a positive number of seconds"),
    (["trainer.max_restarts=-1"], "trainer.max_restarts=-1: use 0 (no restarts) or more"),
    (["data.producer.max_frame_mb=0"], "data.producer.max_frame_mb=0: use "),
    (["data.synthetic.num_shards=0"], "data.synthetic.num_shards=0: use 1 or more"),
    (["data.synthetic.text_only_fraction=1.5"], "data.synthetic.text_only_fraction=1.5: use a value in [0, 1]"),
    (["data.synthetic.images_geometric_p=0"], "data.synthetic.images_geometric_p=0.0: use a value in (0, 1]"),
    (["data.synthetic.caption_words_log_mean=50"], "data.synthetic.caption_words_log_mean=50.0: use a value in"),
    (["data.synthetic.image_side_max=8"], "data.synthetic.image_side_max=8: use 16 pixels or more"),
    (["schedule.microbatches=0"], "schedule.microbatches=0: use null (derived from the batch sizes) or 1 or more"),
    (["schedule.vpp=0"], "schedule.vpp=0: use 1 or more"),
    (["cluster.device=tpu"], "cluster.device='tpu': allowed values are cpu, cuda"),
    (["cluster.num_gpus=0"], "cluster.num_gpus=0: use 1 or more"),
    (["cluster.memory_per_device_gb=0"], "cluster.memory_per_device_gb=0.0: use a positive size"),
    (["cluster.intra_node_bandwidth_gbps=0"], "cluster.intra_node_bandwidth_gbps=0.0: use a positive bandwidth"),
    (["cluster.latency_us=-1"], "cluster.latency_us=-1.0: use 0 or more microseconds"),
    (["cluster.compute_efficiency=1.5"], "cluster.compute_efficiency=1.5: use a value in (0, 1]"),
    (["cluster.runtime_overhead_gb=100"], "cluster.runtime_overhead_gb=100.0 leaves no memory"),
    (["planner.solver=greedy"], "planner.solver='greedy': allowed values are algorithm1, exhaustive"),
    (["planner.precision=fp8"], "planner.precision='fp8': allowed values are auto, '32' and 'bf16-mixed'"),
    (["planner.cost=guess"], "planner.cost='guess': allowed values are auto, profiled, analytic"),
    (["planner.tp_options=[]"], "planner.tp_options=[]: give one or more tensor-parallel sizes"),
    (["planner.vpp_options=[0]"], "planner.vpp_options=[0]: give one or more virtual stage counts"),
    (["planner.dp_overlap=2"], "planner.dp_overlap=2.0: use a value in [0, 1]"),
    (
        [
            "planner.dp_overlap=0.5",
            "parallel.comm.overlap_grad_reduce=false",
            "parallel.comm.overlap_param_gather=false",
        ],
        "planner.dp_overlap=0.5 assumes overlapped ZeRO traffic",
    ),
    (["planner.memory_margin=0"], "planner.memory_margin=0.0: use a value in (0, 1]"),
    (["planner.profile_repeats=0"], "planner.profile_repeats=0: use 1 or more"),
    # ${...} references that do not resolve, or resolve to the wrong shape
    (["model.llm.dim=${oops}"], "model.llm.dim: Interpolation key 'oops' not found; fix the ${...} reference"),
    (["trainer.devices=${optim.lr}"], "trainer.devices: While dereferencing interpolation '${optim.lr}'"),
    (["model.generator.block_out_channels=${optim.lr}"], "block_out_channels=0.003: a list belongs here"),
    (["model.encoder=${model.generator}"], "model.encoder: a VitConfig belongs here, but its ${...} reference"),
    # data.path: shards that are missing, patterns, and where generate_if_missing may write
    (
        ["data.path='SHARDS/shard-{000000..000005}.tar'"],
        "2 of the 6 shard(s) it names are missing (first: SHARDS/shard-000004.tar); restore them or fix "
        "data.path, or set data.allow_missing_shards=true to train on the 4 that exist",
    ),
    (["data.path='SHARDS/*.tarr'"], "no .tar shards found"),
    (["data.path='SHARDS/shard-{0..99999999999}.tar'"], "the pattern names 100000000000 shard files"),
    (["data.path='SHARDS/shard-{0..3'"], "Unbalanced braces"),
    (
        ["data.generate_if_missing=true", "data.path=SHARDS/../synthetic_laoin"],
        "no .tar shards found there, and data.generate_if_missing=true generates the embedded data only into ",
    ),
    (
        ["parallel=pp2", "trainer.devices=2", "schedule=1f1b", "optim.micro_batch_size=1"]
        + ["optim.global_batch_size=100000"],
        "makes 100000 microbatches per step for 2 pipeline stages (200000 schedule slots",
    ),
    # the generator unit's TP splits the heads of every U-Net transformer (mllm_tiny's level 0: 32 channels)
    (
        ["parallel=disagg4_tp2", "parallel.units.llm.tp=1", "parallel.units.generator.tp=2"]
        + ["model.generator.head_dim=32"],
        "tp=2 does not divide the U-Net's 1 attention head(s) at level 0 (model.generator.block_out_channels[0]=32",
    ),
    (
        ["parallel=disagg4_tp2", "parallel.units.llm.tp=1", "parallel.units.generator.pp=6", "trainer.devices=8"],
        "pp=6; the U-Net splits into pipeline stages at level boundaries and has 5 pieces",
    ),
    # a data-parallel preset with tensor parallelism asked for: refused, not silently ignored
    (["parallel=zero1", "parallel.tp=2", "trainer.devices=2"], "parallel.mode=ddp (parallel=zero1) keeps the whole"),
    # MoE under tensor parallelism: each expert splits its hidden width
    (
        ["model=llama_moe_tiny", "parallel=megatron_tp2", "trainer.devices=2", "schedule=none"]
        + ["model.llm.moe.expert_ffn_dim=175"],
        "tp does not divide the experts' hidden width model.llm.moe.expert_ffn_dim=175",
    ),
    (
        ["model=llama_moe_tiny", "parallel=megatron_tp2", "trainer.devices=2", "schedule=none"]
        + ["parallel.comm.tp_overlap=true"],
        "model.llm.moe blocks run sequence parallelism unchunked: set parallel.comm.tp_overlap=false",
    ),
    # trainer.fault_tolerance (validation/fault_tolerance.py): what it protects, named when it does not
    (
        ["trainer.fault_tolerance.enabled=true", "trainer.devices=2", "parallel=disagg2"],
        "trainer.fault_tolerance does not protect parallel=disagg2 (mode manual) yet; it protects parallel=dp",
    ),
    (
        ["trainer.fault_tolerance.enabled=true", "trainer.devices=2", "model=llama_tiny", "parallel=megatron_tp2"],
        "each replica group holds whole TP x PP copies of the model, but the layout's dp=1 is not a multiple of 2",
    ),
    (
        ["trainer.fault_tolerance.enabled=true"],
        "trainer.fault_tolerance.replicas=2 replica groups need at least one process each, but the job has 1",
    ),
    (
        ["trainer.fault_tolerance.enabled=true", "trainer.devices=2", "trainer.fault_tolerance.replace_timeout_s=0"],
        "trainer.fault_tolerance.replace_timeout_s=0.0: use a value in [1, 86400]",
    ),
    (
        ["trainer.fault_tolerance.enabled=true", "trainer.devices=4", "trainer.fault_tolerance.replicas=4"]
        + ["optim.global_batch_size=4", "optim.micro_batch_size=1", "trainer.fault_tolerance.min_replicas=2"],
        "trainer.fault_tolerance.min_replicas=2 must be a majority of the 4 replica groups",
    ),
    # local-SGD workers as replica groups: diloco and post_local_sgd, no warm-up, checkpoints at syncs
    (
        ["trainer.fault_tolerance.enabled=true", "trainer.devices=2", "parallel=local_sgd"]
        + ["parallel.local_sgd.warmup_steps=0", "parallel.local_sgd.method=edit"],
        "trainer.fault_tolerance protects local SGD's diloco and post_local_sgd syncs, not method=edit",
    ),
    (
        ["trainer.fault_tolerance.enabled=true", "trainer.devices=2", "parallel=local_sgd"],
        "parallel.local_sgd.warmup_steps=4 is not protected",
    ),
    (
        ["trainer.fault_tolerance.enabled=true", "trainer.devices=2", "parallel=local_sgd"]
        + ["parallel.local_sgd.warmup_steps=0", "trainer.checkpoint.every_n_steps=6"],
        "trainer.checkpoint.every_n_steps=6 is not a multiple of parallel.local_sgd.sync_every=4",
    ),
    # trainer.replan_on_failure: the solver plans the devices that remain, the run resumes from a checkpoint
    (
        ["trainer.devices=2", "trainer.replan_on_failure=1"],
        "trainer.replan_on_failure=1 re-plans the layout with the solver: use parallel=auto",
    ),
    (
        ["parallel=auto", "trainer.devices=2", "trainer.replan_on_failure=1", "trainer.checkpoint.every_n_steps=0"],
        "the re-planned run resumes from the latest checkpoint; set trainer.checkpoint.every_n_steps",
    ),
    (
        ["parallel=auto", "trainer.devices=2", "trainer.replan_on_failure=2", "trainer.checkpoint.every_n_steps=4"],
        "trainer.replan_on_failure=2: a job of trainer.devices=2 can lose at most 1",
    ),
]


@pytest.mark.parametrize("overrides, expected", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_gives_one_actionable_line(overrides, expected, shards, tmp_path, monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    overrides = [o.replace("SHARDS", str(shards)) for o in overrides]  # the session's test shards
    expected = expected.replace("SHARDS", str(shards))
    argv = base_overrides(shards, tmp_path / "run")
    argv = [a for a in argv if not (a.startswith("data.path=") and any(o.startswith("data.path") for o in overrides))]
    with pytest.raises(PreflightError) as info:
        check_overrides(argv + overrides)
    message = str(info.value)
    assert "\n" not in message
    assert expected in message, message
    assert not (tmp_path / "run").exists()


def test_train_py_prints_one_error_line_and_exits_2(tmp_path):
    result = run_train(["model=foo", f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model=foo"), result.stderr
    assert not (tmp_path / "run").exists()


def test_train_py_reports_a_type_error_on_one_line(tmp_path):
    result = run_train(["optim.lr=abc", f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "optim.lr=abc" in result.stderr


def _preflight_error(overrides: list[str], shards, tmp_path, monkeypatch) -> str:
    for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(PreflightError) as info:
        check_overrides(base_overrides(shards, tmp_path / "run") + overrides)
    message = str(info.value)
    assert "\n" not in message and not (tmp_path / "run").exists()
    return message


def test_a_schedule_that_deadlocks_is_refused_before_launch(shards, tmp_path, monkeypatch):
    """A CSV whose two ranks each wait for the other: caught by the same validation the workers run."""
    csv = tmp_path / "crossed.csv"
    csv.write_text("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")  # 0B0 needs 1B0, which waits for 1F1, which needs 0F1
    overrides = ["model=llama_tiny", "parallel=pp2", "trainer.devices=2", f"schedule.csv={csv}", "schedule=1f1b"]
    overrides += ["optim.global_batch_size=4", "optim.micro_batch_size=2"]
    message = _preflight_error(overrides, shards, tmp_path, monkeypatch)
    assert "deadlock" in message and "crossed" in message, message


def test_deterministic_cuda_run_with_an_operator_that_has_no_deterministic_kernel(shards, tmp_path, monkeypatch):
    """trainer.deterministic=true on CUDA fails at the first call of such an operator; here it is named
    before launch (on a machine without a GPU too: nothing touches a device)."""
    from disttrain_core.models import latents

    class IntegralImageLatents(latents.PixelLatentEncoder):
        def forward(self, images):
            return super().forward(images).cumsum(-1)  # cumsum of floats: no deterministic CUDA kernel

    monkeypatch.setitem(
        latents._LATENT_ENCODERS,
        "integral",
        lambda cfg: IntegralImageLatents(cfg.generator.in_channels, cfg.latent_downsample),
    )
    base = ["model.latent_encoder=integral", "trainer.accelerator=cuda"]
    message = _preflight_error(base + ["trainer.deterministic=true"], shards, tmp_path, monkeypatch)
    assert "aten.cumsum" in message and "trainer.deterministic=warn" in message, message
    # warn (or off, the CUDA default) gets past this check; this machine then has no GPU to run it on
    message = _preflight_error(base + ["trainer.deterministic=warn"], shards, tmp_path, monkeypatch)
    assert "no CUDA device" in message, message


@pytest.mark.parametrize(
    "scaling, expected",
    [
        ({"high_freq_factor": 0.5}, "model.llm.rope_scaling.high_freq_factor=0.5 must be greater than low_freq_factor"),
        ({"factor": 0.5}, "model.llm.rope_scaling.factor=0.5: use 1 or more (Llama-3.1: 8.0)"),
        ({"rope_type": "linear"}, "model.llm.rope_scaling.rope_type='linear': the supported rope_type is 'llama3'"),
    ],
)
def test_rope_scaling_bounds(scaling, expected, compose_cfg):
    """Llama-3.1 frequency scaling (set in a model file or from Hugging Face weights)."""
    from disttrain_core.config import RopeScalingConfig
    from disttrain_core.planner.fit import validate_run
    from disttrain_core.validation import ConfigError

    cfg = compose_cfg()
    cfg.model.llm.rope_scaling = RopeScalingConfig(**scaling)  # the other values at their Llama-3.1 defaults
    with pytest.raises(ConfigError) as info:
        validate_run(cfg)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_missing_shards_can_be_allowed_with_a_counted_warning(shards, tmp_path, caplog):
    """data.allow_missing_shards=true: the run trains on the shards that exist; the reader counts the rest."""
    from disttrain_core.data.reader import resolve_shards

    pattern = f"{shards}/shard-{{000000..000005}}.tar"
    check_overrides(
        base_overrides(shards, tmp_path / "run") + [f"data.path='{pattern}'", "data.allow_missing_shards=true"]
    )
    with caplog.at_level("WARNING", logger="disttrain_core.data.reader"):
        assert len(resolve_shards(pattern)) == 4
    assert "2 of the 6 shard(s) named by" in caplog.text and "reading the 4 that exist" in caplog.text


def test_generate_if_missing_writes_only_where_the_data_group_generates(shards, tmp_path):
    """The default data.path under another paths.data_dir, or an empty directory the user made: accepted
    (validation only; nothing is generated here). Anything else without shards is refused."""
    base = [o for o in base_overrides(shards, tmp_path / "run") if not o.startswith(("data.path", "data.generate"))]
    check_overrides(base + [f"paths.data_dir={tmp_path / 'fresh'}"])  # -> <data_dir>/synthetic_laion
    (tmp_path / "empty").mkdir()
    check_overrides(base + [f"data.path={tmp_path / 'empty'}"])
    with pytest.raises(PreflightError, match="generates the embedded data only into"):
        check_overrides(base + [f"data.path={tmp_path / 'emtpy'}"])
    assert not (tmp_path / "fresh").exists() and not any((tmp_path / "empty").iterdir())


@pytest.mark.parametrize(
    "override,named",
    [
        ("model.llm.rope_scaling.factor=2", "model.llm.rope_scaling.factor"),
        ("model.llm.rope_scaling={factor:2.0}", "model.llm.rope_scaling"),
    ],
)
def test_a_value_inside_a_null_block_is_one_line_naming_it(override, named, shards, tmp_path):
    with pytest.raises(PreflightError, match=f"^{named} is \\(or is inside\\) a block that is null"):
        check_overrides(base_overrides(shards, tmp_path / "run") + ["model=llama_tiny", override])


@pytest.mark.parametrize("logger, package", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_tracker_that_is_not_installed_is_one_line_with_the_install_command(
    logger, package, shards, tmp_path, monkeypatch
):
    import disttrain_core.train.trackers as trackers

    monkeypatch.setattr(trackers, "_has", lambda module: module != package)
    with pytest.raises(PreflightError) as error:
        check_overrides(base_overrides(shards, tmp_path) + [f"logger=[tensorboard,{logger}]"])
    assert str(error.value) == (
        f"logger={logger} needs the {package} package, which is not installed: pip install -e .[trackers] "
        f"(or pip install {trackers.OPTIONAL[logger][1]})"
    )


def test_token_file_validation_needs_a_held_out_file_of_its_own(shards, tmp_path):
    import numpy as np

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(2000, dtype=np.uint16) % 300)
    base = base_overrides(shards, tmp_path) + ["model=llama_tiny", "data=tokens", f"data.path={tokens}"]
    cases = [
        (["trainer.val_every_n_steps=2"], "trainer.val_every_n_steps=2 evaluates on held-out data: set data.val.path"),
        ([f"data.val.path={tokens}", "trainer.val_every_n_steps=2"], "is the training file"),
        (["data.val.holdout_shards=1"], "with data.format=tokens give the held-out windows as a token file"),
        ([f"data.val.path={tmp_path}/none.npy", "trainer.val_every_n_steps=2"], "data.val.path="),
    ]
    for overrides, expected in cases:
        with pytest.raises(PreflightError) as error:
            check_overrides(base + overrides)
        assert expected in str(error.value) and "\n" not in str(error.value), (overrides, str(error.value))


def test_packed_validation_needs_a_held_out_corpus_of_its_own(shards, tmp_path):
    import json

    corpus, held = tmp_path / "train", tmp_path / "held"
    for folder in (corpus, held):
        folder.mkdir()
        (folder / "a.jsonl").write_text("\n".join(json.dumps({"text": f"document {i} " * 20}) for i in range(8)))
    base = base_overrides(shards, tmp_path) + ["model=llama_tiny", "data=longtail_text"]
    from_corpus = ["data.packing.source=corpus", f"data.packing.corpus={corpus}", "trainer.val_every_n_steps=2"]
    cases = [
        (from_corpus, "data.packing.source=corpus evaluates a held-out corpus: set data.val.path"),
        ([*from_corpus, f"data.val.path={corpus}"], "shares 1 file(s) with data.packing.corpus"),
        ([f"data.val.path={held}", "trainer.val_every_n_steps=2"], "draws its held-out documents from another seed"),
        (["data.val.holdout_shards=1"], "packed documents take a held-out corpus"),
    ]
    for overrides, expected in cases:
        with pytest.raises(PreflightError) as error:
            check_overrides(base + overrides)
        assert expected in str(error.value) and "\n" not in str(error.value), (overrides, str(error.value))
    check_overrides(base + [*from_corpus, f"data.val.path={held}"])  # a corpus of its own: accepted
