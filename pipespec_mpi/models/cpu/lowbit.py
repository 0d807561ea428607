"""Weight-only low-bit linear layers for CPU drafters: fewer bytes per weight, float32 arithmetic.

A batch-1 step streams every weight once, so a copy of a stage whose weights take fewer bytes
reads less memory per step. Unlike torch's dynamic int8 (``quantize_dynamic``: activations are
quantised to 8 bits as well, and its small-M GEMM re-packs per call), the layers here keep the
activations and the accumulation in float32 and only *store* the weights in fewer bits; the
kernel converts each weight vector to float32 in registers and uses it for every row of x, as the
float32 flat kernel does (``models/cpu/flat_linear.py``: two weight rows per pass, up to GROUP rows
of x against them, every output the same dot product in the same order whatever the row count).

Formats (``FORMATS``), all with blocks of 32 along the input dimension where they have blocks:

  bf16  bfloat16 weights (the top half of a float32: exact conversion), 2 bytes per weight.
  int8  int8 weights with one float32 scale per output channel (absmax / 127), ~1 byte.
  q8    int8 weights with one scale per block of 32 (llama.cpp's Q8_0; scale rounded to fp16).
  q4    4-bit weights with a scale and a minimum per block of 32 (llama.cpp's Q4_1; both rounded
        to fp16), w = d * q + m, 0.75 bytes per weight with the float32 scales stored here.
  w8a8  not weight-only: int8 weights per output channel as ``int8``, and the activations
        quantised per row to int8 as well, dot products in int32 (AVX512-VNNI where the CPU has
        it: 4 multiply-adds per lane and instruction), so a k-row forward costs far less compute
        than with float32 arithmetic; per-row activation scales keep each row's result
        independent of the other rows.

The q4 and q8 quantisers reproduce a GGUF's own Q4_1/Q8_0 blocks exactly from weights that were
dequantised from them (the embedded SmolLM2 is such a model: its float32 weights *are* the
GGUF's Q4_1 linears and Q8_0 embedding), and the kernel dequantises in the same float32 order as
gguf-py (a multiply, then an add; no fused multiply-add), so such a copy computes bitwise what the
float32 model computes, from a quarter of the bytes. On other models q4 is a real quantisation.

Many rows (a prompt's prefill, a wide batched forward) are compute-bound, and there the kernel's
cost grows with the rows, until a low-bit copy's prefill costs more than the float32 model's
(docs/notebook.md, "Measurements behind the code's choices"). From ``dense_rows`` rows a layer
hands the product to torch's GEMM instead (``dense_linear``; oneDNN runs it on AMX tiles where
the CPU has them): w8a8 as an int8 x int8 -> int32 product, bitwise the kernel's result; the
other formats with bfloat16 activations and weights (int8 weights are exact in bfloat16, their
scale applied after the sum) and a bfloat16 result, a drafter's numerics only (relative error
~3e-3).
"""

from __future__ import annotations

import logging

import torch

from pipespec_mpi.host.dispatch import cpu_flags, cpu_isa
from pipespec_mpi.models.cpu.flat_linear import Blocks, FlatLinear, build, kernel_source

log = logging.getLogger("pipespec_mpi")
BLOCK = 32
FORMATS = ("bf16", "int8", "q8", "q4", "w8a8")

_FUNCTIONS = ["bf16_linear", "int8_linear", "q8_linear", "q4_linear", "w8a8_linear"]
# Rows from which ``dense_linear`` beats the kernel on a CPU with AMX; below them widening the
# weights per call costs more than the GEMM saves (bench/dense_rows.py; docs/notebook.md,
# "Measurements behind the code's choices").
DENSE_ROWS = {"bf16": 16, "int8": 32, "q8": 64, "q4": 128, "w8a8": 48}


def extension(isa: str | None = None):
    """The compiled low-bit kernels for ``isa`` (default: the widest this CPU has), or None.

    Built without floating-point contraction, so the q4/q8 dequantisation is a multiply and an
    add (the float32 order gguf-py uses), never a fused multiply-add."""
    isa = isa or cpu_isa()
    flags: tuple[str, ...] = ("-ffp-contract=off",)
    name = "pipespec_lowbit_linear_v5"
    if isa == "avx512" and "avx512_vnni" in cpu_flags():  # w8a8's integer dot products
        flags, name = (*flags, "-mavx512bw", "-mavx512vnni"), name + "_vnni"
    return build(name, kernel_source("lowbit.cpp"), _FUNCTIONS, isa, flags)


# --- quantisers and their inverses (pure tensor functions) -------------------------------------


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(torch.float32)


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, ...]:
    """The stored tensors of ``w`` [N, K] (float) in ``fmt``; K a multiple of 32 for every format."""
    w = w.detach().float().contiguous()
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"in_features {k} is not a multiple of {BLOCK}")
    if fmt == "bf16":
        return (w.to(torch.bfloat16),)
    if fmt in ("int8", "w8a8"):  # symmetric, per output channel
        if fmt == "w8a8" and k % 64:
            raise ValueError(f"in_features {k} is not a multiple of 64 (w8a8)")
        s = w.abs().amax(1) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        if fmt == "w8a8":  # + column sums, to undo the +128 offset of the unsigned activations
            return q, s.contiguous(), q.sum(1, dtype=torch.int32).contiguous()
        return q, s.contiguous()
    blocks = w.reshape(n, k // BLOCK, BLOCK)  # [N, K/32, 32]
    if fmt == "q8":  # Q8_0: d = amax / 127 (fp16), q = round(w / d)
        d = _fp16(blocks.abs().amax(-1) / 127)
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round(blocks / safe[..., None]).clamp(-127, 127).to(torch.int8)
        return q.reshape(n, k), d.contiguous()
    if fmt == "q4":  # Q4_1: m = min (fp16), d = (max - m) / 15 (fp16), q = round((w - m) / d)
        m = _fp16(blocks.amin(-1))
        d = _fp16((blocks.amax(-1) - m) / 15)
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round((blocks - m[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)  # [N, K/32, 16]
        return packed.reshape(n, k // 2).contiguous(), d.contiguous(), m.contiguous()
    raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")


def dequantize(fmt: str, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The float32 weights [N, K] the kernel computes with (the reference for tests)."""
    if fmt == "bf16":
        return tensors[0].float()
    if fmt in ("int8", "w8a8"):
        q, s = tensors[:2]
        return q.float() * s[:, None]
    if fmt == "q8":
        q, d = tensors
        n, k = q.shape
        return (q.float().reshape(n, k // BLOCK, BLOCK) * d[..., None]).reshape(n, k)
    if fmt == "q4":
        packed, d, m = tensors
        n, k = packed.shape[0], 2 * packed.shape[1]
        p = packed.reshape(n, k // BLOCK, 16)
        q = torch.cat([p & 15, p >> 4], dim=-1).float()  # [N, K/32, 32]
        return (q * d[..., None] + m[..., None]).reshape(n, k)
    raise ValueError(f"unknown weight format {fmt!r}")


EXACT_FORMATS = ("q4", "q8")  # the block formats a float32 layer may be read from, fewest bytes first


def exact_blocks(w: torch.Tensor) -> tuple[str, tuple[torch.Tensor, ...]] | None:
    """The fewest-bytes block format that holds ``w`` [N, K] float32 exactly, with its tensors,
    or None. A model dequantised from a GGUF (the embedded SmolLM2: Q4_1 linears, a Q8_0
    embedding) is such a model, and its kernel computes bitwise the float32 flat kernel's result
    from these tensors (the same dequantisation and dot products), so the layer reads a quarter
    of the bytes for the same outputs. Each format is tried on the first row before the whole
    weight, so a weight that is not block-exact costs about one row's quantisation."""
    w = w.detach()
    if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % BLOCK:
        return None
    for fmt in EXACT_FORMATS:
        if not torch.equal(dequantize(fmt, quantize(w[:1], fmt)), w[:1]):
            continue
        tensors = quantize(w, fmt)
        if torch.equal(dequantize(fmt, tensors), w):
            return fmt, tensors
    return None


def read_exact_blocks(model: torch.nn.Module, isa: str | None = None) -> int:
    """Give every ``FlatLinear`` of ``model`` whose weights have an exact block form
    (``exact_blocks``) those blocks and this module's kernel for them; its 1..16-row forwards
    then read the blocks, bitwise the same outputs. Returns how many layers read blocks. Call it
    before the engine's weights are taken (fused layers take their parts' blocks)."""
    layers = [m for m in model.modules() if isinstance(m, FlatLinear)]
    found = [(m, exact_blocks(m.weight)) for m in layers if m.blocks is None]
    found = [(m, f) for m, f in found if f is not None]
    kernel = extension(isa) if found else None  # built only for a model that has blocks to read
    if kernel is None:
        return sum(m.blocks is not None for m in layers)
    for m, (fmt, tensors) in found:
        m.blocks = Blocks(fmt, tensors, getattr(kernel, f"{fmt}_linear"))
    count = sum(m.blocks is not None for m in layers)
    log.info("flat kernel: %d of %d float32 layers read their exact low-bit blocks", count, len(layers))
    return count


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w8a8's activations: per row, scale = absmax / 127 (1 for a zero row), round half to even."""
    amax = x.abs().amax(-1)
    sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x / sx[:, None]).clamp(-127, 127), sx


def reference_linear(fmt: str, tensors: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes for ``x`` [M, K], in torch (exactly so for w8a8: its sums are
    integers, here in float64, exact for |sum| < 2^53)."""
    if fmt != "w8a8":
        return x @ dequantize(fmt, tensors).T
    q, sw, _ = tensors
    xq, sx = quantize_rows(x.float())
    acc = (xq.double() @ q.double().T).to(torch.int32)  # [M, N], exact
    return acc.float() * (sx[:, None] * sw[None, :])


def dense_linear(fmt: str, tensors: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] float32 times the weights, through torch's GEMM with the weights widened per
    call (no second copy is kept): w8a8 bitwise as the kernel (the same row quantisation, exact
    int32 sums, the same scaling); the other formats in bfloat16 with float32 accumulation."""
    if fmt == "w8a8":
        q, sw, _ = tensors
        xq, sx = quantize_rows(x)
        acc = torch._int_mm(xq.to(torch.int8), q.T)  # [M, N] int32, exact
        return acc.float() * (sx[:, None] * sw[None, :])
    xb = x.to(torch.bfloat16)
    if fmt == "int8":
        q, s = tensors[:2]
        return (xb @ q.to(torch.bfloat16).T).float() * s  # |q| <= 127: exact in bfloat16
    w = tensors[0] if fmt == "bf16" else dequantize(fmt, tensors).to(torch.bfloat16)
    return (xb @ w.T).float()


def dense_rows(fmt: str, requested: int | None) -> int:
    """The row count from which a ``fmt`` layer computes through ``dense_linear`` (0: never).
    ``requested`` None: ``DENSE_ROWS[fmt]`` where the CPU has the AMX tiles the GEMM would run on
    (int8 for w8a8, bfloat16 for the rest), else never; elsewhere torch's GEMM on these types is
    no faster than the kernel."""
    if requested is not None:
        return requested
    return DENSE_ROWS[fmt] if ("amx_int8" if fmt == "w8a8" else "amx_bf16") in cpu_flags() else 0


# --- the layer -----------------------------------------------------------------------------------


class LowBitLinear(torch.nn.Module):
    """Drop-in for a CPU nn.Linear whose weights are stored in ``fmt`` (see the module docstring).

    Forwards of fewer than ``dense`` rows (every forward where ``dense`` is 0) go through the
    kernel, the others through ``dense_linear``; without a kernel (a CPU with neither AVX-512 nor
    AVX2) the weights are dequantised per call, correct but slow."""

    def __init__(
        self,
        fmt: str,
        tensors: tuple[torch.Tensor, ...],
        bias: torch.Tensor | None,
        kernel,
        dense: int = 0,
    ) -> None:
        super().__init__()
        self.fmt = fmt
        self.in_features = tensors[0].shape[1] * (2 if fmt == "q4" else 1)
        self.out_features = tensors[0].shape[0]
        self.names = tuple(f"w{i}" for i in range(len(tensors)))
        for name, t in zip(self.names, tensors, strict=True):
            self.register_buffer(name, t)
        self.bias = bias
        self.kernel = kernel
        self._fn = getattr(kernel, f"{fmt}_linear") if kernel is not None else None
        self.dense = dense

    @classmethod
    def from_linear(cls, linear: torch.nn.Module, fmt: str, kernel, dense: int = 0) -> LowBitLinear:
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(fmt, quantize(linear.weight, fmt), bias, kernel, dense)

    @property
    def max_rows(self) -> int | None:
        """Forwards of up to this many rows compute each row as if alone (the kernel's); None:
        any number (no dense path)."""
        return max(1, self.dense - 1) if self.dense else None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, n) for n in self.names)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()  # [M, K]
        if 0 < self.dense <= x2.shape[0]:
            y = dense_linear(self.fmt, self.tensors, x2)
        elif self._fn is not None:
            y = self._fn(x2, *self.tensors)  # [M, N]
        else:
            y = reference_linear(self.fmt, self.tensors, x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    @classmethod
    def concat(cls, parts: list[LowBitLinear]) -> LowBitLinear | None:
        """As FlatLinear.concat: one layer for ``parts`` side by side, bitwise their outputs (each
        output row keeps its weights, scales and dot product); the parts become views of it."""
        p0 = parts[0]
        if any(
            p.bias is not None or p.fmt != p0.fmt or p.kernel is not p0.kernel or p.dense != p0.dense
            for p in parts
        ):
            return None
        fused = tuple(torch.cat(ts) for ts in zip(*(p.tensors for p in parts), strict=True))
        start = 0
        for p in parts:
            n = p.out_features
            for name, t in zip(p.names, fused, strict=True):
                setattr(p, name, t[start : start + n])
            start += n
        return cls(p0.fmt, fused, None, p0.kernel, p0.dense)

    def extra_repr(self) -> str:
        dense = f", dense from {self.dense} rows" if self.dense else ""
        return f"{self.in_features} -> {self.out_features}, {self.fmt}{dense}"


def head_format(fmt: str) -> str:
    """The output layer's format for a copy in ``fmt``: q4 copies keep it in q8 (as llama.cpp's
    Q4 files do: the vocabulary projection is the layer most sensitive to quantisation)."""
    return "q8" if fmt == "q4" else fmt


def use_lowbit_linear(
    model: torch.nn.Module, fmt: str, isa: str | None = None, dense: int | None = None
) -> int:
    """Replace the nn.Linear layers of a CPU ``model`` by ``fmt`` copies (the output layer by
    ``head_format(fmt)``); returns how many were replaced. Layers whose input size is not a
    multiple of 32 stay as they are. ``dense``: as ``dense_rows``' ``requested``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")
    kernel = extension(isa)
    if kernel is None:
        log.warning("low-bit kernel unavailable on this CPU: %s weights are dequantised per call", fmt)
    head = getattr(model, "lm_head", None)
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or child.in_features % (64 if fmt == "w8a8" else BLOCK):
                continue
            f = head_format(fmt) if child is head else fmt
            setattr(parent, name, LowBitLinear.from_linear(child, f, kernel, dense_rows(f, dense)))
            count += 1
    return count
