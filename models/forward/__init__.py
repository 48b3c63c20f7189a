"""mixbit's own Qwen3.5 forward: the model (qwen3_5.py), the projections it is built from and the
phase of a call (layers.py), and the CPU plan that says which op runs each projection (plan.py).
Below it, the native compute MLX lacks on the CPU (models/kernels)."""

from __future__ import annotations

from .layers import DECODE, PREFILL, SCORE, TRAIN


def score(model, inputs, cache=None):
    """Teacher-forced logits of every position of `inputs` [B, T] (fidelity checks, prompt
    logprobs, evaluation): the SCORE phase on mixbit's forward, a plain call on any other model."""
    from .qwen3_5 import Model

    if isinstance(model, Model):
        return model(inputs, cache=cache, phase=SCORE)
    return model(inputs, cache=cache)


__all__ = ["DECODE", "PREFILL", "SCORE", "TRAIN", "score"]
