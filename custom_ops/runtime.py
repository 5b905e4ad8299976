"""Load the native `zerolock::pipeline_marker.out` kernel (and zl's fast kernels) into this process.

ExecuTorch's Python runtime resolves a program's operators by name when it
loads a method, so a stage program fails with "Missing operator" until
`libzl_custom_ops.so` has registered the marker kernel. The library registers
from a static initializer; loading it with RTLD_GLOBAL after the ExecuTorch
pybindings puts the kernel into the same registry the pybindings use.

The same library holds float32 `linear`/`mm`/`bmm` kernels on a GEMM
compiled for this CPU (docs/design#kernels); `load_library` registers them
too, as the runner does, unless `ZL_KERNELS=executorch` asks for
ExecuTorch's own kernels (for comparisons).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pathlib
import threading

from zl_base.errors import ZLError

logger = logging.getLogger(__name__)

ENV_VAR = "ZL_CUSTOM_OPS_LIB"
KERNELS_ENV = "ZL_KERNELS"
KERNEL_CHOICES = ("zl", "executorch")
LIBRARY_NAME = "libzl_custom_ops.so"
_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_PATH = _REPO_ROOT / "build" / "custom_ops" / LIBRARY_NAME

_lock = threading.Lock()
_loaded: pathlib.Path | None = None
_handle: ctypes.CDLL | None = None


def _choose_path(path: str | os.PathLike[str] | None) -> tuple[str, pathlib.Path]:
    """The library path to load and where it came from.

    The first location given wins with no fallback behind it: a wrong explicit
    path or environment variable is a mistake to report, not to paper over
    with a possibly stale default build.
    """
    if path is not None:
        return "the path argument", pathlib.Path(path)
    env = os.environ.get(ENV_VAR)
    if env:
        return f"${ENV_VAR}", pathlib.Path(env)
    return "the default build location", DEFAULT_PATH


def load_library(path: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Load `libzl_custom_ops.so` so ExecuTorch programs with the marker run.

    Looks at, in order: `path`, then `$ZL_CUSTOM_OPS_LIB`, then
    `<repo>/build/custom_ops/libzl_custom_ops.so`; the first one that is set is
    the only one tried. Idempotent: once loaded, later calls return the loaded path
    and load nothing.

    Args:
        path: the library file; None to use the environment variable or the
            default build location.

    Returns:
        The resolved path of the loaded library.

    Raises:
        ZLError: the library file does not exist or cannot be loaded.
    """
    global _loaded, _handle
    with _lock:
        if _loaded is not None:
            if path is not None and pathlib.Path(path).resolve() != _loaded:
                logger.warning("custom ops already loaded from %s; ignoring %s", _loaded, path)
            return _loaded

        source, lib_path = _choose_path(path)
        if not lib_path.is_file():
            raise ZLError(
                f"the pipeline_marker kernel library was not found at {lib_path} "
                f"(from {source}); expected a built {LIBRARY_NAME}. "
                f"Build it with `bash setup.sh` or `cmake --build build` in {_REPO_ROOT}, "
                f"or set {ENV_VAR} to the built file."
            )
        lib_path = lib_path.resolve()

        # The pybindings bring libexecutorch.so (the operator registry) into the
        # process first; the kernel library then binds to that same copy.
        import executorch.extension.pybindings.portable_lib  # noqa: F401

        try:
            _handle = ctypes.CDLL(str(lib_path), mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            raise ZLError(
                f"cannot load the pipeline_marker kernel library {lib_path}: {err}. "
                f"Rebuild it against this environment's ExecuTorch with `bash setup.sh` "
                f"or `cmake --build build`."
            ) from err
        _handle.zl_pipeline_marker_call_count.restype = ctypes.c_uint64
        _handle.zl_pipeline_marker_call_count.argtypes = []
        _handle.zl_fast_kernel_call_count.restype = ctypes.c_uint64
        _handle.zl_fast_kernel_call_count.argtypes = []
        _handle.zl_gemm_backend.restype = ctypes.c_char_p
        _handle.zl_gemm_backend.argtypes = []
        _loaded = lib_path
        if kernels_choice() == "zl":
            _register_fast_kernels()
        logger.debug("loaded custom ops from %s", lib_path)
        return lib_path


def register_fast_kernels() -> None:
    """Register zl's kernels now, whatever `$ZL_KERNELS` says (loading the library first).

    Programs whose methods load afterwards run on them; those loaded before keep the kernels they bound. Idempotent.

    Raises:
        ZLError: the library cannot be loaded or ExecuTorch refused the kernels.
    """
    load_library()
    with _lock:
        _register_fast_kernels()


def _register_fast_kernels() -> None:
    assert _handle is not None and _loaded is not None
    if _handle.zl_register_fast_kernels() < 0:
        raise ZLError(
            f"{_loaded} could not register its kernels (see the ExecuTorch log above); "
            f"set {KERNELS_ENV}=executorch to run on ExecuTorch's own kernels."
        )


def kernels_choice() -> str:
    """Which float32 kernels programs run on: "zl" (default) or "executorch".

    Raises:
        ZLError: `$ZL_KERNELS` is set to something else.
    """
    choice = os.environ.get(KERNELS_ENV, "zl") or "zl"
    if choice not in KERNEL_CHOICES:
        raise ZLError(
            f"{KERNELS_ENV}={choice!r} is not one of {', '.join(KERNEL_CHOICES)}; "
            f"unset it to use zl's kernels."
        )
    return choice


def fast_kernel_call_count() -> int:
    """Number of calls of zl's kernels in this process so far (for tests and benchmarks).

    Raises:
        ZLError: the library is not loaded yet (call `load_library` first).
    """
    if _handle is None:
        raise ZLError("the zl kernel library is not loaded; call custom_ops.load_library() first.")
    return int(_handle.zl_fast_kernel_call_count())


def gemm_backend() -> str:
    """The GEMM under zl's linear/mm/bmm kernels in the loaded library: "OpenBLAS (...)" or "Eigen x.y.z".

    Raises:
        ZLError: the library is not loaded yet (call `load_library` first).
    """
    if _handle is None:
        raise ZLError("the zl kernel library is not loaded; call custom_ops.load_library() first.")
    return _handle.zl_gemm_backend().decode()


def marker_call_count() -> int:
    """Number of marker kernel calls in this process so far (for tests).

    Raises:
        ZLError: the library is not loaded yet (call `load_library` first).
    """
    if _handle is None:
        raise ZLError(
            "the pipeline_marker kernel library is not loaded; call custom_ops.load_library() first."
        )
    return int(_handle.zl_pipeline_marker_call_count())
