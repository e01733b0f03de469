"""rope_ext's ops on DTensors (rope_ext/_sharding.py): two gloo processes on the CPU run every case of
tests/dtensor_cases.py on DTensors, once for the module; each test compares one case's gathered
results with the same case run here on ordinary tensors.

Tolerances: outputs and the rotated inputs' gradients are computed per element, by the same kernel
on the same numbers, so they must be bitwise equal. Table and cache gradients are sums over batch
and heads that a sharded run adds in another order (float64 cases, bound in dtensor_cases._randn).
(The tensor-parallel Llama is in tests/test_distributed.py, with the tests that need transformers.)
"""
from __future__ import annotations

import itertools
import socket
import subprocess
import sys

import dtensor_cases as cases
import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("dtensor") / "results.pt"
    names = [*cases.CASES, *cases.REFUSED]
    mp.spawn(cases.run_all, args=(WORLD, _free_port(), str(out), names), nprocs=WORLD, join=True)
    return torch.load(out, weights_only=False)


def check_grads(got, ref, n_exact, **tolerance):
    """The first n_exact gradients bitwise equal, the rest within the tolerance."""
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        if i < n_exact:
            assert torch.equal(a, b), f"gradient {i} (a rotated input's) differs"
        else:
            torch.testing.assert_close(a, b, msg=f"gradient {i} (a table's or cache's)", **tolerance)


@pytest.mark.parametrize("name", cases.CASES)
def test_op_on_dtensors_equals_unsharded(sharded, name):
    case, expected = cases.CASES[name]
    got = sharded[name]
    assert not isinstance(got, str), got
    ref = case(cases.Plain())
    if expected is not None:  # (None: DTensor's choice among correct ones)
        assert got["placements"] == expected, "the outputs keep the rotated inputs' placements"
    for a, b in zip(got["out"], ref["out"], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # the rotated inputs' gradients keep their placements (after a redistribution: the output's)
    assert expected is None or got["grad_placements"] == expected[: len(got["grad_placements"])]
    check_grads(got["grads"], ref["grads"], len(got["grad_placements"]), rtol=0, atol=1e-10)
    if "compiled" in name:
        assert got["frames"] == (1, True), "one frame, one graph: no graph break"


@pytest.mark.parametrize("name", cases.REFUSED)
def test_inplace_refuses_what_it_cannot_keep(sharded, name):
    _, words = cases.REFUSED[name]
    got = sharded[name]
    assert isinstance(got, str), "an in-place call whose written input would move, or a norm across sharded heads, " \
        "must be refused"
    # rope_ext's message first, on every torch
    assert got.split(": ", 1)[1].startswith(words[0]), got
    for word in words:
        assert word in got, (word, got)


def test_dtensor_dispatches_ops_that_return_nothing():
    """DTensor asks every op whose rule ran whether it returns a tensor; torch 2.9 answered the
    in-place ops (which return nothing) with an IndexError. Ops with returns keep their answers."""
    from torch.distributed.tensor._op_schema import OpSchema

    import rope_ext._sharding  # noqa: F401  (registered once DTensor is imported)

    for op in ["rotary_", "rotary_pos_"]:
        assert OpSchema(getattr(torch.ops.rope_ext, op).default, (), {}).return_type_tensor() is False
    assert OpSchema(torch.ops.rope_ext.rotary.default, (), {}).return_type_tensor() is True
    assert OpSchema(torch.ops.aten.add.Tensor, (), {}).return_type_tensor() is True


class _Spec:
    """What the rules read of a DTensorSpec: the global shape and the placements."""

    def __init__(self, shape, placements):
        self.shape, self.ndim, self.placements = torch.Size(shape), len(shape), tuple(placements)


@pytest.mark.parametrize("op", ["rotary_qk", "rotary_pos_qk"])
@pytest.mark.parametrize("k_heads", [4, 2])
def test_shared_q_and_k_shards_differ_in_one_dim_on_every_mesh(op, k_heads):
    """q and k that share tables or positions must reach the kernel differing in one leading dim at
    most. The rule answers per mesh dim and DTensor takes any combination of its answers over the
    mesh's dims, which only a mesh whose dims all exceed 1 shows (2 processes cannot have one), so
    every combination is checked here, on a 2 x 2 mesh, for every placement of q and k."""
    from torch.distributed.tensor import Replicate, Shard

    from rope_ext._sharding import _Rule

    B_, S_, H_, D_ = 4, 8, 4, 16
    q_shape, k_shape = (B_, S_, H_, D_), (B_, S_, k_heads, D_)
    if op == "rotary_qk":
        shared = [_Spec((1, S_, 1, D_), [Replicate()] * 2)] * 2
    else:
        shared = [_Spec((32, D_ // 2), [Replicate()] * 2)] * 2 + [_Spec((S_, 1), [Replicate()] * 2)]
    choices = [Replicate(), Shard(0), Shard(1), Shard(2), Shard(3)]
    checked = 0
    for q_pl in itertools.product(choices, repeat=2):
        for k_pl in itertools.product(choices, repeat=2):
            args = [_Spec(q_shape, q_pl), _Spec(k_shape, k_pl), *shared, False]
            strategies = _Rule(op)(*args)
            assert strategies, "replicating q and k is always an answer"
            for combo in itertools.product(strategies, repeat=2):  # one answer per mesh dim
                splits = [[0] * 4, [0] * 4]
                for outputs, _ in combo:
                    for i, p in enumerate(outputs):
                        if isinstance(p, Shard):
                            splits[i][p.dim] += 1
                differ = {d for d in range(3) if splits[0][d] != splits[1][d] or q_shape[d] != k_shape[d]}
                assert len(differ) <= 1, (q_pl, k_pl, combo)
                checked += 1
    assert checked > 1000


def _run(code):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


_REGISTERED = """
import torch
from torch.distributed.tensor import DTensor
funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
ops = ["rotary", "rotary_qk", "rotary_", "rotary_pos", "rotary_pos_qk", "rotary_pos_"]
print(sorted(op for op in ops if getattr(torch.ops.rope_ext, op).default in funcs))
"""


def test_rules_register_when_dtensor_is_imported_after_rope_ext():
    out = _run(
        "import importlib.util, sys, rope_ext\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'importing rope_ext must not import DTensor'\n"
        "assert importlib.util.find_spec('torch.distributed.tensor')  # a lookup alone registers nothing\n"
        + _REGISTERED
    )
    assert out.strip() == str(sorted(["rotary", "rotary_qk", "rotary_", "rotary_pos", "rotary_pos_qk", "rotary_pos_"]))


def test_rules_register_when_dtensor_is_imported_first():
    out = _run("import torch.distributed.tensor, rope_ext\n" + _REGISTERED)
    assert out.strip().count("rotary") == 6


def test_failed_registration_warns_and_leaves_dtensor_importable():
    out = _run(
        "import warnings, rope_ext, rope_ext._sharding as sh\n"
        "def broken():\n    raise RuntimeError('no rules today')\n"
        "sh.register = broken\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from torch.distributed.tensor import DTensor\n"
        "print([str(w.message) for w in caught if 'rope_ext' in str(w.message)])\n"
    )
    assert "could not register its DTensor sharding rules" in out and "no rules today" in out


def test_no_finder_without_torch_distributed():
    out = _run(
        "import sys, torch\n"
        "torch.distributed.is_available = lambda: False\n"
        "import rope_ext, rope_ext._sharding as sh\n"
        "print(any(getattr(f, 'rope_ext_register_on_import', False) for f in sys.meta_path))\n"
    )
    assert out.strip() == "False"
