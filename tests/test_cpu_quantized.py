"""How a quantized model runs on CPU (models/loading.py `cpu_quantized`): dequantized once at
load ("dense"), packed on mixbit's kernels ("packed"), or packed with prompts multiplied through
a transient dequantized weight and single decode rows through MLX's quantized kernel ("mlx").
Every path must compute the same function as the quantized kernels."""

from __future__ import annotations

import json

import httpx
import mlx.core as mx
import pytest

from mixbit.models import kernels

from mixbit.models.forward.layers import MlxQuantizedLinear
from mixbit.models.loading import load
from mixbit.models.registry import resolve

from .conftest import WEATHER

DENSE_ROWS = MlxQuantizedLinear.dense_rows
needs_kernels_for_server = pytest.mark.skipif(not kernels.available(),
                                              reason=f"no kernels: {kernels.IMPORT_ERROR}")


@pytest.fixture(scope="module")
def u4_folder(tmp_path_factory):
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("u4") / "tiny-u4"
    convert(str(resolve("embedded:tiny-qwen3.5").path), mlx_path=str(out), quantize=True,
            q_bits=4, q_group_size=64)
    return out


@pytest.fixture(scope="module")
def uniform4(u4_folder):
    return load(resolve("embedded:tiny-qwen3.5"), path=u4_folder, cpu_quantized="mlx")


def _prompt(lm):
    return mx.array([lm.tokenizer.encode("The weather in Oslo is cold; call get_weather. " * 8)])


def _set_rows(model, rows: int | None) -> int:
    n = 0
    for _, m in model.named_modules():
        if hasattr(m, "dense_rows"):
            m.dense_rows = rows
            n += 1
    return n


def test_every_quantized_layer_takes_the_cpu_path(uniform4):
    import mlx.nn as nn

    quantized = [m for _, m in uniform4.model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert quantized and all(hasattr(m, "dense_rows") for m in quantized)


def test_dense_prefill_equals_the_quantized_kernels(uniform4):
    model = uniform4.model
    ids = _prompt(uniform4)
    try:
        _set_rows(model, 1)  # every call through the dequantized weight
        dense = model(ids)
        _set_rows(model, 1 << 30)  # every call through quantized_matmul
        kernel = model(ids)
        mx.eval(dense, kernel)
    finally:
        _set_rows(model, DENSE_ROWS)
    assert ids.shape[1] > 64
    scale = float(mx.abs(kernel).max().item())
    assert float(mx.abs(dense - kernel).max().item()) < 1e-5 * max(scale, 1.0) * 10
    assert bool(mx.all(dense.argmax(-1) == kernel.argmax(-1)).item())


def test_auto_serves_every_layer_dense_or_on_the_kernels_to_the_same_function(uniform4, u4_folder):
    """auto: each quantized layer dequantized at load or served packed by mixbit's kernels,
    whichever measured faster here; none is left on MLX's slow CPU quantized_matmul."""
    import mlx.nn as nn

    dense = load(resolve("embedded:tiny-qwen3.5"), path=u4_folder)
    layers = [m for _, m in dense.model.named_modules()]
    left = [type(m).__name__ for m in layers if type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding)]
    assert not left
    ids = _prompt(dense)
    _set_rows(uniform4.model, 1 << 30)  # the packed model through quantized_matmul only
    try:
        kernel = uniform4.model(ids)
    finally:
        _set_rows(uniform4.model, DENSE_ROWS)
    got = dense.model(ids)
    scale = float(mx.abs(kernel).max().item())
    assert float(mx.abs(got - kernel).max().item()) < 1e-4 * max(scale, 1.0)
    assert bool(mx.all(got.argmax(-1) == kernel.argmax(-1)).item())


def test_packed_layers_keep_their_stored_bfloat16_scales(u4_folder):
    """Served packed, a quantized layer keeps its scales and biases as the variant stores them
    (bfloat16: no float32 copy in memory, half their bytes read in each decode step), and the
    model computes what it computes with them as float32: identical logits, prompt and decode."""
    from mlx_lm.models.cache import make_prompt_cache

    from mixbit.models.forward.layers import PackedEmbedding, PackedLinear

    if not kernels.available():
        pytest.skip(kernels.IMPORT_ERROR)
    packed = load(resolve("embedded:tiny-qwen3.5"), path=u4_folder, cpu_quantized="packed",
                  cpu_activations="float32")
    layers = [m for _, m in packed.model.named_modules()
              if isinstance(m, (PackedLinear, PackedEmbedding)) and m.bits != 16]
    assert layers and {(m.scales.dtype, m.biases.dtype) for m in layers} == {(mx.bfloat16, mx.bfloat16)}
    ids = _prompt(packed)

    def run():
        cache = make_prompt_cache(packed.model)
        steps = [packed.model(ids, cache=cache)[:, -1]]
        for t in (11, 12, 13):
            steps.append(packed.model(mx.array([[t]]), cache=cache)[:, -1])
        out = mx.concatenate(steps)
        mx.eval(out)
        return out

    stored = run()
    for m in layers:
        m.scales, m.biases = m.scales.astype(mx.float32), m.biases.astype(mx.float32)
    assert bool(mx.array_equal(stored, run()).item())


@pytest.mark.parametrize("activations,tolerance", [("float32", 1e-4), ("auto", 1e-3)])
def test_packed_kernels_compute_the_quantized_function(uniform4, u4_folder, activations, tolerance):
    """"packed": the tied head (4096 x 256, the one projection of this model past the kernels'
    size floor) multiplies on mixbit's kernel for decode rows; logits match MLX's kernels. With
    float32 activations to float rounding; under "auto" a VNNI CPU may take the decode rows' inputs
    as 16-bit integers per group (error bounded in test_kernels: relative 1/65024 of a group's
    largest input), so the logits agree to 1e-3 of their scale and pick the same token."""
    from mlx_lm.models.cache import make_prompt_cache

    from mixbit.models import kernels

    if not kernels.available():
        pytest.skip(kernels.IMPORT_ERROR)
    packed = load(resolve("embedded:tiny-qwen3.5"), path=u4_folder, cpu_quantized="packed",
                  cpu_activations=activations)
    kinds = {type(m).__name__ for _, m in packed.model.named_modules()}
    assert "PackedEmbedding" in kinds and packed.cpu_plan["packed"] >= 1
    ids = _prompt(packed)
    _set_rows(uniform4.model, 1 << 30)
    try:
        outs = []
        for model in (packed.model, uniform4.model):
            cache = make_prompt_cache(model)
            steps = [model(ids, cache=cache)[:, -1]]
            for t in (11, 12, 13):  # decode: one row each
                steps.append(model(mx.array([[t]]), cache=cache)[:, -1])
            outs.append(mx.concatenate(steps))
        mx.eval(outs)
    finally:
        _set_rows(uniform4.model, DENSE_ROWS)
    scale = float(mx.abs(outs[1]).max().item())
    assert float(mx.abs(outs[0] - outs[1]).max().item()) < tolerance * max(scale, 1.0)
    assert bool(mx.all(outs[0].argmax(-1) == outs[1].argmax(-1)).item())


@needs_kernels_for_server
def test_server_serves_a_variant_packed_from_its_own_thread(tmp_path):
    """`mixbit serve` with every layer packed (as a real-size variant runs): the engine's thread
    runs the kernels the loader's thread set up (MLX streams are per thread: a lazy array made
    at load failed there), for a short tool call and a prompt long enough for the prompt-size
    kernels (SiLU, convolution, recurrence over many tokens); the engine never reports an error."""
    import openai

    from .server_proc import ServerProcess

    s = ServerProcess('generation.cpu_quantized="packed"', recipe="uniform-4",
                      cache_dir=str(tmp_path)).wait_ready(600)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0)
        r = client.chat.completions.create(
            model="tiny-qwen3.5", messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
            tools=WEATHER, temperature=0, max_tokens=48)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
        long = " ".join(f"Note {i}: the weather in Oslo was mild." for i in range(40))
        r = client.chat.completions.create(
            model="tiny-qwen3.5", messages=[{"role": "user", "content": long + " Summarise the notes."}],
            temperature=0, max_tokens=16)
        assert r.usage.prompt_tokens > 200 and r.usage.completion_tokens > 0
        assert r.choices[0].finish_reason in ("stop", "length")
        plan = httpx.get(s.url + "/v1/models").json()["data"][0]["mixbit"]["cpu_plan"]
        assert plan["packed"] > 0 and plan["dense"] == 0 and plan["shapes"]
        assert "a decode step failed" not in s.log_path.read_text()
    finally:
        s.stop()


def test_engine_keeps_a_decode_steps_buffers_in_mlx_cache(loaded_tiny):
    """MLX's CPU buffer cache (32 MB by default) must hold what a decode step frees and
    allocates again at the engine's batch size (its logits, GatedDeltaNet states), or each comes
    from a fresh mapping: the limit is raised to 8x the largest, never lowered."""
    from mixbit.server.engine import Engine, step_buffer_bytes

    model = loaded_tiny.model
    text = getattr(model, "language_model", model).model
    vocab = text.embed_tokens.weight.shape[0]
    gdn = next(m for _, m in model.named_modules() if type(m).__name__ == "GatedDeltaNet")
    state = gdn.num_v_heads * gdn.head_v_dim * gdn.head_k_dim
    assert step_buffer_bytes(model, 256) == 4 * 256 * max(vocab, state)
    before = mx.set_cache_limit(32 << 20)
    try:
        engine = Engine(model, loaded_tiny.tokenizer, max_batch=256)
        assert engine.mlx_cache_limit == 8 * step_buffer_bytes(model, 256) > 32 << 20
        assert mx.set_cache_limit(1 << 40) == engine.mlx_cache_limit
        Engine(model, loaded_tiny.tokenizer, max_batch=1)  # a second, smaller engine: kept
        assert mx.set_cache_limit(1 << 40) == 1 << 40
    finally:
        mx.set_cache_limit(before)
