"""tk: a plugin-based PyTorch toolkit for NLP and vision.

The import namespace is assembled by ``setup.py``: ``tk.core`` is the repo's
``core/`` folder, ``tk.plugins`` its ``plugins/`` and ``tk.recipes`` its
``recipes/``. This folder only holds the package root (version, ``python -m tk``).
"""

__version__ = "0.1.0"
