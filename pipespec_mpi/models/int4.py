"""Weight-only int4 linears for the engine (``quantization: int4``): what puts a 70B stage on one
80 GB GPU (about 37 GB of weights).

gpt-fast's int4 handler: each output row's weights in groups of ``group`` inputs, each group an
unsigned 4-bit code with its own scale and zero (``w = (q - 8) * scale + zero``), multiplied by
torch's own tinygemm kernels: ``_weight_int4pack_mm`` on CUDA (bfloat16 activations), its CPU
twin ``_weight_int4pack_mm_for_cpu`` elsewhere; no package beyond torch. A model is quantized
one linear at a time on the target device (``quantize_int4``), so a checkpoint never sits whole
in half precision on the GPU. The LM head stays dense (its logits decide every token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipespec_mpi.models.split import layer_devices, spread

INNER_K_TILES = 8  # tinygemm's packing: the input dim must be a multiple of 16 * this
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] as codes [N, K] int32 in 0..15 and scales_and_zeros [K / group, N, 2] float32
    (min-max per group, the layout tinygemm reads)."""
    n, k = w.shape
    g = w.float().reshape(-1, group)
    lo, hi = g.amin(dim=1, keepdim=True), g.amax(dim=1, keepdim=True)
    scales = (hi - lo).clamp(min=1e-6) / 15
    zeros = lo + scales * 8
    codes = g.sub(lo).div(scales).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    sz = torch.cat([scales.reshape(n, -1, 1), zeros.reshape(n, -1, 1)], dim=2).transpose(0, 1).contiguous()
    return codes, sz


def pack(codes: torch.Tensor) -> torch.Tensor:
    """The codes [N, K] in the packing of the device's kernel."""
    if codes.device.type == "cuda":
        as_bytes = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # two codes a byte
        return torch.ops.aten._convert_weight_to_int4pack(as_bytes, INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)


class Int4Linear(torch.nn.Module):
    """``y = x @ dequantized(W).T`` with W stored as int4 codes in groups (no bias)."""

    def __init__(
        self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int, group: int
    ) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        if packed.device.type == "cuda":  # fixed addresses: CUDA graphs read them in place (engine.static)
            torch._dynamo.mark_static_address(packed)
            torch._dynamo.mark_static_address(scales_and_zeros)
        self.in_features, self.out_features, self.group = in_features, scales_and_zeros.shape[1], group
        self.on_cuda = packed.device.type == "cuda"

    @classmethod
    def of(cls, weight: torch.Tensor, group: int = 128) -> Int4Linear:
        """``weight`` [N, K] quantized on its device (CUDA: scales in bfloat16, as its kernel reads)."""
        n, k = weight.shape
        if k % group or k % (16 * INNER_K_TILES) or n % 8:
            raise ValueError(
                f"int4: a linear of {k} inputs and {n} outputs; needs inputs a multiple of the group "
                f"({group}) and of {16 * INNER_K_TILES}, outputs of 8"
            )
        codes, sz = quantize_groups(weight, group)
        if weight.device.type == "cuda":
            sz = sz.to(torch.bfloat16)
        return cls(pack(codes), sz, k, group)

    @classmethod
    def concat(cls, parts: list[Int4Linear]) -> Int4Linear | None:
        """The parts side by side (q|k|v, gate|up), each output its part's: their packed rows
        (blocks of 8 outputs on CUDA) and their scales stacked along the outputs."""
        if len({(p.in_features, p.group, p.on_cuda) for p in parts}) != 1:
            return None
        packed = torch.cat([p.packed for p in parts], dim=0)
        sz = torch.cat([p.scales_and_zeros for p in parts], dim=1)
        return cls(packed, sz, parts[0].in_features, parts[0].group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.on_cuda:
            y = torch.ops.aten._weight_int4pack_mm(
                flat.to(torch.bfloat16), self.packed, self.group, self.scales_and_zeros
            )
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.packed, self.group, self.scales_and_zeros
            )
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"


def dequantized(weight: torch.Tensor, group: int) -> torch.Tensor:
    """What ``Int4Linear.of(weight, group)`` multiplies by, as a dense float32 [N, K] (for tests
    and the numerics note)."""
    codes, sz = quantize_groups(weight, group)
    n, k = weight.shape
    scales = sz[:, :, 0].t().reshape(-1, 1)
    zeros = sz[:, :, 1].t().reshape(-1, 1)
    return ((codes.float() - 8).reshape(-1, group) * scales + zeros).reshape(n, k)


def quantize_int4(
    model: torch.nn.Module, devices: Sequence[torch.device], group: int = 128
) -> torch.nn.Module:
    """``model`` (a Llama causal LM, anywhere) with every decoder linear an ``Int4Linear`` on its
    layer's device (``devices``: one, or a split's, models/split.py ``spread``), one at a time
    (the dense one dropped as it goes), the rest moved there after."""
    layers = model.model.layers
    for layer, device in zip(layers, layer_devices(len(layers), devices), strict=True):
        for owner in (layer.self_attn, layer.mlp):
            for name in LLAMA_LINEARS:
                dense = getattr(owner, name, None)
                if isinstance(dense, torch.nn.Linear):
                    with torch.no_grad():
                        setattr(owner, name, Int4Linear.of(dense.weight.detach().to(device), group))
                    del dense
    return spread(model, devices)
