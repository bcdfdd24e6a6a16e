"""Start-up rules on the reward: `reward.reward_fn` names a function that loads, and with "auto" every data_source
of the data files has a registered one (an unknown source once fell back to math scoring: a run of silent zeros).

Registered with `@rule` like those of validate.py, which imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from omegaconf import DictConfig

from mrl.config.startup.validate import Violation, rule


@rule
def _reward_sources(cfg: DictConfig, check_paths: bool) -> Iterator[Violation]:
    from mrl.config.startup.field_rules import DATA_SUFFIXES
    from mrl.data.datasets import data_sources
    from mrl.reward.registry import REWARD_FNS, resolve_reward_fn

    spec = str(cfg.reward.reward_fn)
    if spec != "auto":  # one function for every row: the rows' data_source is not read
        try:
            resolve_reward_fn(spec)
        except ValueError as err:
            yield Violation("reward.reward_fn", spec, f"'auto', a registered data_source or a loadable "
                                                      f"'package.module:function': {err}")
        return
    if not check_paths:
        return
    for key in ("train_files", "val_files"):
        for path in map(str, cfg.data[key]):
            if not (path.endswith(DATA_SUFFIXES) and os.path.isfile(path)):
                continue  # reported by the data-file rule
            unknown = sorted(data_sources(path) - set(REWARD_FNS))
            if unknown:
                yield Violation(f"data.{key}", path,
                                f"data_source {', '.join(map(repr, unknown))} has no reward function (known: "
                                f"{', '.join(REWARD_FNS)}); with reward.reward_fn=auto each row is scored by its "
                                "data_source's: register one (mrl.reward.registry.REWARD_FNS) or set "
                                "reward.reward_fn")
