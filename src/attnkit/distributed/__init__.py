"""attnkit on several processes, through PyTorch's own ``torch.distributed`` (launched by torchrun).

* ``ring_attention``: exact attention over a sequence sharded across ranks (context parallelism),
  with ``shard_sequence`` / ``unshard_sequence`` for the contiguous and zigzag layouts.
* ``attnkit.distributed.ddp``: data-parallel training helpers (DistributedDataParallel,
  DistributedSampler, rank-0-only writing) used by ``attnkit train`` under torchrun.
"""

from attnkit.distributed.layout import (
    shard_lengths,
    shard_segments,
    shard_sequence,
    unshard_sequence,
)
from attnkit.distributed.ring import ring_attention

__all__ = [
    "ring_attention",
    "shard_lengths",
    "shard_segments",
    "shard_sequence",
    "unshard_sequence",
]
