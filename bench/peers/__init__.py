"""mlacp against the Python context-parallel systems a user would pick instead (issue 13).

Run: ``scripts/bench-peers.sh`` (``--quick`` for the CI smoke test); see ``run.py``.
"""
