"""Per-op SBP rules: for one mesh axis, which input placements give which output placement. Pure data.

A rule receives the global shapes of the tensor inputs (plain tensors count as ``B``) and the op's other
arguments, and returns candidate signatures ``(input placements..., output placement)``; the dispatcher picks,
per mesh axis independently, the candidate whose inputs are cheapest to reach from where they are.
Examples (x: (..., in), W: (out, in) for ``linear``):

    matmul   S(0) × B → S(0)    B × S(1) → S(1)    S(1) × S(0) → P    P × B → P
    linear   S(batch), B, B → S(batch)   B, S(0), S(0) → S(-1)   S(-1), S(1), P → P
    softmax  S(d) → S(d) for d ≠ the softmax dim; a split softmax dim needs boxing (not listed)
    add      S(d), S(d) → S(d)   P, P → P   (P + B would add B n times: not listed)
    mul      P, B → P   B, P → P   (linear in each factor separately)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .placement import Replicate as _B
from .placement import Partial, Placement, Split

__all__ = ["Candidate", "RULES", "rule_for"]

Candidate = tuple[Placement, ...]
"""Input placements followed by the output placement."""
B, P = _B(), Partial("sum")
Rule = Callable[[Sequence[tuple[int, ...]], dict[str, Any]], list[Candidate]]


def _aligned(shapes: Sequence[tuple[int, ...]], out_ndim: int, d: int) -> Candidate | None:
    """Split output dim ``d`` of a broadcasting elementwise op: each input splits its aligned dim, or is B
    where it broadcasts along ``d``. None when no input really has that dim."""
    ins: list[Placement] = []
    for shape in shapes:
        k = d - (out_ndim - len(shape))
        ins.append(Split(k) if k >= 0 and shape[k] != 1 else B)
    return tuple(ins) + (Split(d),) if any(isinstance(p, Split) for p in ins) else None


def _broadcast_shape(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    nd = max(len(s) for s in shapes)
    return tuple(max((s[i - (nd - len(s))] if i - (nd - len(s)) >= 0 else 1) for s in shapes) for i in range(nd))


def elementwise(linear_ops: str = "") -> Rule:
    """``linear_ops``: "sum" when the op is linear in all inputs together (add/sub: P+P→P), "each" when it is
    linear in each input separately (mul: P×B→P), "first" when linear in the first only (div: P/B→P)."""
    def rule(shapes: Sequence[tuple[int, ...]], kw: dict[str, Any]) -> list[Candidate]:
        out_nd = len(_broadcast_shape(shapes))
        cands: list[Candidate] = [tuple([B] * len(shapes)) + (B,)]
        cands += [c for d in range(out_nd) if (c := _aligned(shapes, out_nd, d)) is not None]
        n = len(shapes)
        if linear_ops == "sum" and kw.get("scalar_operand"):
            return cands  # P + 3 would add 3 once per rank
        if linear_ops == "sum" or (linear_ops == "each" and n == 1) or (linear_ops == "first" and n == 1):
            cands.append(tuple([P] * n) + (P,))
        if linear_ops in ("each", "first"):
            for i in range(n if linear_ops == "each" else 1):
                cands.append(tuple(P if j == i else B for j in range(n)) + (P,))
        return cands
    return rule


def matmul(shapes: Sequence[tuple[int, ...]], kw: dict[str, Any]) -> list[Candidate]:
    a, b = shapes
    if len(a) < 2 or len(b) < 2:
        return [(B, B, B)]
    out_nd = max(len(a), len(b))
    cands: list[Candidate] = [(B, B, B), (Split(len(a) - 2), B, Split(out_nd - 2)),
                              (B, Split(len(b) - 1), Split(out_nd - 1)),
                              (Split(len(a) - 1), Split(len(b) - 2), P), (P, B, P), (B, P, P)]
    for d in range(out_nd - 2):  # batch dims, split on both sides where present
        c = _aligned([a[:-2], b[:-2]], out_nd - 2, d)
        if c is not None:
            cands.append(c[:2] + (Split(d),))
    return cands


def linear(shapes: Sequence[tuple[int, ...]], kw: dict[str, Any]) -> list[Candidate]:
    x = shapes[0]
    has_bias = len(shapes) == 3
    bias_b, bias_p = ((B,), (P,)) if has_bias else ((), ())
    cands: list[Candidate] = [(B, B) + bias_b + (B,),
                              (B, Split(0)) + ((Split(0),) if has_bias else ()) + (Split(len(x) - 1),),
                              (Split(len(x) - 1), Split(1)) + bias_p + (P,),
                              (P, B) + bias_p + (P,)]
    cands += [(Split(d), B) + bias_b + (Split(d),) for d in range(len(x) - 1)]
    return cands


def along_dim(shapes: Sequence[tuple[int, ...]], kw: dict[str, Any]) -> list[Candidate]:
    """softmax/log_softmax over ``dim``: any split except along ``dim`` itself."""
    nd = len(shapes[0])
    dim = kw["dim"] % nd
    return [(B, B)] + [(Split(d), Split(d)) for d in range(nd) if d != dim]


def norm(shapes: Sequence[tuple[int, ...]], kw: dict[str, Any]) -> list[Candidate]:
    """layer_norm/rms_norm: split any dim not normalised; weight and bias replicated."""
    nd = len(shapes[0])
    k = len(kw["normalized_shape"])
    rest = tuple([B] * (len(shapes) - 1))
    return [(B,) + rest + (B,)] + [(Split(d),) + rest + (Split(d),) for d in range(nd - k)]


def embedding(shapes: Sequence[tuple[int, ...]], kw: dict[str, Any]) -> list[Candidate]:
    idx = shapes[0]
    return [(B, B, B), (B, Split(1), Split(len(idx)))] + [(Split(d), B, Split(d)) for d in range(len(idx))]


def cross_entropy(shapes: Sequence[tuple[int, ...]], kw: dict[str, Any]) -> list[Candidate]:
    """Rows split → each rank's partial of the sum (the mean is divided by the global count by the dispatcher)."""
    if kw.get("reduction", "mean") not in ("mean", "sum"):
        return [(B, B, B)] + [(Split(d), Split(d), Split(d)) for d in range(len(shapes[1]))]
    return [(B, B, B)] + [(Split(0), Split(0), P)]


def reduce_dims(shapes: Sequence[tuple[int, ...]], kw: dict[str, Any]) -> list[Candidate]:
    """sum/mean over ``dim`` (None = all): a split reduced dim becomes P; a kept dim stays split."""
    nd = len(shapes[0])
    dims = kw.get("dim")
    dims = set(range(nd)) if dims is None else {d % nd for d in ([dims] if isinstance(dims, int) else dims)}
    keep = kw.get("keepdim", False)
    cands: list[Candidate] = [(B, B), (P, P)]
    for d in range(nd):
        if d in dims:
            cands.append((Split(d), P))
        else:
            out_d = d if keep else d - sum(1 for r in dims if r < d)
            cands.append((Split(d), Split(out_d)))
    return cands


def permutation(shapes: Sequence[tuple[int, ...]], kw: dict[str, Any]) -> list[Candidate]:
    perm = kw["perm"]
    return [(B, B), (P, P)] + [(Split(src), Split(dst)) for dst, src in enumerate(perm)]


def reshape(shapes: Sequence[tuple[int, ...]], kw: dict[str, Any]) -> list[Candidate]:
    """A split dim survives a reshape when its size and the product of the dims before it are unchanged
    (so every rank's piece is the same contiguous run); merged or cut split dims need boxing first."""
    src, dst = shapes[0], kw["shape"]
    cands: list[Candidate] = [(B, B), (P, P)]
    for d, size in enumerate(src):
        before = _prod(src[:d])
        for e, out_size in enumerate(dst):
            if out_size == size and _prod(dst[:e]) == before:
                cands.append((Split(d), Split(e)))
                break
    return cands


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def unary_nonlinear(shapes: Sequence[tuple[int, ...]], kw: dict[str, Any]) -> list[Candidate]:
    return [(B, B)] + [(Split(d), Split(d)) for d in range(len(shapes[0]))]


RULES: dict[str, Rule] = {
    "add": elementwise("sum"), "sub": elementwise("sum"), "mul": elementwise("each"),
    "div": elementwise("first"), "neg": elementwise("sum"), "matmul": matmul, "linear": linear,
    "softmax": along_dim, "log_softmax": along_dim, "layer_norm": norm, "rms_norm": norm,
    "embedding": embedding, "cross_entropy": cross_entropy, "sum": reduce_dims, "mean": reduce_dims,
    "permute": permutation, "reshape": reshape, "gelu": unary_nonlinear, "relu": unary_nonlinear,
    "silu": unary_nonlinear, "tanh": unary_nonlinear, "exp": unary_nonlinear, "dropout": unary_nonlinear,
}


def rule_for(name: str) -> Rule | None:
    return RULES.get(name)
