"""What a refused configuration looks like: one `Violation` per broken rule, all of them in one `ConfigError`.

Each violation names the setting, its value and the rule, so that a bad recipe is fixed in one round rather than
discovered as a hang or a late crash on a cluster; the command line prints each as one
`mrl: <setting>=<value>: <rule>` line (`ConfigError.lines`, mrl/cli.py). The rules are in mrl/config/startup/.
"""

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Violation:
    setting: str
    value: Any
    rule: str

    def __str__(self) -> str:
        return f"{self.setting}={self.value!r}: {self.rule}"


class ConfigError(ValueError):
    def __init__(self, violations: list[Violation]):
        self.violations = violations
        lines = "\n".join(f"  - {v}" for v in violations)
        super().__init__(f"invalid configuration ({len(violations)} problem(s)):\n{lines}")

    def lines(self) -> list[str]:
        """The command line's form: one `mrl: <setting>=<value>: <rule>` line per violation."""
        return [f"mrl: {v}" for v in self.violations]
