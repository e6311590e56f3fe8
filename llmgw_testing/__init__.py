"""What the tests and benchmarks need to run real servers beside the gateway (today a ``redis-server``).

Kept apart from ``extproc``: the gateway never imports it (``tests/test_layout.py`` checks), while it
may import the gateway's helpers (``extproc.launcher.free_port``).
"""
