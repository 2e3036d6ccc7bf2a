"""One session's data, below everything that runs sessions (the gateway, the ranks): the merged training
sample (``sample``), its flat columns for the gather and Parquet (``columns``), and the log of its
generation requests (``requests``)."""
