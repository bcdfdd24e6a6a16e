"""Command-line tools over recipes and checkpoints: `mrl plan`, `mrl convert`, `mrl report`."""
