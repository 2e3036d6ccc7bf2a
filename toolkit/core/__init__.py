"""The bottom layer: errors, the wire protocol, run-directory paths and files, process lifecycle, sockets,
CURVE security, the backend registry, the metrics endpoint and the run's lease. Imports nothing else of
the toolkit's."""
