"""pandas, hidden from the processes the tests start (tests/conftest.py)."""

raise ImportError("pandas is hidden from the processes the tests start")
