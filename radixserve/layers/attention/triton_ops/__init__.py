"""Triton kernels of the Triton attention backend (GPU; on the CPU they run under Triton's
interpreter, TRITON_INTERPRET=1, which is how the unit tests check them)."""

from radixserve.layers.attention.triton_ops.decode_attention import decode_attention_fwd
from radixserve.layers.attention.triton_ops.extend_attention import extend_attention_fwd
from radixserve.layers.attention.triton_ops.store_kv import store_kv_cache

__all__ = ["decode_attention_fwd", "extend_attention_fwd", "store_kv_cache"]
