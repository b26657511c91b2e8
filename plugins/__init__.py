"""Built-in task plugins. Each subfolder is one task, registered in ``setup.py``
under the ``tk.tasks`` entry-point group exactly as a third-party plugin would be."""
