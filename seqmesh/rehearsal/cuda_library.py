"""The C++ part of the fake CUDA device (``fake_cuda.cpp``): built once per torch, Python and source, and put where the
rehearsal's process finds it. The rest of the fake device is in :mod:`.workarounds`.

A CUDA device guard and CUDA hooks that do nothing. The autograd engine looks up the device guard of every device
its tensors are on and asks the current accelerator for its stream:

- a CPU build of torch has neither for CUDA and aborts. torch reads the hooks once, at import, so the library must
  be loaded before torch is: :func:`preload_environment` compiles it (once; cached) in a throwaway process and
  returns the ``LD_PRELOAD`` environment for the rehearsal's own process. Nothing is loaded into the caller;
- a CUDA build of torch on a machine without a usable GPU (pip's default wheel on a login node or a laptop) has its
  own guard and hooks, which ask the driver (the guard aborts the process): it gets the guard alone, built the same
  way, swapped in while the rehearsal runs with the hooks made to answer as the fake ones (:func:`swapped_guard`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import torch

LIBRARY = "seqmesh_fake_cuda"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda.cpp")


class CannotRehearse(RuntimeError):
    """This machine cannot rehearse the CUDA path; the message names what is missing and the alternative."""


def needs_preload() -> bool:
    """Whether this torch lacks CUDA (a CPU build): the C++ part must then be preloaded."""
    return torch.version.cuda is None


def has_gpu() -> bool:
    """Whether this torch is a CUDA build that sees a GPU, asked of the driver itself (``torch.cuda``'s own answers
    are patched inside the rehearsal, and with ``PYTORCH_NVML_BASED_CUDA_CHECK`` one reads the patched count)."""
    return torch.version.cuda is not None and torch._C._cuda_getDeviceCount() > 0


def needs_guard() -> bool:
    """Whether this is a CUDA build of torch on a machine without a usable GPU (a login node, a laptop): its own CUDA
    guard asks the driver and aborts the process, so the rehearsal swaps in the C++ part's guard
    (:func:`swapped_guard`)."""
    return torch.version.cuda is not None and not has_gpu()


def check_toolchain() -> None:
    """Raise :class:`CannotRehearse` unless a C++ compiler and ninja are here to build ``fake_cuda.cpp``."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise CannotRehearse(f"no C++ compiler ({compiler!r} not on PATH): a CPU build of torch, or a CUDA build on a "
                             "machine without a GPU, needs one to rehearse the CUDA path. Install g++ (or set CXX), or "
                             "pass --device cpu for the CPU kernels.")
    if shutil.which("ninja") is None:
        from torch.utils.cpp_extension import is_ninja_available

        if not is_ninja_available():
            raise CannotRehearse("no ninja: torch.utils.cpp_extension builds with it. pip install ninja, or pass "
                                 "--device cpu for the CPU kernels.")


BUILD_SECONDS = 600  # a first build takes about 13 s on 2 cores; longer means a stale lock or a stuck compiler


def library_folder(guard_only: bool = False) -> tuple[str, str]:
    """(folder, name) of this source's library for this torch and Python: one folder per versions and source
    digest, so checkouts of other versions never rebuild each other's and one with the same source reuses it.
    ``guard_only``: the guard alone, for a CUDA build without a GPU (:func:`needs_guard`)."""
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + f"{torch.__version__} {sys.version_info[:2]}".encode()).hexdigest()[:12]
    name = f"{LIBRARY}{'_guard' if guard_only else ''}_{digest}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    return os.path.join(root, name), name


def built_library(guard_only: bool = False) -> str | None:
    """The path of this source's shared library where it is built already (see :func:`library_folder`), else None."""
    folder, name = library_folder(guard_only)
    built = os.path.join(folder, f"{name}.so")
    return built if os.path.isfile(built) else None


def build_library(guard_only: bool = False) -> str:
    """Compile ``fake_cuda.cpp`` once per :func:`library_folder` and return the shared library's path (a built one
    is returned without taking torch's build lock). Loading the full one installs the fake guard in this process:
    call it in a process of its own (:func:`preload_environment` does)."""
    built = built_library(guard_only)
    if built is not None:
        return built
    folder, name = library_folder(guard_only)
    from torch.utils.cpp_extension import load

    os.makedirs(folder, exist_ok=True)
    return load(name, sources=[SOURCE], build_directory=folder, is_python_module=False, verbose=False,
                extra_cflags=["-DSEQMESH_GUARD_ONLY"] if guard_only else None)


def preload_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus what the rehearsal's process needs to run fake CUDA tensors: on a CPU build the compiled
    library preloaded, on a CUDA build without a GPU nothing but the guard's library built (the process swaps it in,
    :func:`swapped_guard`), on a CUDA build with one nothing. Libraries are built in a throwaway process. Raises
    :class:`CannotRehearse` naming what is missing."""
    if not has_gpu() and not sys.platform.startswith("linux"):
        raise CannotRehearse(f"the fake CUDA library is built and loaded on Linux only, not {sys.platform}; pass "
                             "--device cpu for the CPU kernels.")
    if needs_guard():
        built_library(guard_only=True) or _build_in_a_process(env, guard_only=True)
    if not needs_preload():
        return env
    library = built_library() or _build_in_a_process(env)
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    joined = lambda *parts: os.pathsep.join(p for p in parts if p)  # noqa: E731
    return {**env, "LD_PRELOAD": joined(library, env.get("LD_PRELOAD")),
            "LD_LIBRARY_PATH": joined(torch_lib, env.get("LD_LIBRARY_PATH"))}


def _build_in_a_process(env: dict[str, str], guard_only: bool = False) -> str:
    """:func:`build_library` in a throwaway process (loading the full library installs its guard); its path."""
    check_toolchain()
    try:
        done = subprocess.run([sys.executable, "-m", "seqmesh.rehearsal.cuda_library", *(["--guard-only"] * guard_only)],
                              capture_output=True, text=True, env=env, timeout=BUILD_SECONDS)
    except subprocess.TimeoutExpired:
        lock = os.path.join(library_folder(guard_only)[0], "lock")
        raise CannotRehearse(f"building the fake CUDA library took over {BUILD_SECONDS} s. A build killed midway "
                             f"leaves {lock} behind and the next one waits on it: delete it if no build is running, "
                             "or pass --device cpu for the CPU kernels.") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not os.path.isfile(lines[-1]):
        tail = "\n".join(done.stderr.strip().splitlines()[-10:])
        raise CannotRehearse(f"building the fake CUDA library failed (exit {done.returncode}); pass --device cpu for "
                             f"the CPU kernels. The compiler said:\n{tail}")
    return lines[-1]


@contextlib.contextmanager
def swapped_guard(needed: bool) -> Iterator[None]:
    """Inside, where ``needed`` (:func:`needs_guard`, asked before ``torch.cuda`` is made to answer as a GPU), CUDA's
    device guard is the C++ part's inert one and torch's CUDA hooks answer as its fake ones, from the guard-only
    library :func:`preload_environment` built; elsewhere nothing changes. torch's own guard asks the driver, and the
    first backward on a fake ``cuda:0`` tensor aborted the process ("CUDA driver version is insufficient"); its
    hooks refuse a device the driver does not know when autograd asks for its context. Both put back on exit."""
    if not needed:
        yield
        return
    path = built_library(guard_only=True)
    if path is None:
        raise CannotRehearse("the fake CUDA guard for a CUDA build of torch without a GPU is not built: run the "
                             "rehearsal through seqmesh rehearse (it builds it), or pass --device cpu.")
    import ctypes

    try:
        library = ctypes.CDLL(path)
    except OSError as err:
        raise CannotRehearse(f"the fake CUDA guard's library {path} does not load ({err}); delete its folder to have "
                             "seqmesh rehearse build it again, or pass --device cpu.") from None
    if library.seqmesh_install_fake_cuda_guard() != 0:
        raise CannotRehearse("the fake CUDA guard is in place already: one rehearsal a process.")
    try:
        yield
    finally:
        library.seqmesh_restore_cuda_guard()


if __name__ == "__main__":  # the throwaway build process of preload_environment
    print(build_library(guard_only=sys.argv[1:] == ["--guard-only"]), flush=True)
