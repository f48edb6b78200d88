"""One module per conformance level; each defines checks(ctx) -> iterable of Check."""
