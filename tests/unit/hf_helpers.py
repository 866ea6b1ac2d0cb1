"""Helpers the Hugging Face import tests share (test_hf_clip.py, test_hf_whisper.py)."""

from __future__ import annotations

import torch


def perturbed(model):
    """Random values everywhere (Hugging Face inits norms to 1/0 and biases to 0, which would hide swaps)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def save(model, directory) -> str:
    model.save_pretrained(str(directory), safe_serialization=True)
    return str(directory)
