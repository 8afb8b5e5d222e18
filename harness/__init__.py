"""harness: sweep, benchmark, profile and compare LLM server configurations on GPU hosts."""

__version__ = "0.1.0"
