"""The DeepSpeed side of a run: process-group set-up, the DeepSpeed config dict, the engine.

The DeepSpeed config is built in code from `EngineArgs` (train/config.py): a pretraining run's
`TrainConfig` or a finetuning run's own fields, one source of truth as in academic-budget-bert;
`--deepspeed-config FILE` merges an expert's JSON over it. Optimisation follows the paper's
§A.2: AdamW (lr 1e-4, β = (0.9, 0.999), ε = 1e-6), weight decay 0.01 not applied to biases and
LayerNorm weights, 10k steps of linear warm-up then linear decay to 0 at the last step
(DeepSpeed's WarmupDecayLR), gradient clipping at 1.0. fp16 uses DeepSpeed's dynamic loss scaling (Micikevicius et al. 2018); ZeRO stages per Rajbhandari et al. 2020.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from shatter.accelerator import say_deepspeed_accelerator
from shatter.train.config import ConfigError, EngineArgs, TrainConfig
from shatter.train.lifecycle import COLLECTIVE_TIMEOUT
from shatter.train.schedule import DEEPSPEED_DECAYS, Plan, client_scheduler


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> bool:
    """Without the deepspeed launcher the script is a world of one: set what torch.distributed
    reads. Returns True when it did (no launcher)."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return False
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # a world of one needs no agreed port: a fresh one, never one inherited from a caller's
    # environment that another process (a second run, a test's engine) may hold
    os.environ["MASTER_PORT"] = str(_free_port())
    return True


LAUNCHER_PORT = "29500"  # the deepspeed launcher's default --master_port


def _launch_file() -> Path:
    """A file named by this launch on the host: its launcher's (the ranks' parent's) pid and
    start time, so no other launch, then or later, shares it."""
    parent = os.getppid()
    try:
        started = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "0"
    return Path(tempfile.gettempdir()) / f"shatter-port-{os.getuid()}-{parent}-{started}"


def own_port_on_one_host(path: Path | None = None, env: dict | None = None) -> None:
    """A launch on one host left on the launcher's default port (29500, which every job on the
    host shares: two at once would join each other's rendezvous and /dev/shm segments) moves to
    a port free now, which rank 0 picks and the ranks agree on through a file of their launch.
    A port given with --master_port, or a launch over several hosts, is kept. (`path`, `env`:
    the file and the environment, the launch's and os.environ by default.)"""
    env = os.environ if env is None else env
    if env.get("MASTER_PORT") != LAUNCHER_PORT or env.get("CROSS_SIZE") != "1":
        return
    world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    store = torch.distributed.FileStore(str(path or _launch_file()), world)
    store.set_timeout(timedelta(seconds=120))
    if rank == 0:
        store.set("port", str(_free_port()))
    env["MASTER_PORT"] = store.get("port").decode()
    store.add("read", 1)
    if rank == 0:  # the file goes with the last store: kept until every rank has read it
        while store.add("read", 0) < world:
            time.sleep(0.01)


def _file_store() -> str:
    """A world of one rendezvous through a file: no TCP port to race other jobs for."""
    fd, path = tempfile.mkstemp(prefix="shatter-pg-")
    os.close(fd)
    os.unlink(path)  # torch's FileStore creates it
    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    return f"file://{path}"


CPU_OP = "deepspeed_shm_comm"  # DeepSpeed's CPU shared-memory comm op, JIT-built on first use
CPU_OP_WHAT = "DeepSpeed's CPU communication op"  # its name in what the user reads
# its build, measured (DeepSpeed 0.19.8, torch 2.13, g++ on a 2-core AMD EPYC VM, two files
# compiled side by side): 107 CPU-seconds; 75 CPU-s in 52 s of wall time at load average 1-2; 79
# CPU-s in 2 min 23 s at 5-6
CPU_OP_COST = "75-110 CPU-seconds: a minute or two on 2 idle cores, several on a busy machine"


CHECKOUT = Path(__file__).resolve().parents[1]  # the repository this code runs from


def extensions_dir(checkout: Path = CHECKOUT) -> str:
    """Our JIT-extension cache: one per Python environment and checkout (two of them sharing
    torch's default cache would rebuild each other's ops, CPU_OP_COST each time), keyed inside
    by the build (`keyed`)."""
    tag = hashlib.sha1(f"{sys.prefix}|{checkout}".encode()).hexdigest()[:10]
    return keyed(str(Path.home() / ".cache" / "torch_extensions" / f"env-{tag}"))


def build_key() -> str:
    """What a JIT-built op's binary depends on: torch's version (its local label names the
    build: +cpu, +cu126), DeepSpeed's (the op's sources) and the Python ABI (cpython-311,
    cpython-313t), e.g. `torch2.13.0+cpu-deepspeed0.19.8-cpython-311`."""
    from importlib.metadata import version  # not the packages: importing DeepSpeed is slow

    python = sys.implementation.cache_tag + sys.abiflags
    return f"torch{version('torch')}-deepspeed{version('deepspeed')}-{python}"


BUILD_KEY = re.compile(r"torch[^/]+-deepspeed[^/]+-[a-z]+-\d+[a-z]*")  # a build_key()


def keyed(cache: str, key: str | None = None) -> str:
    """The subdirectory of JIT cache `cache` for this build (`key`, default `build_key()`): an op
    built by one torch and loaded by another crashes the second with `undefined symbol`, so two
    builds never share one. A `cache` that names a build already (a parent process's setting,
    inherited) gives its sibling: the same directory for the same build, another for another."""
    path = Path(cache)
    if BUILD_KEY.fullmatch(path.name):
        path = path.parent
    return str(path / (key or build_key()))


def use_extensions_dir() -> str:
    """TORCH_EXTENSIONS_DIR for this process and its children: unset, our own cache
    (`extensions_dir`); set by the user, its subdirectory for this build (`keyed`)."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = keyed(given) if given else extensions_dir()
    return os.environ["TORCH_EXTENSIONS_DIR"]


def announce_build(name: str, what: str) -> None:
    """Say so before a JIT build's silent minute of the compiler, when op `name` is not built yet
    (local rank 0 only: the other ranks wait on its lock)."""
    built = Path(os.environ.get("TORCH_EXTENSIONS_DIR", extensions_dir())) / name
    if os.environ.get("LOCAL_RANK", "0") == "0" and not finished(name, built):
        cost = CPU_OP_COST if name == CPU_OP else "minutes of the compiler"
        print(
            f"building {what} into {built.parent} (once per environment and torch build; {cost})...",
            file=sys.stderr,
            flush=True,
        )


def announce_cpu_build() -> None:
    announce_build(CPU_OP, CPU_OP_WHAT)


def announce_jit_builds() -> None:
    """Every DeepSpeed op JIT-built in this process (its CPU comm op, an optimizer's fused
    kernel on a GPU) says so before its compiler starts."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    original = OpBuilder.jit_load
    if getattr(original, "announces", False):
        return

    def jit_load(self, verbose=True):
        built = Path(os.environ.get("TORCH_EXTENSIONS_DIR", extensions_dir())) / self.name
        module = load_built(self.name, built)
        if module is None:
            what = CPU_OP_WHAT if self.name == CPU_OP else f"DeepSpeed's {self.name} op"
            announce_build(self.name, what)  # before waiting on another process's build
            with _sole_builder(self.name):
                module = load_built(self.name, built)  # built by the process waited on
                if module is None:
                    if drop_unloadable(self.name, built):
                        announce_build(self.name, what)
                    return original(self, verbose)
        OpBuilder._loaded_ops[self.name] = module  # as its own load() does
        return module

    jit_load.announces = True
    OpBuilder.jit_load = jit_load


def finished(name: str, built: Path) -> bool:
    """Whether `built` holds a finished build of op `name`: its .so, and ninja's log of linking
    it (a build killed midway may leave a .so without that line)."""
    log = built / ".ninja_log"
    return (
        (built / f"{name}.so").is_file() and log.is_file() and f"\t{name}.so\t" in log.read_text()
    )


def load_built(name: str, built: Path):
    """Op `name`'s module from a finished build in `built` (the .so, and ninja's log of linking
    it), or None. Loaded as it is, without torch's JIT builder: that builder runs ninja in every
    process, and ninja rebuilds (CPU_OP_COST, every other process waiting on its lock)
    whenever its compile command differs from the last one in any way, as it does between some
    of the processes that share this cache. The cache is per torch, DeepSpeed and Python ABI
    (`keyed`), so the sources and the ABI are those it was built for; a module that fails to
    load is rebuilt (`drop_unloadable`)."""
    import importlib.util

    if not finished(name, built):
        return None
    spec = importlib.util.spec_from_file_location(name, built / f"{name}.so")
    if spec is None or spec.loader is None:
        return None
    try:
        module = importlib.util.module_from_spec(spec)  # an extension module loads here
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module


def drop_unloadable(name: str, built: Path) -> bool:
    """Remove a finished build of op `name` in `built` that does not load (another torch's,
    found `undefined symbol`; a truncated file), so that it is built again: ninja, finding its
    outputs newer than its inputs, would keep it, and torch's loader would fail on it as a
    traceback. True when there was one. Called holding the op's lock (`_sole_builder`)."""
    if not finished(name, built):
        return False
    for entry in built.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return True


@contextlib.contextmanager
def _sole_builder(name: str):
    """Hold an OS lock (released when its process dies) around a JIT load of op `name`. Inside
    it, a baton file torch's builder left (`<op>/lock`: a build killed midway, which every
    later load would wait on for good) is stale, and is removed."""
    from filelock import FileLock

    built = Path(os.environ.get("TORCH_EXTENSIONS_DIR", extensions_dir())) / name
    built.mkdir(parents=True, exist_ok=True)
    with FileLock(str(built.parent / f"{name}.holder.lock")):
        (built / "lock").unlink(missing_ok=True)
        yield


def build_extensions() -> None:
    """JIT-build DeepSpeed's CPU shared-memory comm op now (`make setup` calls this), so the first
    training run or test does not spend its minutes in gcc, or hang on a lock a killed build left."""
    use_extensions_dir()
    if not on_cpu():
        return
    say_deepspeed_accelerator()
    announce_jit_builds()
    from deepspeed.comm.torch import build_shm_op

    if build_shm_op() is None:
        raise RuntimeError(
            "DeepSpeed reports its CPU shm_comm op as incompatible with this machine"
        )


# Lines of DeepSpeed 0.19.8 under torch 2.13 that ask nothing of the user. WarmupDecayLR asks for
# its lr before step 0 and warns of it, and repeats the warm-up warning the config check says
# first (train/config.py); its CPU comm op prints "built successfully" from each rank at every
# start (it was loaded, not built); its ZeRO gather calls a torch collective that torch deprecates.
# Upstream (deepspeedai/DeepSpeed), as of 2026-11-27: no issue for any of them; closest: the lr
# read before step 0, https://github.com/deepspeedai/DeepSpeed/pull/310, and the same deprecation
# warning in another library, https://github.com/huggingface/accelerate/issues/4269.
DEEPSPEED_NOISE = (
    "Attempting to get learning rate from scheduler before it has started",
    "is less than warmup_num_steps",
)
SHM_OP_LOADED = re.compile(r"^DeepSpeed \S+ built successfully$")
TORCH_DEPRECATION = r"`torch\.distributed\.all_gather_into_tensor` is deprecated"


class _DropDeepSpeedNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in DEEPSPEED_NOISE)


@contextlib.contextmanager
def _without_op_loaded_lines():
    """What the block prints to stdout, less DeepSpeed's "built successfully" lines."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        kept = [x for x in printed.getvalue().splitlines() if not SHM_OP_LOADED.match(x)]
        if kept:
            print("\n".join(kept), flush=True)


def quiet_other_ranks() -> None:
    """Warnings once per node, and none that ask nothing of the user (`DEEPSPEED_NOISE`): its
    local rank 0 says Python's and DeepSpeed's warnings, the node's other ranks (which would
    repeat them word for word) keep only DeepSpeed's errors."""
    deepspeed_log = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropDeepSpeedNoise) for f in deepspeed_log.filters):
        deepspeed_log.addFilter(_DropDeepSpeedNoise())
    warnings.filterwarnings("ignore", TORCH_DEPRECATION, FutureWarning)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        return
    warnings.simplefilter("ignore")
    warnings.showwarning = lambda *args, **kwargs: None  # filters added later by libraries too
    deepspeed_log.setLevel(logging.ERROR)


def init_distributed(timeout_s: float | None = None) -> tuple[int, int]:
    """(rank, world_size) after joining the process group (gloo on CPU, nccl on GPUs). A
    collective that waits on a peer for `timeout_s` (`run.collective_timeout_s`) fails: gloo
    raises, and NCCL's watchdog aborts the communicator and the process."""
    use_extensions_dir()
    # NCCL: a timed-out collective tears the process down instead of leaving it blocked
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    say_deepspeed_accelerator()  # no "Setting accelerator to CPU" warning from each rank
    import deepspeed

    quiet_other_ranks()
    alone = single_process_env()
    announce_jit_builds()
    if not alone:
        own_port_on_one_host()
    rendezvous = {"init_method": _file_store(), "rank": 0, "world_size": 1} if alone else {}
    with _without_op_loaded_lines():
        deepspeed.init_distributed(
            dist_backend="gloo" if on_cpu() else "nccl",
            timeout=COLLECTIVE_TIMEOUT if timeout_s is None else timedelta(seconds=timeout_s),
            **rendezvous,
        )
    if on_cpu():
        release_shm_names()
    if on_cpu() and "OMP_NUM_THREADS" not in os.environ:
        # ranks on one host share its cores; oversubscribed BLAS threads make every rank slower
        local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))
    if not on_cpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def shm_name(rank: int) -> Path:
    """The /dev/shm file of DeepSpeed's CPU allreduce for `rank` of this job (MASTER_ADDR and
    MASTER_PORT): a 64 MiB segment per rank, when all ranks share a host."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_names() -> None:
    """DeepSpeed's CPU allreduce creates a 64 MiB /dev/shm segment per rank and never unlinks it:
    each job on a new port left 64 MiB per rank of RAM (tmpfs) taken until the machine rebooted.
    Every rank maps every peer's segment while the process group starts, so once all ranks are
    past that (a barrier) each one unlinks its own name; the mappings stay valid, and no name is
    left behind even if the job is killed. Upstream: no deepspeedai/DeepSpeed issue as of
    2026-11-27; the same leak met elsewhere: https://github.com/sgl-project/sglang/pull/38638."""
    torch.distributed.barrier()
    shm_name(torch.distributed.get_rank()).unlink(missing_ok=True)


def contiguous_gradients(stage: int, world_size: int) -> bool:
    """DeepSpeed's `contiguous_gradients` for ZeRO-1/2: off for ZeRO-1 on one rank, where its
    bucket only adds a copy of every gradient and a buffer of reduce_bucket_size elements (two
    with overlap_comm) that nothing is reduced into (bert-base bf16: 203 backward ops and
    954 MiB fewer, `tools/bench/count_ops.py --zero-options`); on with more ranks, where it is
    DeepSpeed's reduce-scatter path (without it DeepSpeed all-reduces whole gradients), and for
    ZeRO-2, which partitions the gradients through it."""
    return not (stage == 1 and world_size == 1)


# The reduction bucket's cap is rounded up to this many elements
BUCKET_ROUNDING = 1 << 20


def fit_reduce_bucket(ds_config: dict, model: nn.Module) -> dict:
    """`ds_config` with ZeRO-1/2's `reduce_bucket_size` at most the model's trainable parameter
    count (rounded up to BUCKET_ROUNDING elements). DeepSpeed 0.19.8 allocates the whole bucket
    as each backward starts (twice with `overlap_comm`) whatever the model; it reduces a bucket
    when the next gradient would overflow it, and at the backward's end, so a bucket that holds
    every gradient is reduced once, at the end, as a larger one was: the same collectives in
    less memory (bert-base fp16 on 8 GPUs: 2 x 210 MiB where the default 5e8 elements took 2 x
    954 MiB)."""
    zero = ds_config.get("zero_optimization", {})
    if zero.get("stage") not in (1, 2) or "reduce_bucket_size" not in zero:
        return ds_config
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    cap = -(-numel // BUCKET_ROUNDING) * BUCKET_ROUNDING
    if int(zero["reduce_bucket_size"]) <= cap:
        return ds_config
    return {**ds_config, "zero_optimization": {**zero, "reduce_bucket_size": cap}}


def deepspeed_config(
    cfg: TrainConfig | EngineArgs, world_size: int, cpu: bool | None = None
) -> dict:
    """The DeepSpeed config dict of a run, from its typed config alone."""
    r = EngineArgs.of(cfg)
    o = r.optim
    cpu = on_cpu() if cpu is None else cpu
    if cpu and r.precision == "fp16":
        raise ConfigError(
            "fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16); use bf16 or fp32 here"
        )
    scheduler = {
        "type": "WarmupDecayLR" if o.decay == "linear" else "WarmupLR",
        "params": {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": o.lr,
            "warmup_num_steps": o.warmup_steps,
            "warmup_type": "linear",
        },
    }
    if o.decay == "linear":
        scheduler["params"]["total_num_steps"] = (
            r.max_steps
        )  # eq. of §A.2: linear decay to 0 at the last step
    if not deepspeed_schedule(cfg):
        scheduler = None  # build_engine passes train/schedule.py's (a client scheduler)
    zero = {"stage": r.zero_stage}
    if r.zero_stage in (1, 2):
        zero.update(
            overlap_comm=not cpu,
            contiguous_gradients=contiguous_gradients(r.zero_stage, world_size),
            reduce_scatter=True,
            allgather_bucket_size=int(5e8),
            reduce_bucket_size=int(5e8),
        )
    if r.zero_stage == 3:
        zero.update(
            overlap_comm=not cpu,
            contiguous_gradients=True,
            stage3_gather_16bit_weights_on_model_save=False,
        )
    built = {
        "train_micro_batch_size_per_gpu": r.micro_batch,
        "gradient_accumulation_steps": r.grad_accum,
        "train_batch_size": r.micro_batch * r.grad_accum * world_size,
        "gradient_clipping": o.grad_clip,
        **({"scheduler": scheduler} if scheduler else {}),
        "fp16": {
            "enabled": r.precision == "fp16",
            "loss_scale": 0,  # 0 = dynamic loss scaling
            "initial_scale_power": o.initial_scale_power,
            "loss_scale_window": o.loss_scale_window,
            "hysteresis": 2,
            "min_loss_scale": o.min_loss_scale,
        },
        # bf16 keeps DeepSpeed's overflow check on: without it a NaN gradient is applied.
        # Its per-tensor pass is left out at ZeRO-1/2 by `guard_nonfinite_steps`.
        "bf16": {"enabled": r.precision == "bf16"},
        "zero_optimization": zero,
        "steps_per_print": 10**12,  # the trainer logs; DeepSpeed's own step prints are noise
        "wall_clock_breakdown": False,
    }
    if cpu or o.impl == "deepspeed":
        # DeepSpeed builds the optimizer: torch.optim.AdamW on a CPU (`torch_adam`: no C++/CUDA
        # op to build), its JIT-built FusedAdam on a GPU. Otherwise build_engine passes torch's
        # fused AdamW as a client optimizer (`client_optimizer`).
        built["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": o.lr,
                "betas": list(o.betas),
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                "torch_adam": cpu,
            },
        }
    return built


def deepspeed_schedule(cfg: TrainConfig | EngineArgs) -> bool:
    """Whether DeepSpeed's config describes the run's schedule: a linear or constant decay over
    a fixed run.max_steps; other decays and budgeted runs get train/schedule.py's (finetuning's
    EngineArgs have no budget)."""
    budget = getattr(getattr(cfg, "run", None), "budget_hours", None)
    return cfg.optim.decay in DEEPSPEED_DECAYS and budget is None


def merge(base: dict, override: dict) -> dict:
    """Recursive dict merge: `override` wins, nested dicts merge."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolved_deepspeed_config(
    cfg: TrainConfig | EngineArgs, world_size: int, cpu: bool | None = None
) -> dict:
    """The built config, with `deepspeed_config` (a JSON file) merged over it."""
    built = deepspeed_config(cfg, world_size, cpu)
    path = EngineArgs.of(cfg).deepspeed_config
    if not path:
        return built
    try:
        override = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"--deepspeed-config {path}: {err}") from err
    merged = merge(built, override)
    batch = (
        merged["train_micro_batch_size_per_gpu"]
        * merged["gradient_accumulation_steps"]
        * world_size
    )
    if merged.get("train_batch_size") != batch:
        merged["train_batch_size"] = (
            batch  # the launcher's world size decides; keep DeepSpeed's identity true
        )
    return merged


def _no_decay(model: nn.Module) -> set[int]:
    """Biases and LayerNorm weights: §A.2 (as BERT) exempts them from weight decay."""
    exempt = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name.endswith("bias") or isinstance(module, nn.LayerNorm):
                exempt.add(id(p))
    return exempt


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    exempt = _no_decay(model)
    params = {id(p): p for p in model.parameters() if p.requires_grad}  # tied weights once
    decay = [p for i, p in params.items() if i not in exempt]
    no_decay = [p for i, p in params.items() if i in exempt]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def client_optimizer(groups: list[dict], optim) -> torch.optim.Optimizer:
    """torch's AdamW with its fused CUDA kernel (shipped compiled in torch: nothing to build for
    the user's CUDA or arch), §A.2's hyper-parameters."""
    return torch.optim.AdamW(
        groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, fused=True
    )


def cuda_arch_list_for_jit() -> None:
    """DeepSpeed's op builder parses TORCH_CUDA_ARCH_LIST as numbers and dies on the arch
    suffixes nvcc accepts (`9.0a`): keep the numbers for its JIT build (FusedAdam)."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if archs:
        cleaned = [a.rstrip("abf+PTX").rstrip("+") for a in archs.replace(";", " ").split()]
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(dict.fromkeys(a for a in cleaned if a))


def build_engine(
    model: nn.Module, cfg: TrainConfig | EngineArgs, ds_config: dict, plan: Plan | None = None
):
    """deepspeed.initialize with the scheduler of `ds_config` (or `plan`'s, train/schedule.py),
    and its optimizer when it names one; else torch's fused AdamW as a client optimizer (a GPU,
    `optim.impl: torch`)."""
    import deepspeed

    groups = param_groups(model, cfg.optim.weight_decay)
    ds_config = fit_reduce_bucket(ds_config, model)
    if "optimizer" in ds_config:
        cuda_arch_list_for_jit()
        optimizer = None
    else:
        optimizer = client_optimizer(groups, cfg.optim)
    if ds_config.get("zero_optimization", {}).get("stage") == 3:
        zero3_leaf_blocks(model)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=groups if optimizer is None else None,
        optimizer=optimizer,
        lr_scheduler=None if plan is None else client_scheduler(cfg.optim, plan),
        config=ds_config,
    )
    guard_nonfinite_steps(engine)
    streamline_zero(engine.optimizer)
    one_pass_step(engine.optimizer, cfg.optim.impl)
    return engine


def one_pass_step(optimizer, impl: str) -> None:
    """bf16 ZeRO-1/2's step in one kernel a parameter group (train/master_step.py) for
    `optim.impl` `master`, and for `auto` where it applies; a `master` it cannot serve is an
    error that says why."""
    from shatter.train import master_step

    if impl not in master_step.MASTER_IMPLS:
        return
    why = master_step.unsupported(optimizer)
    if why is None:
        master_step.install(optimizer)
    elif impl == "master":
        raise ConfigError(f"optim.impl master: {why}; set optim.impl to auto or torch")


def zero3_leaf_blocks(model: nn.Module) -> None:
    """ZeRO-3 gathers a module's parameters as its own forward starts; a Block makes its layer's
    folded weights from its submodules' parameters (shatter/attention/layer_weights.py) before
    calling them, so each Block is a ZeRO-3 leaf: all its parameters are gathered on entry (and
    the encoder leaves the batched all-layer weight products to the blocks: model.py)."""
    from deepspeed.utils import set_z3_leaf_modules

    from shatter.model import Block

    set_z3_leaf_modules(model, [Block])


def loss_scale(engine) -> float | None:
    """The current fp16 dynamic loss scale, or None when there is none. Every DeepSpeed wrapper
    (FP16_Optimizer, FP16_UnfusedOptimizer, ZeRO-1/2/3) has a `loss_scale` property; some also
    `cur_scale`, or a `loss_scaler`."""
    if not engine.fp16_enabled():
        return None
    optimizer = engine.optimizer
    for owner, name in ((optimizer, "loss_scale"), (optimizer, "cur_scale")):
        scale = getattr(owner, name, None)
        if isinstance(scale, int | float) or torch.is_tensor(scale):
            return float(scale)
    scale = getattr(getattr(optimizer, "loss_scaler", None), "cur_scale", None)
    return float(scale) if scale is not None else None


class FiniteStepGuard:
    """Skips an optimizer step whose gradients are not all finite, for the one optimizer DeepSpeed
    does not wrap (fp32 at ZeRO-0: its fp16/bf16 wrappers and ZeRO optimizers skip such a step
    themselves and count it in `engine.skipped_steps`). Installed over the optimizer's `step`.
    torch's fused AdamW (a GPU) takes the verdict as `found_inf`, a device tensor: the step is
    skipped on the device, with no host sync, and the count stays on the device too; any other
    optimizer (a CPU, where a read costs nothing) is skipped on the host, and DeepSpeed counts
    it through the optimizer's `overflow` (and holds its lr schedule, as for an fp16 overflow)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer, self.step = optimizer, optimizer.step
        self.on_device = all(g.get("fused") for g in optimizer.param_groups)
        self.skipped = None  # device-side count of skipped steps (fused path)
        optimizer.overflow = False
        optimizer.step = self

    def __call__(self, closure=None):
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"]]
        grads = [g for g in grads if g is not None]
        if not grads:
            return self.step(closure)
        total = torch.stack(torch._foreach_norm(grads)).sum()  # NaN/inf if any element is
        bad = (~torch.isfinite(total)).to(torch.float32)
        if self.on_device:
            self.skipped = bad if self.skipped is None else self.skipped + bad
            # torch's fused kernels skip the update (and undo the step count) where it is 1
            self.optimizer.found_inf = bad
            try:
                return self.step(closure)
            finally:
                self.optimizer.found_inf = None
        self.optimizer.overflow = bool(bad)
        if not self.optimizer.overflow:
            return self.step(closure)
        return None


def guard_nonfinite_steps(engine) -> None:
    """A non-finite step is skipped at every stage and precision, at the least cost.

    - fp32 at ZeRO-0: DeepSpeed has no wrapper of its own; `FiniteStepGuard` is installed.
    - bf16 at ZeRO-1/2: DeepSpeed's overflow check first tests every gradient tensor (~8 kernels
      each: ~2,600 ops and 2 host reads a bert-base step), then computes the global norm and
      tests it. The norm is NaN or inf (or its helpers' -1) whenever any gradient is, so the
      norm's test alone decides: the per-tensor pass is made a no-op on this one optimizer.
      (With the check off in the config, DeepSpeed skips the norm's test too and applies a NaN
      step.) tests/train/test_ranks.py injects a NaN at every stage; tools/bench/count_ops.py counts.
      Upstream: no deepspeedai/DeepSpeed issue for the pass's cost as of 2026-11-27; closest: the
      check without a host read per tensor, https://github.com/deepspeedai/DeepSpeed/pull/5115,
      and bf16's check on by default, https://github.com/deepspeedai/DeepSpeed/pull/8035.
    """
    if engine.zero_optimization_stage() == 0 and engine.optimizer is engine.basic_optimizer:
        FiniteStepGuard(engine.optimizer)
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if getattr(scaler, "raise_error_at_min_scale", False):  # fp16 ZeRO: `LossScaleStall` stops
        scaler.raise_error_at_min_scale = False  # the run, in one line, instead of this raise
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    if (
        isinstance(optimizer, DeepSpeedZeroOptimizer)
        and optimizer.dtype == torch.bfloat16
        and optimizer.check_grad_overflow
        and optimizer.compute_grad_norm
    ):
        optimizer.check_overflow = lambda partition_gradients=True: None


def streamline_zero(optimizer) -> None:
    """DeepSpeed 0.19.8's ZeRO-1/2 step with fewer kernels and no host read but the skip's,
    the same values: the global norm in one multi-tensor norm (`fuse_grad_norm`), the clip on
    the device (`clip_without_host_reads`), bf16's skip of a non-finite step on the device
    (`skip_on_the_device`), the partition's gradients flattened straight into fp32
    (`flatten_into_fp32`), and on one rank no reduction of the gradients
    (`skip_one_rank_reduction`)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        fuse_grad_norm(optimizer)
        clip_without_host_reads(optimizer)
        skip_on_the_device(optimizer)  # wraps the clip: installed after it
        flatten_into_fp32(optimizer)
        skip_one_rank_reduction(optimizer)


def flatten_into_fp32(optimizer) -> None:
    """ZeRO-1/2's step flattens the rank's gradients of each parameter group into one
    low-precision buffer (a `cat`), then casts that to the fp32 master's dtype (a second pass
    over it); here each group's gradients are copied straight into a flat buffer of the master's
    dtype by one multi-tensor copy that casts as it goes (`_foreach_copy_`), zero-padded to the
    partition's size as DeepSpeed's aligned flatten pads it. It is given to DeepSpeed through
    its hook for a gradient partition flattened beforehand (`_get_preflattened_grad_partition`),
    whose cast to the master's dtype is then a no-op. bert-base bf16: 0.44 GB a step less read
    and written, and no bf16 copy held beside the fp32 one. Bit for bit DeepSpeed's
    (tests/train/test_fused_step.py)."""
    own = optimizer._get_preflattened_grad_partition

    def _get_preflattened_grad_partition(i):
        flat = own(i)
        grads = optimizer.averaged_gradients[i]
        if flat is not None or not grads:
            return flat
        master = optimizer.single_partition_of_fp32_groups[i]
        size, numel = int(optimizer.partition_size[i]), sum(g.numel() for g in grads)
        flat = torch.empty(max(size, numel), dtype=master.dtype, device=master.device)
        if numel < size:
            flat[numel:].zero_()
        pieces = flat[:numel].split([g.numel() for g in grads])
        torch._foreach_copy_(list(pieces), [g.reshape(-1) for g in grads])
        return flat

    optimizer._get_preflattened_grad_partition = _get_preflattened_grad_partition


def skip_one_rank_reduction(optimizer) -> None:
    """On one data-parallel rank, without contiguous gradients (ZeRO-1 on one GPU:
    `contiguous_gradients`), DeepSpeed still "all-reduces" each bucket of gradients: it
    flattens them into one buffer, divides by the world size (1) and copies every gradient
    back (a `cat` and a copy per tensor: bert-base 204 backward ops) for values it leaves
    unchanged. That fallback is skipped there; everything else (the buckets' bookkeeping, the
    partition's gradients read at the step) is DeepSpeed's."""
    from deepspeed import comm as dist

    if (
        optimizer.contiguous_gradients
        or optimizer.cpu_offload
        or getattr(optimizer, "sequence_parallel_size", 1) != 1
        or dist.get_world_size(group=optimizer.dp_process_group) != 1
    ):
        return
    optimizer.buffered_reduce_fallback = lambda *args, **kwargs: None


def fuse_grad_norm(optimizer) -> None:
    """ZeRO-1/2's global gradient norm in a few kernels. DeepSpeed 0.19.8 takes a norm per
    parameter group (`get_grad_norm_direct`: each gradient tensor cast to fp32 and measured on
    its own, two kernels a tensor, ~380 of the ~490 ops of a bert-base step; then an invalid
    norm masked to -1), and combines the groups' norms in a dozen one-element kernels more
    (`scaled_global_norm`). Here one multi-tensor `_foreach_norm` over every group's gradients
    (accumulating in fp32 as the cast did), the squares summed by one `dot` of the norms (on
    CUDA they are one buffer's elements: `joined`) and all-reduced over the data-parallel group
    as DeepSpeed's, the root, and a NaN norm set to inf as DeepSpeed's combination sets an
    invalid one (the step is then skipped): three kernels after the norm's. Only where each
    gradient counts once and the groups are plain: no CPU offload, no model parallelism, no
    parameter a pipeline replicates, no MoE or Muon groups (else DeepSpeed's own norm). Equal
    to it to fp32 rounding (tests/train/test_fused_step.py). The sum of squares before its root
    is `optimizer.global_grad_squares()` (train/master_step.py takes it from there)."""
    from deepspeed import comm as dist

    params = [p for group in optimizer.bit16_groups for p in group]
    replicated = any(getattr(p, "ds_pipe_replicated", False) for p in params)
    muon = "muon" in type(optimizer.optimizer).__name__.lower()  # its updates' own scaling
    if (
        optimizer.cpu_offload
        or optimizer.model_parallel_group is not None
        or replicated
        or optimizer.has_moe_layers
        or muon
    ):
        return
    own = optimizer.scaled_global_norm

    def global_grad_squares() -> torch.Tensor | None:
        """The sum of the gradients' squares over the data-parallel group (None: no gradient)."""
        grads = [
            g
            for i in range(len(optimizer.bit16_groups))
            for g in optimizer.averaged_gradients.get(i) or ()
            if not getattr(g, "_zero_padding", False)
        ]
        if not grads:
            return None
        norms = joined(torch._foreach_norm(grads, 2, dtype=torch.float32))
        squares = torch.dot(norms, norms)
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
        return squares

    def scaled_global_norm(norm_type=2):
        squares = global_grad_squares() if float(norm_type) == 2.0 else None
        if squares is None:
            return own(norm_type)
        inf = float("inf")
        return squares.sqrt().nan_to_num(nan=inf, posinf=inf)

    optimizer.global_grad_squares = global_grad_squares
    optimizer.scaled_global_norm = scaled_global_norm


def joined(scalars: list[torch.Tensor]) -> torch.Tensor:
    """The 0-d tensors as one 1-D tensor: `_foreach_norm`'s results on CUDA are the elements of
    one buffer in order (then that buffer, no copy), else they are stacked."""
    base = scalars[0]._base
    if (
        base is not None
        and base.dim() == 1
        and base.numel() == len(scalars)
        and all(s._base is base and s.storage_offset() == i for i, s in enumerate(scalars))
    ):
        return base
    return torch.stack(scalars)


def clip_without_host_reads(optimizer) -> None:
    """ZeRO-1/2's unscale and clip without reading the norm on the host, once a step: DeepSpeed
    0.19.8's `unscale_and_clip_grads` first tests the norm's validity in Python
    (`is_invalid_grad_norm`: a host read, once per parameter group, each a wait for the GPU)
    though `step` has already skipped a step whose norm is invalid, and makes the factor anew
    for each group. Here the factor is made on the device once for the norm the groups share,
    an invalid norm taken as infinite as DeepSpeed takes it: grad / (loss scale · max(1, (norm
    / loss scale + 1e-6) / clip)). Where the client optimizer is torch's fused AdamW, the
    factor is its `grad_scale` (its kernel divides each gradient as it reads it, as for torch's
    GradScaler) instead of a pass that multiplies the flat fp32 gradient (bert-base: 0.44 GB
    read and written a step). Equal to DeepSpeed's (tests/train/test_fused_step.py)."""
    client = optimizer.optimizer
    scaled = _fused_client(optimizer)
    made: dict = {}  # the last norm and its factor

    def unscale_and_clip_grads(grad_groups_flat, total_norm):
        scale, clip_grad = optimizer.loss_scale, optimizer.clip_grad
        if scaled:
            client.grad_scale = None
        if clip_grad == 0.0 and scale == 1.0:
            return
        if clip_grad > 0.0 and made.get("norm") is not total_norm:
            factor = _clip_factor(total_norm, scale, clip_grad, optimizer.device)
            made.update(norm=total_norm, factor=factor)
        combined = made["factor"] if clip_grad > 0.0 else scale
        if scaled and clip_grad > 0.0:
            client.grad_scale = combined
            return
        for grad in grad_groups_flat:
            for g in grad if isinstance(grad, list) else [grad]:
                g.data.mul_(1.0 / combined)

    optimizer.unscale_and_clip_grads = unscale_and_clip_grads


def _fused_client(optimizer) -> bool:
    """Whether ZeRO's client optimizer is torch's fused Adam(W) on the device, stepped by ZeRO
    itself: its kernel takes `grad_scale` and `found_inf` tensors."""
    client = optimizer.optimizer
    return (
        isinstance(client, torch.optim.Adam | torch.optim.AdamW)
        and all(g.get("fused") for g in client.param_groups)
        and not getattr(optimizer, "torch_autocast_gradscaler", None)
        and not optimizer.cpu_offload
    )


def skip_on_the_device(optimizer) -> None:
    """bf16 ZeRO-1/2 with torch's fused AdamW: a step whose global norm is not finite (a NaN or
    inf gradient anywhere; the norm is all-reduced, so every rank agrees) is skipped by the
    optimizer's kernel on the device, its `found_inf`: no weight or moment is updated and the
    step count is kept. DeepSpeed 0.19.8 reads the norm's validity on the host to skip it
    (`is_invalid_grad_norm` in `step`, its one host read a step: the host waits for the
    backward to finish before it launches the optimizer's kernels and the next forward's), so
    its test is turned off (`check_grad_overflow`) on this optimizer only. The skipped steps are
    counted on the device (`skipped_on_device`), folded into `engine.skipped_steps` by
    `skipped_steps` at log steps and checkpoints; the lr schedule moves on over a skipped step
    (DeepSpeed holds it). Elsewhere (fp16's loss scale, another client optimizer) DeepSpeed's
    test stays."""
    if not (
        optimizer.dtype == torch.bfloat16
        and optimizer.check_grad_overflow
        and optimizer.compute_grad_norm
        and _fused_client(optimizer)
    ):
        return
    optimizer.check_grad_overflow = False
    optimizer.skipped_on_device = None
    clip, client = optimizer.unscale_and_clip_grads, optimizer.optimizer
    last: dict = {}  # the last norm and its verdict

    def unscale_and_clip_grads(grad_groups_flat, total_norm):
        if last.get("norm") is not total_norm:  # once a step: the groups share the norm
            norm = _norm_tensor(total_norm, optimizer.device)
            bad = ((norm >= 0) & (norm < float("inf"))).logical_not().float()  # NaN fails both
            last.update(norm=total_norm, bad=bad)
            seen = optimizer.skipped_on_device
            optimizer.skipped_on_device = bad if seen is None else seen + bad
        client.found_inf = last["bad"]
        clip(grad_groups_flat, total_norm)

    optimizer.unscale_and_clip_grads = unscale_and_clip_grads


def _norm_tensor(total_norm, device) -> torch.Tensor:
    """DeepSpeed's global norm (a tensor, or a float where its helpers give one) as an fp32
    tensor on the device."""
    return torch.as_tensor(total_norm, dtype=torch.float, device=device)


def _clip_factor(total_norm, scale: float, clip_grad: float, device) -> torch.Tensor:
    """DeepSpeed's combined unscale and clip factor, made on the device in a few one-element
    kernels: loss scale · max(1, (norm / loss scale + 1e-6) / clip), an invalid norm (NaN, inf,
    its helpers' -1: all fail `norm >= 0` but inf) infinite; no division or product by a loss
    scale of 1 (bf16)."""
    norm = _norm_tensor(total_norm, device)
    norm = torch.where(norm >= 0, norm, float("inf"))
    factor = torch.clamp(((norm if scale == 1.0 else norm / scale) + 1e-6) / clip_grad, min=1.0)
    return factor if scale == 1.0 else factor * scale


def skipped_steps(engine) -> int:
    """Optimizer steps skipped so far for non-finite gradients or an fp16 overflow, by
    DeepSpeed's wrappers, by `FiniteStepGuard` or on the device (`skip_on_the_device`), whose
    device-side counts it folds into `engine.skipped_steps` (which DeepSpeed's checkpoints
    keep). One host read: call it at log steps and checkpoints."""
    guard = getattr(engine.optimizer, "step", None)
    if isinstance(guard, FiniteStepGuard) and guard.skipped is not None:
        engine.skipped_steps += int(guard.skipped.item())
        guard.skipped = None
    on_device = getattr(engine.optimizer, "skipped_on_device", None)
    if on_device is not None:
        engine.skipped_steps += int(on_device.item())
        engine.optimizer.skipped_on_device = None
    return int(engine.skipped_steps)


def first_nonfinite_output(module: nn.Module, inputs: dict) -> str | None:
    """The submodule whose output is the first to be non-finite in a forward of `inputs` (a
    hook fires as a module finishes, so the innermost one): one diagnostic forward, after a
    failure. Collective under ZeRO-3, like any forward."""
    found: list[str] = []

    def hook(name):
        def check(_module, _args, out):
            out = out[0] if isinstance(out, (tuple, list)) and out else out
            if not found and torch.is_tensor(out) and out.is_floating_point():
                if not torch.isfinite(out).all():
                    found.append(name)

        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in module.named_modules() if n]
    try:
        with torch.no_grad():
            module(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


class LossScaleStall:
    """fp16: optimizer steps skipped for an overflow, in a row. DeepSpeed's ZeRO loss scaler
    raises "Current loss scale already at minimum" once the scale, halved at each overflow, is
    at `min_loss_scale`: 18 overflows from 2**16 with hysteresis 2, long before the trainer's
    `run.max_nonfinite`. That raise is turned off (`guard_nonfinite_steps`); `check`, called at
    every step boundary (fp16 has read the overflow's verdict on the host already: no extra
    sync), says why the run must stop once `limit` steps in a row were skipped."""

    def __init__(self, engine, limit: int):
        self.engine, self.limit = engine, limit
        self.active = engine.fp16_enabled()
        self.seen = int(engine.skipped_steps) if self.active else 0
        self.run = 0

    def check(self, step: int, inputs: dict, batch: dict) -> str | None:
        """None, or the one line that stops the run: the layer whose output is first
        non-finite on the step's last micro-batch, or that batch when its forward is finite."""
        if not self.active:
            return None
        skipped = int(self.engine.skipped_steps)
        self.run = self.run + 1 if skipped > self.seen else 0
        self.seen = skipped
        if self.run < self.limit:
            return None
        layer = first_nonfinite_output(self.engine.module, inputs)
        rows = batch["sample_id"].tolist() if "sample_id" in batch else []
        what = (
            f"the first non-finite output of its last micro-batch is {layer}'s"
            if layer
            else "the forward of its last micro-batch is finite, its gradients overflow"
        )
        return (
            f"step {step}: {self.run} optimizer steps in a row skipped for an fp16 overflow "
            f"(loss scale {loss_scale(self.engine)}); {what} (rows {rows[:8]}); lower the lr, "
            "train in bf16, or resume from an earlier checkpoint"
        )
