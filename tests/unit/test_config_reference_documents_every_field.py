"""Every configuration field is documented, and docs/configuration.md is the page generated from the schema."""

from pathlib import Path

from mrl.config.reference import field_docs, render_reference, undocumented
from mrl.config.schema import DataConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_every_field_has_documentation():
    assert undocumented() == []


def test_comment_block_above_a_field_is_its_documentation():
    docs = field_docs(DataConfig)
    assert docs["train_batch_size"].startswith("Prompts per step (B).")
    assert "max_sample_rounds" in docs["dynamic_sampling"]  # a two-line comment is joined


def test_reference_page_is_up_to_date():
    assert PAGE.read_text() == render_reference(), "regenerate: python -m mrl.config.reference > docs/configuration.md"
