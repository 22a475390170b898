"""Context parallelism: the loss of a sequence split across ranks.

Under context parallelism (accelerate's, torch's ``context_parallel``) each rank holds a chunk
of every sequence: its hidden states, and the labels already shifted (``shift_labels``, cut
before the split so no label is lost at a chunk's edge). The fused loss runs on the chunk as it
is; only the mean needs the whole: each rank's loss is its tokens' summed loss divided by the
number of labels that count on ALL ranks, so the ranks' losses (and gradients) add up to the
loss of the whole sequence. transformers' Trainer passes that count as ``num_items_in_batch``;
`token_count` makes it with one all-reduce of one number.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def token_count(
    shift_labels: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The labels other than `ignore_index` over every rank of `group` (default: the world),
    as a 0-d fp32 tensor on the labels' device: pass it as ``num_items_in_batch``. One
    all-reduce of one number; nothing waits for the host."""
    count = (shift_labels != ignore_index).sum(dtype=torch.float32)
    dist.all_reduce(count, group=group)
    return count
