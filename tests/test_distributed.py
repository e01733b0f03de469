"""rope_ext under torch.distributed (gloo, CPU, 2 processes): DDP training of a patched model, and
context parallelism with global positions."""
from __future__ import annotations

import socket

import distributed_workers as workers
import pytest
import torch
import torch.multiprocessing as mp

import rope_ext
from rope_ext.integrations import transformers as rope_hf

pytest.importorskip("transformers")
WORLD = 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_step_equals_single_process_step(tmp_path):
    out = tmp_path / "ddp.pt"
    mp.spawn(workers.ddp_step, args=(WORLD, _free_port(), str(out)), nprocs=WORLD, join=True)
    ddp = torch.load(out)

    with rope_hf.patch(["llama"]):  # the same step in one process on the whole batch
        model = workers.tiny_llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = workers.batch()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    # DDP averages the two half-batch gradients: the full-batch gradient up to float32
    # summation order; one AdamW step (lr 1e-2) keeps the parameters within that.
    for name, p in model.named_parameters():
        torch.testing.assert_close(ddp[name], p.detach(), atol=1e-5, rtol=1e-5, msg=name)


def test_context_parallel_rotation_equals_unsharded(tmp_path):
    out = tmp_path / "cp.pt"
    mp.spawn(workers.context_parallel_rotation, args=(WORLD, _free_port(), str(out)), nprocs=WORLD, join=True)
    q_cp, k_cp = torch.load(out)
    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(2, 8, 64, 32, generator=gen), torch.randn(2, 2, 64, 32, generator=gen)
    q_ref, k_ref = rope_ext.RotaryEmbedding(32, 5e5, layout="bhsd")(q, k)
    assert torch.equal(q_cp, q_ref) and torch.equal(k_cp, k_ref)
