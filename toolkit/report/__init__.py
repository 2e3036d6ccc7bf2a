"""What a run reports: ``report.json`` and its tables and timeline (``run_report``), a sweep's summary
(``sweep``), and the experiment trackers (``trackers``)."""
