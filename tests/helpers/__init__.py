"""What several test modules share: CLI runs, expert counting, injected faults, known transformers bugs.

Importable as ``helpers.<module>``: ``tests/`` is on ``sys.path`` (its ``conftest.py`` is not in a package).
"""
