"""The upstream analysis engine, Core: its HTTP client and a simulator that speaks the same HTTP."""
