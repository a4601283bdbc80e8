"""The GPU lane's env step: the interpreter, torch and Triton, the GPU, and every package the lane
imports (the image's and the carried ones); exit 1 when one does not import. run.sh runs it with
PYTHONPATH holding the checkout alone, so the carried packages must come from the .pth file.
With GPU_BUILD_OPS=1 (the rehearsal's preparation, before any call's time box), DeepSpeed's CPU
comm op is JIT-built then, once, not in each job nor in a time box that could kill the build."""

import importlib
import os
import sys

NAMES = (
    "torch", "triton", "apache_beam", "deepspeed", "datasets", "pydantic", "zstandard",
    "mwparserfromhell", "pyarrow", "numpy", "sentencepiece", "transformers", "matplotlib",
    "xdist", "pytest_timeout", "shatter.pipeline.cli", "shatter.train.engine", "shatter",
)  # fmt: skip


def main() -> int:
    print("Python", sys.version.split()[0], sys.executable)
    try:
        import torch
        import triton

        print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            cap = torch.cuda.get_device_capability(0)
            gib = p.total_memory / 2**30
            print(f"{p.name}: capability {cap}, {p.multi_processor_count} SMs, {gib:.1f} GiB")
        else:
            print("torch sees no CUDA device")
    except ImportError as e:
        print(f"torch/triton: import failed: {e}")
    bad = 0
    for name in NAMES:
        try:
            m = importlib.import_module(name)
            print(f"{name} {getattr(m, '__version__', '')} {m.__file__}")
        except Exception as e:
            bad = 1
            print(f"{name}: import failed: {type(e).__name__}: {e}")
    if not bad and os.environ.get("GPU_BUILD_OPS") == "1":
        from shatter.train.engine import build_extensions

        build_extensions()  # a no-op on a GPU
    return bad


if __name__ == "__main__":
    sys.exit(main())
