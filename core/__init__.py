"""tk.core: Transformer parts and the training engine, shared by every task plugin."""
