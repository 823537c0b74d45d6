"""The pipeline executor: a small interpreter of one rank's action list (``schedules`` + ``communication``).

Per action (stage ``s``, micro-batch ``i``):

* ``RECV_F`` / ``RECV_B``: post an asynchronous receive into a fresh buffer; the compute that needs it waits.
  The lowering places receives ahead of their consumer; one whose shape is not known yet (the first message
  on a boundary, whose metadata message is received blocking) is deferred until its consumer runs, and so
  is every later receive from the same sender, which keeps each sender's messages posted in send order.
* ``F``: run the stage; the input of a stage > 0 is a leaf that requires grad, so backward leaves the input
  gradient in ``x.grad``. The last stage applies ``loss_fn`` and keeps ``loss / m`` as the tensor to
  differentiate (the step's loss is the mean over micro-batches, as one device computes it on the whole batch).
  With ``autocast`` (bf16) the stage and the loss run under ``torch.autocast``, as one device's forward would.
* ``B`` without split backward: ``torch.autograd.backward(out, grad)`` — input and weight gradients at once.
* ``B`` with split backward (zero-bubble): the input gradient plus dL/dy for each weight-owning module's
  output (``weight_grad.WeightCapture``); ``W`` later runs each module's local weight backward
  (``weight_grad.weight_gradients``) and accumulates into ``.grad``.
* ``SEND_F`` / ``SEND_B``: start an asynchronous send; every send is waited for at the end of the step.
* A forward-only schedule (evaluation, run under ``torch.no_grad``): ``F`` keeps nothing for a backward; a
  stage's output is dropped once sent (or handed to the next local stage), the last stage keeps only the loss.

Shapes: the first message on each stage boundary is preceded by a small metadata message (dtype and shape).
Under autocast the dtype is whatever the stage returned: the reference GPT's residual stream stays fp32 (a bf16
branch added to an fp32 residual promotes), a stage ending in a bare Linear sends bf16; either way the
gradient coming back has the output's dtype, which is what the backward receive buffer is allocated with.
Both ends cache it, so later steps send only activations; a new micro-batch input shape resets the cache on
every rank at once (every rank receives the same step arguments). Gradients need no metadata: a stage knows
its own output's shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ... import comm
from ...comm.counter import record_collective
from ...comm.p2p import AxisLink
from ...comm.shm_p2p import ShmLink
from ...mesh import Mesh
from ..common.autocast import compute_autocast
from .actions import Action, Schedule
from .graph_stage import GraphStage, model_loss
from .messages import Spec, alloc, decode_meta, encode_meta, META_LEN, pack, spec_of, unpack
from .stage import Stage
from .weight_grad import WeightCapture, weight_gradients

__all__ = ["Interpreter", "StepState", "run_actions"]



@dataclass
class StepState:
    """Everything one step's interpreter keeps between actions, keyed by (stage, micro-batch)."""

    inputs: list[Any]
    """Per micro-batch: the input tensor (chain stages) or ``(args, kwargs)`` (graph stages)."""
    targets: list[Tensor | None]
    inputs_kept: dict[tuple[int, int], list[Tensor]] = field(default_factory=dict)
    """The received tensors that require grad (their ``.grad`` is the gradient sent back)."""
    outputs: dict[tuple[int, int], list[Tensor]] = field(default_factory=dict)
    """The tensors sent to the next stage, or ``[loss / m]`` on the last stage."""
    out_grads: dict[tuple[int, int], Any] = field(default_factory=dict)
    """Split backward: the stage output's gradient, or (module, output, gradient) pairs for W."""
    captured: dict[tuple[int, int], list[tuple[nn.Module, Tensor]]] = field(default_factory=dict)
    in_grads: dict[tuple[int, int], list[Tensor]] = field(default_factory=dict)
    pending: dict[tuple[str, int, int], comm.Handle | Tensor] = field(default_factory=dict)
    deferred: dict[int, list[Action]] = field(default_factory=dict)
    """Sender rank -> receives not posted yet, in that sender's send order (see module doc)."""
    sends: list[comm.Handle] = field(default_factory=list)
    losses: list[Tensor] = field(default_factory=list)
    peak_held: int = 0
    """Most (stage, micro-batch) activation sets held at once (taken by F, freed by full B or by W)."""
    events: list[tuple[Action, float, float]] = field(default_factory=list)
    """Compute actions with host-clock (``time.perf_counter``) start and end, in execution order."""


class Interpreter:
    """Runs lowered action lists for the stages this rank holds (``stages[s]`` for local ``s``)."""

    def __init__(self, *, schedule: Schedule, stages: dict[int, Stage | GraphStage], mesh: Mesh, axis: str,
                 loss_fn: Callable[[Any, Tensor], Tensor] | None, autocast: torch.dtype | None = None,
                 n_values: dict[int, int] | None = None) -> None:
        self.schedule, self.stages, self.mesh, self.axis, self.loss_fn = schedule, stages, mesh, axis, loss_fn
        self.n_values = n_values or {}
        """Boundary ``s`` -> how many tensors stage ``s`` sends (default 1: a chain's hidden states)."""
        self.autocast = autocast
        """Dtype of the forward's ``torch.autocast`` (stage and loss; ``None``: none). Parameters and gradients
        stay in their own dtype; recomputation (activation checkpointing) restores the same autocast state."""
        self.shapes: dict[int, list[Spec]] = {}  # boundary s -> s+1: the tensors stage s sends
        self.shape_key: tuple | None = None
        self.last = schedule.num_stages - 1
        self.synchronize_timings = False
        self.grad_sync: Any = None
        """A ``grad_sync.DpGradSync`` (set by ``Pipeline`` with a dp axis): told when each local stage's last
        gradient-producing action starts and ends, so its dp reduction overlaps the rest of the step."""
        self.zero3: Any = None
        """A ``zero3.PipelineStage3`` (ZeRO-3): frees a stage's units after each action, gathers W's modules."""
        self.captures = {k: WeightCapture(v) for k, v in stages.items()} if schedule.split_backward else {}
        self.p2p: ShmLink | None = None
        """The shared-memory link every message takes (``transport="shm"``); ``None``: the backend's groups."""
        self.microbatch_context: Callable[[Any], Any] | None = None
        """Called with a micro-batch's input (``StepState.inputs[i]``, on every stage): the context manager each
        compute action of that micro-batch runs in (forward, backward with its recomputation, W) — what a model
        needs besides the one tensor a unit takes (packed documents: ``parallel/context/documents.py``)."""

    # -- communication ---------------------------------------------------------------------------------
    @property
    def transport(self) -> str:
        """``shm`` or ``native``: how this interpreter's messages travel (the algorithm ``CommCounter`` records)."""
        return "native" if self.p2p is None else "shm"

    def _link(self, sender: int, receiver: int) -> AxisLink | ShmLink:
        """The shared-memory link when set (one FIFO channel per ordered pair: the two directions between
        neighbours are separate channels already). Otherwise messages towards the higher coordinate travel on
        the axis' collective group, those towards the lower one on its point-to-point group. NCCL runs one
        pair's sends and receives in one ordered stream per group; with one direction per group, a send never
        queues behind a receive that waits for the peer's opposite send (neighbouring stages exchange
        activations and gradients both ways)."""
        if self.p2p is not None:
            return self.p2p
        group = self.mesh.group(self.axis) if sender < receiver else self.mesh.p2p_group(self.axis)
        return AxisLink(group, tuple(self.mesh.ranks(self.axis)), self.mesh.coord(self.axis))

    def _isend(self, t: Tensor, dst: int) -> comm.Handle:
        me = self.mesh.coord(self.axis)
        record_collective("send", self.transport, self.axis, t.numel() * t.element_size(), self.schedule.p)
        work = self._link(me, dst).isend(t, dst)
        return comm.Handle(work=work, finish=lambda: t)

    def _irecv(self, t: Tensor, src: int) -> comm.Handle:
        me = self.mesh.coord(self.axis)
        record_collective("recv", self.transport, self.axis, t.numel() * t.element_size(), self.schedule.p)
        work = self._link(src, me).irecv(t, src)
        return comm.Handle(work=work, finish=lambda: t)

    def _send(self, t: Tensor, to_stage: int, st: StepState) -> None:
        # Finished sends are dropped as we go so their buffers (activations whose backward already ran) are
        # freed during the step, keeping 1F1B's memory bound; the rest are waited for at the end of the step.
        st.sends = [h for h in st.sends if not h.is_completed()]
        st.sends.append(self._isend(t.contiguous(), self.schedule.rank_of(to_stage)))

    def _send_meta(self, s: int, outs: list[Tensor]) -> None:
        self._isend(encode_meta(s, outs, self.mesh.device), self.schedule.rank_of(s + 1)).wait()

    def _recv_meta(self, s: int) -> None:
        meta = torch.zeros(self.n_values.get(s, 1) * META_LEN, dtype=torch.int64, device=self.mesh.device)
        self._irecv(meta, self.schedule.rank_of(s)).wait()
        self.shapes[s] = decode_meta(meta)

    def _post_recv(self, a: Action, st: StepState) -> None:
        boundary = _boundary(a)
        if boundary not in self.shapes:
            assert a.kind == "RECV_F", "a backward receive always follows this stage's own forward"
            self._recv_meta(boundary)
        forward = a.kind == "RECV_F"
        # backward: the gradients of the tensors that require grad, in the same order
        specs = [sp for sp in self.shapes[boundary] if forward or sp.requires_grad]
        handle = self._irecv(alloc(specs, self.mesh.device), self._source(a))
        st.pending[(a.kind, a.stage, a.microbatch)] = comm.Handle(
            finish=lambda: unpack(handle.wait(), specs, leaves=forward))  # type: ignore[arg-type,return-value]

    def _source(self, a: Action) -> int:
        """The rank that sends receive ``a``'s message."""
        return self.schedule.rank_of(a.stage - 1 if a.kind == "RECV_F" else a.stage + 1)

    def _shape_known(self, a: Action) -> bool:
        return _boundary(a) in self.shapes

    def _queue_recv(self, a: Action, st: StepState) -> None:
        """Post ``a`` now, or defer it (see module doc) when its shape is unknown or its sender has a deferred
        earlier message."""
        waiting = st.deferred.setdefault(self._source(a), [])
        if waiting or not self._shape_known(a):
            waiting.append(a)
        else:
            self._post_recv(a, st)

    def _flush_recv(self, need: Action, st: StepState) -> None:
        """Post the deferred receives from ``need``'s sender up to ``need`` (receiving the metadata of a new
        boundary, blocking), then the following ones whose shapes are now known."""
        waiting = st.deferred.get(self._source(need), [])
        if need not in waiting:
            return
        upto = waiting.index(need) + 1
        while waiting and (upto > 0 or self._shape_known(waiting[0])):
            self._post_recv(waiting.pop(0), st)
            upto -= 1

    def _take(self, kind: str, stage: int, mb: int, st: StepState) -> list[Tensor]:
        got = st.pending.pop((kind, stage, mb))
        return got.wait() if isinstance(got, comm.Handle) else got  # type: ignore[return-value]

    # -- compute ---------------------------------------------------------------------------------------
    def _stage_args(self, s: int, i: int, received: list[Tensor], st: StepState) -> tuple:
        """A graph stage takes the micro-batch's inputs and the received tensors; a chain stage one tensor."""
        if isinstance(self.stages[s], GraphStage):
            return (st.inputs[i], received)
        return (st.inputs[i] if s == 0 else received[0],)

    def _forward(self, s: int, i: int, st: StepState) -> None:
        received = self._take("RECV_F", s, i, st) if s > 0 else []
        with compute_autocast(self.mesh.device, self.autocast):
            args, capture = self._stage_args(s, i, received, st), self.captures.get(s)
            if capture is None:
                out = self.stages[s](*args)
            else:
                out, captured = capture.run(self.stages[s], *args)
                if captured is not None:
                    st.captured[(s, i)] = captured
            if s == self.last:
                loss = self.loss_fn(out, st.targets[i]) if self.loss_fn is not None else model_loss(out)
        if s == self.last:
            st.losses.append(loss.detach())
            if self.schedule.forward_only:  # evaluation: the loss is all a micro-batch leaves behind
                return
            outs = [loss / len(st.inputs)]  # d(mean over micro-batches) / d(loss_i) = 1/m
        else:
            outs = out if isinstance(out, list) else [out]
        if not self.schedule.forward_only:  # evaluation keeps the outputs only until they are sent
            st.inputs_kept[(s, i)] = [x for x in received if x.requires_grad]
        st.outputs[(s, i)] = outs
        st.peak_held = max(st.peak_held, len(st.outputs))

    def _out_grad(self, s: int, i: int, st: StepState) -> list[Tensor] | None:
        return None if s == self.last else self._take("RECV_B", s, i, st)

    def _roots(self, s: int, outs: list[Tensor]) -> list[Tensor]:
        """The outputs backward starts from: the loss, or the sent tensors that require grad (their
        gradients come back in that order)."""
        return outs if s == self.last else [o for o in outs if o.requires_grad]

    def _backward_full(self, s: int, i: int, st: StepState) -> None:
        xs, outs = st.inputs_kept.pop((s, i)), st.outputs.pop((s, i))
        roots = self._roots(s, outs)
        grads = self._out_grad(s, i, st)
        if roots:
            torch.autograd.backward(roots, grads)
        if s > 0:
            st.in_grads[(s, i)] = [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]

    def _backward_input(self, s: int, i: int, st: StepState) -> None:
        """Split B: dL/dx for the previous stage, plus dL/dy for every captured weight-owning module output y
        (on the way to x anyway), so W needs only each module's local backward."""
        grad, xs = self._out_grad(s, i, st), st.inputs_kept[(s, i)]
        roots = self._roots(s, st.outputs[(s, i)])
        captured = st.captured.pop((s, i), None)
        wrt = xs + [y for _, y in captured or []]
        grads = list(torch.autograd.grad(roots, wrt, grad, retain_graph=True, allow_unused=True)) \
            if wrt and roots else [None] * len(wrt)
        if s > 0:
            st.in_grads[(s, i)] = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, xs)]
        grads = grads[len(xs):]
        st.out_grads[(s, i)] = list(zip(captured, grads)) if captured is not None else \
            (tuple(grad) if grad is not None else None)

    def _backward_weight(self, s: int, i: int, st: StepState) -> None:
        outs, grad = st.outputs.pop((s, i)), st.out_grads.pop((s, i))
        st.inputs_kept.pop((s, i))
        roots = self._roots(s, outs)
        if roots:
            enter = None if self.zero3 is None else (lambda mod: self.zero3.enter(mod, s))
            weight_gradients(self.stages[s], roots, grad, enter)

    # -- the loop --------------------------------------------------------------------------------------
    def _wait_input(self, a: Action, st: StepState) -> None:
        """Wait for the receive ``a`` consumes (so the recorded compute time excludes waiting)."""
        if a.kind == "W":
            return
        kind = "RECV_F" if a.kind == "F" else "RECV_B"
        self._flush_recv(Action(a.stage, kind, a.microbatch), st)
        got = st.pending.get((kind, a.stage, a.microbatch))
        if isinstance(got, comm.Handle):
            st.pending[(kind, a.stage, a.microbatch)] = got.wait()

    def _compute(self, a: Action, st: StepState) -> None:
        s, i, same_rank = a.stage, a.microbatch, self.schedule.rank_of
        if a.kind == "F":
            self._forward(s, i, st)
            if s < self.last and same_rank(s + 1) == same_rank(s):
                if self.schedule.forward_only:  # no backward: the next stage may take the tensors themselves
                    st.pending[("RECV_F", s + 1, i)] = st.outputs.pop((s, i))
                else:
                    st.pending[("RECV_F", s + 1, i)] = [o.detach().clone().requires_grad_(o.requires_grad)
                                                        for o in st.outputs[(s, i)]]
        elif a.kind == "B":
            (self._backward_input if self.schedule.split_backward else self._backward_full)(s, i, st)
            if s > 0 and same_rank(s - 1) == same_rank(s):
                st.pending[("RECV_B", s - 1, i)] = st.in_grads.pop((s, i))
        else:
            self._backward_weight(s, i, st)

    def _communicate(self, a: Action, st: StepState, sent_meta: set[int]) -> None:
        s, i = a.stage, a.microbatch
        if a.kind in ("RECV_F", "RECV_B"):
            self._queue_recv(a, st)
        elif a.kind == "SEND_F":
            # evaluation frees a micro-batch's output once sent (the send holds its own reference until done)
            outs = st.outputs.pop((s, i)) if self.schedule.forward_only else st.outputs[(s, i)]
            if s not in sent_meta:
                self._send_meta(s, outs)
                self.shapes[s] = [spec_of(o) for o in outs]
                sent_meta.add(s)
            self._send(pack([o.detach() for o in outs], self.mesh.device), s + 1, st)
        else:  # SEND_B
            self._send(pack(st.in_grads.pop((s, i)), self.mesh.device), s - 1, st)

    def run(self, actions: Sequence[Action], st: StepState) -> None:
        """Execute ``actions`` (this rank's lowered list) for one step. Collective along the pipeline axis."""
        key = _shape_key(st.inputs[0])
        if key != self.shape_key:
            self.shapes, self.shape_key = {}, key
        sent_meta = set(self.shapes)
        final = _final_grad_actions(actions, "W" if self.schedule.split_backward else "B")
        for k, a in enumerate(actions):
            if not a.is_compute:
                self._communicate(a, st, sent_meta)
                continue
            self._wait_input(a, st)
            start = time.perf_counter()
            last = self.grad_sync is not None and final.get(a.stage) == k
            if last:
                self.grad_sync.arm(a.stage)
            if self.microbatch_context is None:
                self._compute(a, st)
            else:
                with self.microbatch_context(st.inputs[a.microbatch]):
                    self._compute(a, st)
            if self.zero3 is not None:
                self.zero3.action_done(a.stage)
            if last:
                self.grad_sync.stage_done(a.stage)
            if self.synchronize_timings:  # CUDA: without a sync the clock sees kernel launches only
                torch.cuda.synchronize(self.mesh.device)
            st.events.append((a, start, time.perf_counter()))
        for h in st.sends:
            h.wait()
        assert not st.outputs and not st.pending and not any(st.deferred.values()), \
            "schedule left work undone (validated schedules never do)"


def _shape_key(mb: Any) -> tuple:
    """Shapes and dtypes of a micro-batch's input tensors: a change resets the cached message shapes."""
    leaves = pytree.tree_flatten(mb)[0]
    return tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, Tensor))


def _boundary(recv: Action) -> int:
    """The stage whose output a receive carries (forward: the previous stage's; backward: the input gradient
    of the next stage, shaped like this stage's output): the key of ``Interpreter.shapes``."""
    return recv.stage - 1 if recv.kind == "RECV_F" else recv.stage


def _final_grad_actions(actions: Sequence[Action], kind: str) -> dict[int, int]:
    """Local stage -> position in ``actions`` of its last gradient-producing action (``kind``)."""
    return {a.stage: k for k, a in enumerate(actions) if a.kind == kind}


def run_actions(interpreter: Interpreter, actions: Sequence[Action], inputs: list[Any],
                targets: list[Tensor | None]) -> StepState:
    """Run one step; the state holds the last stage's per-micro-batch losses (empty on other ranks)."""
    st = StepState(inputs=inputs, targets=targets)
    interpreter.run(actions, st)
    return st
