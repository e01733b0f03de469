"""rope_ext: fused Rotary Positional Embedding (RoPE) ops for PyTorch.

    out = rope_ext.rotary(x, cos, sin, interleaved=False)

computes ``x * cos + rotate(x) * sin`` in one pass, for both pairing conventions, with
autograd, torch.compile and torch.export support. On top of the ops: ``rotary_qk`` (q and k
in one call), ``rotary_`` (in place), the ``RotaryEmbedding`` module (positions, offsets,
packed sequences, HF rope scaling, xPos, M-RoPE), and drop-ins (``rope_ext.compat``) for HF's
``apply_rotary_pos_emb`` (``hf``), flash-attn (``flash_attn``), Meta's complex form (``meta``),
lucidrains' rotary-embedding-torch (``lucidrains``), MLX's ``fast.rope`` (``mlx``), vLLM's op
(``vllm``), diffusers (``diffusers``) and timm (``timm``). ``rope_ext.integrations`` switches whole
transformers, diffusers and timm models onto the ops.
``rope_ext.reference`` holds the same math in plain PyTorch.

The ops live in one library, ``rope_ext/lib/librope_ext.so.<major.minor>``, loaded here; C++ programs link the
same file through CMake: ``find_package(rope_ext)`` with ``rope_ext.cmake_prefix_path`` on
``CMAKE_PREFIX_PATH``.
"""

import glob as _glob
import os as _os

import torch  # the library links against libtorch: load it first

_PACKAGE_DIR = _os.path.dirname(_os.path.realpath(__file__))
# lib/librope_ext.so.<major.minor>: the soname carries the release (CMakeLists.txt).
_found = sorted(_glob.glob(_os.path.join(_PACKAGE_DIR, "lib", "librope_ext.so.*")))
if len(_found) != 1:
    raise ImportError(
        f"rope_ext: expected one library {_PACKAGE_DIR}/lib/librope_ext.so.<version>, found {_found or 'none'}. "
        "Build it against the torch you are importing: `pip install --no-build-isolation .` (or `-e .`) in a checkout."
    )
_LIBRARY = _found[0]

#: For CMake: ``-DCMAKE_PREFIX_PATH=<this>`` lets ``find_package(rope_ext)`` find this installation
#: (the library, ``rope_ext/rope.h`` and the package files), as ``torch.utils.cmake_prefix_path``
#: does for torch.
cmake_prefix_path = _PACKAGE_DIR


def _load_library() -> None:
    """Load librope_ext.so, which registers torch.ops.rope_ext.*, and make sure its copy serves them.

    Loading it again (here or from C++) is harmless: the dynamic loader maps a file once. A different
    librope_ext.so loaded first (another build or install) would serve every call with its own
    kernels; that is refused (csrc/ops.cpp).
    """
    try:
        torch.ops.load_library(_LIBRARY)
    except OSError as e:  # never swallowed: say what failed and how to fix it
        raise ImportError(
            f"rope_ext: cannot load its library {_LIBRARY} ({e}). Build it against the torch you are importing: "
            "`pip install --no-build-isolation .` (or `-e .`) in a checkout, after installing torch."
        ) from e
    try:
        registered = torch.ops.rope_ext._library_path()
    except Exception as e:  # a copy without the op, or whose op fails: not this one
        registered = f"a rope_ext without a working rope_ext::_library_path ({e})"
    if not _os.path.exists(registered) or not _os.path.samefile(registered, _LIBRARY):
        raise ImportError(
            f"rope_ext: the rope_ext operators in this process were registered by {registered}, loaded before "
            f"this package's {_LIBRARY}; its kernels would serve every call. Load one librope_ext.so per process."
        )


_load_library()
__version__ = torch.ops.rope_ext._version()  # written once, in csrc/include/rope_ext/version.h

from rope_ext import _autograd  # noqa: E402

_autograd.register()  # the ops' autograd formulas (the library has none: torch's stable ABI has no autograd)

from rope_ext import _sharding, compat, reference, scaling  # noqa: E402
from rope_ext._errors import PositionOutsideCache  # noqa: E402
from rope_ext._ops import (  # noqa: E402
    cpu_kernel_isa,
    norm_rotary,
    qk_norm_rotary,
    qk_norm_rotary_,
    qk_norm_rotary_pos,
    qk_norm_rotary_pos_,
    rotary,
    rotary_,
    rotary_pos,
    rotary_pos_,
    rotary_pos_qk,
    rotary_qk,
)
from rope_ext.compat.hf import apply_multimodal_rotary_pos_emb, apply_rotary_pos_emb  # noqa: E402
from rope_ext.module import RotaryEmbedding  # noqa: E402
from rope_ext.qk_norm import QKNorm  # noqa: E402

_sharding.install()  # DTensor rules, registered when torch.distributed.tensor is imported

__all__ = [
    "rotary",
    "rotary_qk",
    "rotary_",
    "rotary_pos",
    "rotary_pos_qk",
    "rotary_pos_",
    "norm_rotary",
    "qk_norm_rotary",
    "qk_norm_rotary_",
    "qk_norm_rotary_pos",
    "qk_norm_rotary_pos_",
    "RotaryEmbedding",
    "QKNorm",
    "PositionOutsideCache",
    "apply_rotary_pos_emb",
    "apply_multimodal_rotary_pos_emb",
    "reference",
    "scaling",
    "compat",
    "cpu_kernel_isa",
    "cmake_prefix_path",
]
