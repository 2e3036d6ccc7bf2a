"""The fleet twin: ``launch``'s config run in virtual time by the router's own code, to plan a fleet
before it costs an allocation (``python -m toolkit.plan``). Method and fidelity: docs/plan.md."""
