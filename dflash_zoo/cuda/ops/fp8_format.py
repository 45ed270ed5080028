"""transformers' fine-grained FP8 layout in torch (no kernels): W float8_e4m3fn [N, K] with fp32 scales
`weight_scale_inv` [ceil(N/128), ceil(K/128)], one per 128 x 128 block (the block's absolute maximum / 448,
e4m3's largest finite value), and dequant(W, S) = W * S in fp32 (transformers `integrations/finegrained_fp8.py`,
`FP8Linear`; DeepSeek-V3's, Qwen3-FP8's). `quantize` writes it as transformers' quantizer does; `dequantize`
and `quantize_rows` are the torch forms fp8.py's kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
BLOCK = 128  # rows and columns of a scale block
QMAX = 448.0  # e4m3's largest finite value


def blocks(n: int) -> int:
    """Scale blocks along a dimension of n."""
    return -(-n // BLOCK)


def layout_reason(weight: torch.Tensor, scales: object) -> str | None:
    """Why a weight and its `weight_scale_inv` are not the layout the kernels read (float8_e4m3fn [N, K], fp32
    [ceil(N/128), ceil(K/128)]); None: they are."""
    if weight.dtype != FP8 or weight.dim() != 2:
        got = f"{str(weight.dtype).removeprefix('torch.')} {list(weight.shape)}"
        return f"its weight is {got}, not float8_e4m3fn [N, K]"
    want = [blocks(n) for n in weight.shape]
    if not isinstance(scales, torch.Tensor):
        return f"it has no weight_scale_inv (fp32 {want}, one scale per 128 x 128 block)"
    if scales.dtype != torch.float32 or list(scales.shape) != want:
        got = f"{str(scales.dtype).removeprefix('torch.')} {list(scales.shape)}"
        return f"its weight_scale_inv is {got}, not fp32 {want} (one scale per 128 x 128 block)"
    return None


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], fp32 scales [ceil(N/128), ceil(K/128)]), as transformers' quantizer
    (`Fp8Quantize`): per block, scale = 448 / amax (1 for an all-zero block), the weight times it clamped to
    +-448 and cast, and the stored scale its reciprocal. An edge block takes the amax of what it covers."""
    n, k = w.shape
    nb, kb = blocks(n), blocks(k)
    padded = F.pad(w.float(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))  # zeros change no amax
    tiles = padded.reshape(nb, BLOCK, kb, BLOCK)
    amax = tiles.abs().amax(dim=(1, 3))  # [nb, kb]
    scale = torch.where(
        amax > 0, QMAX / amax.clamp(min=torch.finfo(torch.float32).tiny), torch.ones_like(amax)
    )
    q = (tiles * scale[:, None, :, None]).clamp(-QMAX, QMAX).to(FP8).reshape(nb * BLOCK, kb * BLOCK)
    return q[:n, :k].contiguous(), (1.0 / scale).float()


def dequantize(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [N, K] and its block scales -> the fp32 weight [N, K] (each block times its scale)."""
    n, k = weight.shape
    full = scales.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]  # [N, K]
    return weight.float() * full


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., K] -> (float8_e4m3fn [..., K], fp32 scales [..., ceil(K/128)]): per row and 128-column
    group, amax / 448 (the `w8a8` kernels' activation quantization)."""
    k = x.shape[-1]
    groups = F.pad(x.float(), (0, blocks(k) * BLOCK - k)).unflatten(-1, (blocks(k), BLOCK))
    amax = groups.abs().amax(-1).clamp(min=1e-30)
    # divided by a tensor: CUDA divides by a Python scalar as a product with its reciprocal, which differs in
    # the last bit from the kernels' IEEE quotient and moves bf16 rows' frequent ties to the other e4m3 code
    xs = amax / amax.new_tensor(QMAX)
    q = (groups / xs[..., None]).clamp(-QMAX, QMAX).to(FP8).flatten(-2)[..., :k]
    return q, xs
