"""FP8 weight schemes as data, and the one quantization formula they share.

The arithmetic copies compressed-tensors (`calculate_qparams` and `_quantize` in
compressed_tensors/quantization, 0.19): scale = amax / 448 in the scale dtype, zero scales replaced
by that dtype's eps, q = clamp(w / scale + 0, -448, 448) cast to float8_e4m3fn (round to nearest even; the
zero point's + 0 makes -0.0 +0.0).
Doing the division in the same dtype as llm-compressor is what makes our bytes equal to its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128


@dataclass(frozen=True)
class Scheme:
    name: str
    weight_strategy: str  # compressed-tensors QuantizationStrategy: channel | block | tensor
    activation_strategy: str  # token | group (always dynamic)
    activation_group_size: int | None = None
    block: tuple[int, int] | None = None

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, ...]:
        out_features, in_features = shape
        if self.weight_strategy == "channel":
            return (out_features, 1)
        if self.weight_strategy == "block":
            return (-(-out_features // self.block[0]), -(-in_features // self.block[1]))
        return (1,)

    def supports(self, shape: tuple[int, int]) -> bool:
        """Block kernels (vLLM's and transformers') need whole 128x128 blocks."""
        if self.block is None:
            return True
        return shape[0] % self.block[0] == 0 and shape[1] % self.block[1] == 0

    @property
    def row_multiple(self) -> int:
        """Rows that must stay together when a weight is processed in row chunks."""
        return self.block[0] if self.block else 1


SCHEMES: dict[str, Scheme] = {
    "dynamic": Scheme("dynamic", "channel", "token"),
    "block": Scheme("block", "block", "group", activation_group_size=BLOCK, block=(BLOCK, BLOCK)),
    # per-token activations: vLLM quantizes dynamic activations per token whatever the weight strategy
    # (compressed_tensors_w8a8_fp8.py, kFp8DynamicTokenSym), so the config says what every engine will do
    "tensor": Scheme("tensor", "tensor", "token"),
}


def amax(w: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Largest magnitude per scale group, in w's dtype (exact: max does not round)."""
    if scheme.weight_strategy == "channel":
        return w.abs().amax(dim=1, keepdim=True)
    if scheme.weight_strategy == "block":
        r, c = scheme.block
        rows, cols = w.shape
        return w.abs().reshape(rows // r, r, cols // c, c).amax(dim=(1, 3))
    return w.abs().amax().reshape(1)


def scale_from_amax(amax_: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    # Divide by a tensor, as compressed-tensors does: CUDA turns division by a Python scalar into
    # multiplication by its (inexact) reciprocal, which would make GPU and CPU scales differ.
    scale = amax_.to(scale_dtype) / torch.tensor(FP8_MAX, dtype=scale_dtype, device=amax_.device)
    info = torch.finfo(scale_dtype)
    # an all-zero row gets eps, as compressed-tensors gives it (its codes are 0 whatever the scale). A non-zero row
    # whose scale underflows (float16: amax under 1.3e-5) gets the smallest subnormal instead of eps, 5e4 times too
    # large, which quantized it to zeros (there alone the bytes differ from llm-compressor's).
    floor = torch.where(amax_.to(scale_dtype) == 0, torch.tensor(info.eps, dtype=scale_dtype, device=scale.device),
                        torch.tensor(info.tiny * info.eps, dtype=scale_dtype, device=scale.device))
    scale = torch.where(scale == 0, floor, scale)
    # A subnormal scale (float16 rows of amax 2.7e-5 to 3.7e-4) that rounded down puts the row's largest values
    # past 464, where e4m3 saturates at 448 (up to 33% off): the next representable scale up keeps them in range.
    # Normal scales round by 2^-11 at most and never get there, so elsewhere the bytes stay compressed-tensors'.
    over = amax_.float() / scale.float() > FP8_MAX + 16
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[scale.element_size()]
    return torch.where(over, (scale.view(ints) + 1).view(scale_dtype), scale)  # positive: +1 is the next float up


def quantize_with_scale(w: torch.Tensor, scale: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    w = w.to(scale.dtype)
    if scheme.weight_strategy == "block":
        r, c = scheme.block
        rows, cols = w.shape
        blocks = w.reshape(rows // r, r, cols // c, c) / scale[:, None, :, None]
        scaled = blocks.reshape(rows, cols)
    else:
        scaled = w / scale
    # compressed-tensors adds the zero point (0 for FP8), which turns -0.0 into +0.0 and changes nothing else
    scaled += torch.zeros((), dtype=scaled.dtype, device=scaled.device)
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight(w: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a whole 2-D weight; returns (float8 weight, scale of scheme.scale_shape)."""
    scale = scale_from_amax(amax(w, scheme), scale_dtype)
    return quantize_with_scale(w, scale, scheme), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, scheme: Scheme, dtype=torch.float32) -> torch.Tensor:
    q = q.to(dtype)
    scale = scale.to(dtype)
    if scheme.weight_strategy == "block":
        r, c = scheme.block
        scale = scale.repeat_interleave(r, 0)[: q.shape[0]].repeat_interleave(c, 1)[:, : q.shape[1]]
    return q * scale
