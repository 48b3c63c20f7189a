"""Bit allocation under a size budget: one format per tensor (any bits/group size, or bf16) so
that the predicted total KLD is minimal. A multiple-choice knapsack, solved by Lagrangian
relaxation (binary search on the price of a byte) and then a greedy pass that spends what the
relaxation left of the budget on the best KLD-per-byte upgrades. Ties go to the cheaper option.
"""

from __future__ import annotations

from dataclasses import dataclass

from .formats import BF16, Format, formats_for, rows_and_width
from .sensitivity import SensitivityTable


@dataclass(frozen=True)
class Option:
    fmt: Format
    nbytes: float
    kld: float


@dataclass
class Allocation:
    choice: dict[str, Option]
    budget_bytes: float

    @property
    def nbytes(self) -> float:
        return sum(o.nbytes for o in self.choice.values())

    @property
    def predicted_kld(self) -> float:
        return sum(o.kld for o in self.choice.values())

    def bits_per_weight(self, params: dict[str, int]) -> float:
        return 8 * self.nbytes / sum(params[p] for p in self.choice)

    def formats(self) -> dict[str, Format]:
        return {p: o.fmt for p, o in self.choice.items()}


def options_for(table: SensitivityTable, path: str, allow_bf16: bool = True) -> list[Option]:
    n_out, n_in = rows_and_width(table.shapes[path])
    opts = [Option(BF16, BF16.nbytes(n_out, n_in), 0.0)] if allow_bf16 else []
    for fmt in formats_for(n_in):
        if fmt.name in table.kld[path]:
            opts.append(Option(fmt, fmt.nbytes(n_out, n_in), table.kld[path][fmt.name]))
    # keep the Pareto front: cheaper first; drop options no better than a cheaper one
    opts.sort(key=lambda o: (o.nbytes, o.kld))
    front: list[Option] = []
    for o in opts:
        if not front or o.kld < front[-1].kld:
            front.append(o)
    return front


def _pick(opts: list[Option], lam: float) -> Option:
    return min(opts, key=lambda o: (o.kld + lam * o.nbytes, o.nbytes))


def allocate(table: SensitivityTable, budget_bytes: float, allow_bf16: bool = True,
             fixed: dict[str, Format] | None = None) -> Allocation:
    """`fixed` pins some tensors to a format (they still count against the budget)."""
    fixed = fixed or {}
    opts = {p: options_for(table, p, allow_bf16) for p in table.kld if p not in fixed}
    pinned = {}
    for p, fmt in fixed.items():
        n_out, n_in = rows_and_width(table.shapes[p])
        kld = 0.0 if fmt.bits == 16 else table.kld[p].get(fmt.name, 0.0)
        pinned[p] = Option(fmt, fmt.nbytes(n_out, n_in), kld)
    room = budget_bytes - sum(o.nbytes for o in pinned.values())
    cheapest = sum(o[0].nbytes for o in opts.values())
    if cheapest > room:
        raise ValueError(f"the budget of {budget_bytes / 1e6:.2f} MB is below the smallest possible "
                         f"size ({(cheapest + budget_bytes - room) / 1e6:.2f} MB)")

    def cost(lam: float) -> tuple[float, dict[str, Option]]:
        choice = {p: _pick(o, lam) for p, o in opts.items()}
        return sum(c.nbytes for c in choice.values()), choice

    lo, hi = 0.0, 1.0
    while cost(hi)[0] > room:
        hi *= 10
    for _ in range(100):
        mid = (lo + hi) / 2
        if cost(mid)[0] > room:
            lo = mid
        else:
            hi = mid
    spent, choice = cost(hi)
    # greedy: best KLD reduction per extra byte that still fits
    while True:
        best = None
        for p, o in opts.items():
            cur = choice[p]
            for cand in o:
                extra = cand.nbytes - cur.nbytes
                gain = cur.kld - cand.kld
                if extra <= 0 or gain <= 0 or spent + extra > room:
                    continue
                score = gain / extra
                if best is None or score > best[0]:
                    best = (score, p, cand, extra)
        if best is None:
            break
        _, p, cand, extra = best
        choice[p] = cand
        spent += extra
    choice.update(pinned)
    return Allocation(choice=dict(sorted(choice.items())), budget_bytes=budget_bytes)


def budget_for_bpw(table: SensitivityTable, bpw: float) -> float:
    return bpw * sum(table.params.values()) / 8
