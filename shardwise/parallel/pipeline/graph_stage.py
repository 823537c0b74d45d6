"""Pipeline stages cut from a captured forward graph (``capture.py``): any model, not only chains.

Which modules stay whole (**leaves**, the places a cut may fall before): every child of the root and of each
module on the way to the model's layer lists, and each element of those lists. A layer list is an outermost
``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential`` (a Hugging Face decoder's ``model.layers``, a GPT's
``blocks``); the modules above it (``model``) are traced through, so the glue between layers — masks, position
ids, rotary tables, residual adds, the loss — becomes graph nodes. Naming a deeper module in ``split`` traces through its
ancestors too.

Where nodes run: a ``module``/``call`` node runs on the stage its position falls in (a stage starts at its split
module's first call); inputs, parameters read by glue and constants are materialised on every stage that uses
them (every rank has the micro-batch's inputs, so ``labels`` or an attention mask are never sent). Every tensor
computed on stage ``<= k`` and used on a stage ``> k`` crosses boundary ``k`` (relayed through the stages in
between), in node order: hidden states, but also position ids, masks, rotary (cos, sin) and residuals.

Objects made inside the forward (a Hugging Face ``DynamicCache``: ``made.py``) are made anew for every stage
forward and every checkpointed recomputation, so no call sees another's. One passed to modules of two stages is
two objects, one per stage: what the first stage's modules put in it does not reach the second's (a KV cache is
written and read per layer, so a decoder computes what it computes on one device).

Without ``split``, stages balance the leaves' forward FLOPs (``torch.utils.flop_counter`` during the capture:
deterministic, the same on every rank), a leaf without parameters joining its predecessor.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..common.selective import check_mode, checkpoint_kwargs, has_attention
from .capture import Graph, Node, Ref, capture, refs_in, walk
from .made import Made
from .stage import balance_by_params

__all__ = ["GraphStage", "leaf_modules", "build_graph_stages", "model_loss"]

_FREE = ("input", "attr", "const")


def leaf_modules(model: nn.Module, split: Sequence[str] = ()) -> dict[str, nn.Module]:
    """Name -> module of the leaves (see module doc), in registration order."""
    names = dict(model.named_modules())
    through = {""}
    lists = [n for n, m in names.items() if n and isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential))]
    outer = [n for n in lists if not any(n.startswith(o + ".") for o in lists if o != n)]
    through.update(outer)  # an nn.Sequential runs its children in order: trace through it like a list
    for name in [*outer, *split]:
        parts = name.split(".")
        through.update(".".join(parts[:k]) for k in range(len(parts)))
    leaves: dict[str, nn.Module] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            full = f"{prefix}.{child_name}" if prefix else child_name
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or full in through:
                visit(full, child)
            else:
                leaves[full] = child
    visit("", model)
    return leaves


def _owner(name: str) -> str:
    return name.rpartition(".")[0]


class GraphStage(nn.Module):
    """Stage ``index`` of a captured graph: runs its nodes on the micro-batch's inputs and the tensors received
    from the previous stage; returns the tensors the next stage needs (``list``), or the model's output (last)."""

    def __init__(self, index: int, graph: Graph, nodes: list[int], recv: list[int], send: list[int] | None,
                 modules: dict[str, nn.Module], device_of_capture: torch.device) -> None:
        super().__init__()
        self.index, self.graph, self.nodes, self.recv, self.send = index, graph, nodes, recv, send
        self.names = list(modules)  # graph order (the first module called first)
        # original qualified names (dots -> '/': module names cannot hold dots); original keys via owned_names
        self.parts = nn.ModuleDict({n.replace(".", "/"): m for n, m in modules.items()})
        self.capture_device = device_of_capture
        self.checkpoint = "none"
        """Activation checkpointing (``none``, ``full``, ``selective``): each leaf module call keeps only its inputs,
        recomputed in backward (``selective``: a leaf with attention keeps its weight matmuls' outputs too)."""

    @property
    def n_send(self) -> int:
        return len(self.send or ())

    def owned_names(self) -> list[str]:
        return list(self.names)

    def forward(self, mb: tuple[tuple, dict], received: Sequence[Tensor]) -> Any:
        env: dict[int, Any] = dict(zip(self.recv, received))
        flat = pytree.tree_flatten(mb)[0]
        device = next((t.device for t in flat if isinstance(t, Tensor)), self.capture_device)
        run = _Runner(self, env, flat, device)
        for k in self.nodes:
            env[k] = run.node(self.graph.nodes[k])
        if self.send is not None:
            return [run.value(Ref(k)) for k in self.send]
        leaves = [run.value(x) for x in self.graph.output]
        return pytree.tree_unflatten(leaves, self.graph.output_spec)


class _Runner:
    """Evaluates one stage's nodes (free nodes on first use)."""

    def __init__(self, stage: GraphStage, env: dict[int, Any], flat: list[Any], device: torch.device) -> None:
        self.stage, self.env, self.flat, self.device = stage, env, flat, device
        self.made: dict[int, Any] = {}  # this call's objects made inside the forward (``Made`` index -> object)

    def value(self, obj: Any) -> Any:
        """``obj`` (a node's arguments) with every ``Ref`` replaced by its value on this stage."""
        return walk(obj, self._leaf)

    def _leaf(self, obj: Any) -> Any:
        if isinstance(obj, Made):
            if obj.index not in self.made:
                self.made[obj.index] = self.stage.graph.made[obj.index].new()
            return self.made[obj.index]
        if isinstance(obj, Ref):
            if obj.index not in self.env:
                self.env[obj.index] = self.free(self.stage.graph.nodes[obj.index])
            return self.env[obj.index]
        if isinstance(obj, torch.device) and obj == self.stage.capture_device:
            return self.device  # captured on one device, replayed on the stage's
        return obj

    def free(self, node: Node) -> Any:
        assert node.op in _FREE, f"node {node.index} ({node.label()}) is not available on stage {self.stage.index}"
        if node.op == "input":
            return self.flat[node.target]
        if node.op == "const":
            return node.target.to(self.device)
        owner, _, leaf = node.target.rpartition(".")
        return getattr(self.stage.parts[owner.replace(".", "/")] if owner else self.stage, leaf)

    def node(self, node: Node) -> Any:
        args, kwargs = self.value(node.args), self.value(node.kwargs)
        if node.op == "pick":
            return pytree.tree_flatten(args[0])[0][node.target]
        if node.op == "call":
            return node.target(*args, **kwargs)
        module = self.stage.parts[node.target.replace(".", "/")]
        mode = check_mode(self.stage.checkpoint)  # True/False, as the attribute once was, mean full/none
        if mode != "none" and torch.is_grad_enabled() and (mode == "full" or has_attention(module)) and any(
                isinstance(t, Tensor) and t.requires_grad for t in pytree.tree_flatten((args, kwargs))[0]):
            made = {id(self.made[r.index]): r.index for r in _made_in((node.args, node.kwargs))}
            return checkpoint(_Recompute(module, self.stage.graph, made), *args, use_reentrant=False,
                              **checkpoint_kwargs(mode), **kwargs)
        return module(*args, **kwargs)


class _Recompute:
    """A checkpointed module call whose recomputation (in backward) gets new objects made inside the forward,
    copied from the graph like the forward's were: the forward's own already hold what the module put in them (a
    cache would hand the recomputation twice the keys)."""

    def __init__(self, module: nn.Module, graph: Graph, made: dict[int, int]) -> None:
        self.module, self.graph, self.made, self.calls = module, graph, made, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > 1 and self.made:
            new: dict[int, Any] = {}

            def fresh(x: Any) -> Any:
                k = self.made.get(id(x))
                if k is not None and k not in new:
                    new[k] = self.graph.made[k].new()
                return x if k is None else new[k]
            args, kwargs = walk((args, kwargs), fresh)
        return self.module(*args, **kwargs)


def _made_in(obj: Any) -> list[Made]:
    """Every ``Made`` marker inside nested tuples/lists/dicts (a node's arguments)."""
    out: list[Made] = []
    walk(obj, lambda x: out.append(x) if isinstance(x, Made) else None)
    return out


def _stage_of_nodes(graph: Graph, starts: list[str]) -> list[int | None]:
    """Stage of every node (``None`` for free nodes): a stage begins at the first call of its start module."""
    out: list[int | None] = []
    stage, nxt = 0, 0
    for n in graph.nodes:
        if n.op == "module" and nxt < len(starts) and n.target == starts[nxt]:
            stage, nxt = stage + 1, nxt + 1
        out.append(None if n.op in _FREE else (out[n.args[0].index] if n.op == "pick" else stage))
    return out


def _crossings(graph: Graph, stage_of: list[int | None], n: int) -> list[list[int]]:
    """Boundary k -> node indices (in node order) computed on stage <= k and used on a stage > k."""
    last_use: dict[int, int] = {}
    for node in graph.nodes:
        user = stage_of[node.index]
        for r in refs_in((node.args, node.kwargs)):
            if stage_of[r.index] is not None and user is not None:
                last_use[r.index] = max(last_use.get(r.index, -1), user)
    for r in refs_in(graph.output):
        if stage_of[r.index] is not None:
            last_use[r.index] = n - 1
    return [[k for k in sorted(last_use) if stage_of[k] <= b < last_use[k]] for b in range(n - 1)]  # type: ignore[operator]


def build_graph_stages(model: nn.Module, n: int, split: Sequence[str] | None,
                       example: tuple[tuple, dict]) -> list[GraphStage]:
    """All ``n`` stages of ``model`` cut from its captured graph; ``ValueError`` (or ``CaptureError``) first."""
    from .graph_split import check_split, flops_per_leaf, resolve_starts
    leaves = leaf_modules(model, list(split or []))
    check_split(model, leaves, split, n)
    with flops_per_leaf(leaves) as flops:
        graph = capture(model, example[0], example[1], leaves)
    starts = resolve_starts(model, graph, leaves, split, n, flops)
    stage_of = _stage_of_nodes(graph, starts)
    cross = _crossings(graph, stage_of, n)
    device = next((t.device for t in pytree.tree_flatten(example)[0] if isinstance(t, Tensor)), torch.device("cpu"))
    stages, named = [], dict(model.named_modules())
    for s in range(n):
        nodes = [k for k, st in enumerate(stage_of) if st == s]
        stages.append(GraphStage(s, graph, nodes, cross[s - 1] if s else [], cross[s] if s < n - 1 else None,
                                 {m: named[m] for m in _stage_modules(graph, nodes, s == n - 1)}, device))
    return stages


def _stage_modules(graph: Graph, nodes: list[int], last: bool) -> list[str]:
    """The modules a stage runs or reads parameters of, in graph order: the same order on every rank (a set's
    order is not — string hashes differ between processes — and dp buckets are laid out in this order)."""
    out: dict[str, None] = {}
    refs = [r for k in nodes for r in refs_in((graph.nodes[k].args, graph.nodes[k].kwargs))]
    refs += list(refs_in(graph.output)) if last else []
    for k in sorted({*nodes, *(r.index for r in refs)}):
        node = graph.nodes[k]
        if node.op == "module" and k in nodes:
            out[node.target] = None
        elif node.op == "attr":
            out[_owner(node.target)] = None
    return list(out)


def model_loss(output: Any) -> Tensor:
    """The loss a model returned itself: ``output.loss`` / ``output["loss"]``, the first element of a tuple, or
    a scalar tensor; ``ValueError`` otherwise (then pass ``loss_fn``)."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if loss is None and isinstance(output, Tensor):
        loss = output
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn=None needs the model to return its loss (an output with .loss, a dict with "
                         f"'loss', a tuple whose first element is the loss, or a scalar tensor), got "
                         f"{type(output).__name__}; pass labels to the model or give loss_fn=")
    return loss.reshape(())
