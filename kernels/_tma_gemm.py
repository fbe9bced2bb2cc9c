"""The skeleton the dense sm_90a GEMMs share: two K-major operands A [M, K] and B [N, K] in TMA tiles through a
shared-memory pipeline, one producer warp (warp 0 of warpgroup 0, registers given away) feeding two consumer
warpgroups of 64 rows each (WGMMA m64nNk16). A kernel class sets tile_m, tile_n, tile_k and stages, calls
`tma_operands` in its host launcher and `operand_pipeline` then `produce` in its kernel, and writes its own
consumer loop and epilogue (plain fp32 accumulation in compressor.py, per-block scale promotion in gemm_fp8.py).
The pipeline and the shared-tile functions (clusters of CTAs along N multicasting one operand tile) serve
gemm_w4a16.py too, whose weights are not TMA tiles.
(No `from __future__ import annotations` here: cute.struct reads the Storage annotations as objects.)
"""
import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, cute, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

CONSUMER_WARPS = 8          # two warpgroups


def tma_pipeline(barriers, stages: int, tx_bytes: int, cluster_n: int = 1):
    """The TMA -> consumers pipeline over `stages` buffers: one producer thread, the consumer warps' threads.
    In a cluster of cluster_n CTAs along N, a stage is free once every CTA's consumers are done with it (each
    CTA's part of the shared tile lands in all of them), so each consumer warp releases it in every CTA."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers.data_ptr(), num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_WARPS * cluster_n),
        tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, cluster_n, 1)))


def multicast_op(cluster_n: int):
    """The TMA load of a tile that a cluster of cluster_n CTAs along grid x shares (plain when alone)."""
    return cpasync.CopyBulkTensorTileG2SMulticastOp() if cluster_n > 1 else cpasync.CopyBulkTensorTileG2SOp()


@cute.jit
def shared_tile_partition(tma: cute.CopyAtom, cluster_n: cutlass.Constexpr, s: cute.Tensor, g: cute.Tensor):
    """(tS, tG, mask) for `load`: the stages s and global tiles g of a tile shared by a cluster of cluster_n CTAs
    along grid x. Each CTA loads 1 / cluster_n of it and multicasts that part to all of them (mask); alone, the
    whole tile (mask None)."""
    mask = None
    if cutlass.const_expr(cluster_n > 1):
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        ctas = cute.make_layout((1, cluster_n, 1))                     # (M, N, K) of the cluster
        mask = cute.make_layout_image_mask(ctas, ctas.get_flat_coord(rank), mode=1)
        tS, tG = cpasync.tma_partition(tma, rank, cute.make_layout(cluster_n), cute.group_modes(s, 0, 2),
                                       cute.group_modes(g, 0, 2))
    else:
        tS, tG = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                       cute.group_modes(g, 0, 2))
    return tS, tG, mask


@cute.jit
def load(tma: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor, bar, mask):
    """One TMA load into a pipeline stage, multicast where `mask` (from shared_tile_partition) says so."""
    if cutlass.const_expr(mask is None):
        cute.copy(tma, src, dst, tma_bar_ptr=bar)
    else:
        cute.copy(tma, src, dst, tma_bar_ptr=bar, mcast_mask=mask)


RASTER_A_BYTES = 16 << 20  # activation rows a group of tile rows keeps in L2 (50 MB on H100 / H200)


def raster_group(m: int, k: int, tile_m: int, elt_bytes: int) -> int:
    """Host side of `tile_coords`: how many rows of tiles one group spans (their A tiles stay in L2 while the
    group sweeps N, and B streams from memory once per group)."""
    rows = -(-m // tile_m)
    return max(1, min(rows, RASTER_A_BYTES // (tile_m * k * elt_bytes)))


def raster(bx: int, by: int, n_tiles: int, m_tiles: int, group_m: int, cluster_n: int):
    """(N tile, M tile) of the CTA at grid position (bx, by) of a grid [n_tiles, m_tiles] (`tile_coords`);
    plain arithmetic, so the kernel traces it and the CPU tests check it is a permutation."""
    units = n_tiles // cluster_n                        # clusters along N in a row of tiles
    u = (by * n_tiles + bx) // cluster_n
    group = u // (group_m * units)
    first = group * group_m
    rows = cutlass.min(m_tiles - first, group_m)
    r = u - group * group_m * units
    return (r // rows) * cluster_n + bx % cluster_n, first + r % rows


@cute.jit
def tile_coords(group_m: cutlass.Int32, cluster_n: cutlass.Constexpr):
    """In the kernel, on a grid [N tiles, M tiles, ...]: (bx, by), the N and M tile this CTA computes.

    The CTAs run in launch order (x fastest): taken as they come, a wave of CTAs walks one row of tiles and
    streams all of B for every row (Pro wq_b: 100 MB of weights, twice the L2, read once per 128 rows). Here
    consecutive clusters walk down a group of `group_m` tile rows first, then along N, so a wave shares its few
    B tiles and B is read from memory once per group. A cluster's CTAs keep one row and neighbouring columns."""
    bx, by, _ = cute.arch.block_idx()
    n_tiles, m_tiles, _ = cute.arch.grid_dim()
    return raster(bx, by, n_tiles, m_tiles, group_m, cluster_n)


@cute.jit
def leave_cluster(cluster_n: cutlass.Constexpr):
    """Every thread, last: no CTA of a cluster exits while another may still write its shared memory or arrive
    on its barriers."""
    if cutlass.const_expr(cluster_n > 1):
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()


class TmaOperandsAB:
    """Host side and kernel prologue of a GEMM whose A and B both stream through TMA (see the module doc).
    cluster_n > 1: the grid's CTAs form clusters of cluster_n along N (grid x), which share their A tile: each
    CTA loads 1 / cluster_n of it and multicasts that part to all of them, cutting the A traffic from L2 by
    cluster_n (the large FP8 GEMMs are bound by that traffic). Launch with `cluster=[cluster_n, 1, 1]` and end
    the kernel with `leave_cluster(cluster_n)` in every thread."""
    tile_m: int
    tile_n: int
    tile_k: int
    stages: int
    cluster_n: int = 1

    def tma_operands(self, dtype, mA: cute.Tensor, mB: cute.Tensor):
        """(tma_a, mA_tma, tma_b, mB_tma, tiled_mma, sA_layout, sB_layout) for operands of `dtype` with fp32
        accumulation; sets self.storage (barriers, swizzled A and B stages) and self.tx_bytes (a stage)."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(cutlass.utils.LayoutEnum.ROW_MAJOR, dtype, self.tile_k), dtype)
        sA_layout = cute.tile_to_shape(atom, (self.tile_m, self.tile_k, self.stages), order=(0, 1, 2))
        sB_layout = cute.tile_to_shape(atom, (self.tile_n, self.tile_k, self.stages), order=(0, 1, 2))
        tma_a, mA_tma = cpasync.make_tiled_tma_atom(multicast_op(self.cluster_n), mA,
                                                    cute.slice_(sA_layout, (None, None, 0)),
                                                    (self.tile_m, self.tile_k), num_multicast=self.cluster_n)
        tma_b, mB_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mB,
                                                    cute.slice_(sB_layout, (None, None, 0)),
                                                    (self.tile_n, self.tile_k))
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32, (2, 1, 1),
            tiler_mn=(64, self.tile_n))

        @cute.struct
        class Storage:
            bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sB_layout)], 1024]

        self.storage = Storage
        self.tx_bytes = (self.tile_m + self.tile_n) * self.tile_k * dtype.width // 8
        return tma_a, mA_tma, tma_b, mB_tma, tiled_mma, sA_layout, sB_layout

    def operand_pipeline(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                         sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout, bx, by):
        """In the kernel: (pipe, sA, sB, loads), the A tiles of row block `by` and the B tiles of column block
        `bx` partitioned for the producer (`loads`, for `produce`)."""
        st = cutlass.memory.SmemAllocator().allocate(self.storage)
        sA = st.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = st.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        pipe = tma_pipeline(st.bars, self.stages, self.tx_bytes, self.cluster_n)
        gA = cute.local_tile(mA, (self.tile_m, self.tile_k), (by, None))
        gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (bx, None))
        tAsA, tAgA, a_mask = shared_tile_partition(tma_a, self.cluster_n, sA, gA)
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
                                           cute.group_modes(gB, 0, 2))
        return pipe, sA, sB, (tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB)

    def consumer_operands(self, tiled_mma: cute.TiledMma, sA: cute.Tensor, sB: cute.Tensor, tidx):
        """In a consumer warpgroup: (tCrA, tCrB, tCc, acc), its WGMMA fragments of the A and B stages, the
        (row, column) in the tile of each of its accumulator values, and its fp32 accumulator, zeroed."""
        thr = tiled_mma.get_slice(tidx - 128)
        tCrA = tiled_mma.make_fragment_A(thr.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr.partition_B(sB))
        tCc = thr.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        acc = cute.make_rmem_tensor(thr.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc.fill(0.0)
        return tCrA, tCrB, tCc, acc

    @cute.jit
    def producer_warpgroup(self, pipe, loads, k_tiles, warp, lane, k_first=0):
        """Warpgroup 0: its registers given to the consumers, warp 0 the producer."""
        cute.arch.setmaxregister_decrease(40)
        if warp == 0:
            self.produce(pipe, loads, k_tiles, lane, k_first)

    @cute.jit
    def produce(self, pipe, loads, k_tiles, lane, k_first=0):
        """The producer warp: both operands' k-tiles k_first .. k_first + k_tiles - 1 into the pipeline's
        stages, in order (k_first: a split-K part's first tile)."""
        tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB = loads
        if lane == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for kt in cutlass.range(k_tiles, unroll=1):
            pipe.producer_acquire(state)
            bar = pipe.producer_get_barrier(state)
            load(tma_a, tAgA[(None, k_first + kt)], tAsA[(None, state.index)], bar, a_mask)
            cute.copy(tma_b, tBgB[(None, k_first + kt)], tBsB[(None, state.index)], tma_bar_ptr=bar)
            pipe.producer_commit(state)
            state.advance()
        pipe.producer_tail(state)
