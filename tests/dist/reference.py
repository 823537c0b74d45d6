"""The single-device reference every distributed check compares against: plain SGD on the whole batch."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from shardwise.models.gpt import lm_loss


def sgd_reference(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], lr: float,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``model`` one SGD step per batch on one device; the losses and the final state dict."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}
