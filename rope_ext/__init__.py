"""rope_ext: fused Rotary Positional Embedding (RoPE) ops for PyTorch.

    out = rope_ext.rotary(x, cos, sin, interleaved=False)

computes ``x * cos + rotate(x) * sin`` in one pass, for both pairing conventions, with
autograd, torch.compile and torch.export support. On top of the ops: ``rotary_qk`` (q and k
in one call), ``rotary_`` (in place), the ``RotaryEmbedding`` module (positions, offsets,
packed sequences, HF rope scaling, xPos, M-RoPE), and drop-ins for HF's
``apply_rotary_pos_emb`` and flash-attn's ``apply_rotary_emb`` (``rope_ext.compat``).
``rope_ext.reference`` holds the same math in plain PyTorch.
"""

import torch  # noqa: F401  (the extension links against libtorch: load it first)

try:
    from rope_ext import _C  # noqa: F401  (registers torch.ops.rope_ext.*)
except ImportError as e:  # never swallowed: say what failed and how to fix it
    raise ImportError(
        f"rope_ext: cannot load the compiled extension rope_ext._C ({e}). Build it against the "
        "torch you are importing with `pip install --no-build-isolation -e .`."
    ) from e

__version__ = _C.__version__  # written once, in csrc/include/rope_ext/version.h


def _check_one_version() -> None:
    """Refuse to run on operators that another version of rope_ext registered first.

    Every copy of rope_ext in a process (this extension, a librope_ext.so loaded by C++ code)
    shares the first copy's registrations (csrc/ops.cpp); with another version's kernels behind
    them, this package's calls could silently compute something else.
    """
    try:
        registered = torch.ops.rope_ext._version()
    except AttributeError:  # a copy from before the op existed
        registered = "of an unknown version (it has no rope_ext::_version)"
    except Exception as e:  # a copy whose op is broken: still not this version
        registered = f"of an unknown version (rope_ext::_version raised {e!r})"
    if registered != __version__:
        raise ImportError(
            f"rope_ext {__version__}: the rope_ext operators in this process were registered by rope_ext "
            f"{registered}, loaded first (e.g. a librope_ext.so of the C++ API), whose kernels would serve "
            "this package's calls. Load a single version of rope_ext per process."
        )


_check_one_version()

from rope_ext import compat, reference, scaling  # noqa: E402
from rope_ext._ops import cpu_kernel_isa, rotary, rotary_, rotary_qk  # noqa: E402
from rope_ext.compat.hf import apply_multimodal_rotary_pos_emb, apply_rotary_pos_emb  # noqa: E402
from rope_ext.module import RotaryEmbedding  # noqa: E402

__all__ = [
    "rotary",
    "rotary_qk",
    "rotary_",
    "RotaryEmbedding",
    "apply_rotary_pos_emb",
    "apply_multimodal_rotary_pos_emb",
    "reference",
    "scaling",
    "compat",
    "cpu_kernel_isa",
]
