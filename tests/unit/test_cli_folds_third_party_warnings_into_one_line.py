"""Without --verbose the command line hides warnings raised from third-party files behind one summary line that
counts them by package (and tells spawned processes, through PYTHONWARNINGS, to ignore theirs); mrl's own warnings
are shown as usual; uninstalling restores both."""

import os
import warnings

from mrl.utils.noise import ThirdPartyWarnings, quiet

MEGATRON_FILE = "/venv/lib/python3.11/site-packages/megatron/core/optimizer/__init__.py"


def test_third_party_warnings_are_counted_and_mrl_warnings_shown(monkeypatch):
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    mrl_file = os.path.join(os.path.dirname(os.path.dirname(__file__)), "..", "mrl", "cli.py")
    with warnings.catch_warnings(record=True) as passed_on:  # what reaches the usual display
        warnings.simplefilter("always")
        shown = warnings.showwarning
        noise = ThirdPartyWarnings().install()
        assert quiet() and os.environ["PYTHONWARNINGS"] == "ignore"
        for _ in range(3):
            warnings.warn_explicit("Apex is not installed", UserWarning, MEGATRON_FILE, 25)
        warnings.warn_explicit("ours", UserWarning, os.path.abspath(mrl_file), 1)
        noise.uninstall()
        assert warnings.showwarning is shown and not quiet() and "PYTHONWARNINGS" not in os.environ
    assert [str(w.message) for w in passed_on] == ["ours"]
    assert noise.summary() == "mrl: hid 3 third-party warnings (megatron: 3); --verbose shows them"
    assert ThirdPartyWarnings().summary() is None
