"""Pure-PyTorch BF16 reference ops of DeepSeek-V4 (imported as `dsv4_references`).

One module per op family, mirroring kernels/: norm, rope, mhc, linear, attention, moe, quant.
Every op runs in the activation dtype (bf16 reference, fp32/fp64 twins for noise floors).
"""
from .attention import (
                        assemble_idxs,
                        causal_compressed_idxs,
                        compress,
                        indexer_q,
                        indexer_scores,
                        indexer_topk,
                        kv_qat,
                        sparse_attn,
                        window_idxs,
)
from .linear import grouped_linear, linear, linear_fp32
from .mhc import hc_head, hc_post, hc_pre, hc_pre_apply, split_sinkhorn
from .moe import expert, gate, moe_combine
from .norm import head_rms_norm, rms_norm
from .quant import e2m1_round, fp4_sim, fp8_sim, rotate_activation
from .rope import apply_rope, rope_freqs

__all__ = [
                        "apply_rope",
                        "assemble_idxs",
                        "causal_compressed_idxs",
                        "compress",
                        "e2m1_round",
                        "expert",
                        "fp4_sim",
                        "fp8_sim",
                        "gate",
                        "grouped_linear",
                        "hc_head",
                        "hc_post",
                        "hc_pre",
                        "hc_pre_apply",
                        "head_rms_norm",
                        "indexer_q",
                        "indexer_scores",
                        "indexer_topk",
                        "kv_qat",
                        "linear",
                        "linear_fp32",
                        "moe_combine",
                        "rms_norm",
                        "rope_freqs",
                        "rotate_activation",
                        "sparse_attn",
                        "split_sinkhorn",
                        "window_idxs",
]
