"""What a first start will hold in memory, said before it starts and checked against a budget.

The streamed pipeline's working set does not depend on depth or on the checkpoint's size, only on
its widths: one decoder layer (its stored bytes, the quantized output beside them, one matrix
made float32 at a time), one chunk of the head's rows, the calibration activations and the
reference log-probabilities of the probe and check rows. Each part is estimated from the shapes; the
runtime (interpreter, MLX, the tokenizer) is what this process holds when the plan is made.
`quant.memory_gb` (default: what the machine has available) is the budget: a plan over it is
refused before any work, with the numbers, instead of an out-of-memory kill an hour in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .formats import DEQUANTIZE_CHUNK_BYTES
from .stream import EXPERT_CHUNK_BYTES

GB = 1e9


@dataclass
class MemoryPlan:
    parts: dict[str, int] = field(default_factory=dict)  # bytes
    budget: int = 0

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def line(self) -> str:
        detail = ", ".join(f"{k} {v / GB:.2f}" for k, v in self.parts.items())
        return (f"memory: about {self.total / GB:.1f} GB ({detail}; GB) of a {self.budget / GB:.1f} GB "
                "budget; it does not grow with depth or checkpoint size")

    def as_dict(self) -> dict:
        return {"planned_gb": round(self.total / GB, 2), "budget_gb": round(self.budget / GB, 2),
                "parts_gb": {k: round(v / GB, 3) for k, v in self.parts.items()}}


def anon_bytes() -> int:
    """This process's anonymous resident memory (what the kernel cannot drop)."""
    try:
        with open(f"/proc/{os.getpid()}/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def available_bytes() -> int:
    """MemAvailable (Linux), else free pages; a cgroup limit (containers) when lower."""
    avail = 0
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = open(path).read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < (1 << 60):
            avail = min(avail, int(raw) - _cgroup_used())
        break
    return avail


def _cgroup_used() -> int:
    for path in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
        try:
            return int(open(path).read().strip())
        except (OSError, ValueError):
            continue
    return 0


def plan(stream, cal_tokens: int, check_tokens: int, probe_ref_bytes: int, budget_gb: float = 0.0,
         head_chunk_rows: int = 0) -> MemoryPlan:
    """The working set of quantizing `stream`'s model (quant/stream.LayerStream)."""
    args = stream.lm.args
    hidden = int(args.hidden_size)
    inter = max(int(getattr(args, "intermediate_size", 0) or 0),
                int(getattr(args, "moe_intermediate_size", 0) or 0) * int(getattr(args, "num_experts_per_tok", 1) or 1))
    # a layer as stored with its packed output beside it, one matrix's float32 copy at a time
    # (twice while a dequantized one is joined from its row chunks, and a chunk's temporaries),
    # routed experts a chunk of them in float32
    layer = max((1.4 * b + (EXPERT_CHUNK_BYTES if e else 0)
                 for b, e in zip(stream.layer_bytes, stream.expert_bytes)), default=0)
    layer += 2 * stream.matrix_f32_bytes + 7 * DEQUANTIZE_CHUNK_BYTES
    vocab = stream.vocab
    rows = head_chunk_rows or vocab
    parts = {
        "runtime": anon_bytes(),
        "layer": int(layer),
        "head chunk": rows * hidden * 6 + 64 * rows * 4,
        "references": probe_ref_bytes + check_tokens * vocab * 4 * 2,
        # hidden states (reference, quantized, calibration, recorded) + one MLP's activations
        "activations": cal_tokens * (hidden * 4 * 6 + max(inter, hidden) * 4 * 3),
        # the embedding / head quantized a chunk of rows at a time: the scales and biases wait
        # for the end of the table (group 32: 1/8 byte per weight), one chunk in flight
        "outer output": vocab * hidden // 8 + 32768 * hidden * 4,
    }
    budget = int(budget_gb * GB) if budget_gb > 0 else available_bytes() + parts["runtime"]
    return MemoryPlan(parts=parts, budget=budget)


def check(p: MemoryPlan) -> None:
    if p.total > p.budget:
        raise MemoryError(f"quantizing needs about {p.total / GB:.1f} GB ({', '.join(f'{k} {v / GB:.2f}' for k, v in p.parts.items())}) "
                          f"but the budget is {p.budget / GB:.1f} GB (quant.memory_gb, or what the machine "
                          "has available): free memory or raise quant.memory_gb")
