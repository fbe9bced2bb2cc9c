"""Shared fixtures: one tiny synthetic checkpoint per session, single-threaded torch.

Tiny problems run faster on one thread (no OpenMP barriers), and results stay independent of the
machine's core count.
"""
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from dsv4debug.config import preset
    from dsv4debug.synth import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", preset("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from dsv4debug.checkpoint import Checkpoint
    return Checkpoint.open(tiny_dir)
