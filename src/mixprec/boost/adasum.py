"""AdaSum: adaptive summation of the ranks' gradients, as a DDP communication hook.

Averaging gradients from many ranks shrinks the step when the gradients disagree and
wastes nothing when they agree; summing does the opposite. AdaSum (Maleki et al., 2021)
combines two gradients ``a`` and ``b`` as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

which is their average when they are equal and their sum when they are orthogonal. For
``2^k`` ranks the combination is applied along a butterfly: at distance ``d = 1, 2, 4, ..``
each rank exchanges its partial result with rank ``rank XOR d`` and both compute the same
``adasum(lower rank's, higher rank's)``, so after ``k`` rounds every rank holds the same
gradient. As in Horovod, each parameter tensor is combined on its own (a per-layer dot
product), in float64 for the dot products. A zero gradient contributes nothing.

Register with ``ddp.register_comm_hook(None, adasum_hook)`` (done by boost level O2 under
DDP with a power-of-two world size).
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations as objects

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["adasum_hook", "adasum_pair", "is_power_of_two"]


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """AdaSum of two gradients of one parameter (same shape and dtype).

    Example:
        >>> adasum_pair(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))
        tensor([1., 1.])
        >>> adasum_pair(torch.tensor([2.0, 0.0]), torch.tensor([2.0, 0.0]))
        tensor([2., 0.])
    """
    a64, b64 = a.double(), b.double()
    dot = torch.dot(a64.flatten(), b64.flatten())
    na, nb = a64.square().sum(), b64.square().sum()
    ca = torch.where(na > 0, 1 - dot / (2 * na.clamp_min(1e-300)), torch.zeros_like(na))
    cb = torch.where(nb > 0, 1 - dot / (2 * nb.clamp_min(1e-300)), torch.zeros_like(nb))
    return (ca * a64 + cb * b64).to(a.dtype)


def adasum_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that combines the ranks' gradients by AdaSum.

    ``state`` is the process group (None for the default one). Needs ``2^k`` ranks.
    """
    group = state
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if not is_power_of_two(world):
        raise RuntimeError(f"AdaSum needs a power-of-two number of ranks; this group has {world}")
    buffer = bucket.buffer()
    sizes = [g.numel() for g in bucket.gradients()]
    result = buffer.clone()
    distance = 1
    while distance < world:
        partner = rank ^ distance
        peer_global = dist.get_global_rank(group, partner) if group is not None else partner
        received = torch.empty_like(result)
        requests = [
            dist.isend(result, peer_global, group),
            dist.irecv(received, peer_global, group),
        ]
        for request in requests:
            if request is not None:
                request.wait()
        lower, upper = (result, received) if rank < partner else (received, result)
        pieces = [
            adasum_pair(x, y) for x, y in zip(lower.split(sizes), upper.split(sizes), strict=True)
        ]
        result = torch.cat(pieces) if pieces else result
        distance *= 2
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(result)
    return future
