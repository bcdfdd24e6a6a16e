"""Fail fast on dependency versions mrl cannot work with.

Checked from package metadata at `import mrl` (cheap: importing megatron.core itself takes ~7 s),
so a wrong install is reported before any worker starts rather than as an obscure error deep in Megatron.
"""

from importlib import metadata

# Oldest megatron-core whose APIs the engine, CPU compatibility layer and bridges were verified against.
# On Python 3.11 a plain `pip install megatron-core` resolves 0.16.1 (newer releases declare Python >= 3.12).
MIN_MEGATRON_CORE = (0, 19)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_megatron_core() -> None:
    try:
        found = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return  # a driver-only install (controller, rollout, algorithms) does not need Megatron
    if _version_tuple(found) < MIN_MEGATRON_CORE:
        wanted = ".".join(map(str, MIN_MEGATRON_CORE))
        raise ImportError(
            f"mrl needs megatron-core >= {wanted}, found {found}. On Python 3.11 pip picks 0.16.1 because newer "
            "releases declare Python >= 3.12 although their cp311 wheels work; install with "
            "`bash tools/setup/install.sh` (it installs megatron-core==0.19.2 with --ignore-requires-python)."
        )
