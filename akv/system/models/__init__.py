"""Model helpers: tiny random-weight model directories for tests."""
