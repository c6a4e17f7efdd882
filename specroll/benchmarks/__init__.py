"""Speed claims, measured side by side with a reference (run as `python -m specroll.benchmarks.<name>`)."""
