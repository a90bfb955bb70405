"""Tests of examples/demo.py."""
