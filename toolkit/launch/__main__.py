"""``python -m toolkit.launch [overrides]``: the Hydra app in :mod:`toolkit.launch.app`."""

from toolkit.launch.app import cli

if __name__ == "__main__":
    cli()
