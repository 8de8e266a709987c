"""``python -m vitexplain`` runs the command line (also under ``torchrun -m vitexplain``)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
