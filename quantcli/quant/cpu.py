"""The CPU a graph is made for: its kind, read from this machine or named by the user, and what follows from
it.

onnxruntime's CPU provider (MLAS) picks its integer kernels from CPUID at run time, so the instruction set of
the machine that *deploys* decides what a Q/DQ graph computes and how fast:

* ``x86-avx2``: x86 without VNNI (AVX2, and AVX-512 without VNNI). The uint8 x int8 kernels multiply with
  ``VPMADDUBSW``, which adds each pair of adjacent products into a *saturating* 16-bit lane: 255 * 127 * 2
  does not fit, so 8-bit weights can saturate (:mod:`quantcli.quant.u8s8`).
* ``x86-vnni``: x86 with AVX512-VNNI or AVX-VNNI (``VPDPBUSD`` accumulates in 32 bits, never saturates).
* ``arm64``: 64-bit ARM; the integer kernels widen before they add (``SDOT``/``UDOT`` or ``SMULL``): exact.
* ``any``: not known, or a fleet of several kinds: every choice must hold on each of the above.

``auto`` (the default of ``calibrate --cpu`` and ``verify --cpu``) is the kind named by the environment
variable ``QUANTCLI_CPU`` where it is set (a build machine that is not the deployment machine, a CI job whose
runners differ), else this machine, read with :func:`detect`. :func:`detect` itself is always this machine:
what onnxruntime's kernels here compute.
"""

from __future__ import annotations

import functools
import os
import platform

KINDS = ("x86-avx2", "x86-vnni", "arm64", "any")
AUTO = "auto"
CHOICES = (AUTO, *KINDS)

#: kinds whose uint8 x int8 kernels add product pairs in saturating 16-bit lanes (``any`` includes them)
SATURATING = ("x86-avx2", "any")

_REMEDY_LINK = "docs/calibration.md#the-deployment-cpu---cpu"

#: the environment variable that names the deployment CPU where ``--cpu`` is ``auto`` or not given
ENV = "QUANTCLI_CPU"


def _cpuid_features() -> dict[str, bool]:
    """numpy's CPUID reading of this CPU (``{"AVX2": True, "AVX512VNNI": False, ...}``); empty if not read.

    CPUID rather than ``/proc/cpuinfo``: under ``qemu-x86_64 -cpu Haswell`` (how tests run onnxruntime's AVX2
    kernels on any x86 machine) CPUID reports the emulated CPU, which is what onnxruntime reads, while
    ``/proc/cpuinfo`` still shows the host's flags."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        try:
            from numpy.core._multiarray_umath import __cpu_features__
        except ImportError:
            return {}
    return dict(__cpu_features__)


def _proc_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def kind_from(machine: str, cpuid: dict[str, bool], proc_flags: set[str]) -> str:
    """The kind of a CPU from ``platform.machine()``, numpy's CPUID features and ``/proc/cpuinfo``'s flags
    (pure: :func:`detect` reads them).

    AVX-VNNI (the 256-bit VNNI of recent desktop CPUs) is not among numpy's features, so it is read from
    ``/proc/cpuinfo``, but only where that file describes the CPU CPUID describes (it agrees on AVX-512
    Foundation): under user-mode QEMU the file is the host's."""
    m = machine.lower()
    if m in ("aarch64", "arm64"):
        return "arm64"
    if m not in ("x86_64", "amd64", "i686", "i386", "x86"):
        return "any"
    if not cpuid:
        return "any"
    if cpuid.get("AVX512VNNI"):
        return "x86-vnni"
    same_cpu = bool(proc_flags) and ("avx512f" in proc_flags) == bool(cpuid.get("AVX512F"))
    if same_cpu and "avx_vnni" in proc_flags and cpuid.get("AVX2"):
        return "x86-vnni"
    return "x86-avx2"


@functools.lru_cache(maxsize=1)
def detect() -> str:
    """This machine's kind (one of :data:`KINDS`), read once."""
    return kind_from(platform.machine(), _cpuid_features(), _proc_flags())


def resolve(cpu: str | None) -> str:
    """A kind from ``--cpu``: ``auto`` (or None) is ``$QUANTCLI_CPU`` where it names a kind, else this
    machine; raises :class:`~quantcli.errors.ConfigError` for an unknown name."""
    from quantcli.errors import ConfigError

    if cpu is None or cpu == AUTO:
        named = os.environ.get(ENV, "").strip()
        if named in ("", AUTO):
            return detect()
        if named not in KINDS:
            raise ConfigError(
                f"{ENV}={named!r} is not a CPU kind; set one of {', '.join(CHOICES)} or unset it"
            )
        return named
    if cpu not in KINDS:
        raise ConfigError(f"unknown CPU kind {cpu!r}; choose one of {', '.join(CHOICES)}")
    return cpu


def can_saturate(kind: str) -> bool:
    """Whether onnxruntime's uint8 x int8 kernels can saturate on a CPU of this kind (or on one of
    ``any``)."""
    return kind in SATURATING


def flags() -> str:
    """The instruction-set flags that decide onnxruntime's integer kernels on this machine, for printing
    beside a measurement: e.g. ``"x86_64 avx2 (no VNNI)"``."""
    cpuid = _cpuid_features()
    have = [f for f in ("AVX2", "AVX512F", "AVX512VNNI", "AVX512_SPR") if cpuid.get(f)]
    proc = _proc_flags()
    if "avx_vnni" in proc and kind_from(platform.machine(), cpuid, proc) == "x86-vnni":
        have.append("AVX_VNNI")
    names = " ".join(f.lower() for f in have) or "-"
    return f"{platform.machine()} {names} ({detect()})"


def remedy_link() -> str:
    """Where the docs explain the deployment CPU and the saturation remedy."""
    return _REMEDY_LINK
