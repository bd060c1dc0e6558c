"""The merged KV of one sequence: every layer's keys and values in one growable buffer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SeqKV:
    """Keys and values of one sequence, all layers. Slot ``i`` holds the token at position ``i``.

    Keys are stored rotated at their slot's position (use :meth:`Rope.unrotate` to store them
    position-free). Slots past ``length`` are spare capacity, so appending (prefill on top of a
    past, decoding) writes in place; capacity grows by doubling.
    """

    k: Tensor  # [L, H_kv, C, D], rotated keys
    v: Tensor  # [L, H_kv, C, D]
    length: int  # slots in use, <= C
    # called with i before layer i's views are handed out: layer-wise loading waits there
    # until layer i's reused KV is in place (see ChunkEngine); None when all of it is
    before_layer: Callable[[int], None] | None = field(default=None, compare=False)

    @classmethod
    def empty(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> SeqKV:
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        k = torch.empty(shape, dtype=dtype, device=device)  # k: [L, H_kv, C, D]
        return cls(k, torch.empty_like(k), 0)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def extend(self, n: int) -> None:
        """Count ``n`` more slots as used, growing the buffer if needed (new slots unset)."""
        need = self.length + n
        if need > self.capacity:
            size = list(self.k.shape)
            size[2] = max(need, 2 * self.capacity)
            k, v = self.k.new_empty(size), self.v.new_empty(size)  # k, v: [L, H_kv, C', D]
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
            self.k, self.v = k, v
        self.length = need

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Views of layer ``i``'s used slots; writing to them writes the buffer."""
        if self.before_layer is not None:
            self.before_layer(i)
        return self.k[i, :, : self.length], self.v[i, :, : self.length]  # [H_kv, S, D] each

    def keys(self) -> Tensor:
        """All layers' used keys (rotated)."""
        return self.k[:, :, : self.length]  # [L, H_kv, S, D]

    def values(self) -> Tensor:
        """All layers' used values."""
        return self.v[:, :, : self.length]  # [L, H_kv, S, D]
