"""Workload presets for predictions at scale (tools/regime.py): what a training sample holds, each number with
its source, fixed before any sweep (nothing here is tuned to reach a figure).

A preset becomes model overrides the planner reads (planner/workload.py): the encoder sees
``images_per_sample x tiles`` images of ``encoder_px`` pixels per sample (``model.nominal_images_per_sample``,
``model.encoder.image_size``; every preset's patches fit the 4,096-token sequences of mllm9b/15b/72b, checked in
tests/unit/test_presets.py), the generator produces ``generated_per_sample`` images of ``generated_px``
(0: no generator; the runtime generates at most one image per sample) and frozen modules keep no gradients or
optimizer state. The planner uses the mean number of images; the straggler model (planner/stragglers.py
``law_of``) samples the count: a ``skewed`` preset draws it from a truncated geometric law with the preset's mean
(the shape of the repository's LAION-like synthetic data), the others hold exactly ``images_per_sample``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadPreset:
    name: str
    images_per_sample: float  # mean images per training sample (before tiling)
    images_distribution: str  # the shape the mean comes from
    encoder_px: int  # what the encoder sees: the resolution, or the tile size with tiling
    tiles: int  # encoder inputs per image (tiles plus a thumbnail; 1: no tiling)
    generated_per_sample: int  # 0 or 1
    generated_px: int
    frozen: tuple[str, ...]  # modules without gradients (model.freeze.<name>)
    source: str
    skewed: bool = False  # images per sample vary (planner/stragglers.py law_of); False: always the mean
    clips_per_sample: float = 0.0  # audio clips per sample, through the audio tower ``audio_encoder``
    audio_encoder: str = ""  # a conf/model/audio_encoder option
    video_groups_per_sample: float = 0.0  # frame groups per sample through the video tower ``video_encoder``
    video_encoder: str = ""  # a conf/model/video_encoder option
    temporal_merge: int = 1  # frames per group (model.video_encoder.temporal_merge)

    def overrides(self) -> list[str]:
        out = [
            f"model.nominal_images_per_sample={self.images_per_sample * self.tiles:g}",
            f"model.encoder.image_size={self.encoder_px}",
        ]
        if self.clips_per_sample:
            out += [
                f"model/audio_encoder={self.audio_encoder}",
                f"model.nominal_clips_per_sample={self.clips_per_sample:g}",
            ]
        if self.video_groups_per_sample:
            out += [
                f"model/video_encoder={self.video_encoder}",
                f"model.video_encoder.temporal_merge={self.temporal_merge}",
                f"model.nominal_video_groups_per_sample={self.video_groups_per_sample:g}",
            ]
        out += [f"model.gen_image_size={self.generated_px}"] if self.generated_per_sample else ["model.generator=null"]
        out += [f"model.freeze.{name}=true" for name in self.frozen]
        return out


PRESETS = {
    p.name: p
    for p in (
        WorkloadPreset(
            "laion_pairs",
            1.0,
            "one image per pair",
            224,
            1,
            0,
            0,
            (),
            "LAION-400M image-text pairs (Schuhmann et al. 2021), the dataset the DistTrain paper analyses in "
            "its section 2.2; 224 px, CLIP ViT-H/14's pretraining resolution (OpenCLIP)",
        ),
        WorkloadPreset(
            "mmc4_interleaved",
            5.6,
            "skewed count per document (the paper's figure 5(c)): truncated geometric, mean 5.6",
            224,
            1,
            0,
            0,
            (),
            "MMC4 (Zhu et al. 2023): 571M images in 101.2M documents, 5.6 per document, encoded at 224 px",
            skewed=True,
        ),
        WorkloadPreset(
            "obelics_448",
            2.5,
            "skewed count per document: truncated geometric, mean 2.5",
            448,
            1,
            0,
            0,
            ("encoder",),
            "OBELICS (Laurençon et al. 2023): 353M images in 141M documents, 2.5 per document; 448 px and a "
            "frozen vision encoder as in LLaVA-1.5-style training (Liu et al. 2023)",
            skewed=True,
        ),
        WorkloadPreset(
            "highres_tiles",
            1.0,
            "one image of up to 672 px: 2 x 2 tiles + a downsized whole",
            336,
            5,
            0,
            0,
            (),
            "LLaVA-NeXT's AnyRes (Liu et al. 2024): 336 px tiles, up to 2 x 2 for a 672 px image, plus the whole "
            "image at 336 px (InternVL 1.5's 448 px tiles need its pixel shuffle, not modelled here, to fit a "
            "4,096-token sequence)",
        ),
        WorkloadPreset(
            "video_8f_224",
            8.0,
            "8 frames per clip, each an image of the sequence (frames concatenated, no pooling)",
            224,
            1,
            0,
            0,
            (),
            "Video-LLaVA (Lin et al. 2023): 8 frames sampled uniformly from each clip at 224 px, as the runtime's "
            "data.video_frames=8 does; every frame's 256 ViT-H/14 patches enter the sequence (docs/DATA.md)",
        ),
        WorkloadPreset(
            "gen_256",
            1.0,
            "one input image, one generated",
            224,
            1,
            1,
            256,
            (),
            "understanding plus generation with a Stable Diffusion 2.1-style U-Net (Rombach et al. 2022) at 256 "
            "px, the low end of the generated resolutions",
        ),
        WorkloadPreset(
            "gen_512",
            1.0,
            "one input image, one generated",
            224,
            1,
            1,
            512,
            (),
            "the same at 512 px, Stable Diffusion 2.1-base's resolution (the mllm presets' default)",
        ),
        WorkloadPreset(
            "gen_768",
            1.0,
            "one input image, one generated",
            224,
            1,
            1,
            768,
            (),
            "the same with Stable Diffusion 2.1 (768-v) at 768 px",
        ),
        WorkloadPreset(
            "audio_image",
            1.0,
            "one image and one audio clip per sample",
            224,
            1,
            0,
            0,
            (),
            "AudioCaps (Kim et al. 2019): 10 s captioned AudioSet clips, which Whisper large-v3's encoder (Radford "
            "et al. 2022) reads as its 30 s window, 1,500 positions per clip (the audio tower in the LLM's first "
            "stage, where the runtime runs it); one LAION-style image at 224 px beside each",
            clips_per_sample=1.0,
            audio_encoder="whisper_large_v3",
        ),
        WorkloadPreset(
            "video_32f_pooled",
            1.0,
            "one image and one 32-frame clip per sample",
            224,
            1,
            0,
            0,
            (),
            "LLaVA-NeXT-Video (Zhang et al. 2024) samples 32 frames per clip; here each frame goes at 224 px "
            "through a ViT-L/14 video tower of its own, 4 consecutive frames averaged into one group of 256 "
            "<video> positions (the merge factor is a choice made here; Qwen2-VL merges 2): 8 groups, 2,048 "
            "positions, so the tower runs 32 frame passes for 8 frames' worth of LLM tokens; one LAION-style "
            "image at 224 px beside each clip",
            video_groups_per_sample=8.0,
            video_encoder="vit_l14_video",
            temporal_merge=4,
        ),
    )
}
