"""Thin Ray wrappers: each actor sets up its process and runs a plain-Python component."""
