"""Model schema: the encoder, LLM, generator and how they are joined (``conf/model/*.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


# --------------------------------------------------------------------------- model
@dataclass
class VitConfig:
    image_size: int = 224  # input resolution (square) after preprocessing
    patch_size: int = 14
    channels: int = 3
    dim: int = 1280
    n_layers: int = 32
    n_heads: int = 16
    mlp_dim: int = 5120
    output_dim: int = 1024  # CLIP-style output projection; 0 disables it
    class_token: bool = True  # a [CLS] token is prepended (dropped from the output)
    norm_eps: float = 1e-5
    activation: str = "gelu"  # gelu | quick_gelu (OpenAI CLIP's x * sigmoid(1.702 x))
    # None: every block, then norm_post and the output projection (CLIP image embeddings per patch).
    # An int selects a hidden state as LLaVA does (Hugging Face hidden_states indexing: 0 = the embeddings,
    # -1 = the last block's output, -2 = the one before, LLaVA's choice): later blocks are not built, no norm_post
    # and no projection run.
    feature_layer: Optional[int] = None


@dataclass
class VideoEncoderConfig(VitConfig):
    """A video tower (models/video.py): a ViT of its own run on every frame, its patch embeddings averaged over
    each group of ``temporal_merge`` consecutive frames, so a video of F frames gives ceil(F / temporal_merge) x P
    ``<video>`` positions (Qwen2-VL merges frame pairs the same way, with 3-D patches). The data workers pad a
    video's last group by repeating its last frame. Defaults: a ViT-L/14 at 224 px merging frame pairs."""

    dim: int = 1024
    n_layers: int = 24
    n_heads: int = 16
    mlp_dim: int = 4096
    output_dim: int = 0
    class_token: bool = False
    temporal_merge: int = 2  # frames averaged into one group of P tokens (1: every frame its own P tokens)


@dataclass
class AudioEncoderConfig:
    """A Whisper-encoder-family audio tower (models/audio.py): log-mel features (computed in the data workers,
    data/audio.py), two 1-D convolutions (the second halves the frame rate), learned positions, pre-norm
    transformer blocks, a final norm. Defaults: Whisper large-v3's encoder (636,968,960 parameters)."""

    sample_rate: int = 16000  # Hz the waveform is resampled to
    clip_seconds: float = 30.0  # each clip is cut or zero-padded to this length (Whisper: 30 s)
    n_fft: int = 400  # 25 ms windows
    hop_length: int = 160  # 10 ms hops: 100 frames per second
    n_mels: int = 128
    dim: int = 1280
    n_layers: int = 32
    n_heads: int = 20
    mlp_dim: int = 5120
    norm_eps: float = 1e-5


@dataclass
class RopeScalingConfig:
    """Llama-3.1's rotary frequency scaling (Hugging Face ``rope_scaling`` with ``rope_type: llama3``)."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class MoeConfig:
    """Mixture-of-experts feed-forward for the Llama blocks (models/moe.py); expert parallelism in
    parallel/expert_parallel.py."""

    num_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # experts each token is sent to; gates are the top-k probabilities renormalized to sum 1
    # 0: no capacity, nothing is dropped. > 0: each expert takes at most ceil(capacity_factor * tokens * top_k /
    # num_experts) assignments of the tokens this process routes in one forward, first come (token order) first
    # served; the rest are dropped (the token keeps its other experts and the shared ones).
    capacity_factor: float = 0.0
    shared_experts: int = 0  # always-on SwiGLU experts (DeepSeek style), built as one SwiGLU this many times wider
    aux_loss_coef: float = 0.01  # weight of the Switch/GShard load-balancing loss (router=aux_loss only)
    # aux_loss: balance with the auxiliary loss. aux_free: DeepSeek-V3's loss-free balancing -- a per-expert bias
    # added to the scores for top-k selection only (never to the gates), nudged after each optimizer step.
    router: str = "aux_loss"
    bias_update_rate: float = 0.001  # aux_free: bias += rate * sign(mean load - expert load) per optimizer step
    expert_ffn_dim: Optional[int] = None  # hidden width of each expert; None: the llm's ffn_dim
    # How a rank's experts run (models/grouped_experts.py): auto -- one grouped matmul per projection over all of
    # them (torch._grouped_mm) where the device runs it, else a loop; grouped (insist); loop (one matmul per expert)
    experts_kernel: str = "auto"


@dataclass
class LlamaConfig:
    vocab_size: int = 128256
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Optional[RopeScalingConfig] = None  # Llama-3.1's "llama3" frequency scaling
    moe: Optional[MoeConfig] = None  # None: dense SwiGLU feed-forward; set: every block's is a MoE
    # The model families beside Llama (models/llama.py; imports in models/hf/llama_family.py):
    head_dim: Optional[int] = None  # None: dim / n_heads; Qwen3 sets its own (q is n_heads x head_dim wide)
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2, Qwen2.5)
    qk_norm: bool = False  # an RMSNorm over each head's q and k before the rotation (Qwen3)
    # Mistral 7B v0.1: a query sees the last sliding_window positions only (itself included); None: all earlier
    sliding_window: Optional[int] = None


def head_dim_of(cfg) -> int:
    """The attention head width of an llm config: ``head_dim``, else ``dim / n_heads``."""
    return int(cfg.head_dim) if getattr(cfg, "head_dim", None) else int(cfg.dim) // int(cfg.n_heads)


@dataclass
class UNetConfig:
    in_channels: int = 4  # latent channels
    block_out_channels: list[int] = field(default_factory=lambda: [320, 640, 1280, 1280])
    # Which down blocks carry cross-attention transformers (up blocks mirror them).
    cross_attention_blocks: list[bool] = field(default_factory=lambda: [True, True, True, False])
    layers_per_block: int = 2
    head_dim: int = 64
    # Attention heads per level (diffusers' attention_head_dim; SD 1.x: [8,8,8,8]); empty: channels // head_dim.
    attention_heads: list[int] = field(default_factory=list)
    cross_attention_dim: int = 1024  # width of the conditioning from the LLM
    # How that conditioning reaches the U-Net: "cross_attention" (Stable Diffusion: each transformer's second
    # attention attends to it) or "film" (AudioLDM: pooled over its tokens, a linear of it is added to the timestep
    # embedding, or concatenated with film_concat; the second attention then attends to the features themselves)
    conditioning: str = "cross_attention"
    film_concat: bool = False
    # The latent grid it denoises, [height, width] (AudioLDM: [256, 16], 10.24 s of 64 mel bins through its VAE);
    # empty: the image generator's, model.gen_image_size / model.latent_downsample square
    latent_shape: list[int] = field(default_factory=list)
    norm_groups: int = 32
    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012


PROJECTOR_KINDS = ("mlp", "resampler")


@dataclass
class ProjectorConfig:
    """A projector between modules (models/projector.py). ``kind`` (Megatron's ``projector_type``): ``mlp``, one
    position out per position in (LLaVA); ``resampler``, a Perceiver / Q-Former-style cross-attention resampler
    (model.encoder_projector only): ``num_queries`` learned queries attend to the encoder's patches, so each image
    takes ``num_queries`` positions of the LLM's sequence instead of one per patch."""

    kind: str = "mlp"  # mlp | resampler
    # mlp: the hidden width, 0 = the output width; resampler: each block's MLP hidden width, 0 = 4 x the output width
    hidden_dim: int = 0
    # mlp: 1 = a single linear layer, 2 = linear-GELU-linear; resampler: pre-norm blocks (cross-attention, then MLP)
    n_layers: int = 2
    num_queries: int = 64  # resampler: learned queries, the LLM positions per image
    n_heads: int = 8  # resampler: cross-attention heads; they divide the output width (the LLM's dim)


@dataclass
class FreezeConfig:
    encoder: bool = False
    encoder_projector: bool = False
    audio_encoder: bool = False
    audio_projector: bool = False
    video_encoder: bool = False
    video_projector: bool = False
    llm: bool = False
    generator_projector: bool = False
    generator: bool = False
    audio_generator_projector: bool = False
    audio_generator: bool = False


@dataclass
class ModelConfig:
    name: str = MISSING
    family: str = "mllm"  # mllm | llama
    seq_len: int = 2048  # tokens per training sequence (one sample per row, padded)
    # Positions per chunk of the LM head and its loss (models/chunked_loss.py): the full logits are never held;
    # backward computes each chunk's again. 0: the whole microbatch at once.
    loss_chunk: int = 0
    # Attention inside packed documents (models/document_attention.py): auto (= varlen), varlen (one causal SDPA per
    # document), flex (FlexAttention block masks; CUDA only for training), dense (an [S, S] mask; the reference)
    document_attention: str = "auto"
    # FP8 matmuls in the LLM blocks' linears through torchao (parallel/float8.py): none | tensorwise | rowwise.
    # NVIDIA GPUs with FP8 tensor cores only (compute capability 8.9+); refused elsewhere before launch.
    float8: str = "none"
    llm: LlamaConfig = field(default_factory=LlamaConfig)
    encoder: Optional[VitConfig] = None
    generator: Optional[UNetConfig] = None
    # An audio tower beside the image encoder (conf/model/audio_encoder); it runs in the LLM unit's first stage.
    audio_encoder: Optional[AudioEncoderConfig] = None
    # A video tower beside the image encoder (conf/model/video_encoder): a video member's frames go to it instead of
    # the image encoder; it runs in the LLM unit's first stage or, with parallel.units.video_encoder.colocate=false,
    # as a unit of its own. Without one, a video's frames are images to the image encoder.
    video_encoder: Optional[VideoEncoderConfig] = None
    # An audio generator beside the image generator (conf/model/audio_generator: AudioLDM's latent-diffusion U-Net,
    # FiLM-conditioned on the LLM's generation queries): built and counted by tools/model_info.py; training and
    # planning refuse it in one line until its targets reach it.
    audio_generator: Optional[UNetConfig] = None
    audio_generator_projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    encoder_projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    audio_projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    video_projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    generator_projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    gen_tokens: int = 77  # generation query tokens; their LLM states condition the U-Net
    gen_image_size: int = 768  # pixel size of the generation target image
    latent_downsample: int = 8  # pixels per latent cell (SD's VAE: 8)
    latent_encoder: str = "pixel"  # registered latent encoder (see models/latents.py)
    gen_loss_weight: float = 1.0
    nominal_images_per_sample: float = 1.0  # for per-sample FLOP tables and planning
    nominal_clips_per_sample: float = 1.0  # audio clips per sample (with model.audio_encoder), for FLOP tables
    # frame groups (temporal_merge frames each) per sample (with model.video_encoder), for FLOP tables
    nominal_video_groups_per_sample: float = 4.0
    # The batch this model is meant to train with; optim.global_batch_size / micro_batch_size default
    # to these (conf/optim/adamw.yaml), so `model=mllm72b` plans and trains at its own scale.
    reference_global_batch: int = 16
    reference_micro_batch: int = 8
    init_std: float = 0.02
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    # Pretrained weights in Hugging Face formats (models/hf/): a directory holding config.json and *.safetensors
    # (its architecture picks the part: LlamaForCausalLM -> llm, CLIPVisionModel -> encoder,
    # UNet2DConditionModel -> generator), or a mapping part -> directory, e.g. {llm: /w/llama, encoder: /w/clip}.
    init_from: Any = None
    init_from_strict: bool = True  # every parameter must come from init_from; false: the rest keep their init
    latent_encoder_path: Optional[str] = None  # weights of a latent encoder that needs them (sd_vae: a diffusers VAE)


def image_tokens(cfg) -> int:
    """The ``<img>`` positions one image takes in the LLM's sequence (and the embedding rows the encoder unit sends
    the LLM per image): one per patch through the MLP projector, ``num_queries`` through the resampler."""
    projector = cfg.encoder_projector
    if projector.kind == "resampler":
        return int(projector.num_queries)
    return (int(cfg.encoder.image_size) // int(cfg.encoder.patch_size)) ** 2
