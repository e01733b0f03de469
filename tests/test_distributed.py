"""rope_ext under torch.distributed (gloo, CPU, 2 processes): DDP training of a patched model,
context parallelism with global positions, and tensor parallelism on DTensors (the ops' rules are
tested case by case in tests/test_dtensor.py)."""
from __future__ import annotations

import socket

import distributed_workers as workers
import dtensor_cases
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


def test_tensor_parallel_llama_equals_unsharded_stock_model(tmp_path):
    """A tiny Llama whose attention is tensor parallel over heads on DTensors (tests/dtensor_cases.py's
    llama_tp), patched with rope_ext: the loss and every gradient equal the unsharded, unpatched
    model's. Splitting the matmuls (q/k/v by columns, o by rows with an all-reduce) reorders float32
    sums of values below 1, and HF's rotation rounds its two products and their sum where rope_ext's
    kernel rounds differently: a few float32 roundings, so rtol 1e-5 and atol 1e-7."""
    out = tmp_path / "tp.pt"
    name = "llama tensor parallel"
    mp.spawn(dtensor_cases.run_all, args=(WORLD, _free_port(), str(out), [name]), nprocs=WORLD, join=True)
    got = torch.load(out, weights_only=False)[name]
    assert not isinstance(got, str), got
    ref = dtensor_cases.llama_tp(dtensor_cases.Plain())
    assert got["calls"], "the patched attention must call rope_ext"
    assert all(kind == "DTensor" and placement == "S1" for _, kind, placement in got["calls"]), got["calls"]
    torch.testing.assert_close(got["out"][0], ref["out"][0], rtol=1e-5, atol=1e-7)
    assert len(got["grads"]) == len(ref["grads"])
    for i, (a, b) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=f"parameter {i}")
