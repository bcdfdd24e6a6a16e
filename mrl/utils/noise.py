"""Third-party warnings folded into one summary line (`--verbose` shows them in full).

Megatron, Apex, TransformerEngine and transformers warn at import and on every process start (33-51 lines
around `mrl convert`'s one `wrote …`). Warnings raised from mrl's own files are shown as usual. Spawned processes
(convert ranks) inherit the filter through PYTHONWARNINGS; only this process's warnings are counted. A Ray
started meanwhile logs errors only (its start-up notices are not the run's).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

_MRL_ROOT = str(Path(__file__).resolve().parents[2])
QUIET_ENV = "MRL_QUIET"  # set while the command line hides third-party output; Ray's start reads it


def _package(filename: str) -> str:
    parts = Path(filename).parts
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1].removesuffix(".py")
    return Path(filename).stem


def quiet() -> bool:
    """Whether this process hides third-party chatter (the command line without --verbose)."""
    return os.environ.get(QUIET_ENV) == "1"


def quiet_library_logs(names: tuple[str, ...] = ("megatron", "transformers")) -> None:
    """In a spawned process of a quiet command (convert ranks): the libraries' log warnings (Megatron's
    deprecation notices on every model build and save) are not the command's; errors still show."""
    if quiet():
        for name in names:
            logging.getLogger(name).setLevel(logging.ERROR)


class ThirdPartyWarnings:
    """Counts and hides warnings whose source file is outside mrl, from `install()` on."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._show = warnings.showwarning
        self._env: str | None = None

    def install(self) -> ThirdPartyWarnings:
        self._env = os.environ.get("PYTHONWARNINGS")
        os.environ.setdefault("PYTHONWARNINGS", "ignore")
        os.environ[QUIET_ENV] = "1"
        warnings.showwarning = self._record
        return self

    def uninstall(self) -> None:
        warnings.showwarning = self._show
        os.environ.pop(QUIET_ENV, None)
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
