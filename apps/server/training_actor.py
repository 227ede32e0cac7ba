"""Deprecated: moved to apps.server.trainer (apps/server/moved.py), importable from here for a release."""

from apps.server.moved import moved_from

__getattr__ = moved_from(__name__)
