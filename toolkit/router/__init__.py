"""The router: one process between the clients and the replicas. ``server.Router`` holds the sockets
and each request's life, and is composed of parts that each own their state: ``pool`` (replicas and
slots), ``membership``, ``weights``, ``elastic``, ``migration``, ``tail`` (where requests go) and
``metrics``; ``process`` is the router process's entry."""
