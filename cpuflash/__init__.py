"""cpuflash: exact FlashAttention-2 for CPUs, in Python and Numba.

``cpuflash.attention(q, k, v)`` computes ``softmax(Q K^T / sqrt(D)) V`` in tiles, never forming the
``Nq x Nk`` score matrix. See the README and ``help(cpuflash.attention)``.
"""

from ._threads import choose_threading_layer

choose_threading_layer()

from .api import (QuantizedKV, attention, attention_backward, attention_varlen,  # noqa: E402
                  attention_varlen_backward, attention_with_kvcache, dequantize_kv,
                  merge_states, quantize_kv)
from .flex import BlockMask, block_mask, flex_attention, flex_attention_backward  # noqa: E402
from .tiling import TileConfig, choose_tiles, cpu_info  # noqa: E402

__version__ = "0.1.0"

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "merge_states",
           "attention_backward", "attention_varlen_backward", "TileConfig", "choose_tiles",
           "cpu_info", "quantize_kv", "dequantize_kv", "QuantizedKV", "flex_attention",
           "flex_attention_backward", "block_mask", "BlockMask", "__version__"]
