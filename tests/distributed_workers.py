"""Worker functions for tests/test_distributed.py, importable by spawned processes."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)


def tiny_llama():
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return T.AutoModelForCausalLM.from_config(config).float()


def batch():
    return torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(5))


def ddp_step(rank, world, port, out_path):
    """One AdamW step of the patched model under DDP, each rank on its half of the batch."""
    from rope_ext.integrations import transformers as rope_hf

    _init(rank, world, port)
    try:
        rope_hf.patch(["llama"])
        model = torch.nn.parallel.DistributedDataParallel(tiny_llama())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = batch().chunk(world)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        if rank == 0:
            torch.save({n: p.detach() for n, p in model.module.named_parameters()}, out_path)
    finally:
        dist.destroy_process_group()


def context_parallel_rotation(rank, world, port, out_path):
    """Each rank rotates its contiguous shard of the sequence with global positions (offset =
    shard start); the gathered result is saved by rank 0."""
    import rope_ext

    _init(rank, world, port)
    try:
        gen = torch.Generator().manual_seed(6)
        q, k = torch.randn(2, 8, 64, 32, generator=gen), torch.randn(2, 2, 64, 32, generator=gen)
        rope = rope_ext.RotaryEmbedding(32, 5e5, layout="bhsd")
        shard = 64 // world
        sl = slice(rank * shard, (rank + 1) * shard)
        q_out, k_out = rope(q[:, :, sl].contiguous(), k[:, :, sl].contiguous(), offset=rank * shard)
        qs, ks = [torch.empty_like(q_out) for _ in range(world)], [torch.empty_like(k_out) for _ in range(world)]
        dist.all_gather(qs, q_out)
        dist.all_gather(ks, k_out)
        if rank == 0:
            torch.save((torch.cat(qs, dim=2), torch.cat(ks, dim=2)), out_path)
    finally:
        dist.destroy_process_group()
