"""The embedded model as GGUF for llama.cpp (`mixbit export`), and llama-perplexity's KL protocol
that measures mixbit's variants and llama.cpp's quants on the same tokens (docs/llama-quality.md).

Without llama.cpp the GGUF is checked as llama.cpp's loader reads it (names, shapes, metadata,
tokens) and against the weights mixbit computes with; with llama.cpp built
(`tests/bench/llama_quality.py` builds it into .cache/llama.cpp; `make test` does not), llama.cpp
itself tokenizes and scores it: same tokens, logits within float tolerance of mixbit's."""

from __future__ import annotations

import ast
import re
import json
import subprocess
import time

import mlx.core as mx
import numpy as np
import pytest

from mixbit.quant import llama_kld as L
from mixbit.quant.gguf_export import GGUFExportError, ggml_type_for, tensor_types, write_gguf
from tests.bench.llama_cpp import kl_divergence, tool

from .conftest import EMBEDDED, run_cli

gguf = pytest.importorskip("gguf")
CFG = json.loads((EMBEDDED / "config.json").read_text())["text_config"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(EMBEDDED, tmp_path_factory.mktemp("gguf") / "tiny-bf16.gguf")


@pytest.fixture(scope="module")
def reader(tiny_gguf):
    return gguf.GGUFReader(str(tiny_gguf))


def _field(reader, key):
    f = reader.fields[key]
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode() for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]].tolist()[0]


def test_gguf_metadata_is_what_llamas_qwen35_loader_reads(reader):
    assert _field(reader, "general.architecture") == "qwen35"
    n = CFG["num_hidden_layers"]
    assert _field(reader, "qwen35.block_count") == n + 1  # the MTP block after the decoder's
    assert _field(reader, "qwen35.nextn_predict_layers") == 1
    assert _field(reader, "qwen35.embedding_length") == CFG["hidden_size"]
    assert _field(reader, "qwen35.feed_forward_length") == CFG["intermediate_size"]
    assert _field(reader, "qwen35.attention.head_count_kv") == CFG["num_key_value_heads"]
    assert _field(reader, "qwen35.ssm.time_step_rank") == CFG["linear_num_value_heads"]
    assert _field(reader, "qwen35.ssm.group_count") == CFG["linear_num_key_heads"]
    assert _field(reader, "qwen35.rope.dimension_count") == 16  # head_dim 64 x partial rotary 0.25
    assert _field(reader, "qwen35.rope.dimension_sections") == [4, 2, 2, 0]
    assert _field(reader, "qwen35.attention.recurrent_layers") == [
        t == "linear_attention" for t in CFG["layer_types"]] + [False]
    names = {t.name for t in reader.tensors}
    assert {f"blk.{n}.nextn.{t}.weight" for t in ("eh_proj", "enorm", "hnorm", "shared_head_norm")} <= names
    assert {f"blk.{n}.attn_q.weight", f"blk.{n}.ffn_down.weight", f"blk.{n}.attn_norm.weight"} <= names
    assert not any(x.startswith(f"blk.{n}.ssm") for x in names)  # the MTP layer is full attention
    assert "output.weight" not in names  # tied: llama.cpp reuses token_embd
    # qwen35's tensors, and the nextn ones llama.cpp's qwen35 loader reads for the MTP block (the
    # PyPI gguf package lists those for other architectures only)
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN35]}
    allowed |= {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSOR if t.name.startswith("NEXTN_")}
    for n in names:
        base = n.rsplit(".", 1)[0] if n.endswith((".weight", ".bias")) else n
        assert re.sub(r"^blk\.\d+\.", "blk.{bid}.", base) in allowed, n


def test_gguf_tokens_are_the_models_own(reader):
    spec = json.loads((EMBEDDED / "tokenizer.json").read_text())
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = {**spec["model"]["vocab"], **{a["content"]: a["id"] for a in spec["added_tokens"]}}
    assert len(tokens) == CFG["vocab_size"]
    assert all(tokens[i] == t for t, i in vocab.items())
    types = _field(reader, "tokenizer.ggml.token_type")
    assert types[vocab["<|im_start|>"]] == gguf.TokenType.CONTROL
    assert types[vocab["<tool_call>"]] == gguf.TokenType.USER_DEFINED  # rendered as text, like Qwen's
    assert types[vocab["the"]] == gguf.TokenType.NORMAL
    assert len(_field(reader, "tokenizer.ggml.merges")) == len(spec["model"]["merges"])
    assert _field(reader, "tokenizer.ggml.pre") == "qwen35"
    assert _field(reader, "tokenizer.ggml.eos_token_id") == vocab["<|im_end|>"]
    assert _field(reader, "tokenizer.ggml.add_bos_token") is False
    assert _field(reader, "tokenizer.chat_template") == (EMBEDDED / "chat_template.jinja").read_text()


def test_gguf_tensors_are_the_weights_mixbit_computes_with(reader, loaded_tiny):
    """Against the model mixbit loads (mlx-lm's sanitize made the norms' +1 and conv layout), in
    ggml's layout: value heads tiled (GGUF head j = key group j % nk, value r = j // nk)."""
    from mlx.utils import tree_flatten

    params = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(loaded_tiny.model.parameters())}
    got = {t.name: t for t in reader.tensors}

    def f32(name):
        t = got[name]
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:  # raw bytes: bfloat16 is float32's top half
            return (np.array(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        return np.array(t.data, dtype=np.float32)

    nk, nv, dv = CFG["linear_num_key_heads"], CFG["linear_num_value_heads"], CFG["linear_value_head_dim"]
    hf_head = [(j % nk) * (nv // nk) + j // nk for j in range(nv)]
    p = "language_model.model."
    assert np.array_equal(f32("token_embd.weight"), params[p + "embed_tokens.weight"])
    assert np.array_equal(f32("output_norm.weight"), params[p + "norm.weight"])
    checked = 0
    for i, kind in enumerate(CFG["layer_types"]):
        lp = f"{p}layers.{i}."
        assert np.array_equal(f32(f"blk.{i}.attn_norm.weight"), params[lp + "input_layernorm.weight"])
        assert np.array_equal(f32(f"blk.{i}.ffn_down.weight"), params[lp + "mlp.down_proj.weight"])
        if kind == "full_attention":
            assert np.array_equal(f32(f"blk.{i}.attn_q.weight"), params[lp + "self_attn.q_proj.weight"])
            assert np.array_equal(f32(f"blk.{i}.attn_q_norm.weight"), params[lp + "self_attn.q_norm.weight"])
            continue
        la = lp + "linear_attn."
        z, out = f32(f"blk.{i}.attn_gate.weight"), f32(f"blk.{i}.ssm_out.weight")
        for j, h in enumerate(hf_head):
            assert np.array_equal(z[j * dv:(j + 1) * dv], params[la + "in_proj_z.weight"][h * dv:(h + 1) * dv])
            assert np.array_equal(out[:, j * dv:(j + 1) * dv], params[la + "out_proj.weight"][:, h * dv:(h + 1) * dv])
        np.testing.assert_allclose(f32(f"blk.{i}.ssm_a"), -np.exp(params[la + "A_log"])[hf_head], rtol=1e-6)
        assert np.array_equal(f32(f"blk.{i}.ssm_dt.bias"), params[la + "dt_bias"][hf_head])
        assert np.array_equal(f32(f"blk.{i}.ssm_norm.weight"), params[la + "norm.weight"])
        conv = params[la + "conv1d.weight"][:, :, 0]  # MLX [channels, kernel, 1]
        qk = 2 * nk * CFG["linear_key_head_dim"]
        assert np.array_equal(f32(f"blk.{i}.ssm_conv1d.weight")[:qk], conv[:qk])
        checked += 1
    assert checked == CFG["layer_types"].count("linear_attention")
    # the MTP head (its norms with the +1 too), as the block after the decoder's
    n, m = CFG["num_hidden_layers"], "language_model.mtp."
    for gname, name in (("nextn.eh_proj", "fc"), ("nextn.enorm", "pre_fc_norm_embedding"),
                        ("nextn.hnorm", "pre_fc_norm_hidden"), ("nextn.shared_head_norm", "norm"),
                        ("attn_norm", "layers.0.input_layernorm"), ("attn_q", "layers.0.self_attn.q_proj"),
                        ("attn_k_norm", "layers.0.self_attn.k_norm"), ("post_attention_norm",
                        "layers.0.post_attention_layernorm"), ("ffn_up", "layers.0.mlp.up_proj")):
        assert np.array_equal(f32(f"blk.{n}.{gname}.weight"), params[m + name + ".weight"]), gname


def test_export_cli_writes_gguf_atomically_and_refuses_with_a_message(tmp_path):
    out = tmp_path / "tiny.gguf"
    r = run_cli("export", "--gguf", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["gguf"]["bytes"] == out.stat().st_size
    assert gguf.GGUFReader(str(out)).fields["general.architecture"]
    types = tmp_path / "types.txt"
    r = run_cli("export", "--tensor-types", str(types), "--recipe", "uniform-4",
                "--set", f"model.cache_dir={tmp_path / 'cache'}")
    assert r.returncode == 0, r.stderr
    lines = types.read_text().split()
    assert json.loads(r.stdout.strip().splitlines()[-1])["tensor_types"]["tensors"] == len(lines) > 0
    mtp_block = f"^blk\\.{CFG['num_hidden_layers']}\\."
    assert "^token_embd\\.weight$=q4_K" in lines
    assert all(line.endswith("=q6_K" if line.startswith(mtp_block) else "=q4_K") for line in lines)
    assert f"{mtp_block}nextn\\.eh_proj\\.weight$=q6_K" in lines  # the head at the variant's MTP format
    r = run_cli("export", "--tensor-types", str(types), "--recipe", "uniform-4", "--no-mtp", "--gguf",
                str(tmp_path / "no-mtp.gguf"), "--set", f"model.cache_dir={tmp_path / 'cache'}")
    assert r.returncode == 0, r.stderr
    assert not any(line.startswith(mtp_block) for line in types.read_text().split())
    no_mtp = gguf.GGUFReader(str(tmp_path / "no-mtp.gguf"))
    assert not any("nextn" in t.name for t in no_mtp.tensors)
    assert _field(no_mtp, "qwen35.block_count") == CFG["num_hidden_layers"]
    types.unlink()
    (tmp_path / "no-mtp.gguf").unlink()
    r = run_cli("export")
    assert r.returncode == 2 and "nothing to export" in r.stderr
    r = run_cli("export", "--gguf", str(tmp_path / "missing" / "x.gguf"))
    assert r.returncode == 2 and "No such file" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "tiny.gguf"]  # nothing half-written


def test_a_tokenizer_llama_would_split_differently_is_refused(tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(EMBEDDED, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(GGUFExportError, match="Qwen3.5's regex"):
        write_gguf(folder, tmp_path / "x.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


def test_ggml_types_follow_stored_bits():
    assert ggml_type_for(4.5) == "q4_K"  # q4g64
    assert ggml_type_for(4.25) == "iq4_xs"  # q4g128
    assert ggml_type_for(6.5) == "q6_K"
    assert ggml_type_for(3.5) == "q3_K"
    assert ggml_type_for(16.0) == "bf16"


@pytest.fixture(scope="module")
def uniform4(tmp_path_factory):
    from mixbit.models.registry import resolve
    from mixbit.quant.variants import quantize

    out = tmp_path_factory.mktemp("u4") / "uniform-4"
    quantize(resolve("embedded:tiny-qwen3.5"), "uniform-4", out)
    return out


def _logits_of(lm):
    from mixbit.models.forward import score

    return lambda t: np.array(score(lm.model, mx.array(t)[None]).astype(mx.float32)[0])


@pytest.fixture(scope="module")
def base(loaded_tiny, tmp_path_factory):
    from mixbit.quant import calibration as calib

    rows = calib.build(loaded_tiny.tokenizer, n_rows=4, length=256, split="heldout").rows
    return L.write_base(tmp_path_factory.mktemp("kl") / "base.bin", np.array(rows), _logits_of(loaded_tiny))


def test_base_file_round_trips_within_its_16_bit_step(base, loaded_tiny):
    logits = _logits_of(loaded_tiny)(base.tokens[1])[base.first:base.n_ctx - 1].astype(np.float64)
    exact = logits - logits.max(1, keepdims=True)
    exact -= np.log(np.exp(exact).sum(1, keepdims=True))
    stored = base.log_probs(1)
    kept = exact > exact.max(1, keepdims=True) - 15
    step = (logits.max(1) - np.maximum(logits.min(1), logits.max(1) - 16)) / 65535
    assert np.all(np.abs(stored - exact)[kept] <= (step[:, None] * 0.51 + 1e-5).repeat(exact.shape[1], 1)[kept])
    cut = base.path.with_name("cut.bin")
    cut.write_bytes(base.path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="cut short"):
        L.read_base(cut)


def test_kld_protocol_agrees_with_the_exact_kl(base, loaded_tiny, uniform4):
    """The same model scores ~0; a quantized one the float KL of the same positions, to the
    16-bit storage's precision."""
    from mixbit.models.loading import load
    from mixbit.models.registry import resolve

    same = L.kld(base, _logits_of(loaded_tiny))
    assert abs(same.mean) < 2e-6 and same.top1 == 1.0
    lm = load(resolve("embedded:tiny-qwen3.5"), path=uniform4, dequantize=True)
    got = L.kld(base, _logits_of(lm))
    exact = []
    for c in range(base.n_chunk):
        ref = _logits_of(loaded_tiny)(base.tokens[c])[base.first:base.n_ctx - 1].astype(np.float64)
        q = _logits_of(lm)(base.tokens[c])[base.first:base.n_ctx - 1].astype(np.float64)
        ref -= np.log(np.exp(ref - ref.max(1, keepdims=True)).sum(1, keepdims=True)) + ref.max(1, keepdims=True)
        q -= np.log(np.exp(q - q.max(1, keepdims=True)).sum(1, keepdims=True)) + q.max(1, keepdims=True)
        exact.append((np.exp(ref) * (ref - q)).sum(1))
    exact = float(np.concatenate(exact).mean())
    assert exact > 1e-3  # uniform-4 is measurably off
    assert got.mean == pytest.approx(exact, rel=0.01)


def needs(program: str):
    return pytest.mark.skipif(tool(program) is None, reason=f"{program} not built (make llama-quality builds it)")


@needs("llama-tokenize")
def test_llama_cpp_tokenizes_as_mixbit_does(tiny_gguf, loaded_tiny, tmp_path):
    from mixbit.quant import calibration as calib

    tok = loaded_tiny.tokenizer
    text = "".join(calib.render(tok, d) for d in calib.builtin_documents(12, "heldout"))
    text += "\nnaïve café 東京 🙂  tabs\tand  spaces\n\n\n12345.678 don't I'LL"
    (tmp_path / "t.txt").write_text(text)
    out = subprocess.run([str(tool("llama-tokenize")), "-m", str(tiny_gguf), "-f", str(tmp_path / "t.txt"),
                          "--ids", "--log-disable"], capture_output=True, text=True, check=True).stdout
    assert ast.literal_eval(out.strip()) == tok.encode(text, add_special_tokens=False)


@needs("llama-perplexity")
def test_llama_cpp_logits_of_the_bf16_gguf_match_mixbits(tiny_gguf, base, loaded_tiny):
    stats = kl_divergence(tiny_gguf, base.path, base.n_ctx)
    # llama.cpp multiplies bf16 weights with bf16-rounded activations: a floor of ~1e-5, far
    # below any 4-bit quant's (~5e-3)
    assert 0 <= stats["kld_mean"] < 1e-4
    assert stats["top1"] > 0.99
    # the same perplexity on the scored tokens as mixbit's own float32 forward
    assert stats["ppl"] == pytest.approx(L.kld(base, _logits_of(loaded_tiny)).ppl, rel=2e-3)


@needs("llama-quantize")
def test_tensor_type_file_sets_each_tensors_type(tiny_gguf, uniform4, tmp_path):
    lines = tensor_types(uniform4)
    (tmp_path / "types.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "q.gguf"
    subprocess.run([str(tool("llama-quantize")), "--tensor-type-file", str(tmp_path / "types.txt"),
                    str(tiny_gguf), str(out), "Q8_0", "1"], capture_output=True, check=True)
    types = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(str(out)).tensors}
    want = {line.split("=")[0].strip("^$").replace("\\", ""): line.split("=")[1].lower() for line in lines}
    assert want and all(types[n] == t for n, t in want.items())
    assert set(want.values()) == {"q4_k", "q6_k"}  # uniform-4: q4g64 everywhere, the MTP head q6g64


@needs("llama-server")
def test_llama_server_drafts_with_the_exported_mtp_head(tiny_gguf, loaded_tiny, tmp_path):
    """llama.cpp's own MTP drafting (`--spec-type draft-mtp`, one draft a step) on the exported head
    keeps about as many drafts as mixbit's drafting on the same held-out prompts: both feed the head
    x_{t+1} with h_t taken after the final norm (a head fed another position's hidden state would be
    kept near never), and both read the same exported weights."""
    import httpx

    from mixbit.server.speculative import Speculation
    from tests.bench.mtp_bench import decode, embedded_prompts
    from tests.bench.serve_bench import free_port

    prompts = embedded_prompts(loaded_tiny, 6)
    port = free_port()
    log = open(tmp_path / "llama-server.log", "w")
    proc = subprocess.Popen([str(tool("llama-server")), "-m", str(tiny_gguf), "--spec-type", "draft-mtp",
                             "--spec-draft-n-max", "1", "-t", "2", "-np", "1", "-c", "4096", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            assert proc.poll() is None, (tmp_path / "llama-server.log").read_text()[-2000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        drafted = accepted = 0
        for p in prompts:
            r = httpx.post(url + "/completion", json={"prompt": p, "n_predict": 48, "temperature": 0,
                                                      "top_k": 1, "cache_prompt": False}, timeout=120)
            assert r.status_code == 200, r.text
            t = r.json()["timings"]
            drafted += t.get("draft_n", 0)
            accepted += t.get("draft_n_accepted", 0)
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
    assert drafted > 50, (tmp_path / "llama-server.log").read_text()[-2000:]
    _, _, counters = decode(loaded_tiny, prompts, 48, sorted(loaded_tiny.tokenizer.eos_token_ids),
                            Speculation(drafts=1))
    llama_acceptance = accepted / drafted
    assert counters.acceptance > 0.6
    assert llama_acceptance == pytest.approx(counters.acceptance, abs=0.12)
