"""The top layer: ``python -m toolkit.launch`` and everything that starts, watches, scales, resumes and
tears down a run (``app`` is the Hydra app, ``run`` the run's lifecycle)."""
