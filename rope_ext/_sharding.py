"""Sharding rules for the rope_ext ops on DTensors: tensor, sequence and context parallel.

Every op rotates each row of its rotated inputs (x, or q and k) along the last dim, by the table
entries or cache rows of that row alone. So the work splits along any dim but the last, provided
each tensor that broadcasts against the rows is split the same way:

- cos/sin tables (aligned with ``x.shape[:-1] + (r,)`` from the right): sharded on the dim that
  lines up with x's sharded dim, or replicated where they broadcast along it (size 1, or absent);
- positions (aligned with ``x.shape[:-1]``): the same rule;
- the caches of the positions ops (rows indexed by position, columns by pair): always replicated.

The output (and so the gradient, whose op is the same rotation) keeps x's placement. Anything
else is redistributed before the op runs, never computed wrongly: a sharded last dim (the rotated
one), ``Partial`` inputs, tables or caches that do not match. DTensor picks, among the placements
offered here, the one that is cheapest to reach; replicating everything is always among them.

The in-place ops cannot redistribute what they write: their rotated inputs keep their placements,
and a placement that the op cannot keep raises an error that names the argument.

Registration goes through torch's public ``register_sharding`` and happens on import of
``torch.distributed.tensor``, whichever comes first: importing rope_ext never imports DTensor (about
0.9 s), and a process that never uses DTensor pays nothing (see ``install``). Where DTensor cannot
dispatch an op that returns nothing (torch 2.9 could not; rope_ext needs 2.10 now), ``register``
teaches it, found by asking rather than by version.
"""

from __future__ import annotations

import importlib.abc
import itertools
import sys
import threading
import warnings

import torch

_DTENSOR = "torch.distributed.tensor"

# Per op: the rotated arguments (their placements are the outputs'), whether the op writes them in
# place, and its tables (which follow the rotated arguments; _followers says whom each serves) or
# its caches (replicated; their positions follow the rotated arguments).
_QK_PARAMS = ("q_weight", "k_weight", "q_bias", "k_bias")
_OPS = {
    "rotary": dict(rotated=("x",), tables=("cos", "sin"), inplace=False),
    "rotary_": dict(rotated=("x",), tables=("cos", "sin"), inplace=True),
    "rotary_qk": dict(rotated=("q", "k"), tables=("cos", "sin"), inplace=False),
    "rotary_pos": dict(rotated=("x",), caches=("cos_cache", "sin_cache"), inplace=False),
    "rotary_pos_qk": dict(rotated=("q", "k"), caches=("cos_cache", "sin_cache"), inplace=False),
    "rotary_pos_": dict(rotated=("q", "k"), caches=("cos_cache", "sin_cache"), inplace=True),
    # QK-norm + RoPE: the norms' weights and biases are replicated (a row needs all of them), and
    # each rotated argument's statistics (its last dim, or its last two across heads, reduced; with a
    # last dim of 2 when centered) are split as it is. A norm across heads, or a weight with a row
    # per head, needs all of a token's heads: that q or k sharded over dim -2 is refused.
    "qk_norm_rotary": dict(rotated=("q", "k"), tables=("cos", "sin"), weights=_QK_PARAMS, stats=True, inplace=False),
    "qk_norm_rotary_pos": dict(rotated=("q", "k"), caches=("cos_cache", "sin_cache"), weights=_QK_PARAMS, stats=True,
                               inplace=False),
    "norm_rotary": dict(rotated=("x",), tables=("cos", "sin"), weights=("weight", "bias"), stats=True, inplace=False),
    "qk_norm_rotary_": dict(rotated=("q", "k"), tables=("cos", "sin"), weights=_QK_PARAMS, inplace=True),
    "qk_norm_rotary_pos_": dict(rotated=("q", "k"), caches=("cos_cache", "sin_cache"), weights=_QK_PARAMS,
                                inplace=True),
    # Its backward, per tensor: grad and the statistics follow x, the weight's and the bias's
    # gradients are sums over every row (Partial where x is split). cos/sin are tables, or caches
    # when positions are given.
    "qk_norm_rotary_backward": dict(rotated=("x",), tables=("cos", "sin"), weights=("weight",), inplace=False,
                                    backward=True),
}


def _followers(op: str, args: dict) -> list[tuple[str, tuple[str, ...], bool | str]]:
    """(argument, the rotated arguments it serves, how it lines up with them) for each argument that
    must be split like the rows it serves: True for a table (x.shape[:-1] + (r,)), False for
    positions (x.shape[:-1]), "stat" for a norm's rstd (x's leading dims)."""
    if op == "qk_norm_rotary_backward":
        tables = [("positions", ("x",), False)] if args.get("positions") is not None else \
            [("cos", ("x",), True), ("sin", ("x",), True)]
        return [("grad", ("x",), True), ("rstd", ("x",), "stat"), *tables]
    if "caches" in _OPS[op]:
        served = tuple(n for n in _OPS[op]["rotated"] if args.get(n) is not None)
        return [("positions", served, False)]
    if op == "rotary_qk" and args.get("cos_k") is not None:  # k has tables of its own
        return [("cos", ("q",), True), ("sin", ("q",), True), ("cos_k", ("k",), True), ("sin_k", ("k",), True)]
    return [(name, _OPS[op]["rotated"], True) for name in _OPS[op]["tables"]]


def _refusal(message: str) -> RuntimeError:
    """The error with which a rule refuses a call: torch's DTensor dispatcher (2.10 to 2.15, make
    wheel-check) puts its message first."""
    return RuntimeError(message)


def _describe(placements) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


class _Rule:
    """The sharding function of one op, for register_sharding: it gets the op's arguments with
    DTensorSpecs for tensors and returns the acceptable (outputs, inputs) placements on one mesh
    dim; DTensor combines them over the mesh's dims."""

    def __init__(self, op: str):
        self.op = op
        self.schema = getattr(torch.ops.rope_ext, op).default._schema
        self.names = [a.name for a in self.schema.arguments]

    def __call__(self, *args, **kwargs):
        from torch.distributed.tensor import Partial, Replicate, Shard

        # DTensor passes every argument that is not keyword-only positionally, and these schemas have
        # none; it would not redistribute a keyword (a placement chosen for one would be ignored).
        assert not kwargs, f"rope_ext.{self.op}: unexpected keyword arguments {sorted(kwargs)} in a sharding rule"
        order = self.names[: len(args)]
        bound = dict(zip(self.names, args, strict=False))
        spec = _OPS[self.op]
        rotated = [n for n in spec["rotated"] if bound.get(n) is not None]
        followers = _followers(self.op, bound)

        def whole_heads(name):
            """Why rotated argument `name` needs all of a token's heads in one place, or None."""
            if bound.get("across_heads"):
                return "a norm across heads"
            prefix = "" if name == "x" else f"{name}_"
            for param in (f"{prefix}weight", f"{prefix}bias"):
                t = bound.get(param)
                if t is not None and t.ndim == 1 and t.shape[0] != bound[name].shape[-1]:
                    return f"{param}, a row of weights per head,"
            return None

        def usable(name, p):  # a placement a rotated argument can keep through the op
            keep = type(p) is Shard and p.dim % bound[name].ndim != bound[name].ndim - 1
            return keep and not (whole_heads(name) and p.dim % bound[name].ndim == bound[name].ndim - 2)

        def follower_placement(name, served, table, placements):
            """The placement `name` needs for the rotated ones to have `placements`, or None if they
            disagree."""
            t = bound[name]
            needs = set()
            for x_name, p in zip(rotated, placements, strict=True):
                if x_name not in served:
                    continue
                if isinstance(p, Replicate):
                    needs.add(Replicate())
                    continue
                x = bound[x_name]
                # t's dims line up with x.shape[:-1] + (r,) (tables) or x.shape[:-1] (positions), or
                # begin with x's (a norm's rstd)
                a = p.dim % x.ndim - (0 if table == "stat" else x.ndim - t.ndim - (0 if table else 1))
                needs.add(Replicate() if a < 0 or t.shape[a] == 1 else Shard(a))
            return needs.pop() if len(needs) == 1 else None

        def split_dim(name, p):
            return p.dim % bound[name].ndim if isinstance(p, Shard) else None

        def head_dim():
            """The one leading dim in which q's and k's shards may differ when they share tables or
            positions (the kernel takes them so, broadcasting those along it): where their shapes
            differ (GQA), or else where their current placements split them differently; None if
            no one dim qualifies, and -1 (anything goes: the kernel will name the problem) if q
            and k are not such a pair to begin with."""
            q, k = (bound[n] for n in rotated)
            if q.ndim != k.ndim:
                return -1
            differ = {d for d in range(q.ndim - 1) if q.shape[d] != k.shape[d]}
            if not differ:
                differ = {
                    d for pq, pk in zip(q.placements, k.placements, strict=True)
                    for d in (split_dim(rotated[0], pq), split_dim(rotated[1], pk))
                    if d is not None and split_dim(rotated[0], pq) != split_dim(rotated[1], pk)
                }
                return differ.pop() if len(differ) == 1 else None
            return differ.pop() if len(differ) == 1 else -1

        for name in rotated:
            why = whole_heads(name)
            for i, p in enumerate(bound[name].placements):
                if why and isinstance(p, Shard) and p.dim % bound[name].ndim == bound[name].ndim - 2:
                    raise _refusal(
                        f"rope_ext.{self.op}: {name} is sharded over its heads (dim -2, on mesh dim {i}), and "
                        f"{why} needs all of a token's heads in one place. Shard another dim (batch, sequence)"
                        + (", or normalize per head." if bound.get("across_heads") else ".")
                    )
        coupled = len(rotated) == 2 and any(len(served) == 2 for _, served, _ in followers)
        allowed = head_dim() if coupled else -1

        def shards_differ(placements):
            """Whether this mesh dim would split q and k differently along a dim other than the
            allowed one: then the combined shards could differ in two dims."""
            a, b = (split_dim(n, p) for n, p in zip(rotated, placements, strict=True))
            return allowed != -1 and a != b and ({a, b} - {None, allowed})

        def strategy(placements):
            """(outputs, inputs) for the rotated arguments placed as given, or why they cannot be."""
            if coupled and shards_differ(placements):
                return "q's and k's shards would differ in more than the head count"
            by_name = dict(zip(rotated, placements, strict=True))
            for name, served, table in followers:
                p = follower_placement(name, served, table, placements)
                if p is None:
                    return f"{name} cannot be split to match both"
                by_name[name] = p
            caches = spec.get("caches", ())
            if spec.get("backward") and bound.get("positions") is not None:
                caches = ("cos", "sin")
            for name in (*caches, *spec.get("weights", ())):
                if bound.get(name) is not None:
                    by_name[name] = Replicate()
            inputs = [by_name.get(n) for n in order]
            if spec["inplace"]:
                return [], inputs
            outputs = list(placements)
            if spec.get("stats"):  # each rotated argument's rstd, split as it is
                outputs += [p if isinstance(p, Replicate) else Shard(p.dim % bound[n].ndim)
                            for n, p in zip(rotated, placements, strict=True)]
            if spec.get("backward"):  # the weight's and the bias's gradients: sums over every row
                outputs += [Replicate() if isinstance(placements[0], Replicate) else Partial()] * 2
            return outputs, inputs

        if spec["inplace"]:
            return self._inplace(bound, rotated, usable, strategy)
        options = []
        for name in rotated:
            kept = [p for p in bound[name].placements if usable(name, p)]
            options.append(list(dict.fromkeys([Replicate(), *kept])))
        results = [strategy(list(c)) for c in itertools.product(*options)]
        return [r for r in results if not isinstance(r, str)]

    def _inplace(self, bound, rotated, usable, strategy):
        """The in-place ops write their rotated arguments: each keeps its placement on every mesh
        dim (redistributing k would write a copy), and the followers adapt."""
        from torch.distributed.tensor import Replicate

        op = f"rope_ext.{self.op}"
        mesh_dims = range(len(bound[rotated[0]].placements))
        for name in rotated:
            for i, p in enumerate(bound[name].placements):
                if not (isinstance(p, Replicate) or usable(name, p)):
                    raise _refusal(
                        f"{op}: {name} is placed {_describe(bound[name].placements)}, and the in-place op "
                        f"cannot keep {p} on mesh dim {i}: it writes {name} where it is, so {name} must be "
                        "replicated or sharded on a dim other than the last (the rotated one). Redistribute "
                        f"{name} first, or call the out-of-place op."
                    )
        per_dim = [tuple(bound[n].placements[i] for n in rotated) for i in mesh_dims]
        if len(set(per_dim)) != len({c[0] for c in per_dim}):  # DTensor only pins the first one's placement
            raise _refusal(
                f"{op}: q {_describe(bound['q'].placements)} and k {_describe(bound['k'].placements)}: where q "
                "has one placement on two mesh dims, k must too, for the in-place op to keep both. "
                "Redistribute k to match, or call the out-of-place op."
            )
        strategies = []
        for placements in dict.fromkeys(per_dim):
            result = strategy(list(placements))
            if isinstance(result, str):
                raise _refusal(
                    f"{op}: "
                    + " and ".join(f"{n} {_describe(bound[n].placements)}" for n in rotated)
                    + f" do not fit together: {result}. The in-place op cannot redistribute what it writes; "
                    "redistribute the inputs to agree, or call the out-of-place op."
                )
            strategies.append(result)
        return strategies


def is_dtensor(t) -> bool:
    """Whether t is a DTensor, without importing DTensor: a process that has not loaded it has none."""
    module = sys.modules.get(_DTENSOR)
    return module is not None and isinstance(t, getattr(module, "DTensor", ()))


def replicated_like(x, *tensors):
    """For a DTensor x: the plain tensors among ``tensors`` (a module's tables and positions, the same
    on every rank) as DTensors replicated on x's mesh, so that they enter x's op, and its backward,
    as DTensors. Otherwise ``tensors`` as they are."""
    if type(x) is torch.Tensor or not is_dtensor(x):
        return tensors
    from torch.distributed.tensor import DTensor, Replicate

    placements = [Replicate()] * x.device_mesh.ndim
    return tuple(
        t if isinstance(t, DTensor) else DTensor.from_local(t, x.device_mesh, placements, run_check=False)
        for t in tensors
    )


def _let_dtensor_dispatch_ops_that_return_nothing() -> None:
    """The in-place ops return nothing (``-> ()``). DTensor's sharding propagation of torch 2.9 asks
    ``OpSchema.return_type_tensor()`` of every op whose rule it ran, and that reads the op's first
    return without checking that there is one: an IndexError, which DTensor reports as "Sharding
    propagation failed" for any placement. Later torch (2.11 at the latest) answers False for an op
    with no returns; this gives torch 2.9 that answer, and changes nothing for an op with returns.
    Detected by asking, not by version: where torch answers already, nothing is touched."""
    from torch.distributed.tensor._op_schema import OpSchema

    try:
        OpSchema(torch.ops.rope_ext.rotary_.default, (), {}).return_type_tensor()
        return
    except IndexError:
        pass
    answer = OpSchema.return_type_tensor

    def return_type_tensor(self) -> bool:
        return len(self.op._schema.returns) > 0 and answer(self)

    return_type_tensor.__wrapped__ = answer
    OpSchema.return_type_tensor = return_type_tensor


def register() -> None:
    """Register the rules of every rope_ext op with DTensor (imports torch.distributed.tensor)."""
    from torch.distributed.tensor.experimental import register_sharding

    _let_dtensor_dispatch_ops_that_return_nothing()
    for op in _OPS:
        register_sharding(getattr(torch.ops.rope_ext, op).default)(_Rule(op))


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself. Asked for torch.distributed.tensor before the rules are registered,
    it returns the other finders' spec with its loader wrapped, so that the rules are registered
    once the module has run; a spec only looked up (importlib.util.find_spec) changes nothing. It
    stays in sys.meta_path (removing it could make another thread's import skip a finder)."""

    rope_ext_register_on_import = True  # recognised by this mark, also after a reload of this module

    def find_spec(self, fullname, path, target=None):
        if fullname != _DTENSOR or _registered:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "rope_ext_register_on_import", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisterAfter(spec.loader)
                return spec
        return None


class _RegisterAfter(importlib.abc.Loader):
    """A loader that runs the module with the loader it wraps, then registers the rules."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self.loader  # leave no trace in the module
        _register_or_warn()

    def __getattr__(self, name):  # is_package, get_code, get_resource_reader, ...
        if name == "loader":  # not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


_registered = False
_lock = threading.Lock()


def _register_or_warn() -> None:
    """register(), once per process; a failure warns rather than break the user's import."""
    global _registered
    with _lock:
        if _registered:
            return
        try:
            register()
        except Exception as e:
            warnings.warn(f"rope_ext: could not register its DTensor sharding rules ({e!r})", stacklevel=2)
        finally:
            _registered = True


def install() -> None:
    """Make the rules available to DTensor: now if torch.distributed.tensor is loaded, else as
    soon as it is (a finder at the front of sys.meta_path that returns nothing for any other
    module). Nothing when torch has no torch.distributed."""
    if not torch.distributed.is_available():
        return
    if _DTENSOR in sys.modules:
        _register_or_warn()
    elif not any(getattr(f, "rope_ext_register_on_import", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
