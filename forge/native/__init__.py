"""Native libraries that Monarch 0.1.2 links against, made available on hosts that lack them.

Monarch's `_rust_bindings.so` needs libcuda.so.1, libcudart.so.12, libnccl.so.2, libibverbs.so.1 and
libmlx5.so.1 at import time, even on a host with no GPU. On a GPU cluster the real ones are there and
this module does nothing. On a CPU-only host:

- libcudart and libnccl come from torch's own nvidia wheels (already in site-packages);
- libibverbs, libmlx5 and their libnl dependencies are unpacked from Debian packages into
  `<repo>/.native/lib` by `python -m forge.native install` (no root needed once apt lists exist);
- libcuda.so.1 is a stub built from `cuda_stub.c` whose every entry point says "no device".

`preload()` (run by `forge.compat` before Monarch is imported) loads them with RTLD_GLOBAL into this
process; `export_library_path()` (run when a job starts) puts their folders on LD_LIBRARY_PATH for the
processes Monarch spawns. A real driver is never shadowed: the
stub is used only when `libcuda.so.1` cannot be loaded from the system.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

# In dependency order: each library's needs are loaded before it.
_SHIM_LIBS = ["libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1", "libmlx5.so.1"]
_DEBIAN_PACKAGES = ["libnl-3-200", "libnl-route-3-200", "libibverbs1", "ibverbs-providers"]
_STUB_SOURCE = Path(__file__).with_name("cuda_stub.c")
_done = False


def native_dir() -> Path:
    """Where the project-local libraries live (override with FORGE_NATIVE_DIR)."""
    override = os.environ.get("FORGE_NATIVE_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / ".native"


def _loadable(name: str) -> bool:
    try:
        ctypes.CDLL(name)
        return True
    except OSError:
        return False


def _nvidia_wheel_lib_dirs() -> list[Path]:
    """libcudart / libnccl shipped inside torch's nvidia-* wheels."""
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    dirs = []
    for root in roots:
        for sub in ("nvidia/cuda_runtime/lib", "nvidia/nccl/lib"):
            path = Path(root) / sub
            if path.is_dir():
                dirs.append(path)
    return dirs


@functools.cache
def needs_shim() -> bool:
    """True on a host where Monarch's native dependencies are not all on the system (asked once: after
    `preload`, the stand-ins themselves would answer)."""
    return not all(_loadable(n) for n in ("libcuda.so.1", "libibverbs.so.1", "libmlx5.so.1"))


def install(verbose: bool = True) -> Path:
    """Build the libcuda stub and unpack the verbs libraries into `native_dir()/lib` (idempotent)."""
    lib = native_dir() / "lib"
    say = print if verbose else (lambda *a, **k: None)
    if not needs_shim():
        say("forge.native: system CUDA driver and verbs libraries found; no shim needed")
        return lib
    lib.mkdir(parents=True, exist_ok=True)
    stub = lib / "libcuda.so.1"
    if not _loadable("libcuda.so.1") and not stub.exists():
        cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if cc is None:
            raise RuntimeError("forge.native: a C compiler (cc/gcc/clang) is needed to build the libcuda stub")
        say(f"forge.native: building CPU stub {stub}")
        subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", "-o", str(stub), str(_STUB_SOURCE)],
            check=True,
        )
    missing = [n for n in _SHIM_LIBS if not (lib / n).exists() and not _loadable(n)]
    if missing:
        say(f"forge.native: fetching {', '.join(_DEBIAN_PACKAGES)} (Debian packages) for {', '.join(missing)}")
        _unpack_debian_packages(lib, say)
    still = [n for n in _SHIM_LIBS if not (lib / n).exists() and not _loadable(n)]
    if still:
        raise RuntimeError(f"forge.native: could not provide {still} in {lib}")
    say(f"forge.native: native libraries ready in {lib}")
    return lib


def _unpack_debian_packages(lib: Path, say) -> None:
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise RuntimeError(
            "forge.native: libibverbs/libmlx5 are missing and this is not a Debian/Ubuntu host; install "
            "your distribution's rdma-core package (it provides libibverbs.so.1 and libmlx5.so.1)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(["apt-get", "download", *_DEBIAN_PACKAGES], cwd=tmp, capture_output=True, text=True)
        if result.returncode != 0 and os.geteuid() == 0:
            say("forge.native: apt lists look stale; running apt-get update")
            subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True)
            result = subprocess.run(["apt-get", "download", *_DEBIAN_PACKAGES], cwd=tmp, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"forge.native: apt-get download failed:\n{result.stderr.strip()}")
        root = Path(tmp) / "root"
        for deb in glob.glob(os.path.join(tmp, "*.deb")):
            subprocess.run(["dpkg", "-x", deb, str(root)], check=True)
        for so in root.rglob("*.so*"):
            if so.is_file() or so.is_symlink():
                target = lib / so.name
                if not target.exists():
                    shutil.copy2(so.resolve(), target)


def library_dirs() -> list[Path]:
    return [native_dir() / "lib", *_nvidia_wheel_lib_dirs()]


def preload() -> None:
    """Load the stand-ins into this process (RTLD_GLOBAL) so `import monarch` works; idempotent, and
    changes no environment variable. A missing shim is an ImportError that says how to install it."""
    global _done
    if _done or not needs_shim():
        _done = True
        return
    lib = native_dir() / "lib"
    if not (lib / "libcuda.so.1").exists():
        raise ImportError(
            f"forge: Monarch needs libcuda.so.1 and there is no GPU driver on this host, nor a CPU stub in {lib}. "
            "Run `python -m forge.native install` (the README's set-up commands do this)."
        )
    dirs = [d for d in library_dirs() if d.is_dir()]
    for name in ["libcudart.so.12", "libnccl.so.2", "libcuda.so.1", *_SHIM_LIBS]:
        for d in dirs:
            path = d / name
            if path.exists():
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                break
    _done = True


def export_library_path() -> None:
    """Put the stand-ins' folders on LD_LIBRARY_PATH, for the processes Monarch spawns from now on (they
    load Monarch at their own start, before any Python of ours runs). Nothing on a host that has the real ones."""
    if not needs_shim():
        return
    dirs = [str(d) for d in library_dirs() if d.is_dir()]
    current = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(dirs + [p for p in current if p not in dirs])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["install"]:
        install()
        return 0
    print("usage: python -m forge.native install", file=sys.stderr)
    return 2


def setup(strict: bool = True) -> bool:
    """Deprecated spelling of `preload()` + `export_library_path()`; use `forge.compat` instead."""
    preload()
    export_library_path()
    return True
