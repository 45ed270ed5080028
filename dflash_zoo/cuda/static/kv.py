"""The static target's K/V buffers: one [1, kvh, S, hd] K and V per attention layer, written at tensor positions,
and the additive masks a forward reads them through.

Rollback is a position counter: rejected rows stay, masked, until the next verify overwrites them. Sliding
layers keep a ring of R >= window + 2 x max_rows slots (slot = position % R) where that is shorter than the
buffers: a verify's writes then only replace keys outside every live query's window (also after a rollback),
so the rows a later step needs are never overwritten early. `slot_pos` records which position each ring slot
holds, for the masks. A KV-shared layer reads its source layer's buffers (it writes none).
"""

from __future__ import annotations

import torch

from dflash_zoo.cuda.ops.attention import group_mask
from dflash_zoo.cuda.static.layout import LayerModules

NOWHERE = -(2**40)  # the position of a slot never written: far below any window


def ring_size(window: int | None, max_rows: int, max_len: int) -> int | None:
    """Slots of a sliding layer's ring (a multiple of 64, as the buffers), or None: a full-length buffer."""
    if window is None:
        return None
    size = -(-(window + 2 * max_rows) // 64) * 64
    return size if size < max_len else None


class KVBuffers:
    """K/V buffers of every attention layer (None for Gated-DeltaNet layers), their rings and masks.

    Args: the target's layers, its query heads, the buffers' length, the most rows a step writes (the
    verify block), the device and the activations' dtype (None: the k projections' weights', which an FP8
    target's are not).
    """

    def __init__(
        self, layers: list[LayerModules], heads: int, max_len: int, max_rows: int, device, dtype=None
    ):
        self.dtype = dtype
        self.ring = [ring_size(m.window, max_rows, max_len) if m.q is not None else None for m in layers]
        self.slot_pos = {
            r: torch.full((r,), NOWHERE, dtype=torch.long, device=device) for r in set(self.ring) if r
        }
        self.k, self.v = self._buffers(layers, max_len)
        self.group = [heads // k.shape[1] if k is not None else 0 for k in self.k]  # query heads per K/V head
        self.key_pos = torch.arange(max_len, device=device)  # [S]
        # layers whose prefill cannot use the causal flash kernel: windows and sinks need a mask
        self.masked_prefill = any(m.window is not None or m.sinks is not None for m in layers)

    def _buffers(self, layers: list[LayerModules], max_len: int) -> tuple[list, list]:
        """[1, kvh, S, hd] K and V per attention layer (its own sizes; S: max_len, or the ring's slots); a
        KV-shared layer's are its source layer's (it only reads them); None for GDN layers."""
        k: list[torch.Tensor | None] = [None] * len(layers)
        v: list[torch.Tensor | None] = [None] * len(layers)
        for i, m in enumerate(layers):
            if m.k is not None:
                w, rows = m.k.weight, self.ring[i] or max_len
                dtype = self.dtype or w.dtype
                k[i] = torch.zeros(
                    1, m.k.out_features // m.head_dim, rows, m.head_dim, device=w.device, dtype=dtype
                )
                v[i] = torch.zeros_like(k[i])
        for i, m in enumerate(layers):
            if m.kv_source is not None:
                k[i], v[i] = k[m.kv_source], v[m.kv_source]
        return k, v

    def states(self) -> list[torch.Tensor]:
        """The tensors a step mutates in place besides K/V rows it rewrites itself (the ring slots' positions)."""
        return list(self.slot_pos.values())

    def masks(self, layers: list[LayerModules], positions, prefill: bool, dtype) -> dict:
        """Additive group masks by (window, query heads per K/V head), for the `layers` that need one; ring
        layers' by ("ring", R, window, heads per K/V head), from the positions their slots hold."""
        if prefill and not self.masked_prefill:
            return {}
        keys = self.key_pos[: len(positions)] if prefill else self.key_pos
        masks = {}
        for m, g, ring in zip(layers, self.group, self.ring, strict=True):
            if m.q is None:
                continue
            held = self.slot_pos[ring] if ring and not prefill else keys  # [S] the position of each key row
            key = ("ring", ring, m.window, g) if ring and not prefill else (m.window, g)
            if key not in masks:
                ok = held[None, :] <= positions[:, None]  # [T, S] causal
                if m.window is not None:  # HF windows hold the query and the w - 1 keys before it
                    ok = ok & (positions[:, None] - held[None, :] < m.window)
                masks[key] = group_mask(ok, g, dtype)
        return masks

    def place(self, positions, prefill: bool) -> None:
        """Record which position each ring slot holds after this forward's writes (prefill: the prompt's last
        R rows; before any mask is built)."""
        for ring, held in self.slot_pos.items():
            if prefill:
                held.fill_(NOWHERE)
                positions = positions[-ring:]
            held.index_copy_(0, positions % ring, positions)
