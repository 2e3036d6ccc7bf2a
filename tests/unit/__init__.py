"""Test-tier: unit tests: no processes (in-process objects, threads, loopback sockets)."""
