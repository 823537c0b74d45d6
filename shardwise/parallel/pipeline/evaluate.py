"""``Pipeline.evaluate``: the loss of a batch through the pipeline, forward only (a validation pass).

The batch is split exactly as ``step`` splits it (dp slice, then ``microbatches`` micro-batches) and runs the
forward-only schedule (``schedules.forward_only``: every stage's ``F`` per micro-batch, in order), lowered to
sends and receives as the training schedule is, on an interpreter of its own: it shares the stages and the
transport with training but keeps its own message-shape cache (an activation computed under ``no_grad``
does not require grad, and a training step must not inherit that shape). Under ``torch.no_grad`` with the
stages in eval mode (dropout off; each module's own mode restored afterwards): nothing is saved for a
backward, every ``.grad`` is left as it was, and there is no dp gradient reduction, no tied-gradient
exchange, no ZeRO-1 work and no recomputation. What crosses the pipeline axis: one activation message per
micro-batch per stage boundary (plus one shape message per boundary on the first evaluate of a batch shape),
then the loss broadcast; over dp one all-reduce of the loss.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from .mixed import cast_inputs
from .batching import split_chain, split_graph
from .communication import lower_communication
from .executor import Interpreter, run_actions
from .schedules import forward_only

__all__ = ["evaluate"]

# ``pipe`` below is a ``build.Pipeline`` (typed ``Any``: build imports this module, not the other way round)


def _evaluator(pipe: Any) -> Interpreter:
    """The pipeline's forward-only interpreter, built on first use (pure) and kept for later calls."""
    if pipe._evaluator is None:
        sched = forward_only(pipe.schedule.p, pipe.microbatches, pipe.schedule.chunks)
        train = pipe.interpreter
        pipe._evaluator = Interpreter(schedule=sched, stages=pipe.stages, mesh=pipe.mesh, axis=pipe.axis,
                                      loss_fn=train.loss_fn, autocast=train.autocast, n_values=train.n_values)
        lowered = lower_communication(sched, recv_ahead=pipe.recv_ahead, recv_before_send=pipe.recv_before_send)
        pipe._eval_actions = lowered.ranks[pipe.mesh.coord(pipe.axis)]
    return pipe._evaluator


def micro_batches(pipe: Any, args: tuple, kwargs: dict, loss_fn: Callable | None,
                  what: str = "evaluate") -> tuple[list[Any], list[Tensor | None]]:
    """This rank's micro-batches and targets of ``pipe.step``/``pipe.evaluate``'s arguments (``what`` names the
    call in the error): its dp slice, cut into the pipeline's micro-batches."""
    m = pipe.microbatches
    dp = pipe.mesh.size(pipe.dp_axis) if pipe.dp_axis else 1
    me = pipe.mesh.coord(pipe.dp_axis) if pipe.dp_axis else 0
    if pipe.graph is None:
        if len(args) != 2 or kwargs:
            raise TypeError(f"pipe.{what}(inputs, targets) takes two tensors for this pipeline; keyword inputs "
                            f"need sw.pipeline(..., example_inputs=...)")
        return split_chain(args[0], args[1], m, dp, me, pipe.dp_axis, pipe.mesh.device)  # type: ignore[return-value]
    return split_graph(args, kwargs, loss_fn is not None, pipe.graph, m, dp, me, pipe.dp_axis,  # type: ignore[return-value]
                       pipe.mesh.device)


def evaluate(pipe: Any, args: tuple, kwargs: dict, loss_fn: Callable[[Any, Tensor], Tensor] | None) -> float:
    """The mean loss over the micro-batches and dp of one forward-only pass (see module doc). Collective."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, targets) -> scalar, got {loss_fn!r}")
    fn = loss_fn if loss_fn is not None else pipe.interpreter.loss_fn  # the loss `step` uses
    inputs, targets = micro_batches(pipe, args, kwargs, fn)
    inputs = cast_inputs(inputs, pipe.compute_dtype)
    pipe._choose_transport()
    interp = _evaluator(pipe)
    interp.p2p, interp.loss_fn, interp.zero3 = pipe.interpreter.p2p, fn, pipe.zero3
    interp.microbatch_context = pipe.interpreter.microbatch_context
    modes = {id(mod): (mod, mod.training) for stage in pipe.stages.values() for mod in stage.modules()}
    try:
        for mod, _ in modes.values():
            mod.train(False)
        if pipe.zero3 is not None:
            pipe.zero3.hold()  # the held group (tied and shared parameters); units gather as they run
        with torch.no_grad():
            state = run_actions(interp, pipe._eval_actions, inputs, targets)
    finally:
        _restore(modes)
        if pipe.zero3 is not None:
            pipe.zero3.release()
    return pipe._mean_loss(state.losses)


def _restore(modes: dict[int, tuple[nn.Module, bool]]) -> None:
    # per module (not stage.train(mode)): a module the user had in eval mode inside a training stage stays so
    for mod, training in modes.values():
        mod.training = training
