"""Shared test parameters, tolerances and input factories for rope_ext."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import rope_ext  # noqa: F401  (loads the ops)
from rope_ext import reference
from rope_ext._errors import POSITION_OUTSIDE_CACHE

# The tests' hooks into librope_ext.so (csrc/testing/): a library of their own that the product
# never loads, built beside it by `make setup` (ROPE_EXT_TESTING=1).
TESTING_LIBRARY = Path(rope_ext.__file__).resolve().parent / "lib" / "librope_ext_testing.so"
if not TESTING_LIBRARY.exists():
    raise RuntimeError(f"{TESTING_LIBRARY} is missing: the tests need rope_ext built with its test hooks "
                       "(ROPE_EXT_TESTING=1 pip install --no-build-isolation -e ., as `make setup` does)")
torch.ops.load_library(str(TESTING_LIBRARY))
TESTING = torch.ops.rope_ext_testing


def cpp_api():
    """torch.ops.rope_ext_testing_cpp_api: hooks into the header-only C++ API (rope_ext/frequencies.h),
    from librope_ext_testing_cpp_api.so. That library is LibTorch code, built against the torch of
    `make setup`, so it is loaded only by the tests that call it (the core tests run under other
    torches by make wheel-check never do)."""
    library = TESTING_LIBRARY.with_name("librope_ext_testing_cpp_api.so")
    if not hasattr(torch.ops.rope_ext_testing_cpp_api, "cos_sin_tables"):
        torch.ops.load_library(str(library))
    return torch.ops.rope_ext_testing_cpp_api


# --- the emulated CUDA kernels, run on a real device instead (make gpu-check) -----------------


def _twins(tensors, device):
    """Each tensor on `device` with its exact storage layout: every storage copied whole, once (q and
    k split from one buffer stay views of one device buffer), and a view of the same shape, strides
    and offset over it (x.to(device) would make a non-dense view contiguous, and so test another
    layout). Returns the twins (non-tensors as they are) and {storage pointer: (storage, device
    copy)}."""
    copies, twins = {}, []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            twins.append(t)
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in copies:
            flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))
            copies[storage.data_ptr()] = (storage, flat.to(device, copy=True))
        flat = copies[storage.data_ptr()][1]
        twins.append(torch.empty(0, dtype=t.dtype, device=flat.device).set_(
            flat.untyped_storage(), t.storage_offset(), t.shape, t.stride()))
    return twins, copies


class KernelsOn:
    """TESTING, with each cuda_emulate_<op> hook running the real rope_ext.<op> on `device`:
    tests/test_cuda_emulation.py, test_rotary_pos.py, test_fuzz.py and test_robustness.py then test
    the real CUDA kernels against the CPU kernel, every layout with its own strides and offsets
    (CPU allocations are 64-byte aligned and CUDA's 512, so every alignment decision is the same).
    Chosen with ROPE_EXT_TEST_KERNELS_ON=cuda (make gpu-check), or =cpu to check this harness here.
    Inputs are copied storage and all; an in-place op's whole storage is copied back, so a write
    outside the view shows. A position outside the cache is refused here with the kernel's message
    rather than launched: on a GPU it is a device-side assert that ends the process (tested on its
    own, in a subprocess, by tests/test_gpu.py)."""

    def __init__(self, device: str):
        self.device = torch.device(device)

    # The emulator's own instruments, which the real kernels never feed: a test that reads one tests
    # the emulator, and skips here. (cuda_allow_compact_index still sets what the host's launch
    # configuration reports; the real launcher always takes CompactIndex where it can, so a test
    # that forces PlanIndex runs CompactIndex on the device: PlanIndex's kernels run on the device
    # in tests/gpu_kernel_cases.py and the strided layouts of tests/test_gpu.py.)
    EMULATOR_ONLY = ("cuda_ignore_alignment", "cuda_checked_accesses", "cuda_record_traffic", "cuda_traffic",
                     "cuda_traffic_by_site", "cuda_record_launches", "cuda_launches")

    def __getattr__(self, name):
        if name in self.EMULATOR_ONLY:
            pytest.skip(f"{name} instruments the host emulation, not the kernels on {self.device}")
        if not name.startswith("cuda_emulate_"):
            return getattr(torch.ops.rope_ext_testing, name)
        op = getattr(torch.ops.rope_ext, name[len("cuda_emulate_"):])
        return lambda *args: self._run(op, name, *args)

    def _run(self, op, name, *args):
        if "_pos" in name:
            self._check_positions(*args)
        twins, copies = _twins([a.detach() if isinstance(a, torch.Tensor) else a for a in args], self.device)
        out = op(*twins)
        if name.endswith("_"):  # in place: bring every storage back whole
            for storage, flat in copies.values():
                storage.copy_(flat.cpu().untyped_storage())
        outs = out if isinstance(out, (tuple, list)) else [out]
        back = _twins(outs, "cpu")[0]
        return tuple(back) if isinstance(out, (tuple, list)) else back[0]

    @staticmethod
    def _check_positions(*args):
        # (..., cos_cache, sin_cache, positions, interleaved, conjugate) for every gathered op
        i = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not a.is_floating_point())
        positions, rows = args[i], args[i - 2].shape[0]
        bad = positions[(positions < 0) | (positions >= rows)]
        if bad.numel():
            raise RuntimeError(f"{POSITION_OUTSIDE_CACHE}position {int(bad[0])} is outside the cache, whose {rows} "
                               f"rows hold positions 0 to {rows - 1} (refused by conftest.KernelsOn before the launch)")


if os.environ.get("ROPE_EXT_TEST_KERNELS_ON"):
    TESTING = KernelsOn(os.environ["ROPE_EXT_TEST_KERNELS_ON"])

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
CONVENTIONS = {"halfsplit": False, "interleaved": True}

# --- tolerances ----------------------------------------------------------------------------
#
# The kernels compute each output as x1*c1 -/+ x2*s1 in the math type (float32; float64 for
# float64 x) and round once to x's dtype. Tests compare with the same formula evaluated in
# float64 on the same (already rounded) inputs, so the only errors are:
#   math:  at most 3 roundings of the math type on terms bounded by |x| * |table|.
#          Test inputs keep |x| <= 8 (randn clipped) and |cos|, |sin| <= 1, so the error is at
#          most 3 * u_math * (8 + 8) = 48 * u_math.                            -> atol
#   store: one rounding to x's dtype, at most half an ulp: u_out * |out|.    -> rtol
# u is the unit roundoff: 2^-24 (float32), 2^-53 (float64), 2^-11 (float16), 2^-8 (bfloat16).
# float16's subnormal range adds an absolute error below 2^-25, inside atol.
_UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.float16: 2.0**-11,
                  torch.bfloat16: 2.0**-8}
_MATH_TYPE = {torch.float64: torch.float64}  # everything else computes in float32


def tolerance(dtype: torch.dtype) -> dict:
    u_math = _UNIT_ROUNDOFF[_MATH_TYPE.get(dtype, torch.float32)]
    return {"atol": 48 * u_math, "rtol": _UNIT_ROUNDOFF[dtype]}


X_BOUND = 8.0  # |x| bound the tolerances assume


def assert_matches_reference(out, x, cos, sin, interleaved, conjugate=False):
    """out == rotary(x, cos, sin) computed in float64, within out.dtype's tolerance."""
    expected = reference.rotary_reference(x.double(), cos.double(), sin.double(), interleaved, conjugate)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, **tolerance(x.dtype))


# --- inputs --------------------------------------------------------------------------------


class RopeOpSpy(TorchDispatchMode):
    """Records each rope_ext op that runs as (name, args), e.g. ("rotary_qk", (q, k, cos, ...))."""

    def __init__(self):
        super().__init__()
        self.calls = []

    @property
    def names(self):
        return [name for name, _ in self.calls]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "rope_ext":
            self.calls.append((func.__name__.split(".")[0], args))
        return func(*args, **(kwargs or {}))


class HostCopySpy(TorchFunctionMode):
    """Records each call that brings host data to another device: a tensor built from Python data
    (torch.tensor / as_tensor / asarray) on a device other than the CPU, and any call that takes a
    CPU tensor of one or more dims and returns a tensor elsewhere (.to(device), copy_, cat, ...).
    Run with tensors on the meta device, it stands in for a GPU on a machine without one: each such
    call is a host-to-device copy on CUDA (a pageable one waits for the device, and none may be
    captured in a CUDA graph), and reading a value back (.item(), .tolist(), bool()) raises on meta."""

    _FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
    _MOVES = {torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cuda}  # (0-dim operands of other ops are scalars)

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        off_host = any(t.device.type != "cpu" for t in outs)
        host = [t for t in leaves if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
        if func in self._FROM_DATA and off_host:
            self.copies.append(f"{func.__name__} to {outs[0].device}")
        elif off_host and any(t.dim() or func in self._MOVES for t in host):
            self.copies.append(f"{getattr(func, '__name__', func)} of a CPU tensor to {outs[0].device}")
        return out


def randn(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).clamp(-X_BOUND, X_BOUND).to(dtype)


def inv_freq(r: int, base: float = 10000.0) -> torch.Tensor:
    """theta_i = base^(-2i/r), i < r/2, in float64."""
    return base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)


def rope_tables(positions: torch.Tensor, r: int, interleaved: bool, dtype=torch.float32, base=10000.0):
    """Full-form (cos, sin) of shape positions.shape + (r,) for real RoPE angles."""
    angles = positions.to(torch.float64)[..., None] * inv_freq(r, base)
    cos, sin = reference.angles_to_cos_sin(angles, interleaved)
    return cos.to(dtype), sin.to(dtype)


def random_tables(shape, dtype=torch.float32, gen=None):
    """Arbitrary (cos, sin) in [-1, 1] with unequal entries within a pair: exercises the
    general per-pair matrix [[c1, -s1], [s2, c2]], not only rotations."""
    c = torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1
    s = torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1
    return c.to(dtype), s.to(dtype)


# Layouts of a (B, S, H, D) batch of heads, as users hand them to a RoPE op. Each returns
# (x, to_layout), where to_layout maps a canonical (B, S, 1, r)-broadcastable table to the
# layout's dim order, so cos/sin broadcast against x the way a user would build them.
def _bshd(t):
    return t.contiguous()


def _make_bshd(src):
    return src.clone(), _bshd


def _make_bhsd(src):
    return src.transpose(1, 2).contiguous(), lambda t: t.transpose(1, 2)


def _make_hf_view(src):  # HF: (B,H,S,D) view over (B,S,H,D) projection output
    return src.clone().transpose(1, 2), lambda t: t.transpose(1, 2)


def _make_qkv_slice(src):  # q = qkv[:, :, 1] of a packed (B, S, 3, H, D) buffer
    B, S, H, D = src.shape
    qkv = torch.zeros(B, S, 3, H, D, dtype=src.dtype)
    qkv[:, :, 1] = src
    return qkv[:, :, 1], _bshd


def _make_padded(src):  # rows padded to a wider stride (vLLM's padded-shape case)
    B, S, H, D = src.shape
    buf = torch.full((B, S, H, D + 8), float("nan"), dtype=src.dtype)
    buf[..., :D] = src
    return buf[..., :D], _bshd


def _make_strided_cols(src):  # last-dim stride 2: exercises the scalar path
    buf = torch.zeros(*src.shape[:-1], 2 * src.shape[-1], dtype=src.dtype)
    buf[..., ::2] = src
    return buf[..., ::2], _bshd


def _make_thd(src):  # packed tokens (T, H, D)
    return src.reshape(-1, *src.shape[2:]).clone(), lambda t: t.reshape(-1, *t.shape[2:])


LAYOUTS = {
    "bshd": _make_bshd,
    "bhsd": _make_bhsd,
    "hf_view": _make_hf_view,
    "qkv_slice": _make_qkv_slice,
    "padded": _make_padded,
    "strided_cols": _make_strided_cols,
    "thd": _make_thd,
}


# The fields of rope_ext_testing.cuda_launch_config and cuda_pos_launch_config (cuda::RotaryLaunch).
LAUNCH_FIELDS = ("grid_x", "grid_y", "block_x", "block_y", "vec", "pairs_per_item", "rot_items", "pass_items",
                 "table_vec", "compact")


def make_layout(name: str, B: int, S: int, H: int, D: int, dtype, gen=None):
    return LAYOUTS[name](randn(B, S, H, D, dtype=dtype, gen=gen))


@contextlib.contextmanager
def hook_setting(name: str, value):
    """TESTING.<name>(value) in the block, the previous setting restored after (each of the testing
    library's switches returns the setting it replaces)."""
    before = getattr(TESTING, name)(value)
    try:
        yield
    finally:
        getattr(TESTING, name)(before)


@pytest.fixture
def cuda():
    """The CUDA device, for tests that need a GPU: they skip without one (no CUDA call at import or
    collection), and fail if a GPU is present but rope_ext was built without its CUDA kernels."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not torch._C._dispatch_has_kernel_for_dispatch_key("rope_ext::rotary", "CUDA"):
        pytest.fail("a GPU is present but rope_ext was built without CUDA (see ROPE_EXT_CUDA in the README)")
    return torch.device("cuda")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


# --- the CPU kernel's path thresholds ------------------------------------------------------
#
# The CPU kernel switches path at sizes (csrc/cpu/rotary_cpu.cpp gives the defaults and why):
# streaming stores for outputs of >= 16 MiB, huge pages for new outputs of >= 32 MiB, the
# parallel grain, the head-major tile and the head/token thread split. The test hooks
# rope_ext_testing::cpu_thresholds / set_cpu_thresholds read and replace them, so that tests reach
# both sides of every switch on small tensors.
THRESHOLD_NAMES = ("streaming_bytes", "huge_page_bytes", "grain_elements", "tile_tokens", "min_heads_per_thread")
DEFAULT_THRESHOLDS = {"streaming_bytes": 16 << 20, "huge_page_bytes": 32 << 20, "grain_elements": 32768,
                      "tile_tokens": 32, "min_heads_per_thread": 4}


def current_thresholds() -> dict:
    return dict(zip(THRESHOLD_NAMES, TESTING.cpu_thresholds(), strict=True))


@contextlib.contextmanager
def cpu_thresholds(**changes):
    """The CPU kernel's thresholds replaced by `changes` (names from THRESHOLD_NAMES) in the block,
    and restored after it. They are process-wide: the block must not run beside other tests."""
    unknown = set(changes) - set(THRESHOLD_NAMES)
    assert not unknown, f"no such threshold: {sorted(unknown)}"
    before = current_thresholds()
    TESTING.set_cpu_thresholds(**{**before, **changes})
    try:
        yield
    finally:
        TESTING.set_cpu_thresholds(**before)


PATH_COUNT_NAMES = (
    "streamed_rows",
    "huge_page_outputs",
    "head_split_walks",
    "token_split_walks",
    "fast_rows",
    "general_rows",
    "native_bf16_calls",
    "wide_fast_rows",
    "norm_rows",
)


def path_counts() -> dict:
    """How often each side of the CPU kernel's switches ran in this process (cpu::PathCounts)."""
    return dict(zip(PATH_COUNT_NAMES, TESTING.cpu_path_counts(), strict=True))


def path_counts_since(before: dict) -> dict:
    return {k: v - before[k] for k, v in path_counts().items()}


# Bytes one streaming store writes in each CPU kernel variant, and so the alignment it needs:
# vmovntps/vmovntdq on a ymm (AVX2) or zmm (AVX-512) register. The generic variant has none.
STREAMING_STORE_BYTES = {"AVX2": 32, "AVX512": 64, "DEFAULT": 0}


def expected_streamed_rows(out: torch.Tensor, interleaved: bool, r: int, streaming_bytes: int | None = None) -> int:
    """Rows of a new contiguous output that the kernel writes with streaming stores, when the output
    is at least streaming_bytes (default: the threshold in force): those whose every register store
    is aligned to the register size, i.e. the row start and, half-split, the start of its second
    half (r/2 elements in)."""
    w = STREAMING_STORE_BYTES[torch.ops.rope_ext.cpu_kernel_isa()]
    if streaming_bytes is None:
        streaming_bytes = current_thresholds()["streaming_bytes"]
    if w == 0 or out.numel() * out.element_size() < streaming_bytes or out.dtype == torch.float64:
        return 0  # (float64 has no streaming store)
    d, e = out.shape[-1], out.element_size()
    if not interleaved and (r // 2 * e) % w:
        return 0
    starts = out.data_ptr() + torch.arange(out.numel() // d, dtype=torch.int64) * (d * e)
    return int((starts % w == 0).sum())
