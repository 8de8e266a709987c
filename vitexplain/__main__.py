"""``python -m vitexplain`` runs the command line (also under ``torchrun -m vitexplain``)."""

from .cli import run

if __name__ == "__main__":
    run()
