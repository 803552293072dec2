"""Training steps of a tiny in-process Megatron GPT on fixed random batches (seeded per step), the
loop the optimizer tests (swap optimizer, fused Adam) share: their losses compare bit for bit."""
from __future__ import annotations

import torch


def train_steps(model, optimizer, steps: int, start: int = 0) -> list[float]:
    losses = []
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + i)
        tokens = torch.randint(0, 64, (2, 16), generator=g)
        labels = torch.randint(0, 64, (2, 16), generator=g)
        position = torch.arange(16).unsqueeze(0).expand(2, 16)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, position, None, labels=labels).float().mean()
        loss.backward()
        model.finish_grad_sync()
        ok, _, _ = optimizer.step()
        assert ok
        losses.append(loss.item())
    return losses
