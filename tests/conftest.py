"""Shared test setup.

Triton kernels run on CPU through the interpreter; TRITON_INTERPRET must be set before any kernel is
defined, so it is decided here, before any test module imports one (kernels/triton_utils.py then works
around the interpreter's bugs).
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n N` on about N cores: a worker's second intra-op thread would only wait for a core the other
    # workers hold (small ops measured several times slower); subprocesses get OMP_NUM_THREADS=1 already
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def nan_filled_empty():
    """torch.empty / empty_like / new_empty return NaN-filled floats (deterministic mode), so outputs
    the kernels leave unwritten show up as NaN; ops with no deterministic version only warn."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
