"""Where the GPU lane's job tests run: on the CUDA device, or on CPU ranks in the lane's rehearsal
(.ci/gpu/run.sh rehearse sets GPU_REHEARSE=1), which runs every job that means something without
a GPU; what needs one (fp16, the V100 path, GPU memory figures) is skipped there, saying why."""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
REHEARSE = os.environ.get("GPU_REHEARSE") == "1"
DEVICE = "cuda" if CUDA else "cpu"

lane = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not CUDA and not REHEARSE,
        reason="needs a CUDA device (make test-gpu), or GPU_REHEARSE=1 (.ci/gpu/run.sh rehearse)",
    ),
]
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: fp16 is refused on CPU")


def precisions(*names: str) -> list:
    """pytest params of `names`, fp16 skipped without a GPU."""
    return [pytest.param(p, marks=needs_gpu) if p == "fp16" else p for p in names]
