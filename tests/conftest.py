"""Shared fixtures: one tiny synthetic checkpoint per session, single-threaded torch, kernels' PTX.

Tiny problems run faster on one thread (no OpenMP barriers), and results stay independent of the
machine's core count.
"""
import atexit
import os
import shutil
import tempfile

import pytest
import torch

torch.set_num_threads(1)

# CuTeDSL writes the files of KeepPTX compiles into its dump directory, read once when it is imported (by
# default the working directory: a test run would leave .ptx files in the checkout)
_CUTE_DUMP = tempfile.mkdtemp(prefix="dsv4debug-tests-cute-")
os.environ.setdefault("CUTE_DSL_DUMP_DIR", _CUTE_DUMP)
atexit.register(shutil.rmtree, _CUTE_DUMP, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from dsv4debug.config import preset
    from dsv4debug.synth import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", preset("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from dsv4debug.checkpoint import Checkpoint
    return Checkpoint.open(tiny_dir)


@pytest.fixture(scope="session")
def ptx_of():
    """ptx_of(build, **config): the sm_90a PTX of a kernel's `build(**config)` (its file lands in the dump
    directory set above)."""
    def compile_ptx(build, **cfg) -> str:
        from cutlass import cute
        kern, args = build(**cfg)
        return cute.compile[cute.GPUArch("sm_90a"), cute.KeepPTX](kern, *args).artifacts.PTX
    return compile_ptx
