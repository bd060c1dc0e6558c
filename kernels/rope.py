"""Rotary position embedding (RoPE) at arbitrary, scattered positions.

RoPE rotates each pair of channels ``(x[i], x[i + D/2])`` of a query or key by the angle
``pos * inv_freq[i]`` (Hugging Face's ``rotate_half`` layout). Rotations compose, so keys computed
at one position move to another by rotating them by the difference, and rotating by ``-pos``
removes the embedding: CacheBlend §4.3 (footnote 3) and appendix A; Cache-Craft §4 "RPE
Management".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` by the angles whose cosine and sine are given, in ``x``'s dtype.

    ``x * cos + rotate_half(x) * sin``, with the second product accumulated in place into
    the first (two passes over ``x`` fewer, no temporaries for ``rotate_half``).
    """
    # x: [..., N, D]; cos, sin: [N, D] (or [1, D]: one angle for every token)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    out = x * cos  # out: [..., N, D]
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)  # x1 cos - x2 sin
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])  # x2 cos + x1 sin
    return out


def _rotate_into(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor) -> Tensor:
    """:func:`apply_rope` computed in ``cos``'s dtype (float32 cos and sin promote a bf16
    ``x`` exactly) and written straight into ``out``: two passes where converting ``x``,
    rotating and converting back took five (placing a request's moved chunk keys, SmolLM2
    shapes: 3.3 ms against 17 ms, the same bits).  :func:`apply_rope` keeps its in-place
    form: written as this function with ``x``'s dtype, the prefill took 1.04x the time."""
    # x, out: [..., N, D]; cos, sin: [N, D] or [1, D]
    half = x.shape[-1] // 2
    low, high = x[..., :half], x[..., half:]
    torch.addcmul(low * cos[:, :half], high, sin[:, :half], value=-1, out=out[..., :half])
    torch.addcmul(high * cos[:, half:], low, sin[:, half:], out=out[..., half:])
    return out


@dataclass(frozen=True)
class Rope:
    """A model's RoPE: its inverse frequencies and the scale it puts on cos and sin.

    ``attention_scaling`` is 1.0 except for RoPE variants such as YaRN that scale the embedding.
    """

    inv_freq: Tensor  # [D/2] float32
    attention_scaling: float = 1.0

    def angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Unscaled cos and sin of ``positions * inv_freq`` (angles in float64, then float32)."""
        # positions: [N] integer (may be negative: a rotation backwards)
        inv_freq = self.inv_freq.to(positions.device, torch.float64)  # inv_freq: [D/2]
        freqs = positions.to(torch.float64)[:, None] * inv_freq  # freqs: [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # emb: [N, D]
        return emb.cos().float(), emb.sin().float()  # cos, sin: [N, D]

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The model's cos and sin for tokens at ``positions`` (attention scaling applied)."""
        cos, sin = self.angles(positions)  # cos, sin: [N, D]
        return cos * self.attention_scaling, sin * self.attention_scaling

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Embed raw queries or keys ``x`` at ``positions``, as the model does."""
        # x: [H, N, D]; positions: [N]
        return apply_rope(x, *self.cos_sin(positions))

    def shift(self, k: Tensor, delta: Tensor | int, out: Tensor | None = None) -> Tensor:
        """Move rotated keys by ``delta`` positions: a pure rotation, computed in float32 and
        written in ``k``'s dtype, into ``out`` when given (e.g. a slice of a request's KV,
        which may overlap ``k``: keys moved within one buffer)."""
        # k: [..., N, D]; delta: [N] or a scalar; out: like k
        delta = torch.as_tensor(delta, device=k.device).reshape(-1)  # delta: [N] or [1]
        cos, sin = self.angles(delta)  # cos, sin: [N, D] or [1, D] float32
        if out is None:
            return _rotate_into(k, cos, sin, torch.empty_like(k))
        if out.untyped_storage().data_ptr() == k.untyped_storage().data_ptr():
            # the second half reads the first half of k after writing that of out
            return out.copy_(_rotate_into(k, cos, sin, torch.empty_like(k)))
        return _rotate_into(k, cos, sin, out)

    def unrotate(self, k: Tensor, positions: Tensor) -> Tensor:
        """Raw keys from keys rotated at ``positions``: the inverse of :meth:`rotate`."""
        # k: [H, N, D]; positions: [N]
        return (self.shift(k.float(), -positions) / self.attention_scaling).to(k.dtype)
