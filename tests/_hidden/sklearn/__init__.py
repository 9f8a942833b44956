"""scikit-learn, hidden from the processes the tests start (tests/conftest.py)."""

raise ImportError("scikit-learn is hidden from the processes the tests start")
