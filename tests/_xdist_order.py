"""The order of the test files under pytest-xdist (tests/conftest.py): longest first. Imports
nothing heavy (tests/dev/test_suite_order.py runs it in a small pytest of its own)."""


def longest_files_first(items):
    """``items`` by file, the files by their CI seconds (slow markers' ``seconds``), most first."""
    files = {}
    for item in items:
        files.setdefault(item.nodeid.split('::')[0], []).append(item)
    order = sorted(files.values(), key=lambda tests: -sum(map(_seconds, tests)))
    return [item for tests in order for item in tests]


def _seconds(item):
    slow = item.get_closest_marker('slow')
    return 0.2 if slow is None else slow.kwargs.get('seconds', 10)
