"""Tests of the bench scripts that must keep running unchanged (on CPU here, on a GPU elsewhere)."""
