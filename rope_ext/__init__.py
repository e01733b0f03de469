"""rope_ext: fused Rotary Positional Embedding (RoPE) ops for PyTorch.

    out = rope_ext.rotary(x, cos, sin, interleaved=False)

computes ``x * cos + rotate(x) * sin`` in one pass, for both pairing conventions, with
autograd, torch.compile and torch.export support. ``rope_ext.reference`` holds the same
math in plain PyTorch.
"""
import torch  # noqa: F401  (the extension links against libtorch: load it first)

try:
    from rope_ext import _C  # noqa: F401  (registers torch.ops.rope_ext.*)
except ImportError as e:  # never swallowed: say what failed and how to fix it
    raise ImportError(
        f"rope_ext: cannot load the compiled extension rope_ext._C ({e}). Build it against the "
        "torch you are importing with `pip install --no-build-isolation -e .`."
    ) from e

from rope_ext import reference  # noqa: E402
from rope_ext._ops import cpu_kernel_isa, rotary, rotary_, rotary_qk  # noqa: E402

__all__ = ["rotary", "rotary_qk", "rotary_", "reference", "cpu_kernel_isa"]
__version__ = "0.1.0"
