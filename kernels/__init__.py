"""CuTeDSL kernels of DeepSeek-V4 inference (imported as `dsv4_kernels`), one module per op family:

    norm       RMSNorm (weighted) and the unweighted per-head q norm
    rope       interleaved RoPE on the last 64 of 512 dims, forward / inverse, out of place / in place
    nvfp4      NVFP4 activation quantise / dequantise (E2M1 by integer code, e4m3 per 16, fp32 global)
    kv_cache   FP8 paged KV cache: quantise + write by slot mapping, read by block table + dequantise
    mhc        mHC pre (mixes, sigmoid, softmax + Sinkhorn, weighted stream sum) and post
    gemm_fp8   FP8 block-scaled linear (per-1x128 activation quantiser, WGMMA, split-K, clusters; sm_90a)
    gemm_w4a16 NVFP4 W4A16 linear: the WGMMA GEMM (dense, grouped MoE with SwiGLU; sm_90a) and the decode
               kernel (mma.sync, M <= 16); weights repacked by w4_pack
    moe        MoE routing glue around the grouped W4A16 GEMMs and the combine (gather-sum in expert order)
    sparse_attn  MQA sparse attention with sinks over gathered FP8-cache / bf16 rows (WGMMA, sm_90a)
    indexer    lightning indexer scores (WGMMA, sm_90a) and causal top-k (radix select)
    compressor KV compressor pooling (ratio 4 overlapping / 128), RMSNorm, RoPE, FP8 or Hadamard + FP4 QAT
    stats      a capture site's statistics (NaN/Inf counts, extremes, sums) in one launch

Each module registers its kernels (name, family, target archs, representative configurations) in
`_common.REGISTRY` and has torch-facing launchers. `compile.compile_all` compiles them without a GPU.
Importing this package does not import CuTeDSL; importing a family module does.
"""
FAMILY_MODULES = ("norm", "rope", "nvfp4", "kv_cache", "mhc", "gemm_fp8", "gemm_w4a16", "sparse_attn", "indexer", "compressor",
                  "stats", "moe")


def load_all():
    """Import every family module; returns the kernel registry {name: KernelDef}."""
    import importlib
    for m in FAMILY_MODULES:
        importlib.import_module(f"{__name__}.{m}")
    from ._common import REGISTRY
    return REGISTRY
