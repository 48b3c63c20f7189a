"""The variant written layer by layer: AWQ, quantization and the fidelity check in one streamed
pass, shards on disk as they are produced, resumable after a kill.

Per decoder layer: the unquantized layer runs on the calibration rows (AWQ's inputs, and the
next layer's) and on held-out rows (the reference); AWQ folds its scales into the layer's norms;
every quantizable tensor is quantized to its planned format; the quantized layer (dequantized,
float32) runs on its own held-out stream, so the measured KLD against the reference needs no
second pass and never touches MLX's CPU quantized kernels. Finished layers go into shards in a
partial folder beside the cache entry, with the hidden states needed to go on; a killed run
resumes after the last saved shard. The folder becomes the variant only when complete (one
rename), so a partial variant is never served.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from . import artifact
from .awq import awq_layer, group_inputs
from .formats import Format, dequantize, quantizable, quantize
from .progress import Progress
from .checkpoint import Checkpoint, Rows, read_header
from .stream import Float32Linear, LayerStream, _f32, _set_child

SHARD_BYTES = 1 << 30  # a shard is written once its layers reach this size
STATE = "state.json"
HIDDEN = "hidden.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "generation_config.json",
                   "added_tokens.json", "tokenizer.model")


@dataclass
class WriteResult:
    measured_kld: float
    measured_top1: float
    awq: list = field(default_factory=list)  # GroupResults
    mtp: dict = field(default_factory=dict)  # MTP tensor -> format name, kept beside the model
    shards: int = 0


def quantize_tensor(w: mx.array, fmt: Format, rows: int = 32768) -> dict[str, mx.array]:
    """weight (packed), scales and biases as MLX's quantized layers store them. A table read
    from its file (quant/checkpoint.Rows: the 248k-row embedding) comes in a chunk of rows at a
    time; formats.quantize keeps the fit's float32 temporaries small within each."""
    if isinstance(w, mx.array) or w.ndim != 2 or w.shape[0] <= rows:
        q, scales, biases = quantize(w if isinstance(w, mx.array) else w[:], fmt)
    else:
        pieces = []
        for s in range(0, w.shape[0], rows):
            pieces.append(quantize(w[s:s + rows], fmt))
            mx.eval(pieces[-1])
        q, scales, biases = (mx.concatenate([p[i] for p in pieces]) for i in range(3))
    return {"weight": q, "scales": scales, "biases": biases}


class _Shards:
    """Accumulates tensors and writes them as part-NNNNN.safetensors in the partial folder."""

    def __init__(self, folder: Path, start_index: int):
        self.folder, self.index = folder, start_index
        self.pending: dict[str, mx.array] = {}
        self.nbytes = 0

    def add(self, tensors: dict[str, mx.array]) -> None:
        mx.eval(tensors)
        self.pending.update(tensors)
        self.nbytes += sum(v.nbytes for v in tensors.values())

    def copy(self, name: str, rows: Rows) -> None:
        """One tensor stored as is, copied from the checkpoint's file into a part of its own
        (constant memory: a 248k-row bf16 table is never read whole)."""
        if self.pending:
            self.flush()
        self.index += 1
        part = self.folder / f"part-{self.index:05d}.safetensors"
        entry = rows.checkpoint.entries[rows.name]
        header = {"__metadata__": {"format": "mlx"},
                  name: {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [0, entry.nbytes]}}
        tmp = part.with_suffix(".tmp.safetensors")
        with open(tmp, "wb") as fh:
            fh.write(_header_bytes(header))
            _copy_bytes(fh, entry.file, entry.start, entry.nbytes)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, part)

    def quantized(self, path: str, rows: Rows, fmt: Format, chunk_bytes: int = 64 << 20) -> None:
        """A table on disk (`rows`: the embedding, an untied head) quantized a chunk of rows at
        a time into a part of its own: packed rows go to the file as they are made, only the
        scales and biases (1/8 of the packed bytes at 4 bits) wait for the end."""
        if self.pending:
            self.flush()
        self.index += 1
        part = self.folder / f"part-{self.index:05d}.safetensors"
        n = rows.shape[0]
        chunk = max(256, chunk_bytes // (2 * rows.shape[1]))  # rows per step (bf16 bytes)
        q0, s0, _ = quantize_tensor(rows[0:1], fmt).values()
        kinds = {"weight": q0, "scales": s0, "biases": s0}
        header: dict = {"__metadata__": {"format": "mlx"}}
        offset = 0
        for k, a in kinds.items():
            size = n * a.shape[1] * a.itemsize
            header[f"{path}.{k}"] = {"dtype": _ST_DTYPES[a.dtype], "shape": [n, a.shape[1]],
                                     "data_offsets": [offset, offset + size]}
            offset += size
        tmp = part.with_suffix(".tmp.safetensors")
        scales, biases = [], []
        with open(tmp, "wb") as fh:
            fh.write(_header_bytes(header))
            for start in range(0, n, chunk):
                out = quantize_tensor(rows[start:start + chunk], fmt)
                mx.eval(out)
                fh.write(_raw(out["weight"]))
                scales.append(_raw(out["scales"]))
                biases.append(_raw(out["biases"]))
                del out
            for block in scales + biases:
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, part)

    def flush(self) -> bool:
        if not self.pending:
            return False
        self.index += 1
        name = self.folder / f"part-{self.index:05d}.safetensors"
        tmp = name.with_suffix(".tmp.safetensors")
        mx.save_safetensors(str(tmp), self.pending, metadata={"format": "mlx"})
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, name)
        self.pending, self.nbytes = {}, 0
        return True


_ST_DTYPES = {mx.uint32: "U32", mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32"}


def _raw(a: mx.array) -> bytes:
    """An array's bytes in row-major order (bf16 through its 16-bit pattern)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a, copy=False).tobytes()


def _save_state(folder: Path, state: dict, hidden: dict[str, mx.array]) -> None:
    tmp = folder / (HIDDEN + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), hidden)
    os.replace(tmp, folder / HIDDEN)
    tmp = folder / (STATE + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, folder / STATE)


def load_state(folder: Path, key: str) -> tuple[dict | None, dict]:
    """What a killed run of the same variant (`key`) left: its state and hidden states."""
    try:
        state = json.loads((folder / STATE).read_text())
        if state.get("key") != key:
            return None, {}
        return state, mx.load(str(folder / HIDDEN))
    except (OSError, ValueError, RuntimeError):
        return None, {}


def _mtp_tensors(stream: LayerStream) -> dict[str, mx.array]:
    """The MTP head's tensors as the checkpoint stores them (mlx-lm's sanitize drops them),
    unevaluated: the caller reads them one at a time."""
    return stream.checkpoint.lazy(lambda k: k.startswith("mtp."))


# The MTP head's linears in every variant (fc, its layer's projections): the head only drafts,
# so its precision decides acceptance, not outputs. Measured on the embedded model's head
# (tests/bench/mtp_head_bits.py, teacher-forced acceptance 0.817 in bf16): 8, 6 and 5 bits keep
# it (0.817-0.818), 4 bits loses 0.3-0.4 points and 3 bits 1.8; others saw 4-bit heads of real
# checkpoints collapse. 6 bits keeps a margin for a few MB (0.8B: ~20M parameters).
MTP_FORMAT = Format(6, 64)


def write_streamed(stream: LayerStream, partial: Path, formats: dict[str, Format], key: str, *,
                   cal_rows: mx.array | None, heldout_rows: mx.array, awq: bool,
                   progress: Progress | None = None) -> WriteResult:
    """Writes every tensor of `stream`'s model by `formats` into `partial` (shards + state)."""
    partial.mkdir(parents=True, exist_ok=True)
    n = len(stream.layers)
    state, hidden = load_state(partial, key)
    result = WriteResult(measured_kld=float("nan"), measured_top1=float("nan"))
    outer = stream.outer_tensors()
    if state is None:
        for f in partial.glob("part-*.safetensors"):
            f.unlink()
        state = {"key": key, "next_layer": 0, "shards": 0, "awq": []}
        h_ref = stream.embed(heldout_rows)
        h_q = h_ref  # replaced below by the written rows' embeddings when the table is quantized
        h_cal = stream.embed(cal_rows) if awq else None
        first = _Shards(partial, 0)
        for name, value in sorted(stream.outer_weights.items()):
            owner = name.rsplit(".", 1)[0]
            if owner in outer and name.endswith(".weight"):
                rows, fmt = stream.rows(owner), formats.get(owner)
                if isinstance(rows, Rows) and (fmt is None or fmt.bits == 16):
                    first.copy(name, rows)
                elif isinstance(rows, Rows):
                    first.quantized(owner, rows, fmt)
                else:
                    first.add(_tensor_out(owner, rows, fmt))
            else:
                first.add({name: value})
        first.flush()
        state["shards"] = first.index
        embed = formats.get(f"{stream.prefix}.embed_tokens")
        if embed is not None and embed.bits != 16:  # the check starts from the written rows
            picked = WrittenTable(partial, f"{stream.prefix}.embed_tokens", embed)[heldout_rows.reshape(-1)]
            h_q = picked.reshape(*heldout_rows.shape, -1)
        _save_state(partial, state, _hidden(h_ref, h_q, h_cal))
    else:
        h_ref, h_q, h_cal = hidden["ref"], hidden["q"], hidden.get("cal")
        if progress:
            progress.say(f"resuming at layer {state['next_layer']} of {n}")
    shards = _Shards(partial, state["shards"])
    if progress:
        progress.stage("awq+write" if awq else "write", n)
        progress.step(state["next_layer"])
    for i in range(state["next_layer"], n):
        base = stream.layer_path(i)
        if awq:  # the unquantized layer: AWQ's inputs, the next layer's, the reference
            with stream.layer(i, float32=True) as layer:
                inputs, h_cal_next = group_inputs(layer, h_cal, output=True)
                h_ref_next = stream.apply(i, layer, h_ref)
        else:
            h_ref_next = stream.run_layer(i, h_ref)
        with stream.layer(i) as layer:  # stored dtypes: what the variant is made from
            if awq:
                groups = awq_layer(i, layer, inputs, formats, stream.prefix)
                del inputs
                state["awq"] += [[g.layer, g.norm, g.members, g.alpha, g.error_before, g.error_after]
                                 for g in groups]
            tensors = {}
            swapped = set()
            # tensor by tensor: its output made, then the module replaced by what the variant
            # computes before the next one is touched, so only one tensor's temporaries exist
            # at a time. A quantized tensor stays packed: the check's forward dequantizes it at
            # its call (one tensor's float32 copy at a time, never the whole layer's: 1.5 GB at
            # 27B's width).
            packed = []  # (path, original module) replaced by a packed stand-in for the check
            try:
                for rel, module in quantizable(layer).items():
                    fmt = formats.get(f"{base}.{rel}")
                    out = _tensor_out(f"{base}.{rel}", module.weight, fmt)
                    mx.eval(out)
                    tensors.update(out)
                    swapped.add(rel)
                    if fmt is None or fmt.bits == 16:
                        continue  # computed from the stored weight (stream.Float32Linear)
                    ours = {k: out[f"{base}.{rel}.{k}"] for k in ("weight", "scales", "biases")}
                    # 256 stacked experts: computed from the packed output a chunk of experts
                    # at a time (the MoE block's own path)
                    _set_child(layer, rel, _packed_experts(module, ours, fmt) if module.weight.ndim == 3
                               else _Dequantizing(ours, fmt, module.get("bias")))
                    packed.append((rel, module))
                    module.weight = mx.zeros((1,), dtype=module.weight.dtype)  # released
                for name, value in tree_flatten(layer.parameters()):
                    owner, leaf = name.rsplit(".", 1)
                    if not (owner in swapped and (leaf == "weight" or owner in dict(packed))):
                        tensors[f"{base}.{name}"] = value
                shards.add(tensors)
                del tensors
                layer.update(tree_map(_f32, layer.parameters()))
                h_q = stream.apply(i, layer, h_q)
            finally:
                for rel, module in packed:
                    _set_child(layer, rel, module)
        h_ref = h_ref_next
        if awq:
            h_cal = h_cal_next
        shards.flush()  # a part per layer: a killed run loses at most one layer
        state.update(next_layer=i + 1, shards=shards.index)
        _save_state(partial, state, _hidden(h_ref, h_q, h_cal))
        if progress:
            progress.step(i + 1)
    if progress:
        progress.stage("checking", 1, "KLD of the variant against the checkpoint on held-out tokens")
    result.measured_kld, result.measured_top1 = _fidelity(stream, h_ref, h_q, formats, partial)
    result.awq = state["awq"]
    mtp = _mtp_tensors(stream)
    if mtp:
        extra = _Shards(partial, state["shards"])
        for name in sorted(mtp):
            w = mtp.pop(name)  # read, written, dropped: one tensor of the head at a time
            # norms and MoE router gates as stored (the model's own gates keep 8 bits or more)
            fmt = MTP_FORMAT if name.endswith(".weight") and w.ndim == 2 and w.shape[-1] % 32 == 0 \
                and "norm" not in name and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) \
                else None
            if fmt is not None and fmt.bits != 16 and w.shape[-1] % fmt.group_size != 0:
                fmt = Format(fmt.bits, 32)
            result.mtp[name] = fmt.name if fmt else "as stored"
            if fmt is None or fmt.bits == 16:
                extra.add({name: w})
            else:
                extra.add({f"{name.removesuffix('.weight')}.{k}": v
                           for k, v in quantize_tensor(w, fmt).items()})
            del w
            if extra.nbytes > SHARD_BYTES // 4:
                extra.flush()
        extra.flush()
        state["shards"] = extra.index
    result.shards = state["shards"]
    if progress:
        progress.step(1)
    return result


def _packed_experts(module, packed: dict[str, mx.array], fmt: Format):
    """mlx-lm's quantized form of a stack of experts holding the variant's own packed tensors."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    n, rows, cols = module.weight.shape
    out = QuantizedSwitchLinear(cols, rows, n, bias=False, group_size=fmt.group_size, bits=fmt.bits)
    out.update(packed)
    return out


class _Dequantizing(Float32Linear):
    """A linear layer of the variant as the quantize-time check computes it: its packed tensors
    held, the float32 weight dequantized at the call and dropped after the product (the numbers
    of a layer holding it dequantized, with one tensor's float32 copy at a time)."""

    def __init__(self, packed: dict[str, mx.array], fmt: Format, bias: mx.array | None = None):
        nn.Module.__init__(self)
        self.weight, self.scales, self.biases = packed["weight"], packed["scales"], packed["biases"]
        if bias is not None:
            self.bias = bias
        self.fmt = fmt

    def float32_weight(self) -> mx.array:
        return dequantize(self["weight"], self["scales"], self["biases"], self.fmt)


def _hidden(h_ref, h_q, h_cal) -> dict[str, mx.array]:
    out = {"ref": h_ref, "q": h_q}
    if h_cal is not None:
        out["cal"] = h_cal
    return out


def _tensor_out(path: str, w: mx.array, fmt: Format | None) -> dict[str, mx.array]:
    if fmt is None or fmt.bits == 16:
        return {f"{path}.weight": w}
    return {f"{path}.{k}": v for k, v in quantize_tensor(w, fmt).items()}


def _fidelity(stream: LayerStream, h_ref: mx.array, h_q: mx.array,
              formats: dict[str, Format], partial: Path) -> tuple[float, float]:
    ref = stream.logprobs(stream.final_norm(h_ref).reshape(-1, h_ref.shape[-1]))
    fmt = formats.get(stream.head_path)
    weight = None
    if fmt is not None and fmt.bits != 16:
        weight = WrittenTable(partial, stream.head_path, fmt)
    kld, same = stream.compare(ref, stream.final_norm(h_q).reshape(-1, h_q.shape[-1]), weight)
    return float(kld.mean().item()), float(same.astype(mx.float32).mean().item())


class WrittenTable:
    """A quantized table (the embedding, the head) as written into the partial folder, read back
    a slice of rows, or the rows of some tokens, at a time and dequantized as served (float32
    scales): the quantize-time check computes with the variant's own rows, never a second copy
    of the table."""

    def __init__(self, partial: Path, path: str, fmt: Format):
        written = Checkpoint(partial)
        self.packed, self.scales, self.biases = (written.rows(f"{path}.{k}") for k in ("weight", "scales", "biases"))
        self.fmt = fmt
        self.shape = (self.packed.shape[0], self.scales.shape[1] * fmt.group_size)

    def __getitem__(self, rows) -> mx.array:
        return dequantize(self.packed[rows], self.scales[rows], self.biases[rows], self.fmt)


def _header_bytes(header: dict) -> bytes:
    """A safetensors header as written: its length, then JSON padded so the data stays 8-byte
    aligned, as writers do."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _copy_bytes(fh, path: Path, start: int, n: int) -> None:
    """n bytes of `path` from `start` appended to `fh`, 16 MB at a time."""
    with open(path, "rb") as src:
        src.seek(start)
        while n:
            block = src.read(min(n, 1 << 24))
            fh.write(block)
            n -= len(block)


def merge_safetensors(parts: list[Path], out: Path) -> None:
    """One safetensors file from several, by copying their bytes (constant memory)."""
    header: dict = {"__metadata__": {"format": "mlx"}}
    offset = 0
    sources = []
    for part in parts:
        h, start = read_header(part)
        for name, info in h.items():
            if name == "__metadata__":
                continue
            b, e = info["data_offsets"]
            header[name] = {**info, "data_offsets": [offset, offset + e - b]}
            sources.append((part, start + b, e - b))
            offset += e - b
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(_header_bytes(header))
        for part, start, n in sources:
            _copy_bytes(fh, part, start, n)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out)


def finalize(stream: LayerStream, partial: Path, dst: Path, formats: dict[str, Format],
             recipe: dict) -> Path:
    """Names the shards as mlx-lm does, writes config, tokenizer, recipe and checksums into the
    partial folder, then renames it to `dst` in one step."""
    src = stream.folder
    groups: list[list[Path]] = [[]]
    size = 0
    for part in sorted(partial.glob("part-*.safetensors")):  # consecutive parts up to SHARD_BYTES
        n = part.stat().st_size
        if groups[-1] and size + n > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(part)
        size += n
    total = len(groups)
    weight_map, size = {}, 0
    for k, group in enumerate(groups, 1):
        name = "model.safetensors" if total == 1 else f"model-{k:05d}-of-{total:05d}.safetensors"
        if len(group) == 1:
            os.replace(group[0], partial / name)
        else:
            merge_safetensors(group, partial / name)
            for part in group:
                part.unlink()
        header, _ = read_header(partial / name)
        for tensor, info in header.items():
            if tensor != "__metadata__":
                weight_map[tensor] = name
                size += info["data_offsets"][1] - info["data_offsets"][0]
    (partial / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    for f in (STATE, HIDDEN):
        (partial / f).unlink(missing_ok=True)
    config = json.loads((src / "config.json").read_text())
    for k in ("quantization", "quantization_config", "vision_config"):
        config.pop(k, None)
    default = next((f for f in formats.values() if f.bits != 16), Format(4, 64))
    quant: dict = {"group_size": default.group_size, "bits": default.bits, "mode": "affine"}
    for path, fmt in sorted(formats.items()):
        quant[path] = False if fmt.bits == 16 else {"group_size": fmt.group_size, "bits": fmt.bits,
                                                      "mode": "affine"}
    config["quantization"] = quant
    config["quantization_config"] = quant
    (partial / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4))
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, partial / name)
    return artifact.publish(partial, dst, recipe)
