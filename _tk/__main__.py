"""``python -m tk ...`` (also what ``torchrun -m tk`` runs): the ``tk`` CLI."""

from tk.core.cli import main

if __name__ == "__main__":
    main()
