"""The configuration reference, generated from the dataclasses in `mrl/config/schema.py`.

A field's documentation is the comment block directly above it (or a string literal right after it), so the
schema stays readable as code and the reference cannot drift from it. `python -m mrl.config.reference` prints the
Markdown page kept at docs/configuration.md; a unit test fails when a field has no documentation or the page is
stale.
"""

import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from typing import Any

from mrl.config.schema import MrlConfig


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its comment block or trailing docstring} for one dataclass."""
    lines, _ = inspect.getsourcelines(cls)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        comment: list[str] = []
        row = node.lineno - 2  # the line above the field, 0-based
        while row >= 0 and lines[row].strip().startswith("#"):
            comment.insert(0, lines[row].strip().lstrip("#").strip())
            row -= 1
        nxt = body[i + 1] if i + 1 < len(body) else None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            comment.append(inspect.cleandoc(nxt.value.value))
        docs[node.target.id] = " ".join(comment)
    return docs


def sections(root: type = MrlConfig, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted path, dataclass) for the root and every nested config section, depth first."""
    found = [(prefix, root)]
    for f in dataclasses.fields(root):
        if dataclasses.is_dataclass(f.type):
            found += sections(f.type, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        elif typing.get_origin(f.type) is list and dataclasses.is_dataclass(item := typing.get_args(f.type)[0]):
            found += sections(item, f"{prefix}{f.name}[].")  # a list of sections (reward.models): each item's fields
    return found


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return None if dataclasses.is_dataclass(value) else value
    return None


# Appended to the page: defaults a verl user would not expect, checked against verl v0.5+ (its trainer config YAMLs
# and core_algos.py); kept here because the page is generated.
DEFAULTS_VS_VERL = """## Defaults that differ from verl

mrl takes verl's names and most of its defaults. These three surprise a verl user; none of them changes with
another setting, so a recipe sets them explicitly.

- **`actor.megatron.params_dtype` is `float32`, and the rollout engine follows it.** With `rollout.dtype: null`
  the engine runs in the trainer's parameter dtype, so vLLM also runs in fp32. verl's Megatron actor trains in
  bf16 (fp32 main parameters in the optimizer) and its `rollout.dtype: bfloat16` is set apart from the actor's.
  Why: the defaults are the CPU ones (tiny recipes, tests), where fp32 end to end keeps the rollout's log-probs
  within 1e-4 of the trainer's, and the engine receives the dtype the weight sync sends, with no cast. On a GPU
  that doubles the engine's weight memory and slows decoding: every GPU recipe sets `params_dtype: bfloat16` (the
  engine follows). Set `rollout.dtype` only to make the engine differ from the trainer. The reference, a
  distillation teacher and colocated reward models (`ref.megatron`) follow the actor's dtype unless
  `ref.megatron.params_dtype` is set.
- **One micro-batch knob for the actor's updates and its old log-prob pass.** `actor.ppo_micro_batch_size_per_gpu`
  (or the token budget `actor.ppo_max_token_len_per_gpu` with `use_dynamic_bsz`) sizes both;
  `ref.log_prob_micro_batch_size_per_gpu` sizes the reference's pass. verl has a separate
  `rollout.log_prob_micro_batch_size_per_gpu` (and `log_prob_max_token_len_per_gpu`) for the old log-prob pass.
  Why: not built yet. A forward-only pass keeps no activations for a backward pass and could take larger
  micro-batches; mrl bounds that pass's memory by `logprob_keep_logits_gib` and `logprob_chunk_tokens` instead.
  Until a separate knob exists, size the one knob for the update (the larger need).
- **`actor.policy_loss: gspo` keeps `loss_agg_mode: token-mean` and the clip range 0.2 / 0.2.** GSPO honours
  `actor.loss_agg_mode`, `clip_ratio_low` and `clip_ratio_high` like every other loss. verl's GSPO loss
  aggregates `seq-mean-token-mean` whatever `loss_agg_mode` says, and its GSPO example sets the clip ratios to
  3e-4 / 4e-4 (the paper's). Why: mrl keeps aggregation one explicit knob for every loss (exact under
  micro-batching and DP, mrl/algo/aggregation.py) and does not switch defaults behind a loss's name. With the
  defaults, GSPO's clip at 1 ± 0.2 around a sequence's geometric-mean ratio almost never fires, and `token-mean`
  weighs long responses more than the paper's objective does: for GSPO set
  `actor.loss_agg_mode=seq-mean-token-mean actor.clip_ratio_low=3e-4 actor.clip_ratio_high=4e-4`.
"""


def _section_default(path: str) -> Any:
    """The default instance of the section at `path` (its parent's default may differ from the class's own, as
    ref.megatron's params_dtype does); None inside a list section."""
    obj: Any = MrlConfig()
    for part in filter(None, path.rstrip(".").split(".")):
        if part.endswith("[]"):
            return None
        obj = getattr(obj, part)
    return obj


def render_reference() -> str:
    out = ["# Configuration reference", "",
           "Generated by `python -m mrl.config.reference` from `mrl/config/schema.py`; do not edit by hand.",
           "Set any field in a recipe YAML or on the command line (`mrl train RECIPE actor.optim.lr=1e-6`).", ""]
    for path, cls in sections():
        docs = field_docs(cls)
        rows = [f for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(f.type)]
        instance = _section_default(path)
        if not rows:
            continue
        out += [f"## `{path.rstrip('.') or 'root'}` ({cls.__name__})", "", "| field | default | meaning |",
                "| --- | --- | --- |"]
        for f in rows:
            type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            # A bare "|" splits a table cell, in code spans too (`int | None`, `'a|b'`).
            type_name, default, meaning = (text.replace("|", "\\|") for text in
                                           (type_name, repr(_default(f) if instance is None else
                                                             getattr(instance, f.name)), docs.get(f.name, "")))
            out.append(f"| `{path}{f.name}` ({type_name}) | `{default}` | {meaning} |")
        out.append("")
    return "\n".join(out) + "\n" + DEFAULTS_VS_VERL


def undocumented() -> list[str]:
    """Fields without documentation, each named once (a section class used twice is checked once)."""
    seen: set[type] = set()
    missing = []
    for path, cls in sections():
        if cls not in seen:
            seen.add(cls)
            missing += [f"{path}{name}" for name, doc in field_docs(cls).items() if not doc]
    return missing


if __name__ == "__main__":
    sys.stdout.write(render_reference())
