"""Ring attention: one long sequence, sharded across the processes torchrun starts.

    torchrun --standalone --nproc_per_node=4 examples/ring_attention.py

Every rank builds the same full sequence (a fixed seed), keeps its zigzag shard, runs causal ring
attention forward and backward, and rank 0 checks the gathered output and gradients against
single-process attention. Run plainly (``python examples/ring_attention.py``) it is a ring of one.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from attnkit import scaled_dot_product_attention
from attnkit.distributed import ddp, ring_attention, shard_sequence, unshard_sequence


def main() -> None:
    env = ddp.setup()  # init_process_group from torchrun's environment variables
    tmp = None
    if not dist.is_initialized():  # not launched by torchrun: a group of one, through a file
        tmp = tempfile.TemporaryDirectory()
        store = dist.FileStore(str(Path(tmp.name) / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 960, 32, generator=gen, dtype=torch.float64) for _ in range(3))
    local = [
        shard_sequence(t, world, rank, layout="zigzag").requires_grad_(True) for t in (q, k, v)
    ]
    out = ring_attention(*local, is_causal=True, layout="zigzag")  # (b, h, n / W, d)
    out.sum().backward()

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(world)]  # equal shards: 960 / 2W for W <= 4
        dist.all_gather(parts, t.detach().contiguous())
        return unshard_sequence(parts, layout="zigzag")  # (b, h, n, d)

    full_out, full_dq = gather(out), gather(local[0].grad)
    if rank == 0:
        q.requires_grad_(True)
        ref = scaled_dot_product_attention(q, k, v, is_causal=True, backend="math")
        ref.sum().backward()
        print(
            f"{world} rank(s), n=960 causal zigzag: |out - single process| = "
            f"{(full_out - ref).abs().max().item():.1e}, "
            f"|dq - single process| = {(full_dq - q.grad).abs().max().item():.1e}"
        )
    if tmp is not None:
        dist.destroy_process_group()
        tmp.cleanup()
    ddp.teardown(env)


if __name__ == "__main__":
    main()
