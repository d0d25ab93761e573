"""Helpers shared by the test suites (``tests/`` is on ``sys.path`` through its conftest):
:mod:`helpers.engine` (the tiny random models of the engine tests and their checks) and
:mod:`helpers.kernel_cases` (random paged-attention cases and the dense reference of the
kernel tests)."""
