"""Third-party warnings folded into one summary line (`--verbose` shows them in full).

Megatron, Apex, TransformerEngine and transformers warn at import and on every process start (33-51 lines
around `mrl convert`'s one `wrote …`). Warnings raised from mrl's own files are shown as usual. Spawned processes
(convert ranks) inherit the filter through PYTHONWARNINGS; only this process's warnings are counted.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

_MRL_ROOT = str(Path(__file__).resolve().parents[2])


def _package(filename: str) -> str:
    parts = Path(filename).parts
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1].removesuffix(".py")
    return Path(filename).stem


class ThirdPartyWarnings:
    """Counts and hides warnings whose source file is outside mrl, from `install()` on."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._show = warnings.showwarning
        self._env: str | None = None

    def install(self) -> ThirdPartyWarnings:
        self._env = os.environ.get("PYTHONWARNINGS")
        os.environ.setdefault("PYTHONWARNINGS", "ignore")
        warnings.showwarning = self._record
        return self

    def uninstall(self) -> None:
        warnings.showwarning = self._show
        if self._env is None:
            os.environ.pop("PYTHONWARNINGS", None)

    def _record(self, message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                line: str | None = None) -> None:
        inside = filename.startswith(_MRL_ROOT) and "site-packages" not in filename
        if inside:
            self._show(message, category, filename, lineno, file, line)
        else:
            self.counts[_package(filename)] += 1

    def summary(self) -> str | None:
        """`mrl: hid N third-party warnings (megatron: 5, ...); --verbose shows them`, or None when none."""
        if not self.counts:
            return None
        by_package = ", ".join(f"{name}: {n}" for name, n in self.counts.most_common())
        return f"mrl: hid {sum(self.counts.values())} third-party warnings ({by_package}); --verbose shows them"
