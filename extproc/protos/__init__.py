"""Python code generated from the project's own ``.proto`` files under ``protos/``.

``python -m extproc.protos.generate`` writes it; ``tests/test_batch_proto.py`` fails when it is stale.
"""
