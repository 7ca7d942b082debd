"""The benchmark of scripts/benchmark.py: suites, timing harness, cases, sections, Markdown report and plots."""
