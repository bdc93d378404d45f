"""FPDT attention — being written (see issue 3)."""

from __future__ import annotations


def fpdt_attention(*args, **kwargs):
    raise NotImplementedError("fpdt_attention is being implemented")
