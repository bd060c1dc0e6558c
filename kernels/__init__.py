"""Tensor code only: RoPE at arbitrary positions, scattered-row attention, recompute steps."""
