"""Flat-cost verification on CPUs: a small-M float32 matrix multiply that reads each weight once.

A one-token decode step is memory-bound: it streams every weight once. PyTorch's CPU GEMM for
2..16 rows costs well over the one-row GEMV (packing, blocking for large M), which makes
verifying k draft tokens cost much more than a plain step and erases most of speculative
decoding's gain (docs/notebook.md, "Measurements behind the code's choices"). ``small_m_linear``
computes y[M, N] = x[M, K] @ w[N, K]^T for 1..16 rows: two weight rows per pass, up to GROUP rows
of x against them (AVX-512 or AVX2 FMA, chosen by the CPU), and software prefetch of the rows a
few passes ahead, so the weights are streamed from memory once for all rows at close to the
one-row speed.

Every output element is the same dot product accumulated in the same order whatever M is, so a
row's result does not depend on how many rows travel with it: a one-token step (AR) and a k-token
verification compute bitwise the same linear layers for the same inputs. A layer whose float32
weights are exactly llama.cpp blocks (``lowbit.read_exact_blocks``: a model dequantised from a GGUF,
as the embedded SmolLM2 is) reads the blocks instead in these forwards, through the low-bit
kernel that computes bitwise the same dot products: the same outputs from about a quarter of the
bytes, which a memory-bound step reads faster. A prompt's prefill keeps torch's GEMM on the
float32 weights (the same for every method), and the engine runs a wider decoding forward as
pieces of MAX_ROWS rows (``FlatLinear.max_rows``: models/scorer.py).
The kernel is compiled once per machine and ISA (torch.utils.cpp_extension, cached in
~/.cache/torch_extensions); where it cannot be, the model keeps torch's matmul and a warning says so.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from pipespec_mpi.host.dispatch import cpu_isa, supported_isas

log = logging.getLogger("pipespec_mpi")
MAX_ROWS = 16

KERNELS = Path(__file__).resolve().parent / "kernels"  # the C++ sources (package data)


def kernel_source(name: str) -> str:
    """``kernels/<name>`` with ``#include "simd.h"`` replaced by the header's text: one string,
    so that torch's build cache (keyed on the source) sees an edit of either file."""
    src = (KERNELS / name).read_text()
    return src.replace('#include "simd.h"\n', (KERNELS / "simd.h").read_text().replace("#pragma once\n", ""))


@functools.cache
def kernels_digest() -> str:
    """A short hash of every kernel source and the build flags: what forward costs measured with
    them depend on."""
    blob = b"".join(p.name.encode() + p.read_bytes() for p in sorted(KERNELS.iterdir()) if p.is_file())
    blob += repr((_ISA_FLAGS, _OPENMP_FLAGS)).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


_EXT: dict[str, object] = {}  # name_ISA -> compiled module, or None where it failed to build


_ISA_FLAGS = {"avx512": ("-mavx512f", "-mavx512vl", "-mavx2", "-mfma"), "avx2": ("-mavx2", "-mfma")}
# at::parallel_for splits a kernel's work over the rank's torch threads only where the kernel is
# compiled with OpenMP: without -fopenmp its `#pragma omp parallel` is ignored and every kernel
# ran on one thread whatever `hierarchy.stages[i].threads` said (docs/notebook.md, "Measurements
# behind the code's choices"). Linked with -fopenmp, the extension uses the libgomp.so.1 torch has
# already loaded (same soname).
_OPENMP_FLAGS = ("-fopenmp",)  # a tuple: torch appends its own -L/-l flags to the list it is given


def build(name: str, source: str, functions: list[str], isa: str | None, cflags: tuple[str, ...] = ()):
    """Compile ``source`` for ``isa`` once per machine (cached by torch in
    ~/.cache/torch_extensions), or None where it cannot be built (the reason is logged once).
    PIPESPEC_FLAT_LINEAR=0 turns every kernel off."""
    isa = isa or cpu_isa()
    if os.environ.get("PIPESPEC_FLAT_LINEAR", "1") == "0" or isa not in supported_isas():
        return None
    key = f"{name}_{isa}"
    if key not in _EXT:
        try:
            from torch.utils.cpp_extension import load_inline

            _EXT[key] = load_inline(
                name=key,
                cpp_sources=[source],
                functions=functions,
                extra_cflags=["-O3", *_ISA_FLAGS[isa], *_OPENMP_FLAGS, *cflags],
                extra_ldflags=list(_OPENMP_FLAGS),  # a fresh list: torch extends it in place
                verbose=False,
            )
        except Exception as err:  # noqa: BLE001 - the caller falls back to torch
            log.warning("kernel %s unavailable (%s); using torch", key, err)
            _EXT[key] = None
    return _EXT[key]


def extension(isa: str | None = None):
    """The compiled float32 kernel for ``isa`` (default: the widest this CPU has), or None."""
    source = kernel_source("flat_linear.cpp")
    functions = ["small_m_linear", "tiled_linear", "tiles_sequential", "lanes", "parallel_threads"]
    return build("pipespec_flat_linear_v4", source, functions, isa)


class Blocks(NamedTuple):
    """A float32 layer's weights held exactly in a low-bit block format, and the kernel for it."""

    fmt: str
    tensors: tuple[torch.Tensor, ...]
    fn: Callable[..., torch.Tensor]


class FlatLinear(torch.nn.Module):
    """Drop-in for a float32 CPU nn.Linear: the flat kernel for 1..16 rows (reading ``blocks``,
    bitwise the same, where the weights have an exact block form), torch otherwise."""

    max_rows = MAX_ROWS  # forwards of up to this many rows compute each row as if alone

    def __init__(self, linear: torch.nn.Linear, kernel, blocks: Blocks | None = None) -> None:
        super().__init__()
        self.weight = linear.weight  # [out, in], shared (tied embeddings stay tied)
        self.bias = linear.bias
        self.kernel = kernel
        self.blocks = blocks
        # Wider forwards on torch's GEMM in tiles where MKL can run each tile alone, else on the
        # small-row kernel (bitwise the same on any threads either way; the kernel is slower there).
        self.tiled = bool(kernel.tiles_sequential())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if x.dtype != torch.float32:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, x.shape[-1])
        if rows > MAX_ROWS:  # a prompt's prefill: torch's GEMM on fixed tiles (thread-invariant)
            wide = self.kernel.tiled_linear if self.tiled else self.kernel.small_m_linear
            y = wide(x2, self.weight)
        elif self.blocks is not None:
            y = self.blocks.fn(x2, *self.blocks.tensors)
        else:
            y = self.kernel.small_m_linear(x2, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @classmethod
    def concat(cls, parts: list[FlatLinear]) -> FlatLinear | None:
        """One layer computing ``parts`` side by side (outputs concatenated on the last dim), or
        None. Every output is the same dot product as in its part, so the result is bitwise the
        parts' outputs; the parts' weights become views of the fused one (no extra memory)."""
        if any(p.bias is not None or p.kernel is not parts[0].kernel for p in parts):
            return None
        fused = torch.cat([p.weight.detach() for p in parts])  # [sum N, K]
        blocks = parts[0].blocks
        if blocks is not None and all(p.blocks is not None and p.blocks.fmt == blocks.fmt for p in parts):
            tensors = tuple(torch.cat(ts) for ts in zip(*(p.blocks.tensors for p in parts), strict=True))
            blocks = Blocks(blocks.fmt, tensors, blocks.fn)
        else:
            blocks = None  # the fused layer reads the float32 weights: bitwise the same
        start = 0
        for p in parts:
            n = p.weight.shape[0]
            p.weight = torch.nn.Parameter(fused[start : start + n], requires_grad=False)
            start += n
        return cls(types.SimpleNamespace(weight=fused, bias=None), parts[0].kernel, blocks)

    def extra_repr(self) -> str:
        blocks = f", reads {self.blocks.fmt} blocks" if self.blocks is not None else ""
        return f"{self.weight.shape[1]} -> {self.weight.shape[0]}{blocks}"


def fuse_linears(parts: list[torch.nn.Module]) -> torch.nn.Module | None:
    """One layer whose output is the concatenation of ``parts``' outputs, bitwise, or None where
    they cannot be fused (different kinds, biases, kernels). Layers of kinds that define
    ``concat`` (FlatLinear, lowbit.LowBitLinear) can be."""
    kind = type(parts[0])
    if len(parts) < 2 or any(type(p) is not kind for p in parts) or not hasattr(kind, "concat"):
        return None
    return kind.concat(parts)


def use_flat_linear(model: torch.nn.Module, isa: str | None = None) -> int:
    """Replace the float32 CPU nn.Linear layers of ``model``; returns how many were replaced.
    (``lowbit.read_exact_blocks`` then gives those with an exact block form their ``Blocks``.)"""
    kernel = extension(isa)
    if kernel is None:
        return 0
    count = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if (
                type(child) is torch.nn.Linear
                and child.weight.dtype == torch.float32
                and child.weight.device.type == "cpu"
            ):
                setattr(parent, name, FlatLinear(child, kernel))
                count += 1
    return count
