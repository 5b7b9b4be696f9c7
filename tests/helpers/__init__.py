"""Helpers shared by the test modules: builders, readers and fakes, one concern per module; the
fixtures that use them are in tests/conftest.py. A test module imports from here, never from
another test module (tests/test_layers.py checks)."""
