"""GatedDeltaNet's recurrence off mlx-lm's per-token Python loop, wherever mlx-lm has no Metal kernel.

mlx-lm runs GatedDeltaNet with a Metal kernel on Apple GPUs and, everywhere else, one Python loop
iteration per token (`gated_delta_ops`). For a prompt that loop dominates time to first token.
`install()` routes Qwen3.5's calls to mixbit's CPU kernel (`kernels.gated_delta`: token after
token in C, each head's state in cache; prompts and decode steps) where it is built, and prompts
to the chunk-parallel form below where it is not. It also makes a prompt's layer evaluate what it
leaves in the cache (`_state_evaluated`).

The chunk-parallel form, in MLX matrix ops: a prompt is cut into chunks of C tokens; inside a
chunk the recurrence is solved in closed form with one triangular inverse and a few matmuls, and
only the state hand-off between chunks is sequential (T / C steps instead of T). On one core of
this project's machine it took ~1 s of a 256-token prompt at the 0.8B shape, the kernel 0.23 s.

The math, per head, with state S (Dv x Dk), decay g_t, write strength b_t, key k_t, value v_t:
    S_t = g_t S_{t-1} + u_t k_t^T,     u_t = b_t (v_t - g_t S_{t-1} k_t),     y_t = S_t q_t
Inside a chunk with incoming state S_0 and cumulative decay G_i = g_1 ... g_i:
    (I + A) U = diag(b) V - diag(b G) K S_0^T,   A_ij = b_i (G_i / G_j) k_i.k_j  for j < i
    Y = diag(G) Q S_0^T + M U,                    M_ij = (G_i / G_j) q_i.k_j     for j <= i
    S_C = G_C S_0 + U^T diag(G_C / G) K
Masked (padding) positions get g = 1 and b = 0, so they leave the state untouched, exactly as the
loop does. Decays are handled in log space relative to the chunk, so no ratio overflows.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

CHUNK = 64
MIN_TOKENS = 2  # one-token decode steps keep mlx-lm's own step


def chunked_gated_delta(q, k, v, g, beta, state, mask=None, chunk: int = CHUNK):
    """Same contract as mlx-lm's `gated_delta_ops` for scalar gates.

    q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g, beta: [B, T, Hv]; state: [B, Hv, Dv, Dk];
    mask: [B, T] (True = real token) or None. Returns y [B, T, Hv, Dv] and the final state.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    out_dtype = q.dtype
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, axis=-2)
        k = mx.repeat(k, Hv // Hk, axis=-2)
    f32 = mx.float32
    # -> [B, H, T, D] in float32
    q, k, v = (x.astype(f32).transpose(0, 2, 1, 3) for x in (q, k, v))
    log_g = mx.log(mx.maximum(g.astype(f32), 1e-30)).transpose(0, 2, 1)  # [B, H, T]
    beta = beta.astype(f32).transpose(0, 2, 1)
    if mask is not None:
        keep = mask.astype(mx.bool_)[:, None, :]
        log_g = mx.where(keep, log_g, 0.0)
        beta = mx.where(keep, beta, 0.0)
    pad = (-T) % chunk
    if pad:
        q, k, v = (mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (q, k, v))
        log_g = mx.pad(log_g, [(0, 0), (0, 0), (0, pad)])
        beta = mx.pad(beta, [(0, 0), (0, 0), (0, pad)])
    n = (T + pad) // chunk
    # -> [B, H, n, C, D]
    q, k, v = (x.reshape(B, Hv, n, chunk, x.shape[-1]) for x in (q, k, v))
    log_g = log_g.reshape(B, Hv, n, chunk)
    beta = beta.reshape(B, Hv, n, chunk)

    cum = mx.cumsum(log_g, axis=-1)  # log G_i within each chunk
    diff = cum[..., :, None] - cum[..., None, :]  # log(G_i / G_j)
    lower = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_), k=-1)
    lower_eq = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_))
    decay_lower = mx.where(lower, mx.exp(mx.where(lower, diff, 0.0)), 0.0)
    decay_lower_eq = mx.where(lower_eq, mx.exp(mx.where(lower_eq, diff, 0.0)), 0.0)

    kk = k @ k.swapaxes(-1, -2)  # [B, H, n, C, C]
    a = beta[..., :, None] * decay_lower * kk
    eye = mx.eye(chunk, dtype=f32)
    # (I + A) is unit lower triangular: invert once per chunk, batched over everything.
    t_inv = mx.linalg.tri_inv((eye + a).reshape(-1, chunk, chunk), upper=False, stream=mx.cpu)
    t_inv = t_inv.reshape(B, Hv, n, chunk, chunk)
    gamma = mx.exp(cum)  # G_i  (<= 1)
    w_v = t_inv @ (beta[..., None] * v)  # part of U that does not depend on S_0
    w_k = t_inv @ ((beta * gamma)[..., None] * k)  # U = w_v - w_k S_0^T
    m = decay_lower_eq * (q @ k.swapaxes(-1, -2))
    q_dec = gamma[..., None] * q
    tail = mx.exp(cum[..., -1:] - cum)  # G_C / G_j
    k_tail = tail[..., None] * k
    g_last = mx.exp(cum[..., -1])  # G_C

    s = state.astype(f32)
    ys = []
    for c in range(n):
        s_t = s.swapaxes(-1, -2)  # [B, H, Dk, Dv]
        u = w_v[:, :, c] - w_k[:, :, c] @ s_t
        ys.append(q_dec[:, :, c] @ s_t + m[:, :, c] @ u)
        s = g_last[:, :, c, None, None] * s + u.swapaxes(-1, -2) @ k_tail[:, :, c]
    y = mx.concatenate(ys, axis=2)[:, :, :T]  # [B, H, T, Dv]
    return y.transpose(0, 2, 1, 3).astype(out_dtype), s


def _on_metal() -> bool:
    """mlx-lm has its own Metal kernel for the recurrence: nothing here applies."""
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def _kernel():
    """mixbit's CPU kernel, where it is built and the model runs on the CPU (it reads host
    buffers)."""
    from . import kernels

    return kernels.gated_delta if kernels.available() and mx.default_device() == mx.cpu else None


def _patched_update(original):
    from mlx_lm.models.gated_delta import compute_g, compute_lower_bound_g

    def gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *,
                           use_kernel=True, lower_bound=None, allow_neg_eigval=False):
        if _on_metal() or a.ndim != 3:
            return original(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
                            lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)
        beta = mx.sigmoid(b)
        if allow_neg_eigval:
            beta = beta * 2.0
        g = (compute_g(A_log, a, dt_bias) if lower_bound is None
             else compute_lower_bound_g(A_log, a, dt_bias, lower_bound))
        if g.ndim != 3:  # per-channel gates: not these algorithms
            return original(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
                            lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)
        if state is None:
            state = mx.zeros((q.shape[0], v.shape[2], v.shape[3], q.shape[3]), dtype=mx.float32)
        if use_kernel and _kernel() is not None:
            # mixbit's CPU kernel (models/kernels): token after token, each head's state in cache
            y, state = _kernel()(q, k, v, g, beta, state, mask)
            return y.astype(q.dtype), state
        if q.shape[1] < MIN_TOKENS:
            return original(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
                            lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)
        return chunked_gated_delta(q, k, v, g, beta, state, mask)

    gated_delta_update.__wrapped__ = original
    return gated_delta_update


PATCHED_MODULES = ("mlx_lm.models.qwen3_5", "mlx_lm.models.qwen3_next")


def install() -> None:
    """Routes GatedDeltaNet calls of Qwen3.5 / Qwen3-Next to mixbit's CPU kernel, or prompts to
    the chunked form, wherever mlx-lm has no Metal kernel (CPU, CUDA). Idempotent."""
    import importlib

    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        current = module.gated_delta_update
        if getattr(current, "__wrapped__", None) is None:
            module.gated_delta_update = _patched_update(current)
        for attr in dir(module):
            cls = getattr(module, attr)
            if isinstance(cls, type) and attr.endswith("GatedDeltaNet") \
                    and getattr(cls.__call__, "__wrapped__", None) is None:
                cls.__call__ = _state_evaluated(cls.__call__)


def _state_evaluated(original):
    """A prompt's GatedDeltaNet layer evaluates what it leaves in the cache before the next
    layer runs. Nothing reads the cache until the whole forward pass is done, so lazily it kept
    every layer's conv input (the conv state is a copy of its last rows) and chunk intermediates
    (the new state) alive at once: an 8x300-token prefill at the 0.8B shape held ~65 MB more per
    layer, 2.17 GB above the weights at its peak. One synchronisation per layer and prompt."""
    def __call__(self, inputs, mask=None, cache=None):
        out = original(self, inputs, mask, cache)
        if cache is not None and inputs.shape[1] >= MIN_TOKENS \
                and not _on_metal():
            mx.eval([c for c in getattr(cache, "cache", ()) if c is not None])
        return out

    __call__.__wrapped__ = original
    return __call__


@contextlib.contextmanager
def unpatched():
    """mlx-lm's own recurrence for the duration (e.g. for gradients: the chunked form's
    triangular inverse has no vector-Jacobian product in MLX)."""
    import importlib

    saved = {}
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        current = module.gated_delta_update
        if getattr(current, "__wrapped__", None) is not None:
            saved[module] = current
            module.gated_delta_update = current.__wrapped__
    try:
        yield
    finally:
        for module, fn in saved.items():
            module.gated_delta_update = fn
