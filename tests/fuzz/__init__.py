"""Generated hostile frames and documents, and the doors they are sent through (tests/integration/test_fuzz_doors.py,
tests/unit/test_fuzz_documents.py, bench/fuzz_doors.py)."""
