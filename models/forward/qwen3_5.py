"""mixbit's Qwen3.5 text model: dense and MoE, and the MTP head's module.

Loaded through mlx-lm's public loading seam (`mlx_lm.utils.load_model(..., get_model_classes=
...)`), from the same checkpoints and variants, with the module and parameter names of mlx-lm's
`qwen3_5` (which stays the reference its tests compare logits with). After loading, `build`
turns every projection into the one its CPU plan says (models/forward/layers.py); the phase of a
call (PREFILL, DECODE, SCORE, TRAIN) is an argument, passed down to every projection.

Where the model runs on the CPU, GatedDeltaNet's recurrence runs on mixbit's kernel (a prompt
and a decode step: token after token in C, each head's state in cache), or, without the kernels,
prompts in the chunk-parallel form (models/forward/gated_delta_chunked.py); elsewhere, and for
gradients, on mlx-lm's `gated_delta_update`. With a plan that serves anything packed (real
sizes), the short convolution and its SiLU, the gated norm's SiLU and the MLP's SwiGLU run on
the kernels too (MLX's Linux build computes exp one value at a time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear, sum_gradients
from mlx.utils import tree_map, tree_unflatten
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask, create_ssm_mask, gather_last_axis, \
    scaled_dot_product_attention
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk
from mlx_lm.models.qwen3_5 import ModelArgs, TextModelArgs
from mlx_lm.models.qwen3_next import Qwen3NextRMSNormGated as RMSNormGated
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.models.switch_layers import SwitchGLU

from .. import kernels
from .gated_delta_chunked import MIN_TOKENS, chunked_gated_delta
from .layers import (TRAIN, PackedEmbedding, PackedLinear, Projection, dense, head_rows, mlx_quantized,
                     per_position, phase_of, project, verifying)

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


def model_classes(config: dict):
    """mlx-lm's `get_model_classes` for the model types mixbit owns (MODEL_TYPES)."""
    if config.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"mixbit's forward is Qwen3.5's, not {config.get('model_type')!r}")
    return Model, ModelArgs


def _on_metal() -> bool:
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def default_recurrence() -> str:
    """GatedDeltaNet's recurrence on this machine: "kernel" (mixbit's CPU kernel), "chunked"
    (CPU without it: prompts chunk-parallel in MLX ops) or "mlx" (mlx-lm's: a Metal kernel)."""
    if _on_metal() or mx.default_device() != mx.cpu:
        return "mlx"
    return "kernel" if kernels.available() else "chunked"


class GatedDeltaNet(nn.Module):
    def __init__(self, config: TextModelArgs):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_v_heads = config.linear_num_value_heads
        self.num_k_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        if self.num_v_heads % self.num_k_heads != 0:
            raise ValueError(f"num_v_heads ({self.num_v_heads}) must be divisible by num_k_heads "
                             f"({self.num_k_heads})")
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, bias=False, kernel_size=self.conv_kernel_size,
                                groups=self.conv_dim, padding=0)
        self.in_proj_qkv = nn.Linear(self.hidden_size, self.key_dim * 2 + self.value_dim, bias=False)
        self.in_proj_z = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.dt_bias = mx.ones(self.num_v_heads)
        self.A_log = mx.log(mx.random.uniform(low=0, high=16, shape=(self.num_v_heads,)))
        self.norm = RMSNormGated(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)
        self.sharding_group = None
        self.recurrence = default_recurrence()
        self.fused = False  # build(): the conv, its SiLU and the gated norm's SiLU on the kernels
        # a prompt's layer evaluates what it leaves in the cache before the next layer runs:
        # lazily, every layer's conv input and chunk intermediates stayed alive until the whole
        # pass was done (docs/cpu-serving.md)
        self.evaluate_cache = True

    def fuse(self) -> None:
        """The convolution and the SiLUs on the kernels from now on (a plan that serves packed)."""
        self._conv_w_t = mx.contiguous(self.conv1d.weight[..., 0].T.astype(mx.float32))
        mx.eval(self._conv_w_t)
        self.fused = True

    def _recurrence(self, q, k, v, a, b, state, mask, phase):
        if phase == TRAIN or self.recurrence == "mlx":
            return gated_delta_update(q, k, v, a, b, self.A_log, self.dt_bias, state, mask,
                                      use_kernel=phase != TRAIN)
        if self.recurrence == "chunked" and q.shape[1] < MIN_TOKENS:  # a decode step: mlx-lm's own
            return gated_delta_update(q, k, v, a, b, self.A_log, self.dt_bias, state, mask)
        beta = mx.sigmoid(b)
        g = compute_g(self.A_log, a, self.dt_bias)
        if state is None:
            state = mx.zeros((q.shape[0], v.shape[2], v.shape[3], q.shape[3]), dtype=mx.float32)
        if self.recurrence == "kernel":
            y, state = kernels.gated_delta(q, k, v, g, beta, state, mask)
            return y.astype(q.dtype), state
        return chunked_gated_delta(q, k, v, g, beta, state, mask)

    def __call__(self, inputs: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None,
                 phase: str | None = None, keep_states: bool = False):
        """The layer's output; with `keep_states`, also (conv states, recurrent states): lists
        over the call's positions of the states after each ([B, K-1, C] and [B, Hv, Dv, Dk]), to
        which a step of several tokens per sequence rolls back without recomputing."""
        phase = phase_of(inputs, phase)
        B, S, _ = inputs.shape
        if self.sharding_group is not None:
            inputs = sum_gradients(self.sharding_group)(inputs)
        qkv = project(self.in_proj_qkv, inputs, phase)
        z = project(self.in_proj_z, inputs, phase).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b = project(self.in_proj_b, inputs, phase)
        a = project(self.in_proj_a, inputs, phase)
        if self.fused and cache is not None and cache.lengths is None and phase != TRAIN \
                and self.recurrence == "kernel":
            if S == 1 or keep_states:  # a decode step, or a verify step's decode steps one after the other
                out, kept = self._decode_steps(qkv, z, a, b, mask, cache, phase)
                return (out, kept) if keep_states else out
        if cache is not None and cache[0] is not None:
            conv_state = cache[0]
        else:
            conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        if cache is not None:
            n_keep = self.conv_kernel_size - 1
            if cache.lengths is not None:
                ends = mx.clip(cache.lengths, 0, S)
                positions = (ends[:, None] + mx.arange(n_keep))[..., None]
                cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
            else:
                cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
        fused = self.fused and phase != TRAIN
        if fused:
            conv_out = kernels.depthwise_conv(conv_input, self._conv_w_t, then_silu=True)
        else:
            conv_out = nn.silu(self.conv1d(conv_input))
        q, k, v = [t.reshape(B, S, h, d) for t, h, d in zip(
            mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
            [self.num_k_heads, self.num_k_heads, self.num_v_heads],
            [self.head_k_dim, self.head_k_dim, self.head_v_dim])]
        state = cache[1] if cache else None
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim ** -0.5, eps=1e-6)
        if keep_states:  # position by position, each state kept
            n_keep = self.conv_kernel_size - 1
            conv_states = [conv_input[:, t + 1:t + 1 + n_keep] for t in range(S)]
            outs, states = [], []
            for t in range(S):
                y, state = self._recurrence(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[:, t:t + 1],
                                            b[:, t:t + 1], state, None if mask is None else mask[:, t:t + 1], phase)
                outs.append(y)
                states.append(state)
            out, kept = mx.concatenate(outs, axis=1), (conv_states, states)
        else:
            out, state = self._recurrence(q, k, v, a, b, state, mask, phase)
        if cache is not None:
            cache[1] = state
            cache.advance(S)
            if self.evaluate_cache and S >= MIN_TOKENS and phase != TRAIN and not _on_metal():
                mx.eval([c for c in cache.cache if c is not None])
        if fused:
            out = kernels.silu(z, mx.fast.rms_norm(out, self.norm.weight, self.norm.eps)).astype(out.dtype)
        else:
            out = self.norm(out, z)
        out = project(self.out_proj, out.reshape(B, S, -1), phase)
        if self.sharding_group is not None:
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return (out, kept) if keep_states else out

    def _decode_steps(self, qkv, z, a, b, mask, cache, phase):
        """Decode steps, each in one kernel call from the projections' outputs to out_proj's
        input (kernels.gdn_decode_step), one position after the other (so several positions
        compute what decoding them one by one does), keeping the states after each. A masked
        position (padding) leaves the states as they were, as in the step-by-step path (g = 1,
        beta = 0, zeros convolved in)."""
        B, S, _ = qkv.shape
        conv = cache[0] if cache[0] is not None else mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim))
        state = cache[1] if cache[1] is not None else \
            mx.zeros((B, self.num_v_heads, self.head_v_dim, self.head_k_dim))
        ys, convs, states = [], [], []
        for t in range(S):
            x, a_t, b_t = qkv[:, t], a[:, t], b[:, t]
            if mask is not None:  # a padded position leaves the states as they were
                keep = mask[:, t:t + 1]
                x, a_t, b_t = mx.where(keep, x, 0), mx.where(keep, a_t, -mx.inf), mx.where(keep, b_t, -mx.inf)
            y, conv, state = kernels.gdn_decode_step(
                x, z[:, t].reshape(B, -1), a_t, b_t, conv, self._conv_w_t, self.A_log,
                self.dt_bias, state, self.norm.weight, self.norm.eps, self.num_k_heads, self.head_k_dim)
            ys.append(y)
            convs.append(conv)
            states.append(state)
        cache[0], cache[1] = conv, state
        cache.advance(S)
        out = project(self.out_proj, ys[0][:, None] if S == 1 else mx.stack(ys, axis=1), phase)
        if self.sharding_group is not None:
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return out, (convs, states)

class Attention(nn.Module):
    """Qwen3.5's gated full attention (q with an output gate, q/k RMSNorm, partial rotary)."""

    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.num_key_value_heads = args.num_key_value_heads
        self.num_attention_heads = args.num_attention_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim ** -0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.num_attention_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_attention_heads * self.head_dim, args.hidden_size, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = initialize_rope(int(self.head_dim * args.partial_rotary_factor), base=args.rope_theta,
                                    traditional=False, scaling_config=args.rope_scaling,
                                    max_position_embeddings=args.max_position_embeddings)

    def __call__(self, x: mx.array, mask=None, cache=None, phase: str | None = None) -> mx.array:
        phase = phase_of(x, phase)
        B, L, _ = x.shape
        queries, gate = mx.split(project(self.q_proj, x, phase).reshape(B, L, self.num_attention_heads, -1),
                                 2, axis=-1)
        gate = gate.reshape(B, L, -1)
        keys, values = project(self.k_proj, x, phase), project(self.v_proj, x, phase)
        queries = self.q_norm(queries).transpose(0, 2, 1, 3)
        keys = self.k_norm(keys.reshape(B, L, self.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries, keys = self.rope(queries), self.rope(keys)
        if verifying(x, phase) and cache is not None:
            out = self._rows(queries, keys, values, cache, mask)
        else:
            out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return project(self.o_proj, out * mx.sigmoid(gate), phase)


    def remember(self, x: mx.array, cache, phase: str) -> None:
        """Only the keys and values of `x` into `cache` (what a call would add to it, without
        its queries and output): positions later queries attend to, nobody reads now."""
        B, L, _ = x.shape
        keys, values = project(self.k_proj, x, phase), project(self.v_proj, x, phase)
        keys = self.k_norm(keys.reshape(B, L, self.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        cache.update_and_fetch(self.rope(keys, offset=cache.offset), values)

    def _rows(self, queries, keys, values, cache, mask):
        """A decode step of several positions per sequence (a verify step): each position as
        the one-position step that would have computed it (the same keys, the same call), so
        its logits are bit for bit a plain decode step's (CPU attention is a BLAS product whose
        rounding depends on the number of query rows)."""
        L, n = queries.shape[2], keys.shape[2]
        outs = []
        for t in range(L):
            end = n - L + t + 1
            m = mask[..., t:t + 1, :end] if isinstance(mask, mx.array) else None
            outs.append(scaled_dot_product_attention(queries[:, :, t:t + 1], keys[:, :, :end], values[:, :, :end],
                                                     cache=cache, scale=self.scale, mask=m))
        return mx.concatenate(outs, axis=2)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.fused = False  # build(): the SwiGLU on the kernels

    def __call__(self, x, phase: str | None = None) -> mx.array:
        phase = phase_of(x, phase)
        g, u = project(self.gate_proj, x, phase), project(self.up_proj, x, phase)
        if self.fused and phase != TRAIN:
            # where both projections ran on the kernels (evaluated outputs) the SiLU does too,
            # for any number of rows: no synchronisation, and down_proj's input needs none
            on = all(isinstance(p, Projection) and p.on_kernels(x, phase) for p in (self.gate_proj, self.up_proj))
            h = kernels.silu(g, u, evaluated=on)
        else:
            h = swiglu(g, u)
        return project(self.down_proj, h, phase)


class SparseMoeBlock(nn.Module):
    """Routed experts (mlx-lm's SwitchGLU, on MLX's gather kernels) plus a gated shared expert."""

    def __init__(self, args: TextModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.norm_topk_prob = args.norm_topk_prob
        self.num_experts = args.num_experts
        self.top_k = args.num_experts_per_tok
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(dim, args.moe_intermediate_size, args.num_experts)
        self.shared_expert = MLP(dim, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)
        self.sharding_group = None
        # > 0: routed experts computed this many experts at a time, each chunk's weights cast to
        # the input's dtype on their own (quantizing at 256 experts: never a whole layer's
        # experts in float32); 0: SwitchGLU over all of them
        self.expert_chunk = 0

    def __call__(self, x, phase: str | None = None) -> mx.array:
        phase = phase_of(x, phase)
        if self.sharding_group is not None:
            x = sum_gradients(self.sharding_group)(x)
        gates = mx.softmax(project(self.gate, x, phase), axis=-1, precise=True)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        if self.expert_chunk:
            y = self._routed_in_chunks(x, inds, scores)
        else:
            y = (self.switch_mlp(x, inds) * scores[..., None]).sum(axis=-2)
        shared = mx.sigmoid(project(self.shared_expert_gate, x, phase)) * self.shared_expert(x, phase)
        y = y + shared
        if self.sharding_group is not None:
            y = mx.distributed.all_sum(y, group=self.sharding_group)
        return y


    def _routed_in_chunks(self, x: mx.array, inds: mx.array, scores: mx.array) -> mx.array:
        """The routed experts' sum, `expert_chunk` experts at a time: the (token, slot) pairs
        routed into a chunk run against that chunk's weights only (evaluated per chunk)."""
        import numpy as np

        sw = self.switch_mlp
        flat = x.reshape(-1, x.shape[-1])
        routes = np.array(inds.reshape(flat.shape[0], -1))
        weights = scores.reshape(flat.shape[0], -1).astype(x.dtype)
        out = mx.zeros_like(flat)
        for e0 in range(0, self.num_experts, self.expert_chunk):
            tok, slot = np.nonzero((routes >= e0) & (routes < e0 + self.expert_chunk))
            if tok.size == 0:
                continue
            t, k = mx.array(tok), mx.array(slot)
            experts = mx.array(routes[tok, slot] - e0)
            xs = flat[t][:, None, :]

            def proj(layer, h):
                if hasattr(layer, "observe"):  # a wrapper that records its inputs (quantizing): per expert
                    layer.observe(h, experts=experts + e0, n_experts=self.num_experts, weights=weights[t, k],
                                  tokens=tok.size / routes.shape[1])
                e1 = e0 + self.expert_chunk
                if "scales" in layer:  # quantized experts: this chunk dequantized on its own
                    w = mx.dequantize(layer.weight[e0:e1], layer.scales[e0:e1], layer.biases[e0:e1],
                                      group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
                else:
                    w = layer.weight[e0:e1]
                return mx.gather_mm(h, w.astype(x.dtype).swapaxes(-1, -2), rhs_indices=experts)

            h = swiglu(proj(sw.gate_proj, xs), proj(sw.up_proj, xs))
            y = proj(sw.down_proj, h)[:, 0, :] * weights[t, k][:, None]
            out = out.at[t].add(y)
            mx.eval(out)
        return out.reshape(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, args: TextModelArgs, layer_idx: int, linear: bool | None = None):
        super().__init__()
        self.is_linear = (layer_idx + 1) % args.full_attention_interval != 0 if linear is None else linear
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = Attention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = SparseMoeBlock(args) if args.num_experts > 0 else MLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x, mask=None, cache=None, phase: str | None = None, keep_states: bool = False):
        """The layer's output; with `keep_states` on a GatedDeltaNet layer, also its states after
        each position (GatedDeltaNet.__call__), else None beside it."""
        phase = phase_of(x, phase)
        kept = None
        if self.is_linear:
            r = self.linear_attn(self.input_layernorm(x), mask, cache, phase, keep_states=keep_states)
            if keep_states:
                r, kept = r
        else:
            r = self.self_attn(self.input_layernorm(x), mask, cache, phase)
        h = x + r
        out = h + self.mlp(self.post_attention_layernorm(h), phase)
        return (out, kept) if keep_states else out


class TextModel(nn.Module):
    """Embeddings, the decoder layers and the final norm (mlx-lm's `Qwen3_5TextModel`)."""

    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        linear = [i for i, layer in enumerate(self.layers) if layer.is_linear]
        full = [i for i, layer in enumerate(self.layers) if not layer.is_linear]
        self.ssm_idx = linear[0] if linear else None
        self.fa_idx = full[0] if full else None

    def __call__(self, inputs, cache=None, input_embeddings=None, phase: str | None = None,
                 states: dict | None = None) -> mx.array:
        """The final normed hidden states; with a `states` dict, each GatedDeltaNet layer's
        states after every position are put in it by layer index."""
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        phase = phase_of(h, phase)
        if cache is None:
            cache = [None] * len(self.layers)
        fa_mask = create_attention_mask(h, cache[self.fa_idx]) if self.fa_idx is not None else None
        ssm_mask = create_ssm_mask(h, cache[self.ssm_idx]) if self.ssm_idx is not None else None
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            mask = ssm_mask if layer.is_linear else fa_mask
            if states is not None and layer.is_linear:
                h, states[i] = layer(h, mask=mask, cache=c, phase=phase, keep_states=True)
            else:
                h = layer(h, mask=mask, cache=c, phase=phase)
        return self.norm(h)


@dataclass
class DraftVocab:
    """The tokens the MTP head drafts from (`Model.set_draft_vocab`) and their output rows."""
    ids: mx.array
    head: object


class MTP(nn.Module):
    """Qwen3.5's multi-token-prediction head (`mtp.*`): fc over [norm(embed(x_{t+1})); norm(h_t)],
    one full-attention decoder layer with its own cache, a norm, and the model's output head.
    Built only where the checkpoint has its tensors."""

    def __init__(self, args: TextModelArgs, layers: int = 1):
        super().__init__()
        self.fc = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args, 0, linear=False) for _ in range(layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, embeddings, hidden, cache=None, phase: str | None = None) -> mx.array:
        """The head's hidden state for position t+1 from the embeddings of x_{t+1} and the
        model's hidden state h_t (both [B, T, H]); the caller applies the output head."""
        x = mx.concatenate([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1)
        phase = phase_of(x, phase)
        h = project(self.fc, x, phase)
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask=mask, cache=c, phase=phase)
        return self.norm(h)


    def remember(self, embeddings, hidden, cache, phase: str | None = None) -> None:
        """What `__call__` leaves in the head's caches, without its outputs: the last layer
        only stores its keys and values (the head follows the model this way; its outputs are
        needed only where it drafts)."""
        x = mx.concatenate([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1)
        phase = phase_of(x, phase)
        h = project(self.fc, x, phase)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers[:-1], cache):
            h = layer(h, mask=mask, cache=c, phase=phase)
        self.layers[-1].self_attn.remember(self.layers[-1].input_layernorm(h), cache[len(self.layers) - 1], phase)


class LanguageModel(nn.Module):
    """The text model and its output head (mlx-lm's `TextModel`), and the MTP head where the
    checkpoint has one (`mtp_layers`: decided by `Model.sanitize` from the weights)."""

    def __init__(self, args: TextModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = TextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.sharding_group = None

    def head(self, h, phase: str) -> mx.array:
        if self.args.tie_word_embeddings:
            table = self.model.embed_tokens
            if isinstance(table, Projection):
                return table.as_linear(h, phase)
            if verifying(h, phase):  # as `project` does
                return per_position(table.as_linear, h)
            return table.as_linear(h)
        out = project(self.lm_head, h, phase)
        if self.sharding_group is not None:
            out = gather_last_axis(out, self.sharding_group)
        return out

    def __call__(self, inputs, cache=None, input_embeddings=None, phase: str | None = None,
                 return_hidden: bool = False, states: dict | None = None):
        h = self.model(inputs, cache, input_embeddings=input_embeddings, phase=phase, states=states)
        logits = self.head(h, phase_of(h, phase))
        return (logits, h) if return_hidden else logits

    def make_cache(self):
        return [ArraysCache(size=2) if layer.is_linear else KVCache() for layer in self.model.layers]


_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
          ".q_norm.weight", ".k_norm.weight", "mtp.norm.weight", ".pre_fc_norm_embedding.weight",
          ".pre_fc_norm_hidden.weight")


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = LanguageModel(TextModelArgs.from_dict(args.text_config))

    def __call__(self, inputs, cache=None, input_embeddings=None, phase: str | None = None,
                 return_hidden: bool = False, states: dict | None = None):
        """Logits [B, T, V] of `inputs` [B, T] (and, with `return_hidden`, the final normed hidden
        states [B, T, H]). `phase`: models/forward/layers.py (None: PREFILL for T > 1, else
        DECODE). With a `states` dict: each GatedDeltaNet layer's (conv, recurrent) states after
        every position, by layer index (a multi-token step rolls back to any position with
        them: set cache[i][0], cache[i][1] to the states at that position)."""
        return self.language_model(inputs, cache=cache, input_embeddings=input_embeddings, phase=phase,
                                   return_hidden=return_hidden, states=states)

    @property
    def model(self):
        return self.language_model.model

    @property
    def layers(self):
        return self.language_model.model.layers

    @property
    def mtp(self):
        return self.language_model.get("mtp")

    def detach_mtp(self):
        """Removes the MTP head from the model (and its parameters) and returns it (or None)."""
        return self.language_model.pop("mtp", None)

    def make_cache(self, mtp: bool = False):
        """One cache per decoder layer; with `mtp` (and an MTP head), the head's own after them:
        a KV cache per MTP layer, then an ArraysCache holding the model's hidden state of the
        last token processed (`mtp_follow`). mlx-lm's batching methods treat them as any other
        layer's, and the model's layers ignore what follows theirs."""
        cache = self.language_model.make_cache()
        if mtp and self.mtp is not None:
            cache += [KVCache() for _ in self.mtp.layers] + [ArraysCache(size=1)]
        return cache

    def has_mtp_cache(self, cache: list) -> bool:
        return self.mtp is not None and len(cache) == len(self.layers) + len(self.mtp.layers) + 1

    def mtp_pairs(self, tokens, hidden, cache, phase: str | None = None):
        """The MTP head's hidden states (normed) for pairs (token x_p [B, T], the hidden state
        that precedes it [B, T, H]) appended to the head's caches in `cache` (make_cache(mtp=
        True)); `draft_logits` turns them into logits."""
        n = len(self.layers)
        emb = self.model.embed_tokens(tokens)
        return self.mtp(emb.astype(hidden.dtype), hidden, cache=cache[n:n + len(self.mtp.layers)], phase=phase)

    def mtp_remember(self, tokens, hidden, cache, phase: str | None = None) -> None:
        """`mtp_pairs` for the head's caches only (no outputs)."""
        n = len(self.layers)
        emb = self.model.embed_tokens(tokens)
        self.mtp.remember(emb.astype(hidden.dtype), hidden, cache[n:n + len(self.mtp.layers)], phase)

    def draft_logits(self, hidden, phase: str | None = None):
        return self.language_model.head(hidden, phase_of(hidden, phase))

    def set_draft_vocab(self, ids) -> None:
        """Drafts over the tokens `ids` only (None: the whole vocabulary): the MTP head's logits
        then come from those rows of the output head (FR-Spec). The model's own logits, which
        verify every draft, stay over the whole vocabulary, so outputs do not change; a token
        outside `ids` is never drafted."""
        if ids is None:
            self.draft_vocab = None
            return
        lm = self.language_model
        table = lm.model.embed_tokens if lm.args.tie_word_embeddings else lm.lm_head
        ids = mx.array(sorted(ids), dtype=mx.int32)
        self.draft_vocab = DraftVocab(ids, head_rows(table, ids))

    def draft_tokens(self, hidden, phase: str | None = None) -> mx.array:
        """The MTP head's greedy drafts [B, T] from its hidden states (`mtp_pairs`)."""
        vocab = getattr(self, "draft_vocab", None)
        if vocab is None:
            return mx.argmax(self.draft_logits(hidden, phase), axis=-1)
        return vocab.ids[mx.argmax(project(vocab.head, hidden, phase_of(hidden, phase)), axis=-1)]

    def mtp_follow(self, tokens, hidden, cache, phase: str | None = None, lengths=None) -> None:
        """Keeps the MTP head's caches in step with the model's: after the model processed
        `tokens` [B, T] with final hidden states `hidden` [B, T, H], the head takes the pairs
        (x_p, h_{p-1}) (h before the first: the one kept from the previous call, zeros at the
        start of a sequence) and keeps h of each row's last token (`lengths`: of a right-padded
        batch). Pair p sits at position p of the head's cache, as token p sits in the model's."""
        pending = cache[-1]
        B, T, H = hidden.shape
        before = pending[0] if pending[0] is not None else mx.zeros((B, 1, H), hidden.dtype)
        prev = mx.concatenate([before.astype(hidden.dtype), hidden[:, :-1]], axis=1) if T > 1 else before
        self.mtp_remember(tokens, prev, cache, phase)
        if lengths is None:
            pending[0] = hidden[:, -1:]
        else:
            pending[0] = mx.take_along_axis(hidden, (mx.array(lengths) - 1)[:, None, None], axis=1)

    def rollback(self, cache: list, states: dict, kept: int, verified: int) -> None:
        """After a step of `verified` positions per sequence, with the GatedDeltaNet `states` it
        kept (the `states` of the call), the caches as if only the first `kept` had been run:
        attention caches trimmed, GatedDeltaNet's conv and recurrent states the ones after
        position kept - 1 (no recompute). The MTP head's caches are the caller's."""
        if kept == verified:
            return
        for i in range(len(self.layers)):
            if i in states:
                conv, recurrent = states[i]
                cache[i][0], cache[i][1] = conv[kept - 1], recurrent[kept - 1]
            else:
                cache[i].trim(verified - kept)

    def mtp_state(self, cache: list) -> list:
        """The arrays the MTP head's caches hold (to evaluate with a step)."""
        n = len(self.layers)
        out = [c.state for c in cache[n:-1]]
        return out + [a for a in cache[-1].cache if a is not None]

    def sanitize(self, weights: dict) -> dict:
        """The checkpoint's names and conventions as mlx-lm's qwen3_5 takes them (vision tower
        dropped; conv1d weights moved to MLX's layout; zero-centred norms +1 for a Hugging Face
        checkpoint), except that an MTP head is kept: its module is built here when its
        tensors are present."""
        lm = self.language_model
        out = {}
        for key, value in weights.items():
            if key.startswith(("vision_tower", "model.visual")):
                continue
            if key.startswith("model.language_model"):
                key = key.replace("model.language_model", "language_model.model")
            elif key.startswith("mtp."):
                key = "language_model." + key
            elif not key.startswith("language_model."):
                key = "language_model." + key
            out[key] = value
        out = self._fuse_experts(out)
        hf_layout = any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in out.items())
        if lm.args.tie_word_embeddings:
            out.pop("language_model.lm_head.weight", None)
        for k, v in list(out.items()):
            if "conv1d.weight" in k and v.shape[-1] != 1:
                out[k] = v.moveaxis(2, 1)
            if hf_layout and k.endswith(_NORMS) and v.ndim == 1:
                out[k] = v + 1.0
        mtp_layers = {int(k.split(".")[3]) for k in out if k.startswith("language_model.mtp.layers.")}
        if mtp_layers:
            lm.mtp = MTP(lm.args, max(mtp_layers) + 1)
        return out

    def _fuse_experts(self, weights: dict) -> dict:
        """MoE checkpoints: routed experts stacked as SwitchGLU's [experts, out, in] tensors."""
        args = self.language_model.args
        if args.num_experts <= 0:
            return weights
        prefixes = {k.rsplit(".mlp.", 1)[0] + ".mlp" for k in weights if ".mlp.experts." in k}
        for prefix in prefixes:
            fused = weights.pop(f"{prefix}.experts.gate_up_proj", None)
            if fused is not None:  # Qwen3.5's fused layout
                mid = fused.shape[-2] // 2
                weights[f"{prefix}.switch_mlp.gate_proj.weight"] = fused[..., :mid, :]
                weights[f"{prefix}.switch_mlp.up_proj.weight"] = fused[..., mid:, :]
                weights[f"{prefix}.switch_mlp.down_proj.weight"] = weights.pop(f"{prefix}.experts.down_proj")
                continue
            for name in ("gate_proj", "up_proj", "down_proj"):  # one tensor per expert
                for part in ("weight", "scales", "biases"):
                    keys = [f"{prefix}.experts.{e}.{name}.{part}" for e in range(args.num_experts)]
                    if keys[0] in weights:
                        weights[f"{prefix}.switch_mlp.{name}.{part}"] = mx.stack([weights.pop(k) for k in keys])
        return weights

    def shard(self, group=None):
        """Tensor parallelism over `group`'s ranks (mx.distributed), before `build`: each rank
        holds a slice of every projection, as mlx-lm's qwen3_5 shards."""
        group = group or mx.distributed.init()
        n, rank = group.size(), group.rank()
        lm = self.language_model
        if not lm.args.tie_word_embeddings:
            assert lm.args.vocab_size % n == 0, f"group size {n} must divide vocab_size {lm.args.vocab_size}"
            lm.lm_head = shard_linear(lm.lm_head, "all-to-sharded", group=group)
            lm.sharding_group = group

        def repeat_heads(layer, heads):  # fewer KV heads than ranks: each rank gets copies
            if n <= heads:
                return

            def _repeat(p):
                s = p.shape
                return mx.repeat(p.reshape(heads, s[0] // heads, *s[1:]), n // heads, axis=0).reshape(-1, *s[1:])
            layer.update(tree_map(_repeat, layer.parameters()))

        for layer in self.layers:
            if layer.is_linear:
                gdn = layer.linear_attn
                kd = gdn.key_dim
                gdn.sharding_group = group
                shard_inplace(gdn.conv1d, lambda p, w, kd=kd: (0, [kd, 2 * kd]), group=group)
                gdn.conv1d.groups //= n
                shard_inplace(gdn.in_proj_qkv, "all-to-sharded", segments=[kd, 2 * kd], group=group)
                for proj in (gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a):
                    shard_inplace(proj, "all-to-sharded", group=group)
                gdn.dt_bias = mx.contiguous(mx.split(gdn.dt_bias, n)[rank])
                gdn.A_log = mx.contiguous(mx.split(gdn.A_log, n)[rank])
                shard_inplace(gdn.out_proj, "sharded-to-all", group=group)
                gdn.num_k_heads //= n
                gdn.num_v_heads //= n
                gdn.key_dim //= n
                gdn.value_dim //= n
                gdn.conv_dim //= n
            else:
                attn = layer.self_attn
                attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
                attn.q_proj = shard_linear(attn.q_proj, "all-to-sharded", group=group)
                repeat_heads(attn.k_proj, attn.num_key_value_heads)
                repeat_heads(attn.v_proj, attn.num_key_value_heads)
                attn.k_proj = shard_linear(attn.k_proj, "all-to-sharded", group=group)
                attn.v_proj = shard_linear(attn.v_proj, "all-to-sharded", group=group)
                attn.num_attention_heads //= n
                attn.num_key_value_heads = max(1, attn.num_key_value_heads // n)
            mlp = layer.mlp
            if isinstance(mlp, MLP):
                mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
                mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
                mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
            else:
                mlp.sharding_group = group
                for part in (mlp.shared_expert, mlp.switch_mlp):
                    shard_inplace(part.gate_proj, "all-to-sharded", group=group)
                    shard_inplace(part.down_proj, "sharded-to-all", group=group)
                    shard_inplace(part.up_proj, "all-to-sharded", group=group)

    @property
    def quant_predicate(self):
        if self.language_model.args.num_experts <= 0:
            return None

        def predicate(path, _):
            if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
                return {"group_size": 64, "bits": 8}
            return True

        return predicate

    @property
    def cast_predicate(self):
        return lambda path: not path.endswith("A_log")


def build(model: Model, plan=None, *, mlx_quantized_prompts: bool = False, dtype=None) -> dict:
    """Makes every projection of a loaded `model` the one `plan` (models/forward/plan.CpuPlan)
    says, by constructing mixbit's modules from the loaded layers' arrays: packed on the kernels
    (PackedLinear/PackedEmbedding) or dense float32 in MLX's graph (DenseLinear; also the
    quantized projections too small for the plan). Without a plan: `mlx_quantized_prompts`
    keeps quantized layers packed on MLX's kernels with prompts through a dequantized weight,
    else they are dequantized once. Returns {"packed": n, "dense": n}."""
    from .plan import candidates, shape_key

    counts = {"packed": 0, "dense": 0}
    packed_paths = {path for path, _, _ in candidates(model, plan.small)} if plan is not None else set()
    swaps = []
    for path, module in model.named_modules():
        if type(module) not in (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding):
            continue  # already mixbit's, sharded layers, and others keep their own computation
        sp = plan.for_shape(shape_key(module)) if path in packed_paths else None
        if sp is not None and sp.runs == "packed":
            head = path.endswith("lm_head")
            swaps.append((path, PackedEmbedding(module, sp) if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding))
                          else PackedLinear(module, sp, head=head)))
            counts["packed"] += 1
        elif isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            if plan is None and mlx_quantized_prompts:
                swaps.append((path, mlx_quantized(module)))
            else:
                swaps.append((path, dense(module, dtype)))
                counts["dense"] += sp is not None
        elif isinstance(module, nn.Linear):
            swaps.append((path, dense(module, dtype)))
            counts["dense"] += sp is not None
        elif dtype is not None and module.weight.dtype != dtype:  # a float table: the compute dtype
            swaps.append((path, dense(module, dtype)))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    if plan is not None and plan.packed_any:  # real size: the convolutions and SiLUs too
        for _, module in model.named_modules():
            if isinstance(module, GatedDeltaNet) and module.conv1d.groups == module.conv_dim:
                module.fuse()
            elif isinstance(module, MLP):
                module.fused = True
    return counts
