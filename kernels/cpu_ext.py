"""The CPU kernels in kernels/csrc/, compiled for this machine on first use.

They cover what torch does badly on a CPU for decoding: attention that reads K/V
straight out of the paged cache (torch needs a gather first, which copies every
sequence's context once per layer), and the few-row matmuls of a decode step (MKL
is far from both the memory and the FMA limit below ~64 rows).

The sources are built with the system C++ compiler (g++, -O3 -march=native, OpenMP
through ATen's parallel_for so torch.set_num_threads applies) by
torch.utils.cpp_extension into data/cpu_kernels/<hash> (see build_dir), where the hash
covers the sources, the compiler flags and this CPU's feature flags: a different
machine (or edited sources) gets its own build. `make setup` builds it once; a
machine without a compiler falls back to the torch paths, and says so once.

KVOPS_CPU_KERNELS=0 turns them off process-wide (the torch paths run instead). An engine
runs them as EngineConfig.cpu_kernels says: by default only on a CPU with AVX-512 (see
wanted). Whether prefill's many-row matmuls go to MKL or to the packed kernel too is
EngineConfig.large_matmuls (matmul_choice).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("paged_decode_attention.cpp", "paged_prefill_attention.cpp", "small_gemm.cpp",
           "fused_ops.cpp")
HEADERS = ("vec.h", "attention_args.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")

_lock = threading.Lock()
_state: dict[str, object] = {}


class CpuKernelsUnavailable(RuntimeError):
    """The CPU kernels could not be built or loaded here."""


def enabled() -> bool:
    return os.environ.get("KVOPS_CPU_KERNELS", "1") not in ("0", "false", "no")


def available() -> bool:
    """True when the kernels are built and loaded (building them if needed)."""
    if not enabled():
        return False
    try:
        ops()
    except CpuKernelsUnavailable:
        return False
    return True


def wanted(mode: str) -> bool:
    """Whether EngineConfig.cpu_kernels asks for the kernels: "on", "off", or "auto":
    where the CPU has AVX-512. They are written for it: small_gemm.cpp's tiles and the
    attention kernels' 16-float vectors assume 32 vector registers, and with AVX2's 16
    they spill. On an AVX2 EPYC core the default model's decode step at 16 requests took
    0.87 s with them against 0.33 s on torch's paths, and its prefill 23 s against 4.3 s
    (with MKL doing the matmuls and the other kernels on: 0.39 s and 5.4 s)."""
    if mode == "auto":
        return "avx512f" in cpu_flags()
    return mode == "on"


def usable_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an engine on this device and dtype runs the kernels: float32 on a CPU,
    turned on, and built here."""
    return device.type == "cpu" and dtype == torch.float32 and available()


def ops():
    """torch.ops.kvops, with the CPU kernels registered. Raises CpuKernelsUnavailable
    (with the compiler's reason) when they cannot be built."""
    with _lock:
        if "error" in _state:
            raise CpuKernelsUnavailable(str(_state["error"]))
        if "ops" not in _state:
            try:
                _build_and_load()
                _state["ops"] = torch.ops.kvops
            except Exception as exc:  # a compiler error, a missing compiler, ...
                _state["error"] = exc
                print(f"kvops: CPU kernels unavailable ({_first_line(exc)}); "
                      "using the torch paths", file=sys.stderr, flush=True)
                raise CpuKernelsUnavailable(str(exc)) from exc
        return _state["ops"]


@dataclass(frozen=True, slots=True)
class MatmulChoice:
    """Who does the many-row matmuls of a prefill: MKL (torch.mm) or small_gemm's
    packed kernel. Which is faster depends on the CPU: on Intel MKL is ahead or even,
    on AMD it takes a path at about half of what the packed kernel reaches."""
    packed_gflops: float
    mkl_gflops: float
    source: str  # "measured" or the environment variable that decided

    @property
    def packed(self) -> bool:
        return self.packed_gflops > PACKED_MARGIN * self.mkl_gflops


# The packed kernel takes the many-row matmuls only when clearly faster: the two are
# timed for a few milliseconds, and a busy moment must not flip a close call.
PACKED_MARGIN = 1.1
CHOICE_SHAPE = (512, 1024, 1536)  # rows, K, N: a prefill-sized matmul of a small model


def matmul_choice(mode: str = "auto") -> MatmulChoice:
    """Who does prefill's many-row float32 matmuls (EngineConfig.large_matmuls): "mkl" or
    "packed" as said; "auto" by the CPU's maker (AMD: the packed kernel, as MKL takes a
    path at about half its rate there; others: MKL); "measure" times both on one
    prefill-sized matmul (best of a few, interleaved; once per process and thread count,
    about 50 ms), the faster by more than PACKED_MARGIN winning."""
    if mode in ("packed", "mkl"):
        return MatmulChoice(float(mode == "packed"), float(mode == "mkl"),
                            f"large_matmuls={mode}")
    if mode == "auto":
        packed = cpu_vendor() == "AuthenticAMD"
        return MatmulChoice(float(packed), float(not packed),
                            f"auto: {cpu_vendor() or 'unknown'} CPU")
    if mode != "measure":
        raise ValueError(f"large_matmuls={mode!r}: expected auto, mkl, packed or measure")
    key = ("choice", torch.get_num_threads())
    with _lock:
        cached = _state.get(key)
    if cached is None:
        cached = _measure_choice()
        with _lock:
            _state[key] = cached
    return cached


def cpu_flags() -> set[str]:
    """The CPU's feature flags (avx2, avx512f, ...), empty if unknown."""
    return set(_cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """The CPU's vendor_id (GenuineIntel, AuthenticAMD, ...), or "" if unknown."""
    return _cpuinfo_field("vendor_id")


def _cpuinfo_field(name: str) -> str:
    """The first processor's `name` line in /proc/cpuinfo, or "" if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == name:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _measure_choice() -> MatmulChoice:
    rates = time_matmuls(*CHOICE_SHAPE, repeats=5)
    return MatmulChoice(rates["kvops packed"] / 1e9, rates["torch.mm"] / 1e9, "measured")


def time_matmuls(m: int, k: int, n: int, repeats: int, dtype: torch.dtype = torch.float32,
                 packed: bool = True) -> dict[str, float]:
    """FLOP/s of x[m, k] @ w[k, n] by torch.mm and, with packed (float32, the kernels
    built), by the packed kernel: the fastest of `repeats` runs each, interleaved so
    that a busy moment slows both; the first round warms them up."""
    x, w_t = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    runs = {"torch.mm": lambda: torch.mm(x, w_t)}
    if packed:
        kv = ops()
        packed_w = kv.pack_weight(w_t)
        runs["kvops packed"] = lambda: kv.packed_linear(x, packed_w, n, None)
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats + 1):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return {name: 2 * m * k * n / seconds for name, seconds in best.items()}


def build_dir() -> Path:
    """$KVOPS_KERNEL_DIR/<hash>, by default data/cpu_kernels/<hash> in the checkout: with
    the code, not under KVOPS_DATA_DIR, so a service stack with its own data folder
    (tests, a second deployment) reuses the build instead of compiling again."""
    default = Path(__file__).resolve().parent.parent / "data" / "cpu_kernels"
    return Path(os.environ.get("KVOPS_KERNEL_DIR") or default) / _build_key()


def _build_key() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _build_and_load() -> None:
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    # torch's own build lock is a plain file that a build killed midway leaves behind,
    # and every later build then waits on it forever. Builders take this lock first (the
    # kernel drops it when its holder dies), so while it is held no other build is under
    # way and a `lock` file left in the directory is a dead build's: remove it.
    with open(directory.parent / f"{directory.name}.build-lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        _load(directory)


def _load(directory: Path) -> None:
    from torch.utils import cpp_extension

    # cpp_extension runs `ninja` from PATH; the virtualenv's (the ninja package) is not
    # on it unless the venv is activated.
    venv_bin = Path(sys.executable).parent
    if shutil.which("ninja") is None and (venv_bin / "ninja").exists():
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    cpp_extension.load(
        name="kvops_cpu_kernels",
        sources=[str(CSRC / name) for name in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def main() -> int:
    """python -m kernels.cpu_ext: build the kernels now (make setup does)."""
    try:
        ops()
    except CpuKernelsUnavailable as exc:
        print(f"CPU kernels not built: {exc}", file=sys.stderr)
        return 1
    print(f"CPU kernels built in {build_dir()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
