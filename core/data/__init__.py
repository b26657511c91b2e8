"""Data loading shared by every task: the loader spec, samplers and the default loader."""
