"""``tk.core`` re-exports its public API by name."""

import tk.core


def test_every_export_resolves():
    for name in tk.core.__all__:
        assert getattr(tk.core, name).__name__ == name
