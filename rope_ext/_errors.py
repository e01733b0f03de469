"""The errors rope_ext raises as types of its own, and the one place a kernel's error gets its type.

librope_ext is built on torch's stable ABI: a kernel's exception reaches Python as a RuntimeError
carrying its message alone. The library writes the kind of error as the message's first words
(csrc/include/rope_ext/errors.h, one prefix per kind); :func:`raise_typed` turns such an error into
its type, with the rest of the message. The wrappers that call a kernel able to raise one (the ops
by position) call it in their ``except`` clause, which costs nothing unless the kernel raised.
"""
from __future__ import annotations


class PositionOutsideCache(IndexError, RuntimeError):
    """A position outside the cos/sin cache an op gathers from: :func:`rope_ext.rotary_pos`,
    :func:`rope_ext.rotary_pos_qk`, :func:`rope_ext.rotary_pos_`, :func:`rope_ext.qk_norm_rotary_pos`
    and :func:`rope_ext.qk_norm_rotary_pos_` check every position before writing anything, on the
    CPU. The message names the position, its index in ``positions.flatten()`` and the cache's rows.

    An ``IndexError``, and a ``RuntimeError`` as the kernels' other errors are. On CUDA a position
    outside the cache is a device-side assert instead: checking it on the host would wait for the
    device. Under ``torch.compile`` the error is torch's ``RuntimeError``, with the message the
    library wrote (the compiled code calls the kernel itself).
    """

    __module__ = "rope_ext"


# The prefix of a kernel message that refuses a position outside the cache: errors.h's
# ROPE_EXT_POSITION_OUTSIDE_CACHE (tests/test_errors.py holds the two equal).
POSITION_OUTSIDE_CACHE = "rope_ext.PositionOutsideCache: "


def raise_typed(error: RuntimeError) -> None:
    """Raise the rope_ext type a kernel's error carries in its message's prefix (the message less
    the prefix), or return when it carries none."""
    text = str(error)
    if text.startswith(POSITION_OUTSIDE_CACHE):
        raise PositionOutsideCache(text[len(POSITION_OUTSIDE_CACHE):]) from None
