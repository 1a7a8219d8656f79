"""The benchmarks: scripts with a main() that print a table (`python -m benchmarks.<name>`),
each comparing against a baseline run in the same process or the same session. The
README and docs/ say which figure comes from which command."""
