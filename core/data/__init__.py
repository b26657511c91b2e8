"""Data loading shared by every task: the loader spec, resumable samplers and the default
loader (``loader``), and batch samplers for text (``samplers``: token budgets, endless
random batches for iteration-based training)."""
