"""``python -m toolkit.plan [overrides]``: the Hydra app in :mod:`toolkit.plan.app`."""

from toolkit.plan.app import cli

if __name__ == "__main__":
    cli()
