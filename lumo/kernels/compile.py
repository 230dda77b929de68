"""NVRTC: CUDA C++ source -> cubin (on-disk cache) -> loaded kernel launched on torch's current stream.

Compiling needs no GPU (CI compiles every .cu for sm_90 and sm_121a). Loading and launching initialise
the CUDA driver lazily, after torch has created its context, so `import lumo.kernels` works anywhere.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

KERNEL_DIR = Path(__file__).parent
DEFAULT_OPTIONS = ("--std=c++17", "-default-device")
_TEST_DEFINES = re.compile(r"^//\s*lumo:test-defines\s*(.*)$", re.MULTILINE)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message carries the kernel name, arch, options and full log."""


def cache_dir() -> Path:
    return Path(os.environ.get("LUMO_CACHE_DIR", "~/.cache/lumo/kernels")).expanduser()


def clean_cache() -> int:
    """Delete every cached cubin; returns how many files were removed."""
    d = cache_dir()
    n = 0
    if d.is_dir():
        for f in d.glob("*.cubin"):
            f.unlink(missing_ok=True)
            n += 1
    return n


def _check(result: tuple, what: str) -> tuple:
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return result[1:]


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    return tuple(_check(nvrtc.nvrtcVersion(), "nvrtcVersion"))


@functools.cache
def include_dirs() -> tuple[str, ...]:
    # cuda_bf16.h / vector_types.h come from the nvidia-cuda-runtime wheel; a system toolkit is the fallback.
    from cuda import pathfinder

    d = pathfinder.find_nvidia_header_directory("cudart")
    if d is None:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        d = str(Path(home) / "include") if (Path(home) / "include" / "cuda_bf16.h").is_file() else None
    if d is None:
        raise RuntimeError("CUDA runtime headers not found: pip install nvidia-cuda-runtime")
    return (d, str(KERNEL_DIR))


def compile_to_cubin(
    src: str, arch: str, options: Sequence[str] = (), name: str = "kernel.cu", log: list[str] | None = None
) -> bytes:
    """Compile CUDA C++ to a cubin for `arch` (e.g. "sm_90", "sm_121a"). Needs no GPU. `log`, if given,
    receives NVRTC's log of a successful compile (ptxas remarks such as wgmma serialisation land there)."""
    from cuda.bindings import nvrtc

    opts = [f"--gpu-architecture={arch}", *DEFAULT_OPTIONS, *(f"-I{d}" for d in include_dirs()), *options]
    (prog,) = _check(nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        # NVRTC writes into the buffers it is given: bytearrays, never bytes. (An immutable b" " * 1 is
        # CPython's shared one-byte object: an empty log's terminating NUL written there turned every b" "
        # of the process into b"\x00".)
        (log_size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log_bytes = bytearray(log_size)
        _check(nvrtc.nvrtcGetProgramLog(prog, log_bytes), "nvrtcGetProgramLog")
        text = log_bytes.decode(errors="replace").rstrip("\x00")
        if int(err) != 0:
            raise KernelCompileError(f"NVRTC failed on {name} for {arch} with options {opts}:\n{text}")
        if log is not None:
            log.append(text)
        (size,) = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _local_headers() -> bytes:
    # Included .cuh files change the cubin too, so they are part of the cache key.
    return b"".join(p.read_bytes() for p in sorted(KERNEL_DIR.glob("*.cuh")))


def cached_cubin(src: str, arch: str, options: Sequence[str] = (), name: str = "kernel.cu") -> bytes:
    """compile_to_cubin through the on-disk cache keyed by sha256(source, headers, options, arch, NVRTC)."""
    h = hashlib.sha256()
    for part in (src.encode(), _local_headers(), "\0".join(options).encode(), arch.encode()):
        h.update(part)
        h.update(b"\0\1")
    h.update(repr(nvrtc_version()).encode())
    path = cache_dir() / f"{Path(name).stem}-{arch}-{h.hexdigest()[:32]}.cubin"
    if path.is_file():
        return path.read_bytes()
    cubin = compile_to_cubin(src, arch, options, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Atomic publish: concurrent processes never see a half-written cubin.
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(cubin)
    os.replace(tmp, path)
    return cubin


def define_options(defines: Mapping[str, object] | None) -> tuple[str, ...]:
    return tuple(f"-D{k}={v}" for k, v in sorted((defines or {}).items()))


def compile_test_defines(path: Path) -> list[dict[str, str]]:
    """`// lumo:test-defines A=1 B=2` lines of a .cu file: the specialisations CI compiles (none -> [{}])."""
    sets = []
    for line in _TEST_DEFINES.findall(path.read_text()):
        sets.append(dict(kv.split("=", 1) for kv in line.split()))
    return sets or [{}]


def kernel_sources() -> list[Path]:
    return sorted(KERNEL_DIR.glob("**/*.cu"))


_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def kernel_params(source: str, name: str) -> tuple[str, ...]:
    """The parameter kinds of extern "C" kernel `name` in CUDA source text, in order: "ptr:T" (a pointer to
    T, its last type word: "ptr:float", "ptr:bf16", "ptr:u64"...), "i32" (int / unsigned), "i64" (long
    long), "f32" (float); what a launch's arguments must be (tests check the launchers against it without
    a GPU). A parameter list spelled as one object-like macro (a
    list several kernels share) is expanded."""
    text = _COMMENT.sub("", source.replace("\\\n", " "))
    macros = dict(re.findall(r"^[ \t]*#define[ \t]+(\w+)[ \t]+(.*)$", text, re.M))
    head = re.search(
        r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?'
        + re.escape(name)
        + r"\s*\(",
        text,
    )
    if head is None:
        raise KeyError(f'no extern "C" kernel {name}')
    depth, i = 1, head.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    listed = text[head.end() : i - 1].strip()
    listed = macros.get(listed, listed)
    params = [p.strip() for p in listed.split(",") if p.strip()]
    kinds = []
    for p in params:
        names = [w for w in re.findall(r"\w+", p.split("*")[0]) if w not in ("const", "volatile")]
        words = set(re.findall(r"\w+", p.split("=")[0]))
        if "*" in p:
            kinds.append("ptr:" + ("unsigned " if "unsigned" in names[:-1] else "") + names[-1])
        elif "float" in words:
            kinds.append("f32")
        elif "long" in words:
            kinds.append("i64")
        elif words & {"int", "unsigned", "u32"}:
            kinds.append("i32")
        else:
            raise ValueError(f"{name}: parameter {p!r} of a kind kernel_params does not know")
    return tuple(kinds)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 for any other device): launch-shape choices."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def arch_of(device: torch.device | int | None = None) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    # Arch-specific ("a") targets only where the family needs them for its fast instructions.
    suffix = "a" if major >= 10 else ""
    return f"sm_{major}{minor}{suffix}"


@dataclass
class Kernel:
    """A loaded kernel. `launch` reads torch's current stream at every call (graph capture needs that)."""

    name: str
    function: object  # CUfunction
    _max_shmem: list[int]
    sm_major: int = 0  # the cubin's architecture (PDL only for 9 and newer: pdl.cuh is a no-op below)
    _non_portable: list[bool] = field(default_factory=lambda: [False])  # cluster sizes > 8 allowed
    _cluster_sizes: dict = field(default_factory=dict)  # max_cluster_size's answers
    _occupancy: dict = field(default_factory=dict)  # blocks_per_sm's answers

    def launch(
        self,
        grid: tuple[int, ...] | int,
        block: tuple[int, ...] | int,
        args: Sequence[object],
        shmem: int = 0,
        pdl: bool = False,
        cluster: tuple[int, int, int] | None = None,
    ) -> None:
        """Launch on torch's current stream. pdl=True: with programmatic dependent launch when
        use_pdl() (the kernel must call pdl_wait() before it reads what earlier kernels write; pdl.cuh).
        cluster: thread-block cluster dims (sm_90+; above 8 CTAs the non-portable sizes are allowed)."""
        from cuda.bindings import driver as cu

        g = (grid,) if isinstance(grid, int) else tuple(grid)
        b = (block,) if isinstance(block, int) else tuple(block)
        g, b = g + (1,) * (3 - len(g)), b + (1,) * (3 - len(b))
        self._allow_shmem(shmem)
        values, types = [], []
        for a in args:
            if isinstance(a, torch.Tensor):
                values.append(a.data_ptr())
                types.append(ctypes.c_void_p)
            elif isinstance(a, bool):
                raise TypeError(f"{self.name}: pass bools as int")
            elif isinstance(a, int):
                values.append(a)
                types.append(ctypes.c_int)
            elif isinstance(a, float):
                values.append(a)
                types.append(ctypes.c_float)
            elif isinstance(a, ctypes._SimpleCData):
                values.append(a.value or 0)
                types.append(type(a))
            else:
                raise TypeError(f"{self.name}: unsupported kernel argument type {type(a).__name__}")
        stream = torch.cuda.current_stream().cuda_stream
        what = f"launch of {self.name} (grid {g}, block {b}, shmem {shmem}, attr max {self._max_shmem[0]})"
        params = (tuple(values), tuple(types))
        pdl = pdl and self.sm_major >= 9 and use_pdl()
        if cluster is not None:
            if self.sm_major < 9:
                raise RuntimeError(f"{self.name}: thread-block clusters need sm_90 or newer")
            if cluster[0] * cluster[1] * cluster[2] > 8:
                self._allow_non_portable_clusters()
            what += f", cluster {cluster}"
        if pdl or cluster is not None:
            cfg = _launch_config(g, b, shmem, stream, pdl, cluster)
            _check(cu.cuLaunchKernelEx(cfg, self.function, params, 0), what)
        else:
            _check(cu.cuLaunchKernel(self.function, *g, *b, shmem, stream, params, 0), what)

    def _allow_shmem(self, shmem: int) -> None:
        from cuda.bindings import driver as cu

        if shmem > 48 * 1024 and shmem > self._max_shmem[0]:
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(cu.cuFuncSetAttribute(self.function, attr, shmem), f"cuFuncSetAttribute({self.name})")
            self._max_shmem[0] = shmem

    def _allow_non_portable_clusters(self) -> None:
        """Clusters above 8 CTAs (H100 / H200 schedule 16). A device that refuses the attribute keeps the
        portable sizes; max_cluster_size then reports at most 8."""
        from cuda.bindings import driver as cu

        if not self._non_portable[0]:
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
            (err,) = cu.cuFuncSetAttribute(self.function, attr, 1)
            self._non_portable[0] = err == cu.CUresult.CUDA_SUCCESS

    def max_cluster_size(self, grid: tuple[int, int, int], block: int, shmem: int) -> int:
        """The largest thread-block cluster the device can schedule for this launch shape (the driver's
        occupancy query; non-portable sizes allowed where the device has them); 0 below sm_90 or on error.
        Cached per (block, shmem)."""
        from cuda.bindings import driver as cu

        key = (block, shmem)
        if key not in self._cluster_sizes:
            size = 0
            if self.sm_major >= 9:
                self._allow_shmem(shmem)
                self._allow_non_portable_clusters()
                cfg = _launch_config(grid, (block, 1, 1), shmem, 0, False, None)
                err, n = cu.cuOccupancyMaxPotentialClusterSize(self.function, cfg)
                size = n if err == cu.CUresult.CUDA_SUCCESS else 0
            self._cluster_sizes[key] = size
        return self._cluster_sizes[key]

    def blocks_per_sm(self, block: int, shmem: int) -> int:
        """CTAs of this launch shape one SM holds at once (the driver's occupancy query: registers, shared
        memory, warps); 0 on error. Cached per (block, shmem)."""
        from cuda.bindings import driver as cu

        key = (block, shmem)
        if key not in self._occupancy:
            self._allow_shmem(shmem)
            err, n = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function, block, shmem)
            self._occupancy[key] = n if err == cu.CUresult.CUDA_SUCCESS else 0
        return self._occupancy[key]


@functools.cache
def use_pdl() -> bool:
    """Programmatic dependent launch for the kernels that support it (sm_90+); LUMO_PDL=0 turns it off
    (read once per process).
    H200, 27B decode step at 1k context: 9.09 ms with it, 9.44 ms without (bench_decode.py)."""
    return os.environ.get("LUMO_PDL", "1") != "0"


def _launch_config(
    grid: tuple[int, ...],
    block: tuple[int, ...],
    shmem: int,
    stream: int,
    pdl: bool,
    cluster: tuple[int, int, int] | None,
) -> object:
    from cuda.bindings import driver as cu

    attrs = []
    if pdl:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    if cluster is not None:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
        attrs.append(attr)
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes, cfg.hStream = shmem, stream
    cfg.attrs, cfg.numAttrs = attrs, len(attrs)
    return cfg


@functools.cache
def _load(cubin: bytes, kernel_name: str, device_index: int) -> Kernel:
    from cuda.bindings import driver as cu

    torch.cuda.init()  # the driver context is torch's primary context
    (lib,) = _check(cu.cuLibraryLoadData(cubin, None, None, 0, None, None, 0), "cuLibraryLoadData")
    (kern,) = _check(cu.cuLibraryGetKernel(lib, kernel_name.encode()), f"cuLibraryGetKernel({kernel_name})")
    (fn,) = _check(cu.cuKernelGetFunction(kern), f"cuKernelGetFunction({kernel_name})")
    return Kernel(kernel_name, fn, [48 * 1024])


def resolve_source(source: str | os.PathLike) -> Path:
    p = Path(source)
    if not p.is_absolute() and not p.exists():
        p = KERNEL_DIR / p
    if p.suffix != ".cu":
        p = p.with_suffix(".cu")
    if not p.is_file():
        raise FileNotFoundError(f"kernel source {source} not found (looked in {KERNEL_DIR})")
    return p


def compile_kernel(
    source: str | os.PathLike,
    kernel_name: str,
    defines: Mapping[str, object] | None = None,
    arch: str | None = None,
) -> Kernel:
    """Compile (cached) `source` (a name in lumo/kernels or a path) and load `kernel_name` (extern "C")."""
    path = resolve_source(source)
    device = torch.cuda.current_device()
    arch = arch or arch_of(device)
    try:
        cubin = cached_cubin(path.read_text(), arch, define_options(defines), path.name)
    except KernelCompileError as e:
        raise KernelCompileError(f"kernel {kernel_name}: {e}") from None
    kernel = _load(cubin, kernel_name, device)
    kernel.sm_major = int(re.match(r"sm_(\d+)", arch).group(1)) // 10
    return kernel
