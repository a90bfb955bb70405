"""Tests of the CPU reference server and the SmolLM2 converter."""
